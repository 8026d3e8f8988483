"""Workspaces the toolkit owns: a marker file says so, and only such a directory is cleared.

`fedal demo --workdir DIR` (and `fedal hil fleet --start-coordinator --workdir DIR`) replace what
an earlier run left there. A path typed by a user may be `.`, `~` or a thesis folder: the toolkit
creates the directory (or adopts an empty one) and writes MARKER into it; a later run reuses and
clears only a directory holding that marker, and only the parts it writes itself. Any other
non-empty directory is refused before anything in it is touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path

log = logging.getLogger("fedal.workspace")

MARKER = ".fedal-workspace"
LOCK = ".fedal-workspace.lock"  # held (flock) by the run using the workspace; the kernel drops it when that process ends


class WorkspaceError(ValueError):
    """A directory the toolkit may not use as its workspace; the message says why and what to do."""


def is_workspace(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def claim(path: str | Path, owner: str, adoptable: Callable[[list[Path]], bool] | None = None) -> Path:
    """Create path as a workspace of `owner` (a command name), adopt it if empty, reuse it if marked.

    `adoptable(entries)` may also adopt an unmarked directory by what it holds: a workspace
    written before the marker existed holds only its owner's own files."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise WorkspaceError(f"{path} exists and is not a directory")
    if path.is_dir():
        if is_workspace(path):
            return path
        entries = sorted(path.iterdir())
        if entries and not (adoptable is not None and adoptable(entries)):
            raise WorkspaceError(
                f"{path} is not empty and is not a FedAL workspace (it has no {MARKER} file): refusing to "
                f"delete or overwrite anything in it; give a new or an empty directory")
        if entries:
            log.info("adopting %s as the workspace of `%s`", path, owner)
    path.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    (path / MARKER).write_text(f"FedAL workspace created by `{owner}` at {stamp}.\n"
                               f"The toolkit replaces its own files here on the next run; remove this file to stop that.\n")
    return path


def clear(path: str | Path, parts: Iterable[str]) -> None:
    """Remove the named parts (files or trees) of a marked workspace; nothing else in it."""
    path = Path(path)
    if not is_workspace(path):
        raise WorkspaceError(f"{path} is not a FedAL workspace (no {MARKER}); nothing removed")
    for part in parts:
        if Path(part).is_absolute() or ".." in Path(part).parts:
            raise ValueError(f"workspace part {part!r} must be a plain relative path")
        target = path / part
        if target.is_symlink() or target.is_file():
            target.unlink()  # a link goes, never what it points to
        elif target.is_dir():
            shutil.rmtree(target)


@contextlib.contextmanager
def held(path: str | Path, owner: str) -> Iterator[Path]:
    """The marked workspace `path`, for this run alone while within: a second run on it (another
    demo on the same --workdir) is refused instead of clearing the files of the one under way.
    An exclusive flock on LOCK, which the kernel releases however this process ends."""
    path = Path(path)
    if not is_workspace(path):
        raise WorkspaceError(f"{path} is not a FedAL workspace (no {MARKER})")
    with locked(path, owner, LOCK):
        yield path


@contextlib.contextmanager
def locked(path: str | Path, owner: str, name: str) -> Iterator[Path]:
    """Directory `path` for this process alone while within: an exclusive flock on its file
    `name` (`owner` written into it, for the refusal of a second one)."""
    path = Path(path)
    flags = os.O_CLOEXEC | os.O_NOFOLLOW  # never through a link: what it points to is not the toolkit's to write
    try:
        fd = os.open(path / name, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except PermissionError:  # made by another user (root ran it by hand once): a lock needs no write access
        try:
            fd = os.open(path / name, os.O_RDONLY | flags)
        except OSError as exc:
            raise WorkspaceError(f"{path / name} cannot be opened by this user ({exc.strerror or exc})") from None
    except OSError as exc:
        why = "remove it: it is a link" if exc.errno == errno.ELOOP else "check the directory"
        raise WorkspaceError(f"{path / name} cannot be opened ({exc.strerror or exc}); {why}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another run"
            raise WorkspaceError(f"{path} is in use by {holder}: wait for it to end, or give another directory") from None
        except OSError as exc:  # a filesystem without locks (some NFS): the run goes on unguarded
            log.warning("%s cannot be locked (%s): nothing stops a second run on it", path, exc.strerror or exc)
        else:
            with contextlib.suppress(OSError):  # who holds it is for the message above; not writable, or a full disk
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"`{owner}` (PID {os.getpid()})\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
