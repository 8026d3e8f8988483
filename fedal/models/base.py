"""The split every zoo model follows: a feature extractor (backbone) and a classifier head.

Strategies such as FedHKD train and exchange the two parts separately (class prototypes live in
feature space, the head is distilled on its own), so `features` and `head` call exactly
`self.backbone` and `self.classifier` and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .shapes import check_num_classes, normalize_input_shape

__all__ = ["SplitModel"]


class SplitModel(nn.Module):
    """`backbone` (x -> [B, feature_dim]) followed by `classifier` ([B, feature_dim] -> logits).

    Subclasses build the two submodules and pass them here; everything else (forward, the
    feature/head split) is shared so all strategies can rely on the same contract.
    """

    feature_dim: int
    num_classes: int
    input_shape: tuple[int, ...]

    def __init__(
        self,
        backbone: nn.Module,
        classifier: nn.Module,
        *,
        feature_dim: int,
        num_classes: int,
        input_shape: Sequence[int],
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.classifier = classifier
        self.feature_dim = int(feature_dim)
        self.num_classes = check_num_classes(num_classes)
        self.input_shape = normalize_input_shape(input_shape)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Flat features [B, feature_dim]; FedHKD builds its class prototypes from these."""
        return self.backbone(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits [B, num_classes] from features, so the head can be trained on its own."""
        return self.classifier(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def extra_repr(self) -> str:
        return (
            f"input_shape={self.input_shape}, feature_dim={self.feature_dim}, "
            f"num_classes={self.num_classes}"
        )
