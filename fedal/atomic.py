"""Atomic file writes: readers see the old file or the new one, never a torn one."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

# What write_atomic names a file before its rename (mkstemp's random part has no dot): a name a
# write cut short (a power cut, SIGKILL) leaves behind, `.<name>.<random>.tmp`.
TEMPORARY_NAME = re.compile(r"^\.(?P<name>.+)\.[^.]+\.tmp$")


def write_atomic(path: str | Path, write: Callable[[BinaryIO], Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    write_atomic(path, lambda fh: fh.write(data))


def torch_save_atomic(obj: Any, path: str | Path) -> None:
    import torch

    write_atomic(path, lambda fh: torch.save(obj, fh))
