"""The firmware scripts delete only what they made: arm64-smoke.sh --rebuild (and a leftover
`.partial` build) only a userland it built, flash.sh only a fedal/ payload an earlier flash wrote,
bench/arm64_smoke.py clears agent state only inside the smoke's own userland."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.test_firmware_flash import OFFSET, device, file_hash, flash, rpi_image, sh  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "firmware_scripts" / "arm64-smoke.sh"


def fake_host(tmp_path: Path) -> dict[str, str]:
    """PATH where the smoke script finds itself root on an arm64 host (no binfmt needed) with every
    tool it checks for, debootstrap failing at once: it gets as far as its userland, no further."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"id": "echo 0", "uname": "echo aarch64", "debootstrap": "exit 1", "chroot": "exit 1",
             "mount": "exit 1", "umount": "exit 0"}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def smoke(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SMOKE), *args], capture_output=True, text=True, env=env, timeout=60)


def test_arm64_smoke_rebuild_never_deletes_a_directory_it_did_not_build(tmp_path):
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("precious")
    r = smoke(fake_host(tmp_path), "--cache", str(precious), "--rebuild", "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and "refusing to delete" in r.stderr, r.stderr
    assert (precious / "chapter1.tex").read_text() == "precious"


def test_arm64_smoke_leaves_a_partial_directory_it_did_not_start(tmp_path):
    cache = tmp_path / "rootfs"
    partial = tmp_path / "rootfs.partial"
    partial.mkdir()
    (partial / "mine.txt").write_text("mine")
    env = fake_host(tmp_path)
    r = smoke(env, "--cache", str(cache), "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and "not an unfinished userland" in r.stderr, r.stderr
    assert (partial / "mine.txt").read_text() == "mine"

    (partial / "mine.txt").unlink()
    partial.rmdir()
    r = smoke(env, "--cache", str(cache), "--out", str(tmp_path / "out"))
    assert r.returncode == 1 and "debootstrap failed" in r.stderr, r.stderr  # its own attempt, stamped ...
    r = smoke(env, "--cache", str(cache), "--out", str(tmp_path / "out"))
    assert "debootstrap failed" in r.stderr, r.stderr  # ... which the next run may clear and retry


def test_arm64_smoke_driver_refuses_a_rootfs_it_did_not_build(tmp_path):
    root = tmp_path / "root"
    state = root / "var" / "lib" / "fedal-agent"
    state.mkdir(parents=True)
    (state / "checkpoint.pt").write_bytes(b"a real agent's checkpoint")
    (root / "run").mkdir()
    r = subprocess.run([sys.executable, str(REPO / "bench" / "arm64_smoke.py"), "--rootfs", str(root),
                        "--workdir", "/run"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "not a userland arm64-smoke.sh built" in r.stderr, r.stderr
    assert (state / "checkpoint.pt").exists()


def test_flash_keeps_a_fedal_folder_it_did_not_write(tmp_path, device):  # noqa: F811
    img = rpi_image(tmp_path)
    fat = f"{img}@@{OFFSET}"
    sh("mmd", "-i", fat, "::/fedal")
    (tmp_path / "notes.txt").write_text("someone else's")
    sh("mcopy", "-i", fat, str(tmp_path / "notes.txt"), "::/fedal/notes.txt")
    before = file_hash(img)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheel",
              str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"))
    assert r.returncode == 1 and "flash.sh did not write" in r.stderr, r.stderr + r.stdout
    assert file_hash(img) == before


def test_prune_venv_removes_nothing_where_pip_installed_no_torch(tmp_path):
    site = tmp_path / "checkout"
    for rel in ("torch/test/my_test.cpp", "torch/include/mine.h", "torch/bin/tool"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("mine")
    r = subprocess.run([sys.executable, str(REPO / "firmware_scripts" / "prune-venv.py"), str(site)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert all((site / rel).read_text() == "mine" for rel in ("torch/test/my_test.cpp", "torch/include/mine.h", "torch/bin/tool"))
