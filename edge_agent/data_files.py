"""The device's own data files (.npz of rows `x` and labels `y`), read without torch: the agent's
command checks them at start, so a file that can never be trained on is a config error (exit 2)
said in a line, not a join retried for ever; the agent reads them again when it joins a run,
where the run's number of classes is known."""

from __future__ import annotations

import pickle
import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedal.data.public import ZIP_REFUSALS

MAX_LABEL = 2**31  # a class index; the run's number of classes, known at joining, bounds it further


def read_rows(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(x as float32, y as int64). Anything else is a ValueError that names the file: labels
    that are not whole non-negative numbers are refused, not truncated, rows with NaN or infinite
    values never reach training, and x and y must hold as many rows."""
    if Path(path).is_file() and not zipfile.is_zipfile(path):  # numpy would speak of pickles
        raise ValueError(f"{path} is not an .npz of rows x and labels y: not a zip archive (torn, or another kind "
                         "of file)")
    try:
        with np.load(path, allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile) or not {"x", "y"} <= set(z.files):
                raise ValueError(f"it holds {', '.join(getattr(z, 'files', [])) or 'no arrays'}, not arrays x and y")
            x, y = np.ascontiguousarray(z["x"], np.float32), np.asarray(z["y"])
    except (ValueError, TypeError, EOFError, OSError, zipfile.BadZipFile, zlib.error, pickle.UnpicklingError,
            MemoryError, *ZIP_REFUSALS) as exc:  # MemoryError: a size a damaged header claims
        raise ValueError(f"{path} is not an .npz of rows x and labels y: {type(exc).__name__}: {exc}") from None
    if y.dtype == bool or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)) \
            or (np.issubdtype(y.dtype, np.floating) and not np.array_equal(y, np.round(y))):
        raise ValueError(f"{path}: labels y must be integers, got {y.dtype}"
                         + (" with fractional values" if np.issubdtype(y.dtype, np.floating) else ""))
    if not np.isfinite(x).all():
        raise ValueError(f"{path}: x holds NaN or infinite values")
    if x.ndim < 2 or y.ndim != 1:
        raise ValueError(f"{path}: x must be rows [n, ...] and y n labels, got x {list(x.shape)} and y {list(y.shape)}")
    if len(x) != len(y):
        raise ValueError(f"{path}: x has {len(x)} rows but y has {len(y)} labels")
    if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
        raise ValueError(f"{path}: labels y hold NaN or infinite values")
    if len(y) and y.min() < 0:
        raise ValueError(f"{path}: labels y must not be negative, got {int(y.min())}")
    if len(y) and y.max() >= MAX_LABEL:  # int64 would wrap them (2**63 and up, huge floats) to negatives
        raise ValueError(f"{path}: labels y must be class indices below {MAX_LABEL}, got {y.max()}")
    return x, np.ascontiguousarray(y, np.int64)
