"""Child processes that die with the command that started them, and stop signals that shut down.

Every command that starts processes (`fedal demo`, `fedal hil fleet --start-coordinator`, the
private Mosquitto of hil and benches) starts them here, so that:

- on Linux each child asks the kernel for SIGTERM when its parent dies (PR_SET_PDEATHSIG): a
  `kill -9` of the command, an OOM kill or a crash leaves no coordinator, agent or broker behind
  holding its ports. The signal fires when the *thread* that forked the child ends, so children
  are forked by the main thread or, from any other thread, by one long-lived spawner thread that
  lives as long as the process;
- SIGTERM (systemd, `timeout`, `kill`) and SIGHUP (a closed terminal) end the command the way
  Ctrl-C does: the exception unwinds through its `finally` blocks, which stop the children in
  order, instead of the default action that kills only the command itself.

Standard library only: the core package imports no runtime extra.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import hashlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # with SIGINT: what ends a command in an orderly way


class Stopped(KeyboardInterrupt):
    """A stop signal other than SIGINT, raised in the main thread like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # what a shell reports for a process ended by that signal


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _load_prctl()  # resolved here, not in the forked child


def dies_with_this_process():
    """A preexec_fn for a subprocess.Popen made elsewhere: the child gets SIGTERM when this
    process ends (as procs.spawn's children do)."""
    return _die_with(os.getpid())


def _die_with(parent_pid: int):
    """preexec_fn: SIGTERM to this child when the forking thread ends; gone at once if it already has."""
    prctl = _PRCTL

    def _preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl: nobody will signal us
            os._exit(1)

    return _preexec


def die_with_parent() -> None:
    """SIGTERM to this process when its parent ends: a driver that a shell script runs and
    cleans up after (arm64-smoke.sh) does not run on alone once the script is killed, even by
    SIGKILL. Linux only; elsewhere nothing."""
    parent = os.getppid()
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # it ended before the request: nobody will signal
            os.kill(os.getpid(), signal.SIGTERM)


class _Spawner:
    """One daemon thread that forks children for callers outside the main thread: it ends only
    with the process, so PDEATHSIG does not fire when a short-lived caller thread returns."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def call(self, fn):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="fedal-spawner", daemon=True)
                self._thread.start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut.result()

    def _serve(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed back to the caller
                fut.set_exception(exc)


_SPAWNER = _Spawner()


def spawn(argv: Sequence[str], *, log_path: str | Path | None = None, stdout: int | IO | None = None,
          env: dict[str, str] | None = None, new_session: bool = True, **popen) -> subprocess.Popen:
    """Start argv as a child that dies with this process; output to log_path (appended) or stdout.

    new_session: the child gets its own session, so a terminal's Ctrl-C reaches only this
    command, which then stops its children in order.
    """
    log = open(log_path, "ab") if log_path is not None else None
    try:
        out = log if log is not None else stdout
        err = subprocess.STDOUT if out is not None and out is not subprocess.DEVNULL else out

        def _start() -> subprocess.Popen:
            return subprocess.Popen(list(map(str, argv)), stdout=out, stderr=err, env=env,
                                    start_new_session=new_session, preexec_fn=_die_with(os.getpid()), **popen)

        if threading.current_thread() is threading.main_thread():
            return _start()
        return _SPAWNER.call(_start)
    finally:
        if log is not None:
            log.close()  # the child holds its own descriptor


def spawn_python(module: str, *args: str, log_path: str | Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m module args...` with this interpreter, unbuffered, its output in log_path."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return spawn([sys.executable, "-m", module, *args], log_path=log_path, env=env)


def terminate(procs: Sequence[subprocess.Popen], grace_s: float = 10) -> None:
    """SIGTERM to all (each shuts down cleanly), then wait; SIGKILL whoever outlives grace_s."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended in between
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextmanager
def stop_signals_interrupt() -> Iterator[list[int]]:
    """Within: SIGTERM and SIGHUP raise Stopped in the main thread, as SIGINT raises
    KeyboardInterrupt. Only the first stop signal does: later ones must not cut the shutdown short.
    Yields the signals that fired (the first, once one has): a library that catches Stopped
    (it is a KeyboardInterrupt) and raises a bare KeyboardInterrupt instead, as Ray does inside
    its waits, still leaves which signal it was."""
    fired: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield fired
        return

    def _handler(signum, _frame) -> None:
        if fired:
            return
        fired.append(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield fired
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def pid_dir(parent: str | Path, prefix: str) -> str:
    """A new directory `<prefix><this PID>-<where>-<random>` in `parent`, for work this process
    removes when it is done; those of processes no longer alive are removed first (reap_pid_dirs).
    `<where>` names this host and PID namespace: a PID means nothing elsewhere."""
    reap_pid_dirs(parent, prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{_where()}-", dir=parent)


def reap_pid_dirs(parent: str | Path, prefix: str) -> None:
    """Remove the pid_dir directories in `parent` of processes no longer alive (ended by SIGKILL
    before they could remove theirs): only directories of that name, made on this host and in
    this PID namespace (a /tmp or --out shared with a container or over NFS holds others'), and
    of this user, so nothing the toolkit did not make, and nothing a live process still uses."""
    where = _where()
    for path in Path(parent).glob(f"{glob.escape(prefix)}*-*-*"):
        pid_text, made_at = (path.name[len(prefix):].split("-") + [""])[:2]
        try:
            if not pid_text.isdigit() or made_at != where or path.is_symlink() or not path.is_dir() \
                    or path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (OSError, OverflowError):  # alive (another user's: PermissionError), gone meanwhile; no PID
            continue


def _where() -> str:
    """This host and PID namespace, as a short tag."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]


def last_error(log: Path | None) -> str:
    """': <the log's last error or warning line> (log: <path>)', or '' without a log: why a process
    that exited did (a usage error's `Error:` line included)."""
    if log is None:
        return ""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return f" (log: {log})"
    said = next((line for line in reversed(lines)
                 if any(m in line for m in (" ERROR ", " CRITICAL ", "ERROR:")) or line.startswith("Error:")), None) \
        or next((line for line in reversed(lines) if " WARNING " in line), None)
    return (f": {said.strip()}" if said else "") + f" (log: {log})"
