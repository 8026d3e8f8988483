"""`wrn10_1` / `wrn16_1`: Wide-ResNets (Zagoruyko & Komodakis) for 32x32 images, without dropout.

The usual CIFAR student/teacher pair in distillation papers. Depth = 6n + 4 (n blocks per
group), widths 16k, 32k, 64k; global average pooling makes the features 64k-dimensional.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .base import SplitModel
from .shapes import check_num_classes, image_chw

__all__ = ["WideResNet"]

# Designed for 32x32; the strides (1, 2, 2) and global pooling still work down to 8x8.
MIN_HW = 8


class _WideBasic(nn.Module):
    """Pre-activation block: BN-ReLU-conv3-BN-ReLU-conv3 plus (projected) shortcut."""

    def __init__(self, in_planes: int, out_planes: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, out_planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)
        self.conv2 = nn.Conv2d(out_planes, out_planes, 3, 1, 1, bias=False)
        self.equal_in_out = in_planes == out_planes and stride == 1
        self.shortcut = (
            None
            if self.equal_in_out
            else nn.Conv2d(in_planes, out_planes, 1, stride, 0, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        # As in the reference code: the projection sees the activated input, identity the raw one.
        residual = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(torch.relu(self.bn2(out)))
        return out + residual


class WideResNet(SplitModel):
    """WRN-depth-k: conv3(16) -> 3 groups of n blocks -> BN-ReLU-pool (features) -> Linear."""

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        depth: int = 16,
        widen_factor: int = 1,
    ) -> None:
        name = f"wrn{depth}_{widen_factor}"
        c, _, _ = image_chw(input_shape, name, MIN_HW)
        num_classes = check_num_classes(num_classes)
        if (depth - 4) % 6 != 0 or depth < 10:
            raise ValueError(f"WideResNet depth must be 6n + 4 with n >= 1, got {depth}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        layers: list[nn.Module] = [nn.Conv2d(c, widths[0], 3, 1, 1, bias=False)]
        in_planes = widths[0]
        for out_planes, stride in zip(widths[1:], (1, 2, 2)):
            for i in range(n):
                layers.append(_WideBasic(in_planes, out_planes, stride if i == 0 else 1))
                in_planes = out_planes
        layers += [
            nn.BatchNorm2d(in_planes),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(1),
        ]
        backbone = nn.Sequential(*layers)
        classifier = nn.Linear(in_planes, num_classes)
        _init_weights(backbone, classifier)
        super().__init__(
            backbone,
            classifier,
            feature_dim=in_planes,
            num_classes=num_classes,
            input_shape=input_shape,
        )


def _init_weights(*modules: nn.Module) -> None:
    """He init for convs, unit BN, zero biases: the standard WRN recipe."""
    for root in modules:
        for m in root.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
