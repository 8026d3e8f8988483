"""Waiting for ports and conditions in tests; no torch here, so broker-only tests stay light."""

from __future__ import annotations

import socket
import time

from fedal.ports import free_port  # noqa: F401 (the tests' picker is the toolkit's)


def wait_for_port(port: int, timeout_s: float = 10.0) -> bool:
    """True once something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def wait_until(predicate, timeout_s: float = 30, what: str = "condition", interval_s: float = 0.05):
    """predicate()'s first truthy value, polled until timeout_s; AssertionError naming `what` after."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")



def signal_when_ready(proc, ready, sig: int, timeout_s: float = 120, settle_s: float = 0.0) -> tuple[str, str]:
    """Send `sig` to `proc` (started in a session of its own, pipes for stdout and stderr) once
    ready() is true, and return its (stdout, stderr) when it has ended; its process group is
    killed if the test fails on the way, so nothing it started outlives the test."""
    import contextlib
    import os
    import signal

    try:
        wait_until(lambda: ready() or proc.poll() is not None, timeout_s, "the process to be ready", 0.1)
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(settle_s)
        proc.send_signal(sig)
        return proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
