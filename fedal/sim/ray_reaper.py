"""Ends a local Ray instance's processes when the driver that started it dies without doing so.

Ray gives its GCS server and raylet the driver's fate, but not the raylet's dashboard and
runtime-env agents: a driver killed outright (SIGKILL, the OOM killer) leaves them running for a
minute or more, reparented to init. The driver starts this script right after `ray.init` and
keeps a pipe to it open: it sends the instance's session directory and processes (`session
PATH`, `proc PID CREATE_TIME`) and, when it has shut the instance down itself, `done`. End of
file without `done` means the driver is gone: the processes it named, and those they started
since, are ended (checked by PID and start time, so no later process with a reused PID is
touched), and the session directory is removed.

Run by path with the driver's interpreter; it imports nothing of the toolkit (psutil only).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys

import psutil

POLL_S = 1.0


def family(known: set[tuple[int, float]]) -> set[tuple[int, float]]:
    """`known` processes (PID, start time) and, for those still alive as themselves, their descendants."""
    out = set(known)
    for pid, created in known:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() != created:
                continue
            for child in proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    out.add((child.pid, child.create_time()))
        except psutil.Error:
            continue
    return out


def end(known: set[tuple[int, float]]) -> None:
    """SIGTERM, then SIGKILL after 5 s, each of `known` still alive as the same process."""
    alive = []
    for pid, created in known:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.terminate()
                alive.append(proc)
        except psutil.Error:
            continue
    _gone, left = psutil.wait_procs(alive, timeout=5)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def main() -> int:
    known: set[tuple[int, float]] = set()
    session = ""
    buffer = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        known = family(known)  # workers and agents the instance started since
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:  # the driver is gone without saying it is done
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "done":
                return 0
            if word == "session":
                session = rest
            elif word == "proc":
                pid, created = rest.split()
                known.add((int(pid), float(created)))
    end(family(known))
    if session and os.path.isdir(session):
        shutil.rmtree(session, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
