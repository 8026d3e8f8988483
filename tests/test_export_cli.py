"""`fedal export` end to end in a subprocess: files written, clear errors with the right exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fedal.models import build_model


def _export(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fedal_cli.main", "export", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def lenet_checkpoint(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "final" / "model.pt"
    path.parent.mkdir()
    torch.save(build_model("lenet5", (1, 8, 8), 10).state_dict(), path)
    return path


def test_export_check_and_int8_write_files_and_report(tmp_path, lenet_checkpoint):
    out = tmp_path / "out" / "lenet5.onnx"
    result = _export("--model", "lenet5", "--checkpoint", str(lenet_checkpoint), "--dataset", "digits",
                     "--out", str(out), "--check", "--quantize", "int8", "--threads", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    int8 = tmp_path / "out" / "lenet5.int8.onnx"
    report_path = tmp_path / "out" / "lenet5.onnx.json"
    assert out.is_file() and int8.is_file() and report_path.is_file()
    assert "parity ok" in result.stdout and "int8" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["model"] == "lenet5" and report["opset"] == 17
    assert 0 <= report["parity_max_diff"] <= 1e-4
    assert report["onnx_bytes"] == out.stat().st_size
    assert report["int8"]["bytes"] == int8.stat().st_size and report["int8"]["mode"] == "static"
    assert set(report["int8"]["accuracy"]) == {"fp32_acc", "int8_acc", "delta_points"}


def test_export_with_explicit_shape_and_dynamic_int8(tmp_path):
    result = _export("--model", "mlp", "--input-shape", "40", "--num-classes", "10",
                     "--out", "mlp.onnx", "--check", "--quantize", "int8", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "mlp.onnx.json").read_text())
    assert report["input_shape"] == [40] and report["int8"]["mode"] == "dynamic"
    assert report["int8"]["accuracy"] is None  # no dataset, no accuracy
    assert report["conv1d_channel_multiple"] is None  # no 1-D layers to lift
    assert (tmp_path / "mlp.int8.onnx").is_file()


def test_unknown_model_is_a_usage_error_naming_choices(tmp_path):
    result = _export("--model", "vgg16", "--dataset", "digits", "--out", "x.onnx", cwd=tmp_path)
    assert result.returncode == 2
    assert "vgg16" in result.stderr and "lenet5" in result.stderr and "resnet18" in result.stderr
    assert not (tmp_path / "x.onnx").exists()


def test_missing_shape_without_dataset_is_a_usage_error(tmp_path):
    result = _export("--model", "mlp", "--out", "x.onnx", cwd=tmp_path)
    assert result.returncode == 2
    assert "--input-shape and --num-classes are required" in result.stderr


def test_mismatched_checkpoint_fails_with_message(tmp_path):
    ckpt = tmp_path / "other.pt"
    torch.save(build_model("lenet5", (1, 8, 8), 5).state_dict(), ckpt)
    result = _export("--model", "lenet5", "--dataset", "digits", "--checkpoint", str(ckpt),
                     "--out", "x.onnx", cwd=tmp_path)
    assert result.returncode == 1
    assert "does not match model" in result.stderr and "classifier.weight" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.onnx").exists()


def _conv_in_channels(path):
    import onnx

    proto = onnx.load(str(path))
    dims = {t.name: list(t.dims) for t in proto.graph.initializer}
    return [dims[n.input[1]] for n in proto.graph.node if n.op_type == "Conv"]


def test_1d_model_channel_multiple_for_the_target_device(tmp_path):
    """A file for a device without NCHWc kernels: 2-D convs, but no channel padding."""
    result = _export("--model", "cnn1d", "--input-shape", "40", "--num-classes", "10", "--out", "plain.onnx",
                     "--channel-multiple", "0", "--check", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _conv_in_channels(tmp_path / "plain.onnx") == [[24, 1, 1, 5], [48, 24, 1, 3]]
    assert json.loads((tmp_path / "plain.onnx.json").read_text())["conv1d_channel_multiple"] == 0

    result = _export("--model", "cnn1d", "--input-shape", "40", "--num-classes", "10", "--out", "padded.onnx",
                     "--channel-multiple", "16", "--check", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [w[1] for w in _conv_in_channels(tmp_path / "padded.onnx")] == [1, 32]
    assert json.loads((tmp_path / "padded.onnx.json").read_text())["conv1d_channel_multiple"] == 16

    result = _export("--model", "mlp", "--input-shape", "40", "--num-classes", "10", "--out", "mlp.onnx",
                     "--channel-multiple", "-1", cwd=tmp_path)
    assert result.returncode == 2 and "--channel-multiple" in result.stderr
