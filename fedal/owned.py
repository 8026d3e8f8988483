"""Files the toolkit writes where a user says (results, plots, exported models): a path that
already holds one of the toolkit's own files is rewritten (a run repeated into the same path); a
path holding anything else is refused, never overwritten.

Results JSON and export reports are recognised by their shape; plots and ONNX files carry MARK
(a plot's Creator metadata, an ONNX model's metadata_props), which this module looks for."""

from __future__ import annotations

import json
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


def is_marked(path: Path) -> bool:
    """A plot or an ONNX model the toolkit wrote (MARK inside)."""
    try:
        if path.stat().st_size > _MAX_SCAN:
            return False
        return MARK.encode() in path.read_bytes()
    except OSError:
        return False


def check_replaceable(path: str | Path, ours: Callable[[Path], bool], what: str) -> None:
    """ForeignFile if `path` holds something that is not a file of ours of this kind."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not (path.is_file() and not path.is_symlink() and ours(path)):
        raise ForeignFile(f"{path} exists and is not a {what} this toolkit wrote: refusing to overwrite it; "
                          "give another path, or move it away first")


def _json_with(path: Path, keys: set[str]) -> bool:
    try:
        if path.stat().st_size > _MAX_SCAN:
            return False
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and keys <= set(data)
