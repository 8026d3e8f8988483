"""Files the toolkit writes where a user says (results, plots, exported models): a path that
already holds one of the toolkit's own files is rewritten (a run repeated into the same path); a
path holding anything else is refused, never overwritten.

Results JSON and export reports are recognised by their shape; plots and ONNX files carry MARK
(a plot's Creator metadata, an ONNX model's metadata_props), which this module looks for where
each format keeps it. A plot in a format without such metadata (jpg, tiff, webp) cannot be
recognised: an existing one is always refused."""

from __future__ import annotations

import gzip
import io
import json
import re
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

MARK = "fedal-edge"
MARKED_PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "ps", "eps")  # matplotlib writes a Creator into these
_MAX_SCAN = 256 << 20  # bytes: a file this large is no plot or model of ours


class ForeignFile(ValueError):
    """An output path that holds a file the toolkit did not write."""


def is_results(path: Path) -> bool:
    """A results JSON of `fedal simulate`, `fedal demo` or the coordinator."""
    return _json_with(path, {"config", "rounds", "final"})


def is_export_report(path: Path) -> bool:
    """The JSON report `fedal export` writes beside an ONNX file."""
    return _json_with(path, {"model", "onnx", "opset", "onnx_bytes"})


def is_our_plot(path: Path) -> bool:
    """A plot the toolkit wrote: MARK as its Creator, where each format keeps it (not merely the
    letters anywhere: an EPS names its own file in its title)."""
    fmt = path.suffix.lstrip(".").lower()
    data = _read(path)
    if data is None or fmt not in MARKED_PLOT_FORMATS:
        return False
    if fmt == "svgz":
        try:
            data = gzip.GzipFile(fileobj=io.BytesIO(data)).read(_MAX_SCAN)
        except (OSError, EOFError, zlib.error):
            return False
    mark = MARK.encode()
    if fmt == "png":  # a tEXt chunk of exactly "Creator\0" + MARK
        text = b"Creator\x00" + mark
        return len(text).to_bytes(4, "big") + b"tEXt" + text in data
    if fmt == "pdf":
        return b"/Creator (" + mark + b")" in data
    if fmt in ("svg", "svgz"):
        return re.search(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>" + re.escape(mark) + rb"</dc:title>", data) is not None
    return b"\n%%Creator: " + mark + b"\n" in data  # ps, eps


def is_our_onnx(path: Path) -> bool:
    """An ONNX model the toolkit wrote: its metadata_props hold producer = MARK (the entry's
    protobuf encoding, looked for without parsing the model)."""
    data = _read(path)
    entry = b"\n" + bytes([len("producer")]) + b"producer" + b"\x12" + bytes([len(MARK)]) + MARK.encode()
    return data is not None and entry in data


def _read(path: Path) -> bytes | None:
    try:
        if path.stat().st_size > _MAX_SCAN:
            return None
        return path.read_bytes()
    except OSError:
        return None


def is_fleet_status(path: Path) -> bool:
    """The counters `fedal hil fleet --status-file` writes."""
    return _json_with(path, {"run_id", "clients", "per_client", "ts"})


def check_replaceable(path: str | Path, ours: Callable[[Path], bool], what: str) -> None:
    """ForeignFile if `path` holds something that is not a file of ours of this kind."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not (path.is_file() and not path.is_symlink() and ours(path)):
        article = "an" if what[:1].lower() in "aeiou" else "a"
        raise ForeignFile(f"{path} exists and is not {article} {what} this toolkit wrote: refusing to overwrite it; "
                          "give another path, or move it away first")


def unwritable(path: str | Path) -> str | None:
    """Why a file could not be written at `path` after a run (its output would be lost), else None.
    Tried, not asked (permission bits say nothing to root, or on /proc): a scratch file made and
    removed where it will go, as outputs are written (a temporary file renamed over the name, so
    the directory must take new files even where the file itself is writable), and an existing
    file opened for appending, which changes nothing."""
    target = Path(path)
    if target.is_dir():
        return f"{path} is a directory"
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{path} cannot be created: {parent} is not a directory"
    try:
        if target.exists():
            open(target, "ab").close()  # opened for appending: changes nothing
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".fedal-write-check-"):
            return None
    except OSError:
        return f"{path} is not writable here"


def _json_with(path: Path, keys: set[str]) -> bool:
    try:
        if path.stat().st_size > _MAX_SCAN:
            return False
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable, not JSON, nested past the parser: not ours
        return False
    return isinstance(data, dict) and keys <= set(data)
