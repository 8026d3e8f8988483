"""`mlp`: the generic baseline; it flattens any input, so it fits every dataset in the project."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from .base import SplitModel
from .shapes import check_num_classes, normalize_input_shape

__all__ = ["MLP"]


class MLP(SplitModel):
    """Flatten -> 100 -> ReLU -> 100 -> ReLU (features, dim 100) -> Linear head.

    Two hidden layers of 100 as in the MNIST-1D paper's MLP: tiny enough to train on a CPU.
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden: int = 100
    ) -> None:
        shape = normalize_input_shape(input_shape)
        num_classes = check_num_classes(num_classes)
        backbone = nn.Sequential(
            nn.Flatten(1),
            nn.Linear(math.prod(shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        super().__init__(
            backbone,
            nn.Linear(hidden, num_classes),
            feature_dim=hidden,
            num_classes=num_classes,
            input_shape=shape,
        )
