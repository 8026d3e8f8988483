"""`smallcnn`: a three-conv image CNN, cheaper than the ResNets and size-agnostic.

Global average pooling at the end means any H, W >= 8 gives the same 64 features.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .base import SplitModel
from .shapes import check_num_classes, image_chw

__all__ = ["SmallCNN"]

MIN_HW = 8


class SmallCNN(SplitModel):
    """conv3(32)-pool-conv3(64)-pool-conv3(64)-global avg pool (features, dim 64) -> Linear."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        c, _, _ = image_chw(input_shape, "smallcnn", MIN_HW)
        num_classes = check_num_classes(num_classes)
        backbone = nn.Sequential(
            nn.Conv2d(c, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(1),
        )
        super().__init__(
            backbone,
            nn.Linear(64, num_classes),
            feature_dim=64,
            num_classes=num_classes,
            input_shape=input_shape,
        )
