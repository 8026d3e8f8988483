"""The shared public set: a provisioned file, or fetched once from the coordinator over HTTP and
cached; either way checked against the run's content hash before use. A cached copy that is
unreadable or not the run's (a power cut mid-write, another run's set) is a cache miss: fetched
again and replaced, never a reason to stop joining."""

from __future__ import annotations

import glob
import logging
import urllib.request
from pathlib import Path

import numpy as np

from fedal.atomic import write_bytes_atomic
from fedal.data import content_hash, public_rows_from_npz

log = logging.getLogger("edge_agent.public_set")


class PublicSetError(RuntimeError):
    """The public set is missing, unreadable, or not the one the run's hash names."""


def load_public_set(expected_hash: str | None, file: Path | None, url: str | None, cache: Path,
                    timeout_s: float = 60) -> np.ndarray:
    if file is not None and file.exists():  # provisioned: the operator's file, used or refused
        x = _read(file)
        if expected_hash is not None and content_hash(x) != expected_hash:
            raise PublicSetError(f"public set {file} has hash {content_hash(x)[:12]}…, the run expects {expected_hash[:12]}…")
        return x
    for torn in cache.parent.glob(f".{glob.escape(cache.name)}.*.tmp"):  # a write cut short (power, SIGKILL):
        torn.unlink(missing_ok=True)  # write_bytes_atomic's temporary name; only this agent writes here
    if cache.exists():
        try:
            x = _read(cache)
        except PublicSetError as exc:
            log.warning("%s: fetching it again", exc)
        else:
            if expected_hash is None or content_hash(x) == expected_hash:
                return x
    if not url:
        raise PublicSetError("no public set: provision public_file or let the coordinator announce a public_url")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            payload = resp.read()
    except OSError as exc:
        raise PublicSetError(f"cannot fetch the public set from {url}: {exc}") from None
    x = _rows(payload, f"the public set from {url}")
    if expected_hash is not None and content_hash(x) != expected_hash:
        raise PublicSetError(f"public set from {url} does not match the run's content hash")
    write_bytes_atomic(cache, payload)  # synced before it replaces the cache: never a torn file
    return x


def _read(path: Path) -> np.ndarray:
    try:
        payload = path.read_bytes()
    except OSError as exc:
        raise PublicSetError(f"cannot read the public set {path}: {exc}") from None
    return _rows(payload, f"public set {path}")


def _rows(payload: bytes, where: str) -> np.ndarray:
    try:
        return public_rows_from_npz(payload, where)
    except ValueError as exc:
        raise PublicSetError(str(exc)) from None
