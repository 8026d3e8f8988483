"""Datasets that need no files and no network: MNIST-1D (generated) and scikit-learn's digits.

They make every experiment and test reproducible offline. MNIST-1D is generated locally with
the `mnist1d` package (never its download path). Both are cached as arrays, keyed by what
determines them (the package's version, size, seed, split): generation takes seconds, and
importing either package alone takes a second or more (mnist1d imports matplotlib and scipy), which
every simulation, Ray actor and demo would pay at start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np

from fedal.data.arrays import ArrayDataset
from fedal.data.public import ZIP_REFUSALS

log = logging.getLogger("fedal.data")
__all__ = ["MNIST1D_SAMPLES", "load_mnist1d", "load_digits", "default_cache_dir"]

_CACHE_FORMAT = 2  # bump when the cached file layout or key changes


def default_cache_dir() -> Path:
    """`$FEDAL_CACHE_DIR` if set, else `~/.cache/fedal`."""
    env = os.environ.get("FEDAL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fedal"


def _version(package: str) -> str:
    try:
        return metadata.version(package)  # the generator's or split's code may change with it
    except metadata.PackageNotFoundError:  # pragma: no cover - vendored copy
        return "unknown"


def _cached(name: str, key: dict, build: Callable[[], dict[str, np.ndarray]],
            cache_dir: str | os.PathLike | None) -> dict[str, np.ndarray]:
    """The arrays `build` makes for `key`, from `<name>-<hash of key>.npz` in the cache when it
    holds them (else built and written there)."""
    key_json = json.dumps({**key, "cache_format": _CACHE_FORMAT}, sort_keys=True)
    digest = hashlib.sha256(key_json.encode()).hexdigest()[:16]
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"{name}-{digest}.npz"
    arrays = _read_cache(path, key_json)
    if arrays is None:
        arrays = build()
        try:
            _write_atomic(path, arrays, key_json)
        except OSError as exc:  # the cache saves time, nothing else: the run goes on without it
            log.warning("%s: cannot cache the generated data in %s (%s); generating it again next time",
                        name, path.parent, exc.strerror or exc)
    return arrays


def _mnist1d_args(num_samples: int, seed: int):
    import mnist1d.data

    args = mnist1d.data.get_dataset_args()
    args.num_samples = int(num_samples)
    args.seed = int(seed)
    return args


def _generate_mnist1d(args) -> dict[str, np.ndarray]:
    import mnist1d.data

    # make_dataset reseeds the global `random` and `np.random` generators; restore them so that
    # loading data never changes the caller's random stream.
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        d = mnist1d.data.make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    return {
        "x": np.asarray(d["x"], dtype=np.float32),
        "y": np.asarray(d["y"], dtype=np.int64),
        "x_test": np.asarray(d["x_test"], dtype=np.float32),
        "y_test": np.asarray(d["y_test"], dtype=np.int64),
    }


def _read_cache(path: Path, key_json: str) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None if the file is missing, unreadable or for other args."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) != key_json:
                return None
            return {k: z[k] for k in ("x", "y", "x_test", "y_test")}
    except (OSError, KeyError, ValueError, EOFError, MemoryError, zipfile.BadZipFile, zlib.error, *ZIP_REFUSALS):
        return None  # (MemoryError: an array header there claiming an absurd shape) made again


def _write_atomic(path: Path, arrays: dict[str, np.ndarray], key_json: str) -> None:
    """Write via a temp file in the same directory + os.replace, so that concurrent runs never
    see a half-written cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, key=np.array(key_json), **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as bool
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


MNIST1D_SAMPLES = 12000  # the toolkit's default size of generated MNIST-1D (train and test together)


def load_mnist1d(num_samples: int = MNIST1D_SAMPLES, seed: int = 42,
                 cache_dir: str | os.PathLike | None = None) -> tuple[ArrayDataset, ArrayDataset]:
    """MNIST-1D (train, test): x [n, 40] float32, 10 classes, the package's 80/20 split.

    Generated with `mnist1d.data.make_dataset` (num_samples // 10 samples per class, the
    package's default arguments otherwise, fixed by its version), cached as `mnist1d-<hash>.npz`
    in `cache_dir` (default: `default_cache_dir()`).
    """
    if int(num_samples) < 10:
        raise ValueError(f"num_samples must be at least 10 (one per class), got {num_samples}")
    key = {"num_samples": int(num_samples), "seed": int(seed), "mnist1d_version": _version("mnist1d")}
    arrays = _cached("mnist1d", key, lambda: _generate_mnist1d(_mnist1d_args(num_samples, seed)), cache_dir)
    name = "mnist1d"
    return (ArrayDataset(arrays["x"], arrays["y"], 10, name),
            ArrayDataset(arrays["x_test"], arrays["y_test"], 10, name + "-test"))


def load_digits(test_fraction: float = 0.2, seed: int = 0,
                cache_dir: str | os.PathLike | None = None) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's bundled 8x8 digits (train, test): x [n, 1, 8, 8] float32 in [0, 1].

    The split is stratified and fixed by `seed`, so every run sees the same test set; cached as
    `digits-<hash>.npz` like MNIST-1D.
    """
    key = {"sklearn_version": _version("scikit-learn"), "test_fraction": float(test_fraction), "seed": int(seed)}
    arrays = _cached("digits", key, lambda: _split_digits(test_fraction, seed), cache_dir)
    return (ArrayDataset(arrays["x"], arrays["y"], 10, "digits"),
            ArrayDataset(arrays["x_test"], arrays["y_test"], 10, "digits-test"))


def _split_digits(test_fraction: float, seed: int) -> dict[str, np.ndarray]:
    from sklearn.datasets import load_digits as _sk_digits
    from sklearn.model_selection import train_test_split

    d = _sk_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None, :, :]  # pixel values are 0..16
    y = d.target.astype(np.int64)
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=test_fraction,
                                           random_state=seed, stratify=y)
    idx_train, idx_test = np.sort(idx_train), np.sort(idx_test)
    return {"x": x[idx_train], "y": y[idx_train], "x_test": x[idx_test], "y_test": y[idx_test]}
