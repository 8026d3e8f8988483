#!/usr/bin/env python3
"""Drop what the torch wheel ships for building and testing torch itself from an agent virtualenv.

The aarch64 torch wheel carries its C++ unit-test binaries, C++ headers, CMake files and protoc:
about 190 MB of the SD card that an agent never opens (it builds no C++ extension and runs no
torch test). Only those paths go; every Python module stays importable. The removed files also
leave the distribution's RECORD, so pip uninstall and pip show -f stay consistent. Idempotent:
a second run removes and rewrites nothing. Standard library only: it runs with the virtualenv's
python, right after pip.

Usage: prune-venv.py SITE_PACKAGES [--dry-run]
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import sys
from pathlib import Path

# (path relative to site-packages, what it is); a directory goes as a whole
PRUNE = (
    ("torch/test", "C++ unit-test binaries"),
    ("torch/include", "C++ headers for building extensions"),
    ("torch/share/cmake", "CMake package files for C++ builds"),
    ("torch/bin", "C++ test binaries and protoc (torch_shm_manager stays)"),
)
KEEP = {"torch/bin/torch_shm_manager"}  # torch.multiprocessing's file_system sharing starts it


def doomed(site: Path) -> list[Path]:
    """The paths to remove: none unless pip installed torch here (its dist-info), so a directory
    that merely holds a torch/ folder (a source checkout, the wrong argument) loses nothing."""
    if not any(p.is_dir() for p in site.glob("torch-*.dist-info")):
        return []
    out = []
    for rel, _ in PRUNE:
        top = site / rel
        if not top.exists():
            continue
        if any(k.startswith(rel + "/") for k in KEEP):
            out += sorted(p for p in top.iterdir() if p.relative_to(site).as_posix() not in KEEP)
        else:
            out.append(top)
    return out


def size_of(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


def drop_from_records(site: Path, removed: list[str]) -> list[Path]:
    """Rewrite each RECORD that lists a removed file, without those lines."""
    changed = []
    for record in sorted(site.glob("*.dist-info/RECORD")):
        text = record.read_text(encoding="utf-8")
        rows = list(csv.reader(io.StringIO(text)))
        kept = [r for r in rows if not (r and any(r[0] == p or r[0].startswith(p + "/") for p in removed))]
        if len(kept) == len(rows):
            continue
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(kept)
        record.write_text(buf.getvalue(), encoding="utf-8")
        changed.append(record)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site_packages", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    site = args.site_packages
    if not site.is_dir():
        parser.error(f"not a directory: {site}")
    paths = doomed(site)
    total = sum(size_of(p) for p in paths)
    for p in paths:
        print(f"prune-venv: {'would remove' if args.dry_run else 'removed'} {p.relative_to(site)}")
        if args.dry_run:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
    if not args.dry_run and paths:
        for record in drop_from_records(site, [p.relative_to(site).as_posix() for p in paths]):
            print(f"prune-venv: updated {record.relative_to(site)}")
    print(f"prune-venv: {total / 2**20:.1f} MB {'to free' if args.dry_run else 'freed'} in {len(paths)} path(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
