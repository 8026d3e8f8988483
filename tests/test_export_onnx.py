"""ONNX export of the zoo: dynamic batch axis, checker-valid files, torch/onnxruntime parity."""

from __future__ import annotations

import gc
import warnings

import onnx
import pytest
import torch

from export import ParityError, check_parity, export_onnx
from export import onnx_export as onnx_export_module
from fedal.models import MODEL_NAMES, build_model

# Each zoo model at an intended shape, plus the shape-dependent variants (padded LeNet, (1, L)).
CASES = [
    ("mlp", (40,)),
    ("mlp", (1, 28, 28)),
    ("cnn1d", (40,)),
    ("cnn1d", (1, 40)),
    ("cnn1d_wide", (40,)),
    ("lenet5", (1, 8, 8)),
    ("lenet5", (1, 28, 28)),
    ("smallcnn", (3, 32, 32)),
    ("wrn10_1", (3, 32, 32)),
    ("wrn16_1", (3, 32, 32)),
    ("resnet18", (3, 32, 32)),
]
CASE_IDS = [f"{name}-{'x'.join(map(str, shape))}" for name, shape in CASES]
EXPORT_BATCH = 3
PARITY_BATCHES = (2, 5)  # both differ from EXPORT_BATCH: proves the batch axis is dynamic


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _inputs(shape, batch, seed=0):
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def _trained_looking_model(name, shape, num_classes=10):
    """A model whose BatchNorm running stats are not the defaults, so eval mode matters."""
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes)
    with torch.no_grad():
        model.train()(_inputs(shape, 8, seed=99) * 2 + 0.5)
    return model


def test_every_model_is_exported():
    assert {name for name, _ in CASES} == set(MODEL_NAMES)


@pytest.mark.parametrize(("name", "shape"), CASES, ids=CASE_IDS)
def test_export_and_parity(name, shape, tmp_path, capfd):
    model = _trained_looking_model(name, shape)
    target = tmp_path / "sub" / f"{name}.onnx"
    gc.collect()  # earlier tests' garbage (an unclosed pipe's ResourceWarning) is not the export's warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = export_onnx(model, _inputs(shape, EXPORT_BATCH), target)
    assert [str(w.message) for w in caught] == []
    out, err = capfd.readouterr()
    assert out == "" and err == ""

    assert path == target and path.is_file()
    assert model.training  # previous mode restored
    proto = onnx.load(str(path))
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [17]
    (inp,), (out_,) = proto.graph.input, proto.graph.output
    assert (inp.name, out_.name) == ("input", "logits")
    in_dims = inp.type.tensor_type.shape.dim
    out_dims = out_.type.tensor_type.shape.dim
    assert in_dims[0].dim_param and not in_dims[0].dim_value
    assert out_dims[0].dim_param == in_dims[0].dim_param
    assert [d.dim_value for d in in_dims[1:]] == list(shape)
    assert out_dims[1].dim_value == 10

    for batch in PARITY_BATCHES:
        diff = check_parity(model, path, _inputs(shape, batch, seed=batch), atol=1e-4)
        assert 0.0 <= diff <= 1e-4
    assert model.training


def test_batch_of_one_example_keeps_batch_dynamic(tmp_path):
    model = _trained_looking_model("cnn1d", (40,)).eval()
    path = export_onnx(model, _inputs((40,), 1), str(tmp_path / "one.onnx"))
    assert not model.training  # eval stays eval
    assert check_parity(model, path, _inputs((40,), 5)) <= 1e-4
    assert check_parity(model, path, _inputs((40,), 1)) <= 1e-4


def test_parity_error_on_changed_weights(tmp_path):
    model = _trained_looking_model("mlp", (40,))
    path = export_onnx(model, _inputs((40,), 2), tmp_path / "mlp.onnx")
    with torch.no_grad():
        model.classifier.bias.add_(0.5)
    with pytest.raises(ParityError, match=r"differ by up to 0\.5.*atol=0\.0001"):
        check_parity(model, path, _inputs((40,), 5))
    # A looser tolerance accepts the same difference and reports it.
    assert check_parity(model, path, _inputs((40,), 5), atol=1.0) == pytest.approx(0.5, abs=1e-5)


def test_parity_error_on_output_shape_mismatch(tmp_path):
    path = export_onnx(_trained_looking_model("mlp", (40,)), _inputs((40,), 2), tmp_path / "a.onnx")
    other = _trained_looking_model("mlp", (40,), num_classes=3)
    with pytest.raises(ParityError, match="output shape"):
        check_parity(other, path, _inputs((40,), 2))


def test_example_input_must_match_model(tmp_path):
    model = build_model("cnn1d", (40,), 10)
    with pytest.raises(ValueError, match=r"per-sample shape \(41,\)"):
        export_onnx(model, torch.zeros(2, 41), tmp_path / "bad.onnx")
    with pytest.raises(ValueError, match="batched"):
        export_onnx(model, torch.tensor(1.0), tmp_path / "bad.onnx")


def test_dynamo_fallback_when_legacy_exporter_fails(tmp_path, monkeypatch, caplog):
    def legacy_gone(*args, **kwargs):
        raise RuntimeError("legacy exporter unavailable")

    monkeypatch.setattr(onnx_export_module, "_export_legacy", legacy_gone)
    model = _trained_looking_model("cnn1d", (40,))
    path = export_onnx(model, _inputs((40,), EXPORT_BATCH), tmp_path / "dynamo.onnx")
    assert "retrying with dynamo" in caplog.text
    for batch in PARITY_BATCHES:
        assert check_parity(model, path, _inputs((40,), batch)) <= 1e-4
