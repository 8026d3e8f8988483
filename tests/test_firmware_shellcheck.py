"""Every shell script in firmware_scripts/ and scripts/ passes shellcheck (warnings included)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shell_scripts() -> list[Path]:
    found = []
    for top in ("firmware_scripts", "scripts"):
        for path in sorted((REPO / top).rglob("*")):
            if not path.is_file():
                continue
            with open(path, "rb") as f:
                first = f.readline()
            if path.suffix == ".sh" or (first.startswith(b"#!")
                                        and first.rstrip().split(b"/")[-1].split()[-1] in (b"sh", b"bash")):
                found.append(path)
    return found


def test_there_are_scripts_to_check():
    names = {p.relative_to(REPO).as_posix() for p in shell_scripts()}
    assert {"firmware_scripts/flash.sh", "firmware_scripts/install-agent.sh", "firmware_scripts/boot/firstrun.sh",
            "firmware_scripts/boot/firstboot.sh", "firmware_scripts/boot/stage.sh", "scripts/test.sh"} <= names


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed: run scripts/install-test-tools.sh")
    scripts = shell_scripts()
    r = subprocess.run(["shellcheck", "--external-sources", *map(str, scripts)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr  # shellcheck names file and line of every finding
    not_executable = [str(p) for p in scripts if p.is_relative_to(REPO / "firmware_scripts") and not os.access(p, os.X_OK)]
    assert not_executable == []


@pytest.mark.parametrize("script", ["scripts/demo.sh", "scripts/test.sh"])
def test_the_two_commands_hand_their_process_to_python(script):
    """The README's two commands end by exec'ing Python: a signal to the script's PID (a
    supervisor, `timeout`, CI) then reaches the demo or pytest, which stop what they started.
    Without exec only bash dies and the demo, its coordinator and agents run on under init."""
    commands = [line.strip() for line in (REPO / script).read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#") and not line.startswith((" ", "\t"))]
    last = commands[-1]
    assert last.startswith('exec "$PYTHON" -m '), last
