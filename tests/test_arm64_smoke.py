"""Opt-in: the agent installed by install-agent.sh in an emulated arm64 Debian userland takes part
in a real run next to x86 agents (firmware_scripts/arm64-smoke.sh). Takes minutes, needs root,
debootstrap, qemu-user-static with binfmt_misc and a Debian mirror plus PyPI, so it is not part
of the default suite:

    FEDAL_ARM64_SMOKE=1 python -m pytest tests/test_arm64_smoke.py     # or: -m arm64
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "firmware_scripts" / "arm64-smoke.sh"

pytestmark = pytest.mark.arm64


def _opted_in(config) -> bool:
    return os.environ.get("FEDAL_ARM64_SMOKE") == "1" or "arm64" in (config.getoption("markexpr") or "")


@pytest.mark.timeout(7200)
def test_emulated_arm64_agent_installs_cpu_torch_and_finishes_a_run(request, tmp_path):
    if not _opted_in(request.config):
        pytest.skip("opt-in (minutes under emulation): FEDAL_ARM64_SMOKE=1 or -m arm64")
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(out), "--rounds", "2"], cwd=REPO, capture_output=True,
                          text=True, timeout=7000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((out / "arm64_smoke.json").read_text())
    venv = report["venv"]
    # a CPU-only aarch64 torch from the constraints: no CUDA toolkit, far below the 4.7 GB of torch>=2.11
    assert venv["torch"] == "2.10.0", venv
    assert any("aarch64" in tag for tag in venv["torch_wheel_tags"]), venv
    assert venv["cuda_packages"] == []
    assert venv["bytes"] < 1024**3
    assert report["venv_distributions"]["paho-mqtt"].startswith("2.")
    assert report["venv_distributions"]["onnxruntime"] != "1.21.0"
    arm = next(a for a in report["agents"] if a["arch"].startswith("arm64"))
    assert arm["exit"] == 0 and arm["last_round"] == 2
    assert all(acc is not None for acc in arm["accuracies"])
    assert arm["peak_rss_mb"] and arm["peak_rss_mb"] > 0
    assert report["run"]["completed_rounds"] == 2
    assert {"model.pt", "model.onnx"} <= set(report["arm64_artifacts"])  # the final export worked on torch 2.10
    compat = report["torch_compat"]
    assert compat["ok"] and compat["torch"].startswith("2.10.0") and not compat["cuda_available"], compat
    assert "venv size:" in proc.stdout and "peak RSS" in proc.stdout and "completed round 2 of 2" in proc.stdout
