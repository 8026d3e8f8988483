"""In-memory labelled dataset: the one container every loader returns.

Plain numpy arrays, so partitioning, hashing and caching never need torch; the training code
wraps them in tensors itself. Dtypes are validated up front because a float64 or int32 array
slipping through surfaces much later as a confusing torch dtype error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ArrayDataset"]


@dataclass(frozen=True, eq=False)  # eq=False: elementwise array == has no single truth value
class ArrayDataset:
    """Samples `x` (float32, [n, *input_shape]) with integer labels `y` (int64, [n]).

    `groups` (int64, [n]) names who produced each sample where the dataset says so (CelebA's
    celebrity identities): the "identity" partition deals whole groups to clients. None elsewhere.
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    groups: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.x, np.ndarray) or not isinstance(self.y, np.ndarray):
            raise ValueError(f"{self.name}: x and y must be numpy arrays, "
                             f"got {type(self.x).__name__} and {type(self.y).__name__}")
        if self.x.dtype != np.float32:
            raise ValueError(f"{self.name}: x must be float32, got {self.x.dtype}")
        if self.y.dtype != np.int64:
            raise ValueError(f"{self.name}: y must be int64, got {self.y.dtype}")
        if self.x.ndim < 2:
            raise ValueError(f"{self.name}: x must have shape [n, *input_shape], got {self.x.shape}")
        if self.y.ndim != 1:
            raise ValueError(f"{self.name}: y must have shape [n], got {self.y.shape}")
        if len(self.x) != len(self.y):
            raise ValueError(f"{self.name}: x has {len(self.x)} rows but y has {len(self.y)} labels")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, (int, np.integer)) \
                or self.num_classes < 1:
            raise ValueError(f"{self.name}: num_classes must be a positive int, got {self.num_classes!r}")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ValueError(f"{self.name}: labels must lie in [0, {self.num_classes}), "
                             f"got range [{self.y.min()}, {self.y.max()}]")
        if self.groups is not None:
            if not isinstance(self.groups, np.ndarray) or self.groups.dtype != np.int64 \
                    or self.groups.shape != self.y.shape:
                raise ValueError(f"{self.name}: groups must be an int64 array of shape {self.y.shape}, got "
                                 f"{getattr(self.groups, 'dtype', type(self.groups).__name__)} "
                                 f"{getattr(self.groups, 'shape', '')}")

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. (40,) for MNIST-1D or (3, 32, 32) for CIFAR-10."""
        return tuple(int(d) for d in self.x.shape[1:])

    def subset(self, idx, name: str | None = None) -> ArrayDataset:
        """Rows `idx` (integer indices or a boolean mask) as a new dataset (copies the rows)."""
        idx = np.asarray(idx)
        if idx.dtype != bool and not np.issubdtype(idx.dtype, np.integer):
            if idx.size:  # an empty list arrives as float64
                raise ValueError(f"{self.name}: subset indices must be integers or a boolean mask, "
                                 f"got {idx.dtype}")
            idx = idx.astype(np.int64)
        return ArrayDataset(self.x[idx], self.y[idx], int(self.num_classes),
                            self.name if name is None else name,
                            None if self.groups is None else self.groups[idx])
