"""Atomic file writes: readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
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
    fd, tmp = temporary_beside(path, private)
    try:
        if not private:  # a file it replaces keeps its mode
            with contextlib.suppress(FileNotFoundError):
                os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode))
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


def temporary_beside(path: Path, private: bool = False) -> tuple[int, str]:
    """A new file `.<name>.<random>.tmp` in `path`'s folder, open for writing: mode 0600 if
    private, else 0666 with the umask and the folder's default ACL applied by the system, as a
    plain write of `path` would get (what the umask is need not be known: there may be no
    /proc to read it from, and setting it to read it races with other threads)."""
    while True:
        tmp = os.path.join(path.parent, f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600 if private else 0o666), tmp
        except FileExistsError:
            continue
