"""`python -m edge_agent --self-check`, which install-agent.sh runs after pip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def self_check(env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "edge_agent", "--self-check"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_self_check_trains_exports_and_matches_onnxruntime():
    out = self_check()
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "ok" and report["loss_last"] < report["loss_first"]
    assert report["onnx"] == "ok" and report["onnx_max_abs_diff"] <= 1e-4
    assert report["compiler_stack_loaded_while_training"] == []


def test_a_broken_onnxruntime_is_warned_about_and_does_not_fail_the_check(tmp_path):
    """The agent never depends on ONNX on the device (it keeps torch for inference): a broken
    onnxruntime is reported with the reason, the install goes on."""
    fake = tmp_path / "onnxruntime"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libonnxruntime.so: cannot open shared object file')\n")
    out = self_check({"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert out.returncode == 0, out.stderr
    assert "self-check: warning: ONNX export or onnxruntime does not work here (ImportError: libonnxruntime.so" in out.stderr
    assert "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "ok" and report["loss_last"] < report["loss_first"]
    assert report["onnx"].startswith("ONNX export or onnxruntime does not work here (ImportError")
    assert report["onnxruntime"] is None and report["onnx_max_abs_diff"] is None


def test_a_torch_that_cannot_train_fails_the_check_with_the_reason(tmp_path):
    """What the install must not go past: training itself broken (here: every step's loss NaN)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import torch.nn.functional as F\n"
        "_ce = F.cross_entropy\n"
        "F.cross_entropy = lambda *a, **k: _ce(*a, **k) * float('nan')\n")
    out = self_check({"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert out.returncode == 1 and out.stdout == ""
    assert "self-check failed: training does not work here: loss nan" in out.stderr
    assert "Traceback" not in out.stderr
