"""Model zoo: every model is a `SplitModel` (backbone -> features, classifier -> logits).

Models are built by registry name so configs, the simulator and edge agents agree on them:

    model = build_model("cnn1d", (40,), num_classes=10)

Nothing here touches the global RNG at import; seed with `torch.manual_seed` before
`build_model` to get reproducible weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from torch import nn

from fedal.model_names import MODEL_NAMES

from . import cnn1d, lenet, resnet, smallcnn, wrn
from .base import SplitModel
from .cnn1d import CNN1D
from .lenet import LeNet5
from .mlp import MLP
from .resnet import ResNet18
from .shapes import (
    check_num_classes,
    image_chw,
    is_image_shape,
    is_signal_shape,
    normalize_input_shape,
    signal_length,
)
from .smallcnn import SmallCNN
from .wrn import WideResNet

__all__ = [
    "MODEL_NAMES",
    "SplitModel",
    "build_model",
    "check_model_input",
    "count_parameters",
    "models_for_input",
]

_BUILDERS: dict[str, Callable[[Sequence[int], int], SplitModel]] = {
    "mlp": MLP,
    "cnn1d": partial(CNN1D, channels=(24, 48), name="cnn1d"),
    "cnn1d_wide": partial(CNN1D, channels=(32, 64), hidden=100, name="cnn1d_wide"),
    "lenet5": LeNet5,
    "smallcnn": SmallCNN,
    "wrn10_1": partial(WideResNet, depth=10, widen_factor=1),
    "wrn16_1": partial(WideResNet, depth=16, widen_factor=1),
    "resnet18": ResNet18,
}

assert tuple(_BUILDERS) == MODEL_NAMES, "fedal/model_names.py lists the zoo"

_SHAPE_CHECKS: dict[str, Callable[[Sequence[int]], object]] = {
    "mlp": normalize_input_shape,
    "cnn1d": partial(signal_length, model_name="cnn1d", min_length=cnn1d.MIN_LENGTH),
    "cnn1d_wide": partial(signal_length, model_name="cnn1d_wide", min_length=cnn1d.MIN_LENGTH),
    "lenet5": partial(image_chw, model_name="lenet5", min_hw=lenet.MIN_HW),
    "smallcnn": partial(image_chw, model_name="smallcnn", min_hw=smallcnn.MIN_HW),
    "wrn10_1": partial(image_chw, model_name="wrn10_1", min_hw=wrn.MIN_HW),
    "wrn16_1": partial(image_chw, model_name="wrn16_1", min_hw=wrn.MIN_HW),
    "resnet18": partial(image_chw, model_name="resnet18", min_hw=resnet.MIN_HW),
}

_SIGNAL_MODELS = ("mlp", "cnn1d", "cnn1d_wide")
_SMALL_IMAGE_MODELS = ("mlp", "lenet5", "smallcnn")
# The deep nets are built for CIFAR-sized inputs; on smaller images they are mostly wasted compute.
_LARGE_IMAGE_MODELS = ("wrn10_1", "wrn16_1", "resnet18")
_LARGE_IMAGE_MIN_HW = 32


def models_for_input(input_shape: Sequence[int]) -> list[str]:
    """Names of the zoo models suited to a per-sample `input_shape` (no batch dimension).

    1D signals (L,) / (1, L) -> mlp, cnn1d, cnn1d_wide; images (C, H, W) -> mlp, lenet5,
    smallcnn, plus the WRNs and resnet18 when H, W >= 32. Anything else -> mlp only.
    Only names whose constructor accepts the shape are returned.
    """
    shape = normalize_input_shape(input_shape)
    if is_signal_shape(shape):
        candidates: tuple[str, ...] = _SIGNAL_MODELS
    elif is_image_shape(shape):
        candidates = _SMALL_IMAGE_MODELS
        if min(shape[1:]) >= _LARGE_IMAGE_MIN_HW:
            candidates += _LARGE_IMAGE_MODELS
    else:
        candidates = ("mlp",)
    return [name for name in candidates if _accepts(name, shape)]


def _accepts(name: str, shape: tuple[int, ...]) -> bool:
    # The same shape checks the constructors run, without building anything.
    try:
        _SHAPE_CHECKS[name](shape)
    except ValueError:
        return False
    return True


def build_model(name: str, input_shape: Sequence[int], num_classes: int) -> SplitModel:
    """Build zoo model `name` for per-sample `input_shape` and `num_classes` outputs.

    Raises ValueError for an unknown name (listing MODEL_NAMES) or a shape the model cannot
    take (listing the models that can).
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    num_classes = check_num_classes(num_classes)
    shape = normalize_input_shape(input_shape)
    try:
        return _BUILDERS[name](shape, num_classes)
    except ValueError as exc:
        hint = ", ".join(models_for_input(shape)) or "none"
        raise ValueError(f"{exc}; models for input_shape {shape}: {hint}") from None


def check_model_input(name: str, input_shape: Sequence[int]) -> None:
    """build_model's ValueError for `name` and `input_shape`, without building the model."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}")
    shape = normalize_input_shape(input_shape)
    try:
        _SHAPE_CHECKS[name](shape)
    except ValueError as exc:
        hint = ", ".join(models_for_input(shape)) or "none"
        raise ValueError(f"{exc}; models for input_shape {shape}: {hint}") from None


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (trainable or not, buffers excluded); shared tensors count once."""
    return sum(p.numel() for p in model.parameters())
