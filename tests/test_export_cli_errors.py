"""`fedal export` error paths, run as the real command in a subprocess.

* an opset the exporter cannot write is a usage error (exit 2) before any work, and the report's
  opset is the one in the written file, never just the one asked for;
* a --checkpoint that is not a torch.save file fails with one line (exit 1), not torch's page.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

from export.checkpoint import load_checkpoint
from fedal.models import build_model

SUPPORTED = "7 to 20"  # the range docs/export.md promises


def _export(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fedal_cli.main", "export", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def _file_opset(path) -> list[int]:
    return [o.version for o in onnx.load(str(path)).opset_import if o.domain in ("", "ai.onnx")]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


MLP = ("--model", "mlp", "--input-shape", "40", "--num-classes", "10")


@pytest.mark.parametrize("opset", ["6", "21"])  # just below and above the range
def test_opset_outside_the_supported_range_is_a_usage_error_before_any_work(tmp_path, opset):
    result = _export(*MLP, "--out", "x.onnx", "--opset", opset, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and "--opset" in errors[0] and opset in errors[0] and SUPPORTED in errors[0]
    assert "Torch IR graph" not in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert "note:" not in result.stderr  # refused while parsing: the command did not start
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # neither x.onnx nor x.onnx.json


def test_lowest_supported_opset_is_written_and_reported(tmp_path):
    result = _export(*MLP, "--out", "x.onnx", "--opset", "7", "--check", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _file_opset(tmp_path / "x.onnx") == [7]
    assert json.loads((tmp_path / "x.onnx.json").read_text())["opset"] == 7
    assert "Warning" not in result.stderr  # torch's opset<9 initializer notice is not the user's business


# The real command, with the legacy exporter made to write opset 13 whatever it is asked for:
# what the dynamo fallback does (it writes 18) when the legacy exporter fails.
_EXPORTER_IGNORES_OPSET = """
import sys
import export.onnx_export as onnx_export
real = onnx_export._export_legacy
onnx_export._export_legacy = lambda model, example, path, opset: real(model, example, path, 13)
from fedal_cli.main import cli
cli(prog_name="fedal")
"""


def test_report_states_the_opset_actually_written(tmp_path):
    result = subprocess.run([sys.executable, "-c", _EXPORTER_IGNORES_OPSET, "export", *MLP, "--out", "x.onnx",
                             "--opset", "17"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert _file_opset(tmp_path / "x.onnx") == [13]
    assert json.loads((tmp_path / "x.onnx.json").read_text())["opset"] == 13
    assert "opset 13 instead of the requested 17" in result.stderr


def test_static_int8_below_opset_13_is_a_usage_error_before_any_work(tmp_path):
    result = _export("--model", "lenet5", "--dataset", "digits", "--out", "x.onnx", "--opset", "12",
                     "--quantize", "int8", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = _error_lines(result.stderr)
    assert len(errors) == 1 and "--opset 13" in errors[0] and "dynamic" in errors[0]
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def _results_json(path):
    path.write_text(json.dumps({"run": "abc", "rounds": [{"round": 1, "accuracy": 0.52}]}, indent=2))


def _empty(path):
    path.write_bytes(b"")


def _npz(path):
    with open(path, "wb") as fh:
        np.savez(fh, weights=np.zeros(3))


def _plain_pickle(path):
    path.write_bytes(pickle.dumps({"classifier.weight": [0.0] * 4}, protocol=4))


def _truncated_checkpoint(path):
    torch.save(build_model("mlp", (40,), 10).state_dict(), path)
    path.write_bytes(path.read_bytes()[:2000])


@pytest.mark.parametrize("name, write, reason", [
    ("results.json", _results_json, "text file"),
    ("empty.pt", _empty, "empty"),
    ("arrays.npz", _npz, "zip archive"),
    ("model.pkl", _plain_pickle, "pickle"),
    ("model.pt", _truncated_checkpoint, "zip archive"),
])
def test_file_that_is_not_a_torch_checkpoint_is_named_in_one_line(tmp_path, name, write, reason):
    path = tmp_path / name
    write(path)
    with pytest.raises(ValueError) as refused:
        load_checkpoint(build_model("mlp", (40,), 10), path)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path} is not a model checkpoint saved by torch.save (")
    assert reason in message and message.endswith(")") and "weights_only" not in message


def test_the_command_reports_a_results_file_as_checkpoint_in_one_line(tmp_path):
    path = tmp_path / "results.json"
    _results_json(path)
    result = _export(*MLP, "--checkpoint", str(path), "--out", "x.onnx", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines == [f"Error: {path} is not a model checkpoint saved by torch.save (it is a text file starting "
                     "'{ \"run\": \"abc\", \"rounds\"')"], result.stderr
    assert not (tmp_path / "x.onnx").exists()


def test_whole_pickled_model_fails_with_one_line_naming_the_fix(tmp_path):
    path = tmp_path / "model.pt"
    torch.save(build_model("mlp", (40,), 10), path)  # the module, not its state_dict
    result = _export(*MLP, "--checkpoint", str(path), "--out", "x.onnx", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"Error: {path} is not a state_dict checkpoint")
    assert "fedal.models.mlp.MLP" in lines[0] and "state_dict()" in lines[0]
    assert not (tmp_path / "x.onnx").exists()
