"""The progress bar of long commands (simulate, demo, hil fleet): tqdm on stderr.

A terminal that reports no size (a serial console such as a Pi's UART, a pty nobody sized)
is taken as 80 x 24: tqdm sizes its bar from the terminal, and from 0 rows it prints nothing.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm import tqdm

FALLBACK_SIZE = os.terminal_size((80, 24))


def progress_bar(**kwargs: Any) -> tqdm:
    """A tqdm bar on stderr; `kwargs` as tqdm's."""
    stream = kwargs.setdefault("file", sys.stderr)
    size = _reported_size(stream)
    if size is not None:
        if size.columns == 0:
            kwargs.setdefault("ncols", FALLBACK_SIZE.columns)
        if size.lines == 0:
            kwargs.setdefault("nrows", FALLBACK_SIZE.lines)
    return tqdm(**kwargs)


def _reported_size(stream: Any) -> os.terminal_size | None:
    """The terminal's size as the terminal reports it; None where `stream` is no terminal."""
    try:
        return os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None
