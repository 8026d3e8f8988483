"""Atomic file writes: readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

# What write_atomic names a file before its rename (mkstemp's random part has no dot): a name a
# write cut short (a power cut, SIGKILL) leaves behind, `.<name>.<random>.tmp`.
TEMPORARY_NAME = re.compile(r"^\.(?P<name>.+)\.[^.]+\.tmp$")


def write_atomic(path: str | Path, write: Callable[[BinaryIO], Any], private: bool = False, parents: bool = True) -> None:
    """private: mode 0600 (an agent's checkpoints); else the mode of the file it replaces, or for a
    new one 0666 less the umask, as a plain write gives results and exports. The directory must
    take new files (fedal.owned.unwritable checks outputs so before a run); `parents` False: it
    must exist too (FileNotFoundError), for a directory that is removed when its owner is done."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if not private:  # a file it replaces keeps its mode; a new one gets what a plain write gives
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except OSError:
                mode = 0o666 & ~current_umask()
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes, private: bool = False) -> None:
    write_atomic(path, lambda fh: fh.write(data), private)


def torch_save_atomic(obj: Any, path: str | Path, private: bool = True, parents: bool = True) -> None:
    import torch

    write_atomic(path, lambda fh: torch.save(obj, fh), private, parents)


def current_umask() -> int:
    """The process's umask, read without setting it (os.umask sets it: a race with other threads):
    from /proc, or where there is none (macOS) from the mode a new file gets."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return _umask_of_a_new_file()


def _umask_of_a_new_file() -> int:
    """A scratch file made with mode 0777 gets 0777 less the umask (the usual 022 if none can be made)."""
    probe = os.path.join(tempfile.gettempdir(), f".fedal-umask-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o777))
    except OSError:
        return 0o022
    try:
        return 0o777 & ~stat.S_IMODE(os.stat(probe).st_mode)
    except OSError:
        return 0o022
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
