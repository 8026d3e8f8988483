"""firmware_scripts/arm64-smoke.sh installs its own host packages (debootstrap, and on x86-64
qemu-user-static and binfmt-support) with apt-get, as the test tools script does, instead of
stopping at "debootstrap not found". Run for real with a PATH that lacks them and an apt-get
stand-in that records its arguments and puts stand-in commands in place (nothing is installed)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "firmware_scripts" / "arm64-smoke.sh"
# what the script may run before and in its prerequisite step, taken from the host
HOST_TOOLS = ("bash", "dirname", "uname", "chroot", "mount", "umount", "flock", "mountpoint", "cat", "chmod", "printf")
PROVIDES = {"debootstrap": ["debootstrap"], "binfmt-support": ["update-binfmts"], "qemu-user-static": ["qemu-aarch64-static"]}

APT_GET = """#!/bin/sh
# records its arguments; `install` puts a stand-in for each package's command next to itself
echo "$*" >> "{log}"
[ -n "$APT_FAIL" ] && exit 100
if [ "$1" = install ]; then
  for arg in "$@"; do
    case "$arg" in
      debootstrap) cmds=debootstrap ;;
      binfmt-support) cmds=update-binfmts ;;
      qemu-user-static) cmds=qemu-aarch64-static ;;
      *) cmds= ;;
    esac
    for c in $cmds; do printf '#!/bin/sh\\nexit 0\\n' > "{bin}/$c"; chmod +x "{bin}/$c"; done
  done
fi
exit 0
"""


@pytest.fixture()
def shim(tmp_path):
    """A bin dir holding only what the prerequisite step may use, an apt-get stand-in and an `id`
    that reports root (the script refuses to run otherwise)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in HOST_TOOLS:
        found = shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        if found is None:
            pytest.fail(f"{tool} is needed on the host for this test")
        (bin_dir / tool).symlink_to(found)
    log = tmp_path / "apt-get.log"
    (bin_dir / "apt-get").write_text(APT_GET.format(log=log, bin=bin_dir))
    (bin_dir / "id").write_text('#!/bin/sh\n[ "$1" = -u ] && echo 0 && exit 0\nexec /usr/bin/id "$@"\n')
    for f in ("apt-get", "id"):
        (bin_dir / f).chmod(0o755)
    return bin_dir, log


def run_prereqs(bin_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "bash"), str(SCRIPT), "--prereqs-only"], capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "HOME": str(bin_dir.parent), **env}, timeout=60)


def expected_packages() -> list[str]:
    return ["debootstrap"] if platform.machine() == "aarch64" else ["debootstrap", "binfmt-support", "qemu-user-static"]


def test_missing_packages_are_installed_with_apt_get(shim):
    bin_dir, log = shim
    assert shutil.which("debootstrap", path=str(bin_dir)) is None
    proc = run_prereqs(bin_dir)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "update -qq"
    assert calls[1] == "install -y -qq --no-install-recommends " + " ".join(expected_packages())
    assert len(calls) == 2
    assert "installing " + " ".join(expected_packages()) in proc.stderr


def test_nothing_is_installed_when_all_is_there(shim):
    bin_dir, log = shim
    for pkg in expected_packages():
        for cmd in PROVIDES[pkg]:
            (bin_dir / cmd).write_text("#!/bin/sh\nexit 0\n")
            (bin_dir / cmd).chmod(0o755)
    proc = run_prereqs(bin_dir)
    assert proc.returncode == 0, proc.stderr
    assert not log.exists()


def test_a_failed_install_stops_with_a_clear_message(shim):
    bin_dir, log = shim
    proc = run_prereqs(bin_dir, APT_FAIL="1")
    assert proc.returncode == 1
    assert "arm64-smoke: error: apt-get update failed" in proc.stderr
    assert log.read_text().splitlines() == ["update -qq"]


def _python_that_cannot_import(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(0o755)
    return path


def run_smoke(bin_dir: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "bash"), str(SCRIPT)], capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "HOME": str(bin_dir.parent), **env}, timeout=60)


def test_a_host_python_without_the_toolkit_is_refused_before_any_build(shim, tmp_path):
    """The host side (bench/arm64_smoke.py) imports torch and the toolkit: a Python without them
    is said at once, not after a userland build of many minutes."""
    bin_dir, _ = shim
    fake = _python_that_cannot_import(tmp_path / "py" / "python")
    proc = run_smoke(bin_dir, FEDAL_PYTHON=str(fake), VIRTUAL_ENV=str(tmp_path / "unused"))
    assert proc.returncode == 1
    assert f"runs with {fake}, which cannot import the toolkit" in proc.stderr
    assert "scripts/install.sh dev" in proc.stderr
    assert not (tmp_path / ".cache").exists()  # the userland's cache was not started


def test_the_active_virtualenv_is_taken_and_an_inherited_python_is_not(shim, tmp_path):
    bin_dir, _ = shim
    venv = tmp_path / "venv"
    fake = _python_that_cannot_import(venv / "bin" / "python")
    proc = run_smoke(bin_dir, VIRTUAL_ENV=str(venv), PYTHON=shutil.which("python3") or "/usr/bin/python3")
    assert proc.returncode == 1
    assert f"runs with {fake}, which cannot import the toolkit" in proc.stderr
