"""install-agent.sh with the real pip into a staging root on this x86-64 machine: torch from a
--torch-index (a local PEP 503 index), the agent and its closure installed from the checkout,
torch's build and test files pruned, bytecode only for what the agent imports, the self-check
passed; a second run changes nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.test_firmware_install import AGENT_TOML as STAGED_TOML

REPO = Path(__file__).resolve().parents[1]
# the staged device's config, with a plain broker URL: no CA to install here
AGENT_TOML = STAGED_TOML.split("[broker]")[0] + '[broker]\nurl = "mqtt://127.0.0.1:1883"\n'


def checkout_copy(dest: Path) -> Path:
    """The tracked files only, so pip's build leaves the checkout as it was."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def torch_index(dest: Path) -> str:
    """A PEP 503 index holding torch alone, as PyTorch's CPU wheel index would (file:// URL)."""
    files = dest / "files"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(files),
                    "torch==2.13.0"], check=True, timeout=600)
    (wheel,) = files.glob("torch-*.whl")
    page = dest / "simple" / "torch" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(f'<!DOCTYPE html><html><body><a href="{wheel.as_uri()}">{wheel.name}</a></body></html>\n')
    return (dest / "simple").as_uri()


def test_real_install_prunes_compiles_what_is_used_and_self_checks(tmp_path):
    source = checkout_copy(tmp_path / "src")
    index = torch_index(tmp_path / "index")
    config = tmp_path / "agent.toml"
    config.write_text(AGENT_TOML)
    root = tmp_path / "root"
    env = {k: v for k, v in os.environ.items() if k not in ("DESTDIR", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env["FEDAL_ARCH"] = "x86_64"
    cmd = ["bash", str(source / "firmware_scripts/install-agent.sh"), "--root", str(root), "--config", str(config),
           "--source", str(source), "--torch-index", index, "--no-start"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "self-check passed" in first.stdout and "MB freed" in first.stdout
    assert f"Looking in indexes: {index}" in first.stdout  # torch came through --torch-index
    # built from a copy: the checkout gets no build/ or egg-info (root's, under sudo)
    assert not (source / "build").exists() and not list(source.glob("*.egg-info"))

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
