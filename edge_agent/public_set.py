"""The shared public set: a provisioned file, or fetched once from the coordinator over HTTP;
either way checked against the run's content hash before use."""

from __future__ import annotations

import io
import urllib.request
from pathlib import Path

import numpy as np

from fedal.data import content_hash


class PublicSetError(RuntimeError):
    """The public set is missing, unreadable, or not the one the run's hash names."""


def load_public_set(expected_hash: str | None, file: Path | None, url: str | None, cache: Path,
                    timeout_s: float = 60) -> np.ndarray:
    for candidate in (file, cache):
        if candidate is not None and candidate.exists():
            x = _read_npz(candidate.read_bytes(), str(candidate))
            if expected_hash is None or content_hash(x) == expected_hash:
                return x
            if candidate == file:
                raise PublicSetError(f"public set {file} has hash {content_hash(x)[:12]}…, the run expects {expected_hash[:12]}…")
    if not url:
        raise PublicSetError("no public set: provision public_file or let the coordinator announce a public_url")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            payload = resp.read()
    except OSError as exc:
        raise PublicSetError(f"cannot fetch the public set from {url}: {exc}") from None
    x = _read_npz(payload, url)
    if expected_hash is not None and content_hash(x) != expected_hash:
        raise PublicSetError(f"public set from {url} does not match the run's content hash")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_bytes(payload)
    tmp.replace(cache)
    return x


def _read_npz(payload: bytes, where: str) -> np.ndarray:
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as z:
            x = z["x"]
    except (ValueError, KeyError, OSError) as exc:
        raise PublicSetError(f"{where} is not an .npz with an array 'x': {exc}") from None
    return np.ascontiguousarray(x, dtype=np.float32)
