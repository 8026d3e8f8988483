"""The shared public set: a provisioned file, or fetched once from the coordinator over HTTP and
cached; either way checked against the run's content hash before use. A cached copy that is
unreadable or not the run's (a power cut mid-write, another run's set) is a cache miss: fetched
again and replaced, never a reason to stop joining."""

from __future__ import annotations

import glob
import logging
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from fedal.atomic import write_bytes_atomic
from fedal.data import content_hash, public_file_limit, public_rows_from_npz

log = logging.getLogger("edge_agent.public_set")


class PublicSetError(RuntimeError):
    """The public set is missing, unreadable, or not the one the run's hash names."""


def load_public_set(expected_hash: str | None, file: Path | None, url: str | None, cache: Path,
                    timeout_s: float = 60, max_elements: int | None = None) -> np.ndarray:
    """max_elements: the most values the run's public set can hold (its rows x the model's input);
    a fetched or cached file declaring more is refused before it is inflated."""
    if file is not None and file.exists():  # provisioned: the operator's file, used or refused
        x = _read(file, max_elements)
        if expected_hash is not None and content_hash(x) != expected_hash:
            raise PublicSetError(f"public set {file} has hash {content_hash(x)[:12]}…, the run expects {expected_hash[:12]}…")
        return x
    for torn in cache.parent.glob(f".{glob.escape(cache.name)}.*.tmp"):  # a write cut short (power, SIGKILL):
        torn.unlink(missing_ok=True)  # write_bytes_atomic's temporary name; only this agent writes here
    if cache.exists():
        try:
            x = _read(cache, max_elements)
        except PublicSetError as exc:
            log.warning("%s: fetching it again", exc)
        else:
            if expected_hash is None or content_hash(x) == expected_hash:
                return x
    if not url:
        raise PublicSetError("no public set: provision public_file or let the coordinator announce a public_url")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):  # never file://: the device's private files
        raise PublicSetError(f"public_url {url[:200]!r} is not an http:// or https:// URL")
    if expected_hash is None:
        raise PublicSetError("the run announces a public_url without a public_hash: a fetched set could not be checked")
    limit = None if max_elements is None else public_file_limit(max_elements)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            payload = resp.read() if limit is None else resp.read(limit + 1)
    except OSError as exc:
        raise PublicSetError(f"cannot fetch the public set from {url}: {exc}") from None
    if limit is not None and len(payload) > limit:
        raise PublicSetError(f"the public set from {url} is longer than the run's public set can be ({limit} bytes)")
    x = _rows(payload, f"the public set from {url}", max_elements)
    if expected_hash is not None and content_hash(x) != expected_hash:
        raise PublicSetError(f"public set from {url} does not match the run's content hash")
    write_bytes_atomic(cache, payload)  # synced before it replaces the cache: never a torn file
    return x


def _read(path: Path, max_elements: int | None) -> np.ndarray:
    try:
        payload = path.read_bytes()
    except OSError as exc:
        raise PublicSetError(f"cannot read the public set {path}: {exc}") from None
    return _rows(payload, f"public set {path}", max_elements)


def _rows(payload: bytes, where: str, max_elements: int | None) -> np.ndarray:
    try:
        return public_rows_from_npz(payload, where, max_elements)
    except ValueError as exc:
        raise PublicSetError(str(exc)) from None
