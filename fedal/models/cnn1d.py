"""`cnn1d` / `cnn1d_wide`: small pooled 1D CNNs for MNIST-1D.

Two 'same'-padded convolutions (k5, then k3), each followed by max-pooling (by 2, then by 4),
shrink a length-40 signal to 5 steps. Pooling, not strided convolutions, is what lets such a
small net find MNIST-1D's shifted, scaled templates: the earlier stride-2 stack (no pooling) lost
10-15 points of local accuracy at the same parameter count (docs/results/accuracy.md).
`cnn1d_wide` adds a hidden layer of 100 units, so its features are as wide as `mlp`'s and the two
can share FedProto's prototypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .base import SplitModel
from .shapes import check_num_classes, signal_length

__all__ = ["CNN1D", "conv_out_length"]

_KERNELS = (5, 3)
_POOLS = (2, 4)


def conv_out_length(length: int) -> int:
    """Signal length after the conv/pool stack ('same' convolutions, floor pooling)."""
    for pool in _POOLS:
        length //= pool
    return length


def _min_length() -> int:
    length = 1
    while conv_out_length(length) < 1:
        length += 1
    return length


MIN_LENGTH = _min_length()  # 8: shorter signals vanish inside the pooling


class _AsChannels(nn.Module):
    """[B, L] or [B, 1, L] -> [B, 1, L]; flatten+unsqueeze keeps the batch axis dynamic in ONNX."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).unsqueeze(1)


class CNN1D(SplitModel):
    """Conv1d(k5, c1) + ReLU + MaxPool(2) -> Conv1d(k3, c2) + ReLU + MaxPool(4) -> flatten
    [-> Linear(hidden) + ReLU] (features) -> Linear head.

    With L=40: `cnn1d` (24, 48, no hidden) has 240 features and 6k parameters; `cnn1d_wide`
    (32, 64, hidden 100) has 100 features and 40k parameters.
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: tuple[int, int] = (24, 48),
        hidden: int | None = None,
        name: str = "cnn1d",
    ) -> None:
        length = signal_length(input_shape, name, MIN_LENGTH)
        num_classes = check_num_classes(num_classes)
        layers: list[nn.Module] = [_AsChannels()]
        in_ch = 1
        for out_ch, kernel, pool in zip(channels, _KERNELS, _POOLS):
            layers += [nn.Conv1d(in_ch, out_ch, kernel, padding=kernel // 2), nn.ReLU(), nn.MaxPool1d(pool)]
            in_ch = out_ch
        layers.append(nn.Flatten(1))
        feature_dim = in_ch * conv_out_length(length)
        if hidden is not None:
            layers += [nn.Linear(feature_dim, hidden), nn.ReLU()]
            feature_dim = hidden
        super().__init__(
            nn.Sequential(*layers),
            nn.Linear(feature_dim, num_classes),
            feature_dim=feature_dim,
            num_classes=num_classes,
            input_shape=input_shape,
        )
