"""`lenet5`: LeNet-5 (ReLU/max-pool variant) for small grayscale or colour images.

It must fit MNIST (28x28), CIFAR-sized (32x32) and scikit-learn's 8x8 digits alike, so the
first conv is 'same'-padded and the second is padded only when the map is too small for a
valid 5x5 conv. A static flatten (no adaptive pooling) keeps the ONNX graph plain.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .base import SplitModel
from .shapes import check_num_classes, image_chw

__all__ = ["LeNet5"]

MIN_HW = 8


def _conv2_padding(size: int) -> int:
    # A valid 5x5 conv then 2x2 pool needs >= 6 pixels to leave one; else pad to 'same'.
    return 0 if size >= 6 else 2


class LeNet5(SplitModel):
    """conv5(6)-pool-conv5(16)-pool-fc120-fc84 (features, dim 84) -> Linear head.

    On 28x28 this is the classic 16x5x5 = 400 -> 120 -> 84 network.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        c, h, w = image_chw(input_shape, "lenet5", MIN_HW)
        num_classes = check_num_classes(num_classes)
        h1, w1 = h // 2, w // 2
        pad = (_conv2_padding(h1), _conv2_padding(w1))
        h2 = (h1 + 2 * pad[0] - 4) // 2
        w2 = (w1 + 2 * pad[1] - 4) // 2
        backbone = nn.Sequential(
            nn.Conv2d(c, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5, padding=pad),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(1),
            nn.Linear(16 * h2 * w2, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
        )
        super().__init__(
            backbone,
            nn.Linear(84, num_classes),
            feature_dim=84,
            num_classes=num_classes,
            input_shape=input_shape,
        )
