"""firmware_scripts/prune-venv.py: torch's build and test files leave an agent virtualenv, every
Python module stays, RECORD follows, and install-agent.sh runs it after pip."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRUNE = REPO / "firmware_scripts" / "prune-venv.py"

GONE = ["torch/test/Dict_test", "torch/test/List_test", "torch/include/ATen/ATen.h", "torch/include/c10/core/Device.h",
        "torch/share/cmake/Torch/TorchConfig.cmake", "torch/bin/test_api", "torch/bin/protoc", "torch/bin/upgrader_models/a.ptl"]
KEPT = ["torch/__init__.py", "torch/bin/torch_shm_manager", "torch/lib/libtorch_cpu.so", "torch/share/other.txt",
        "torch/testing/__init__.py", "torch/include_not/x.py", "numpy/__init__.py"]


def fake_site(site: Path) -> None:
    """A site-packages laid out like the torch wheel's, with RECORD files that list every file."""
    rows = {"torch-2.10.0.dist-info": [], "numpy-2.2.0.dist-info": []}
    for rel in GONE + KEPT:
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * 1000)
        dist = "numpy-2.2.0.dist-info" if rel.startswith("numpy") else "torch-2.10.0.dist-info"
        rows[dist].append([rel, "sha256=abc", "1000"])
    for dist, lines in rows.items():
        (site / dist).mkdir()
        lines.append([f"{dist}/RECORD", "", ""])
        with open(site / dist / "RECORD", "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(lines)


def prune(site: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PRUNE), str(site), *args], capture_output=True, text=True, timeout=60)


def tree(site: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(site)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(site.rglob("*")) if p.is_file()}


def test_prunes_build_and_test_files_only_and_keeps_record_consistent(tmp_path):
    site = tmp_path / "site-packages"
    fake_site(site)
    numpy_record = (site / "numpy-2.2.0.dist-info/RECORD").read_bytes()

    dry = prune(site, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert all((site / rel).exists() for rel in GONE) and "to free" in dry.stdout

    out = prune(site)
    assert out.returncode == 0, out.stderr
    assert not any((site / rel).exists() for rel in GONE)
    assert not (site / "torch/test").exists() and not (site / "torch/include").exists()
    assert all((site / rel).exists() for rel in KEPT)
    listed = [r[0] for r in csv.reader((site / "torch-2.10.0.dist-info/RECORD").read_text().splitlines())]
    assert set(listed) == {rel for rel in KEPT if rel.startswith("torch/")} | {"torch-2.10.0.dist-info/RECORD"}
    assert (site / "numpy-2.2.0.dist-info/RECORD").read_bytes() == numpy_record
    assert f"{len(GONE) * 1000 / 2**20:.1f} MB freed" in out.stdout

    before = tree(site)
    again = prune(site)
    assert again.returncode == 0 and "0.0 MB freed in 0 path(s)" in again.stdout
    assert tree(site) == before  # nothing removed, no RECORD rewritten


def test_refuses_a_missing_directory(tmp_path):
    out = prune(tmp_path / "nope")
    assert out.returncode == 2 and "not a directory" in out.stderr
