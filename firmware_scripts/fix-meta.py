"""Install one file into the agent's state directory, or fix its mode and owner there, through
descriptors that follow no link.

install-agent.sh runs as root, and the state directory is the service user's to write: any name
in it may be swapped for a link (to /etc/shadow, say) between two commands. So nothing here acts
on a name twice. An existing file is opened once with O_NOFOLLOW, compared and given its mode and
owner through that descriptor; a new one is written to a fresh temporary file (O_EXCL: no link
followed), given its mode and owner through its descriptor, and renamed over the name, which
replaces whatever the name held, a link included, without following it.

    python3 fix-meta.py [--dry-run] [--install SRC] PATH MODE UID:GID|-

Prints one line per change ("installed PATH", "mode 0640: PATH", "owner 0:123: PATH"); exit 2,
naming the path, for what it will not touch (a hard-linked file, a directory where a file goes,
a link or a FIFO at a path it only fixes).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import stat
import sys
import tempfile


class Refused(Exception):
    """PATH is something this installer leaves alone."""


def refuse(path: str, why: str) -> int:
    print(f"install-agent: {path} {why}: the installer left it as it is; remove it and run the installer again",
          file=sys.stderr)
    return 2


def _open_existing(path: str) -> int | None:
    """A descriptor of the regular file or directory at PATH itself, None if nothing is there;
    Refused for a link, a hard-linked file or anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Refused("is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})") from None
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        os.close(fd)
        raise Refused(f"has {st.st_nlink - 1} other hard link(s)")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        os.close(fd)
        raise Refused("is neither a regular file nor a directory")
    return fd


def _fix(fd: int, path: str, mode: int, mode_text: str, owner: tuple[int, int] | None, dry: bool) -> None:
    st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) != mode:
        print(f"mode {mode_text}: {path}")
        if not dry:
            os.fchmod(fd, mode)
    if owner is not None and (st.st_uid, st.st_gid) != owner:
        print(f"owner {owner[0]}:{owner[1]}: {path}")
        if not dry:
            os.fchown(fd, *owner)


def _same_content(fd: int, src: str) -> bool:
    with open(src, "rb") as f, os.fdopen(os.dup(fd), "rb") as g:
        while True:
            a, b = f.read(1 << 16), g.read(1 << 16)
            if a != b:
                return False
            if not a:
                return True


def _install(src: str, path: str, mode: int, owner: tuple[int, int] | None, dry: bool) -> None:
    print(f"installed {path}")
    if dry:
        return
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o600)
            if owner is not None:
                os.fchown(out.fileno(), *owner)
            while chunk := f.read(1 << 20):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
            os.fchmod(out.fileno(), mode)
        try:
            os.replace(tmp, path)  # replaces a link itself, never what it points at
        except IsADirectoryError:
            raise Refused("is a directory where the installer puts a file") from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):  # the rename may have taken it already
            os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--install", metavar="SRC", help="install SRC as PATH unless PATH already holds its content")
    ap.add_argument("path")
    ap.add_argument("mode")
    ap.add_argument("owner", help="UID:GID, or - to leave the owner as it is")
    args = ap.parse_args(argv)
    path, mode, dry = args.path, int(args.mode, 8), args.dry_run
    owner: tuple[int, int] | None = None
    if args.owner != "-":
        uid, gid = args.owner.split(":")
        owner = (int(uid), int(gid))
    try:
        if args.install is None:
            fd = _open_existing(path)
            if fd is None:
                return refuse(path, "does not exist")
            try:
                _fix(fd, path, mode, args.mode, owner, dry)
            finally:
                os.close(fd)
            return 0
        try:
            fd = _open_existing(path)
        except Refused:
            fd = None  # a link, a hard link, a FIFO: the rename below replaces the name itself
        if fd is not None:
            try:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise Refused("is a directory where the installer puts a file")
                if _same_content(fd, args.install):
                    _fix(fd, path, mode, args.mode, owner, dry)
                    return 0
            finally:
                os.close(fd)
        _install(args.install, path, mode, owner, dry)
    except Refused as exc:
        return refuse(path, str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
