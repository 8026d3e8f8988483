"""Input-shape checks shared by the zoo, so every model rejects a wrong shape the same clear way.

Shapes are per sample (no batch dimension). A 1D signal is (L,) or (1, L); an image is (C, H, W).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

__all__ = [
    "normalize_input_shape",
    "check_num_classes",
    "is_signal_shape",
    "is_image_shape",
    "signal_length",
    "image_chw",
]


def normalize_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """Turn any int sequence (tuple, list, torch.Size) into a tuple of positive ints.

    Configs and JSON give lists; comparing shapes only works once they are all plain tuples.
    """
    if isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Sequence):
        raise ValueError(
            "input_shape must be a sequence of positive ints (per sample, no batch), "
            f"got {input_shape!r}"
        )
    dims = []
    for d in input_shape:
        try:
            if isinstance(d, bool):
                raise TypeError
            dims.append(operator.index(d))
        except TypeError:
            raise ValueError(
                f"input_shape must contain only ints, got {tuple(input_shape)!r}"
            ) from None
    shape = tuple(dims)
    if not shape or any(d < 1 for d in shape):
        raise ValueError(
            "input_shape must be non-empty with all dims >= 1 (per sample, no batch), "
            f"got {shape!r}"
        )
    return shape


def check_num_classes(num_classes: int) -> int:
    """A classifier needs at least one output; bools and floats are config mistakes."""
    if isinstance(num_classes, bool):
        raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
    try:
        n = operator.index(num_classes)
    except TypeError:
        raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}") from None
    if n < 1:
        raise ValueError(f"num_classes must be an int >= 1, got {n}")
    return n


def is_signal_shape(shape: tuple[int, ...]) -> bool:
    """(L,) or (1, L): a single-channel 1D signal such as MNIST-1D."""
    return len(shape) == 1 or (len(shape) == 2 and shape[0] == 1)


def is_image_shape(shape: tuple[int, ...]) -> bool:
    return len(shape) == 3


def signal_length(input_shape: Sequence[int], model_name: str, min_length: int) -> int:
    """Length L of a (L,) or (1, L) signal shape, or a ValueError saying what was expected."""
    shape = normalize_input_shape(input_shape)
    if not is_signal_shape(shape) or shape[-1] < min_length:
        raise ValueError(
            f"{model_name!r} expects a 1D signal input_shape (L,) or (1, L) with "
            f"L >= {min_length} (e.g. (40,) for MNIST-1D), got {shape}"
        )
    return shape[-1]


def image_chw(
    input_shape: Sequence[int], model_name: str, min_hw: int
) -> tuple[int, int, int]:
    """(C, H, W) of an image shape, or a ValueError saying what was expected."""
    shape = normalize_input_shape(input_shape)
    if not is_image_shape(shape) or shape[1] < min_hw or shape[2] < min_hw:
        raise ValueError(
            f"{model_name!r} expects an image input_shape (C, H, W) with "
            f"H, W >= {min_hw}, got {shape}"
        )
    c, h, w = shape
    return c, h, w
