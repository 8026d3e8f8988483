"""`cnn1d` / `cnn1d_wide`: small 1D CNNs for MNIST-1D, after the MNIST-1D paper's ConvBase.

Three stride-2 convolutions shrink a length-40 signal to 4 steps, so the whole model is a few
thousand parameters and trains in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .base import SplitModel
from .shapes import check_num_classes, signal_length

__all__ = ["CNN1D", "conv_out_length"]

_KERNEL, _STRIDE, _PADDING, _LAYERS = 5, 2, 1, 3


def conv_out_length(length: int, layers: int = _LAYERS) -> int:
    """Signal length after `layers` of the conv stack (k=5, s=2, p=1)."""
    for _ in range(layers):
        length = (length + 2 * _PADDING - _KERNEL) // _STRIDE + 1
    return length


def _min_length() -> int:
    length = 1
    while conv_out_length(length) < 1:
        length += 1
    return length


MIN_LENGTH = _min_length()  # 15: shorter signals vanish inside the conv stack


class _AsChannels(nn.Module):
    """[B, L] or [B, 1, L] -> [B, 1, L]; flatten+unsqueeze keeps the batch axis dynamic in ONNX."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).unsqueeze(1)


class CNN1D(SplitModel):
    """3 x (Conv1d k5 s2 p1 + ReLU) -> flatten (features) -> Linear head.

    With L=40: feature_dim = channels * 4 (100 for `cnn1d`, 256 for `cnn1d_wide`).
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: int = 25,
        name: str = "cnn1d",
    ) -> None:
        length = signal_length(input_shape, name, MIN_LENGTH)
        num_classes = check_num_classes(num_classes)
        layers: list[nn.Module] = [_AsChannels()]
        in_ch = 1
        for _ in range(_LAYERS):
            layers += [nn.Conv1d(in_ch, channels, _KERNEL, _STRIDE, _PADDING), nn.ReLU()]
            in_ch = channels
        layers.append(nn.Flatten(1))
        feature_dim = channels * conv_out_length(length)
        super().__init__(
            nn.Sequential(*layers),
            nn.Linear(feature_dim, num_classes),
            feature_dim=feature_dim,
            num_classes=num_classes,
            input_shape=input_shape,
        )
