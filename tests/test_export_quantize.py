"""Int8 models run through OrtModel and stay close to fp32; OrtModel matches torch; bad checkpoints are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from export import export_onnx
from export.checkpoint import load_checkpoint
from export.quantize import accuracy_delta, quantize_int8
from export.session import OrtModel
from fedal.data import load_dataset
from fedal.models import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="module")
def trained_lenet(digits, tmp_path_factory):
    """lenet5 trained briefly on digits (so argmax agreement is meaningful), exported to fp32 ONNX."""
    train, _ = digits
    torch.manual_seed(0)
    model = build_model("lenet5", (1, 8, 8), 10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(150):
        idx = torch.randint(0, len(x), (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    path = export_onnx(model, x[:2], tmp_path_factory.mktemp("onnx") / "lenet5.onnx")
    return model, path


def test_ort_model_matches_torch(trained_lenet, digits):
    model, path = trained_lenet
    x = digits[1].x[:100]
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    ort_model = OrtModel(path, threads=1)
    for batch_size in (7, 1024):  # uneven batches are stitched back together in order
        out = ort_model(x, batch_size=batch_size)
        assert out.dtype == np.float32 and out.shape == (100, 10)
        np.testing.assert_allclose(out, expected, atol=1e-4, rtol=0)


def test_ort_model_rejects_wrong_feature_shape(trained_lenet):
    ort_model = OrtModel(trained_lenet[1], threads=1)
    with pytest.raises(ValueError, match=r"expects \[n, 1x8x8\]"):
        ort_model(np.zeros((4, 1, 28, 28), np.float32))
    with pytest.raises(ValueError, match="expects"):
        ort_model(np.zeros((4, 64), np.float32))


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_int8_runs_and_agrees_with_fp32(trained_lenet, digits, tmp_path, mode):
    train, test = digits
    _, fp32_path = trained_lenet
    int8_path = quantize_int8(fp32_path, tmp_path / f"lenet5.{mode}.onnx", mode, calibration=train.x)
    assert int8_path.stat().st_size < fp32_path.stat().st_size
    fp32_out = OrtModel(fp32_path, threads=1)(test.x)
    int8_out = OrtModel(int8_path, threads=1)(test.x, batch_size=32)
    assert int8_out.shape == fp32_out.shape == (len(test.x), 10)
    assert int8_out.dtype == np.float32 and np.isfinite(int8_out).all()
    agreement = (int8_out.argmax(1) == fp32_out.argmax(1)).mean()
    assert agreement >= 0.95, agreement
    acc = accuracy_delta(fp32_path, int8_path, test.x, test.y, threads=1)
    assert acc["fp32_acc"] > 0.5  # the brief training did something
    assert abs(acc["delta_points"]) <= 3.0
    assert acc["delta_points"] == pytest.approx(100 * (acc["int8_acc"] - acc["fp32_acc"]))


def test_static_quantization_needs_calibration(trained_lenet, tmp_path):
    with pytest.raises(ValueError, match="calibration"):
        quantize_int8(trained_lenet[1], tmp_path / "q.onnx", "static")
    with pytest.raises(ValueError, match="unknown quantization mode"):
        quantize_int8(trained_lenet[1], tmp_path / "q.onnx", "int4")


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(1)
    source = build_model("cnn1d", (40,), 10)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    target = load_checkpoint(build_model("cnn1d", (40,), 10), tmp_path / "model.pt")
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    torch.save(build_model("smallcnn", (1, 8, 8), 10).state_dict(), tmp_path / "model.pt")
    with pytest.raises(ValueError, match="does not match model.*(missing|unexpected) keys"):
        load_checkpoint(build_model("lenet5", (1, 8, 8), 10), tmp_path / "model.pt")


def test_checkpoint_with_other_num_classes_is_refused(tmp_path):
    torch.save(build_model("lenet5", (1, 8, 8), 5).state_dict(), tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"classifier\.weight has shape \(5, 84\).*\(10, 84\)"):
        load_checkpoint(build_model("lenet5", (1, 8, 8), 10), tmp_path / "model.pt")


def test_non_state_dict_is_refused(tmp_path):
    torch.save([torch.zeros(2)], tmp_path / "model.pt")
    with pytest.raises(ValueError, match="not a state_dict"):
        load_checkpoint(build_model("mlp", (40,), 10), tmp_path / "model.pt")
