"""`resnet18`: the CIFAR variant of ResNet-18 (3x3 stem, no max-pool) for 32x32 images.

The largest zoo model (~11M parameters), used as a server-side or teacher model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .base import SplitModel
from .shapes import check_num_classes, image_chw

__all__ = ["ResNet18"]

# Designed for 32x32; the strides (1, 2, 2, 2) and global pooling still work down to 8x8.
MIN_HW = 8


class _BasicBlock(nn.Module):
    """conv3-BN-ReLU-conv3-BN plus (1x1-projected) shortcut, then ReLU."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(SplitModel):
    """conv3(64)-BN-ReLU -> 4 stages x 2 blocks -> global pool (features, 512) -> Linear."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        c, _, _ = image_chw(input_shape, "resnet18", MIN_HW)
        num_classes = check_num_classes(num_classes)
        layers: list[nn.Module] = [
            nn.Conv2d(c, 64, 3, 1, 1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
        ]
        in_planes = 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            for i in range(2):
                layers.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(1)]
        super().__init__(
            nn.Sequential(*layers),
            nn.Linear(in_planes, num_classes),
            feature_dim=in_planes,
            num_classes=num_classes,
            input_shape=input_shape,
        )
