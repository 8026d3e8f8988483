"""Give one installed path its mode and owner through a descriptor that follows no link.

install-agent.sh runs as root and fixes files inside the agent's state directory, which the
service user can write. A chmod or chown by name there follows whatever that user swapped in
between two commands (a link to /etc/shadow, say); a descriptor opened with O_NOFOLLOW is the
file that was checked, whatever happens to the name afterwards.

    python3 fix-meta.py [--dry-run] PATH MODE UID:GID|-

Prints one line per change ("mode 0640: PATH", "owner 0:123: PATH"); exit 2, naming the path,
for a link, a hard-linked file or anything but a regular file or a directory.
"""

from __future__ import annotations

import errno
import os
import stat
import sys


def refuse(path: str, why: str) -> int:
    print(f"install-agent: {path} {why}: the installer left it as it is; remove it and run the installer again",
          file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    dry = argv[:1] == ["--dry-run"]
    if dry:
        argv = argv[1:]
    if len(argv) != 3:
        print("usage: fix-meta.py [--dry-run] PATH MODE UID:GID|-", file=sys.stderr)
        return 2
    path, mode_text, owner = argv
    mode = int(mode_text, 8)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return refuse(path, "is a symbolic link")
        return refuse(path, f"cannot be opened ({e.strerror})")
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            if st.st_nlink != 1:
                return refuse(path, f"has {st.st_nlink - 1} other hard link(s)")
        elif not stat.S_ISDIR(st.st_mode):
            return refuse(path, "is neither a regular file nor a directory")
        if stat.S_IMODE(st.st_mode) != mode:
            print(f"mode {mode_text}: {path}")
            if not dry:
                os.fchmod(fd, mode)
        if owner != "-":
            uid, gid = (int(v) for v in owner.split(":"))
            if (st.st_uid, st.st_gid) != (uid, gid):
                print(f"owner {owner}: {path}")
                if not dry:
                    os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
