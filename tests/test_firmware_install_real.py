"""install-agent.sh with the real pip into a staging root on this x86-64 machine: the agent and
its closure installed from the checkout, torch's build and test files pruned, bytecode only for
what the agent imports, the self-check passed; a second run changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AGENT_TOML = """client_id = "pi-1"
run_id = "fleet"
model = "cnn1d"
data_file = "/var/lib/fedal-agent/train.npz"
workspace = "/var/lib/fedal-agent"

[broker]
url = "mqtt://127.0.0.1:1883"
"""


def checkout_copy(dest: Path) -> Path:
    """The tracked files only, so pip's build leaves the checkout as it was."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def test_real_install_prunes_compiles_what_is_used_and_self_checks(tmp_path):
    source = checkout_copy(tmp_path / "src")
    config = tmp_path / "agent.toml"
    config.write_text(AGENT_TOML)
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if k not in ("DESTDIR", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["FEDAL_ARCH"] = "x86_64"
    cmd = ["bash", str(source / "firmware_scripts/install-agent.sh"), "--root", str(root), "--config", str(config),
           "--source", str(source), "--torch-index", "pypi", "--no-start"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "self-check passed" in first.stdout and "MB freed" in first.stdout

    venv = root / "opt/fedal-agent"
    site = next(venv.glob("lib/python3*/site-packages"))
    assert (site / "torch/bin/torch_shm_manager").exists() and (site / "torch/lib").is_dir()
    for gone in ("torch/test", "torch/include", "torch/share/cmake", "torch/bin/protoc", "torch/bin/test_api"):
        assert not (site / gone).exists(), gone
    check = json.loads((venv / "self-check.json").read_text())
    assert check["status"] == "ok" and check["torch"].startswith("2.13.0") and check["cuda_available"] is False
    assert check["compiler_stack_loaded_while_training"] == []
    assert check["onnx_max_abs_diff"] <= 1e-4

    # bytecode for what the agent imported, none for what it never loads
    assert list((site / "torch/__pycache__").glob("__init__.cpython-*.pyc"))
    assert list((site / "edge_agent/__pycache__").glob("selfcheck.cpython-*.pyc"))
    assert not list((site / "sympy").rglob("*.pyc")) and not list((site / "torch/_inductor").rglob("*.pyc"))
    vpy = str(venv / "bin/python")
    pip_check = subprocess.run([vpy, "-I", "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert pip_check.returncode == 0, pip_check.stdout + pip_check.stderr
    files = subprocess.run([vpy, "-I", "-m", "pip", "show", "-f", "torch"], capture_output=True, text=True, timeout=300)
    assert "torch/include/" not in files.stdout and "torch/bin/torch_shm_manager" in files.stdout

    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert second.returncode == 0 and "nothing changed" in second.stdout, second.stdout + second.stderr
