"""Ends a local Ray instance's processes when the driver that started it dies without doing so.

Ray gives its GCS server and raylet the driver's fate, but not the raylet's dashboard and
runtime-env agents: a driver killed outright (SIGKILL, the OOM killer) leaves them running for a
minute or more, reparented to init. The driver starts this script right after `ray.init` and
keeps a pipe to it open: it sends the instance's session directory and processes (`session
PATH`, `proc PID START_TICKS`) and, when it has shut the instance down itself, `done`. End of
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

POLL_S = 2.0

Process = tuple[int, int]  # (PID, start time in clock ticks since boot): a PID alone may be reused


def start_ticks(pid: int) -> int | None:
    """The process's start time as the kernel keeps it (/proc/PID/stat, field 22): unlike
    psutil's create_time, which adds the boot time as read now, it does not move when the
    system clock is stepped (NTP, a VM resumed). None: no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state is field 3
    return int(fields[19])


def identify(pid: int) -> Process | None:
    ticks = start_ticks(pid)
    return None if ticks is None else (pid, ticks)


def alive(known: set[Process]) -> set[Process]:
    return {(pid, ticks) for pid, ticks in known if start_ticks(pid) == ticks}


def family(known: set[Process]) -> set[Process]:
    """Those of `known` still alive as themselves, and their descendants: one scan of the process table."""
    roots = alive(known)
    children: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"] or 0, []).append(proc.pid)
    out = set(roots)
    todo = [pid for pid, _ in roots]
    while todo:
        for child in children.get(todo.pop(), ()):
            who = identify(child)
            if who is not None and who not in out:
                out.add(who)
                todo.append(child)
    return out


def end(known: set[Process]) -> None:
    """SIGTERM, then SIGKILL after 5 s, each of `known` still alive as the same process."""
    procs = []
    for pid, ticks in alive(known):
        try:
            proc = psutil.Process(pid)
            if start_ticks(pid) == ticks:
                proc.terminate()
                procs.append(proc)
        except psutil.Error:
            continue
    _gone, left = psutil.wait_procs(procs, timeout=5)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def main() -> int:
    known: set[Process] = set()
    session = ""
    buffer = b""
    fd = sys.stdin.fileno()
    print("ready", flush=True)  # imported: the driver waits for this line
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
                pid, ticks = rest.split()
                known.add((int(pid), int(ticks)))
    end(family(known))
    if session and os.path.isdir(session):
        shutil.rmtree(session, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
