"""Opt-in: a whole emulated Pi (firmware_scripts/boot-test.sh): a Raspberry Pi OS-shaped arm64 image
flashed with `flash.sh --wheelhouse` boots under qemu-system-aarch64 with a network that reaches
only the broker and the coordinator, installs the agent offline, finishes a run next to x86
agents, and does not run its first-boot hook again. An hour or more under emulation, needs root,
a Debian mirror and PyPI on the host, so it is not part of the default suite:

    FEDAL_BOOT_TEST=1 python -m pytest tests/test_boot_test.py     # or: -m boot
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "firmware_scripts" / "boot-test.sh"

pytestmark = pytest.mark.boot


def _opted_in(config) -> bool:
    return os.environ.get("FEDAL_BOOT_TEST") == "1" or "boot" in (config.getoption("markexpr") or "")


@pytest.mark.timeout(4 * 3600)
def test_an_emulated_pi_boots_installs_offline_and_finishes_a_run(request, tmp_path):
    if not _opted_in(request.config):
        pytest.skip("opt-in (an hour or more under emulation): FEDAL_BOOT_TEST=1 or -m boot")
    out = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT), "--workdir", str(tmp_path / "work"), "--out", str(out), "--rounds", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=4 * 3600 - 60)
    report = json.loads((out / "boot_test.json").read_text()) if (out / "boot_test.json").exists() else {}
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert report["ok"] and all(report["checks"].values()), report.get("checks")
    assert report["pi"]["last_round"] == 2 and report["run"]["completed_rounds"] == 2
    assert report["wheelhouse"]["torch"] == "2.10.0"


def test_a_host_python_without_the_toolkit_is_refused_before_any_install(tmp_path):
    """bench/boot_test.py runs on the host and imports torch and the toolkit: a Python without
    them is said before apt-get and the image build (an hour), not after."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    (bin_dir / "id").write_text('#!/bin/sh\n[ "$1" = -u ] && echo 0 && exit 0\nexec /usr/bin/id "$@"\n')
    log = tmp_path / "apt-get.log"
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexit 0\n')
    fake = tmp_path / "py" / "python"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    for f in (bin_dir / "id", bin_dir / "apt-get", fake):
        f.chmod(0o755)
    proc = subprocess.run([str(bin_dir / "bash"), str(SCRIPT), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": str(bin_dir), "HOME": str(tmp_path), "FEDAL_PYTHON": str(fake)})
    assert proc.returncode == 2
    assert f"runs with {fake}, which cannot import the toolkit" in proc.stderr
    assert "boot-test: error: no host Python for bench/boot_test.py" in proc.stderr
    assert not log.exists() and not (tmp_path / "work").exists()
