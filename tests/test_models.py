"""Model zoo contract: shapes, the backbone/classifier split, gradients, determinism, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fedal.models import (
    MODEL_NAMES,
    SplitModel,
    build_model,
    count_parameters,
    models_for_input,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
# Intended inputs per model: MNIST-1D, sklearn digits (8x8), MNIST (28x28), CIFAR (32x32).
CASES = [
    ("mlp", (40,)),
    ("mlp", (1, 40)),
    ("mlp", (1, 8, 8)),
    ("mlp", (3, 32, 32)),
    ("cnn1d", (40,)),
    ("cnn1d", (1, 40)),
    ("cnn1d_wide", (40,)),
    ("cnn1d_wide", (1, 40)),
    ("lenet5", (1, 8, 8)),
    ("lenet5", (1, 28, 28)),
    ("lenet5", (3, 32, 32)),
    ("lenet5", (1, 11, 13)),
    ("smallcnn", (1, 8, 8)),
    ("smallcnn", (1, 28, 28)),
    ("smallcnn", (3, 32, 32)),
    ("wrn10_1", (3, 32, 32)),
    ("wrn10_1", (1, 32, 32)),
    ("wrn16_1", (3, 32, 32)),
    ("resnet18", (3, 32, 32)),
]
EXPECTED_FEATURE_DIM = {
    "mlp": 100,
    "cnn1d": 240,
    "cnn1d_wide": 100,
    "lenet5": 84,
    "smallcnn": 64,
    "wrn10_1": 64,
    "wrn16_1": 64,
    "resnet18": 512,
}
NUM_CLASSES = 7
CASE_IDS = [f"{name}-{'x'.join(map(str, shape))}" for name, shape in CASES]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _build(name: str, shape: tuple[int, ...], seed: int = 0) -> SplitModel:
    torch.manual_seed(seed)
    return build_model(name, shape, NUM_CLASSES)


def _batch(shape: tuple[int, ...], batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def test_every_model_has_a_case():
    assert set(MODEL_NAMES) == {name for name, _ in CASES} == set(EXPECTED_FEATURE_DIM)
    assert len(MODEL_NAMES) == len(set(MODEL_NAMES))


@pytest.mark.parametrize(("name", "shape"), CASES, ids=CASE_IDS)
def test_shapes_and_split(name, shape):
    model = _build(name, shape)
    assert isinstance(model, SplitModel)
    assert model.input_shape == shape
    assert model.num_classes == NUM_CLASSES
    assert model.feature_dim == EXPECTED_FEATURE_DIM[name]
    assert isinstance(model.backbone, nn.Module) and isinstance(model.classifier, nn.Module)
    assert not any(isinstance(m, nn.modules.dropout._DropoutNd) for m in model.modules())

    model.eval()
    x = _batch(shape, batch=3)
    with torch.no_grad():
        logits = model(x)
        h = model.features(x)
        assert logits.shape == (3, NUM_CLASSES)
        assert h.shape == (3, model.feature_dim)
        assert torch.equal(model.head(h), logits)
        # features/head are exactly the two submodules
        assert torch.equal(model.backbone(x), h)
        assert torch.equal(model.classifier(h), logits)
        assert torch.equal(model(x), logits)  # repeatable: no dropout, eval BN


@pytest.mark.parametrize(("name", "shape"), CASES, ids=CASE_IDS)
def test_gradients_reach_backbone_and_classifier(name, shape):
    model = _build(name, shape)
    model.train()
    x = _batch(shape, batch=2)
    y = torch.tensor([0, NUM_CLASSES - 1])
    nn.functional.cross_entropy(model(x), y).backward()
    for part in (model.backbone, model.classifier):
        grads = [p.grad for p in part.parameters()]
        assert grads, f"{name}: a part has no parameters"
        assert all(g is not None for g in grads)
        assert sum(float(g.abs().sum()) for g in grads) > 0
    backbone_ids = {id(p) for p in model.backbone.parameters()}
    classifier_ids = {id(p) for p in model.classifier.parameters()}
    all_ids = {id(p) for p in model.parameters()}
    assert backbone_ids | classifier_ids == all_ids  # nothing trains outside the two parts


@pytest.mark.parametrize(("name", "shape"), CASES, ids=CASE_IDS)
def test_train_mode_split_matches_forward(name, shape):
    model = _build(name, shape).train()
    x = _batch(shape, batch=2)
    with torch.no_grad():
        assert torch.equal(model.head(model.features(x)), model(x))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_deterministic_under_seed(name):
    shape = next(s for n, s in CASES if n == name)
    a, b = _build(name, shape, seed=3), _build(name, shape, seed=3)
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    x = _batch(shape)
    with torch.no_grad():
        assert torch.equal(a.train()(x), b.train()(x))
        assert torch.equal(a.eval()(x), b.eval()(x))


def test_different_seeds_differ():
    a, b = _build("cnn1d", (40,), seed=3), _build("cnn1d", (40,), seed=4)
    assert not torch.equal(a.classifier.weight, b.classifier.weight)


def test_lenet5_is_classic_on_mnist():
    model = _build("lenet5", (1, 28, 28))
    assert model.backbone[7].in_features == 16 * 5 * 5


def test_models_for_input():
    signal = ["mlp", "cnn1d", "cnn1d_wide"]
    small = ["mlp", "lenet5", "smallcnn"]
    assert models_for_input((40,)) == signal
    assert models_for_input([1, 40]) == signal
    assert models_for_input(torch.Size([40])) == signal
    assert models_for_input((1, 8, 8)) == small
    assert models_for_input((1, 28, 28)) == small
    assert models_for_input((3, 32, 31)) == small
    assert models_for_input((3, 32, 32)) == small + ["wrn10_1", "wrn16_1", "resnet18"]
    assert models_for_input((1, 4, 4)) == ["mlp"]
    assert models_for_input((7,)) == ["mlp"]  # too short for the conv stack
    assert models_for_input((2, 40)) == ["mlp"]  # multi-channel signal: only the MLP fits


@pytest.mark.parametrize("shape", [(40,), (1, 40), (1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_models_for_input_all_build(shape):
    for name in models_for_input(shape):
        assert build_model(name, shape, 10).input_shape == shape


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown model 'vgg16'") as info:
        build_model("vgg16", (3, 32, 32), 10)
    for name in MODEL_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("name", "shape", "expected", "suggested"),
    [
        ("cnn1d", (3, 32, 32), r"\(L,\) or \(1, L\)", "resnet18"),
        ("cnn1d_wide", (2, 40), r"\(L,\) or \(1, L\)", "mlp"),
        ("cnn1d", (7,), "L >= 8", "mlp"),
        ("lenet5", (40,), r"\(C, H, W\)", "cnn1d"),
        ("smallcnn", (1, 4, 4), "H, W >= 8", "mlp"),
        ("wrn16_1", (40,), r"\(C, H, W\)", "cnn1d_wide"),
        ("resnet18", (1, 40), r"\(C, H, W\)", "cnn1d"),
    ],
)
def test_bad_shape_raises_with_choices(name, shape, expected, suggested):
    with pytest.raises(ValueError, match=expected) as info:
        build_model(name, shape, 10)
    message = str(info.value)
    assert repr(name) in message and str(shape) in message
    assert "models for input_shape" in message and suggested in message


@pytest.mark.parametrize("shape", [(), (0, 40), (-1,), (40.0,), "40", 40, (True, 3)])
def test_malformed_shape_raises(shape):
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", shape, 10)
    with pytest.raises(ValueError, match="input_shape"):
        models_for_input(shape)


@pytest.mark.parametrize("num_classes", [0, -3, 2.5, True, "10"])
def test_bad_num_classes(num_classes):
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (40,), num_classes)


def test_direct_construction_validates_too():
    from fedal.models.cnn1d import CNN1D
    from fedal.models.resnet import ResNet18

    with pytest.raises(ValueError, match="'cnn1d'"):
        CNN1D((1, 28, 28), 10)
    with pytest.raises(ValueError, match="'resnet18'"):
        ResNet18((40,), 10)


def test_count_parameters():
    model = _build("mlp", (40,))
    # 40*100+100 + 100*100+100 + 100*7+7
    assert count_parameters(model) == 4100 + 10100 + 707
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())
    assert count_parameters(nn.Sequential()) == 0


def test_import_does_not_touch_global_rng():
    # A fresh interpreter: in this one fedal.models is already imported.
    code = (
        "import torch; s = torch.get_rng_state(); import fedal.models as m; "
        "m.models_for_input((3, 32, 32)); assert torch.equal(s, torch.get_rng_state())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
