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
    assert report["onnx_max_abs_diff"] <= 1e-4
    assert report["compiler_stack_loaded_while_training"] == []


def test_a_broken_onnxruntime_fails_the_check_with_the_reason(tmp_path):
    fake = tmp_path / "onnxruntime"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libonnxruntime.so: cannot open shared object file')\n")
    out = self_check({"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert out.returncode == 1 and out.stdout == ""
    assert "self-check failed: ONNX export or onnxruntime does not work here (ImportError: libonnxruntime.so" in out.stderr
    assert "Traceback" not in out.stderr
