"""A benchmark option no run can use is a usage error up front (exit 2, the option named), not
a traceback after minutes of work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, args, message", [
    ("scale.py", ["--clients", "100,1"], "argument --clients: must be at least 2, got 1"),
    ("scale.py", ["--clients", "100,x"], "argument --clients: expected a whole number, got 'x'"),
    ("scale.py", ["--tau", "0"], "argument --tau: must be at least 1"),
    ("scale.py", ["--render", "missing.json"], "argument --render: missing.json is not a readable scale.json"),
    ("onnx_speed.py", ["--cpu", "4096"], "argument --cpu: 4096 is not one of this process's CPUs"),
    ("model_zoo.py", ["--rows", "10000000"], "argument --rows: at most"),
    ("model_zoo.py", ["--steps", "0"], "argument --steps: must be at least 1"),
    ("sim_checkpoint.py", ["--clients", "10,1"], "argument --clients: must be at least 2, got 1"),
    ("sim_checkpoint.py", ["--rounds", "0"], "argument --rounds: must be at least 1"),
])
def test_an_unusable_option_is_a_usage_error(tmp_path, script, args, message):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--out", str(tmp_path / "out")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()  # nothing written
