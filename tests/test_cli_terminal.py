"""Long commands on a real terminal (a pty that is the command's controlling terminal): the
progress bar shows on one that reports no width (a serial console), and a terminal closed under
a run ends it with SIGHUP's status, though its final lines can no longer be written (EIO)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import signal
import subprocess
import termios
import time

from tests.helpers import fedal_command

SIMULATE = ["simulate", "--dataset", "digits", "--clients", "2", "--strategy", "fedmd", "--public-size", "60",
            "--out", "r.json"]


def on_terminal(args: list[str], cwd) -> tuple[subprocess.Popen, int]:
    """`fedal args` with a new pty as stdin, stdout, stderr and controlling terminal, left at the
    size a new pty has (0 x 0, as a serial console reports); (process, the pty's master side)."""
    master, slave = pty.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "COLUMNS", "LINES")}
    proc = subprocess.Popen([*fedal_command(), *args], cwd=cwd, stdin=slave, stdout=slave, stderr=slave,
                            preexec_fn=own_terminal, env=env)
    os.close(slave)
    return proc, master


def read_until(master: int, proc: subprocess.Popen, pattern: bytes, timeout: float = 120) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, seen[-2000:]):
        assert time.monotonic() < deadline, seen[-2000:].decode(errors="replace")
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the command has closed its side
                chunk = b""
            if not chunk:
                raise AssertionError(f"ended ({proc.poll()}) before {pattern!r}: {seen[-2000:].decode(errors='replace')}")
            seen += chunk
    return seen


def test_the_progress_bar_shows_on_a_terminal_that_reports_no_width(tmp_path):
    proc, master = on_terminal([*SIMULATE, "--rounds", "3"], tmp_path)
    try:
        seen = read_until(master, proc, rb"fedmd: 100%.*\| 3/3")
        assert proc.wait(timeout=60) == 0, seen.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_closed_terminal_ends_a_simulation_with_sighups_status(tmp_path):
    proc, master = on_terminal([*SIMULATE, "--rounds", "100000"], tmp_path)
    try:
        read_until(master, proc, rb"\| [1-9]\d*/100000")  # a round done: the run is under way
        os.close(master)  # the terminal goes away: SIGHUP, and EIO for every later write
        master = -1
        proc.wait(timeout=60)
    finally:
        if master >= 0:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGHUP
    assert not (tmp_path / "r.json").exists()
    with contextlib.suppress(FileNotFoundError):
        assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
