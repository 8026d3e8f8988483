"""The shared unlabeled public set P and its fingerprint.

P is held out from the training split before clients are formed, so no client ever trains on
a public row with its label; labels are dropped because the protocol only ever sends logits on
P. Its content hash goes into the run config, so results name exactly which P they used.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import zipfile
import zlib

import numpy as np

from fedal.data.arrays import ArrayDataset

__all__ = ["split_public", "split_public_indices", "content_hash", "public_rows_from_npz", "public_file_limit",
           "check_servable"]


def public_file_limit(max_elements: int) -> int:
    """The most bytes an agent reads of a public set file holding at most max_elements values:
    float64 rows, and the .npz's framing."""
    return max_elements * 8 + (1 << 20)


def split_public_indices(n: int, public_size: int,
                         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(public indices, remaining indices) of a uniformly random hold-out; both sorted int64."""
    if public_size > n:
        raise ValueError(f"public_size must be at most {n} (the training split's size), got {public_size}")
    if public_size < 0:
        raise ValueError(f"public_size must not be negative, got {public_size}")
    perm = rng.permutation(n)
    return (np.sort(perm[:public_size]).astype(np.int64),
            np.sort(perm[public_size:]).astype(np.int64))


def split_public(train: ArrayDataset, public_size: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Hold `public_size` random rows of `train` out as the public set.

    Returns (public_x, remaining_indices): public_x [public_size, *input_shape] float32 without
    labels (rows in dataset order), and the sorted indices into `train` of everything else.
    """
    public_idx, remaining = split_public_indices(len(train), public_size, rng)
    return np.ascontiguousarray(train.x[public_idx]), remaining


def content_hash(x: np.ndarray) -> str:
    """sha256 hex digest over dtype, shape and C-order bytes of `x`.

    Stable across runs and machines: the bytes are taken little-endian and C-contiguous
    whatever the array's memory layout.
    """
    x = np.asarray(x)
    if x.dtype.byteorder == ">":
        x = x.astype(x.dtype.newbyteorder("<"))
    x = np.ascontiguousarray(x)
    h = hashlib.sha256()
    h.update(f"{x.dtype.str}|{tuple(int(d) for d in x.shape)}|".encode())
    h.update(x.tobytes())
    return h.hexdigest()


# Besides BadZipFile, what zipfile raises for an archive it refuses to read: a damaged "version
# needed" or compression-method field (zipfile raises NotImplementedError for those), a member
# flagged as encrypted (RuntimeError). Every .npz reader catches these as a damaged file.
ZIP_REFUSALS = (NotImplementedError, RuntimeError)


def public_rows_from_npz(data: bytes, where: str, max_elements: int | None = None) -> np.ndarray:
    """The rows `x` of a public set file's bytes as float32, for the coordinator that serves it
    and the agent that fetches or is provisioned with it. Anything but an .npz holding a numeric
    array `x` of at least one finite row raises ValueError, naming `where` and what is wrong.
    max_elements: refuse an `x` declaring more, from its header, before any of it is inflated (a
    small compressed file may declare gigabytes)."""
    if max_elements is not None:
        _check_declared_size(data, where, max_elements)
    try:
        loaded = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, pickle.UnpicklingError, MemoryError,
            *ZIP_REFUSALS) as exc:
        raise ValueError(f"{where} is not a readable .npz file: {exc}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{where} is a single .npy array, not an .npz holding an array x")
    with loaded as z:
        if "x" not in z.files:
            raise ValueError(f"{where} holds no array x (it holds: {', '.join(z.files) or 'nothing'})")
        try:
            x = np.ascontiguousarray(z["x"], dtype=np.float32)
        except (ValueError, TypeError, EOFError, OSError, zipfile.BadZipFile, zlib.error, MemoryError,
                *ZIP_REFUSALS) as exc:
            raise ValueError(f"{where}: its array x cannot be read as float32 rows: {exc}") from None
    if x.ndim < 2 or len(x) == 0:
        raise ValueError(f"{where}: x must hold at least one row of features (shape [rows, ...]), "
                         f"got shape {list(x.shape)}")
    if not np.isfinite(x).all():
        raise ValueError(f"{where}: x holds NaN or infinite values")
    return x


def _check_declared_size(data: bytes, where: str, max_elements: int) -> None:
    """The sizes the archive declares within max_elements float64s: every entry's inflated size
    together, and the shape `x`'s .npy header declares (numpy reads an entry named `x` before
    one named `x.npy`: whichever it would read is the one checked)."""
    limit_bytes = max_elements * 8 + (1 << 16)  # float64 rows at most, and the headers
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
            inflated = sum(info.file_size for info in infos)
            names = {info.filename: info for info in infos}
            info = names.get("x") or names.get("x.npy")
            if info is None:
                shape, dtype = None, None  # no x: np.load below names what the file holds
            else:
                with z.open(info) as member:
                    major, _minor = np.lib.format.read_magic(member)
                    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                    shape, _, dtype = read_header(member)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, zlib.error, *ZIP_REFUSALS) as exc:
        raise ValueError(f"{where} is not a readable .npz file: {exc}") from None
    if dtype is not None and (dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None):
        raise ValueError(f"{where}: x declares dtype {dtype}, not numbers")  # (a string dtype may declare gigabytes a row)
    elements = 0 if shape is None else int(np.prod(shape, dtype=object))
    if elements > max_elements or elements * (dtype.itemsize if dtype is not None else 0) > limit_bytes \
            or inflated > limit_bytes:
        what = f"x declares shape {list(shape)} of {dtype}" if shape is not None else "its entries"
        raise ValueError(f"{where}: {what} ({inflated} bytes inflated in all), more than the run's public set can "
                         f"hold ({max_elements} values)")


def check_servable(data: bytes, x: np.ndarray, where: str) -> None:
    """ValueError, saying why, for a public set file every agent of its run would refuse: the
    limits an agent applies (public_size rows of its input, see edge_agent.public_set) computed
    for the file's own rows. Extra entries (labels) or a wide dtype can push a file over them."""
    most = int(x.size)
    if len(data) > public_file_limit(most):
        raise ValueError(f"{where} is {len(data)} bytes, more than an agent reads for {len(x)} rows of "
                         f"{list(x.shape[1:])} ({public_file_limit(most)} bytes): every agent would refuse it; "
                         "keep only the array x in it, e.g. np.savez_compressed(path, x=x.astype(np.float32))")
    try:
        _check_declared_size(data, where, most)
    except ValueError as exc:
        raise ValueError(f"{exc}: every agent would refuse it; keep only the array x in it, e.g. "
                         "np.savez_compressed(path, x=x.astype(np.float32))") from None
