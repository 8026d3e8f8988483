"""Loaders for real datasets from files the user already has (nothing is ever downloaded).

Each reads the official distribution format, checks it (magic numbers, sizes, label ranges) and
returns `ArrayDataset`s with pixels scaled to [0, 1], channels first. Missing files raise
FileNotFoundError naming what was expected and where; corrupt or mismatched files ValueError.
"""

from __future__ import annotations

import gzip
import io
import math
import pickle
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fedal.data.arrays import ArrayDataset

__all__ = ["load_idx", "load_mnist_dir", "load_cifar10_dir", "load_svhn_dir"]

_IDX_IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
_IDX_LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension


def _require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: expected file {path}")
    return path


def _read_idx_bytes(path: Path, header: int, size: Callable[[bytes], int]) -> bytes:
    """The file's header and data, gunzipped where it starts with gzip's magic (not by its name).
    `size(header bytes)` says how many data bytes the header promises: no more than one byte past
    that is read or decompressed, so a corrupt or hostile file costs no more memory than its
    header admits."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        f: BinaryIO = gzip.GzipFile(fileobj=raw) if gzipped else raw  # type: ignore[assignment]
        try:
            head = f.read(header)
            if len(head) < header:
                raise ValueError(f"{path}: too short for an IDX header ({len(head)} bytes)")
            want = size(head) + 1
            chunks, got = [], 0
            while got < want:
                chunk = f.read(min(want - got, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            data = head + b"".join(chunks)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: corrupt gzip data ({e})") from e
        except MemoryError:  # what the header promised (twice over, joined) did not fit
            raise ValueError(f"{path}: the data its IDX header promises does not fit in memory") from None
    return data


MAX_IDX_BYTES = 1 << 32  # 4 GiB of data: the largest IDX datasets (EMNIST) take under a fifth of it


def _parse_idx(path: Path, magic: int, ndim: int,
               check_dims: Callable[[tuple[int, ...]], None] | None = None) -> np.ndarray:
    """`check_dims(dims)` raises ValueError for dimensions the caller cannot take: checked before
    any data is read (a gzip file is inflated no further than its header promises)."""
    header = 4 + 4 * ndim
    dims: tuple[int, ...] = ()

    def promised(head: bytes) -> int:
        nonlocal dims
        got_magic = struct.unpack(">i", head[:4])[0]
        if got_magic != magic:
            raise ValueError(f"{path}: bad IDX magic number {got_magic}, expected {magic}")
        dims = struct.unpack(">" + "i" * ndim, head[4:header])
        if any(d < 0 for d in dims):
            raise ValueError(f"{path}: negative IDX dimension in {dims}")
        if check_dims is not None:
            check_dims(dims)
        if math.prod(dims) > MAX_IDX_BYTES:  # Python ints: no wrap-around
            raise ValueError(f"{path}: IDX header {dims} promises {math.prod(dims)} bytes of data, more than the "
                             f"{MAX_IDX_BYTES} an IDX file may hold here (a damaged header)")
        return math.prod(dims)

    data = _read_idx_bytes(path, header, promised)
    expected = math.prod(dims)
    if len(data) - header != expected:
        raise ValueError(f"{path}: IDX header {dims} promises {expected} bytes of data, "
                         f"file has {'more than that' if len(data) - header > expected else len(data) - header} "
                         "(truncated or corrupt)")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def load_idx(images_path, labels_path, name: str, num_classes: int = 10,
             image_shape: tuple[int, int] | None = None) -> ArrayDataset:
    """An MNIST-style IDX pair (gzip or raw): x [n, 1, rows, cols] float32 in [0, 1]. With
    `image_shape`, images of another (rows, cols) are refused."""
    images_path = _require_file(Path(images_path), f"{name} images")
    labels_path = _require_file(Path(labels_path), f"{name} labels")

    def image_size(dims: tuple[int, ...]) -> None:
        rows_cols = dims[1:]
        if 0 in rows_cols or (image_shape is not None and rows_cols != tuple(image_shape)):
            expected = f"{image_shape[0]}x{image_shape[1]}" if image_shape is not None else "at least 1x1"
            raise ValueError(f"{name}: {images_path} holds {rows_cols[0]}x{rows_cols[1]} images, "
                             f"{name} images are {expected}")

    images = _parse_idx(images_path, _IDX_IMAGES_MAGIC, 3, image_size)

    def as_many_labels(dims: tuple[int, ...]) -> None:  # (checked before a gzip file is inflated)
        if dims[0] != len(images):
            raise ValueError(f"{name}: {images_path} has {len(images)} images but {labels_path} has {dims[0]} labels")

    labels = _parse_idx(labels_path, _IDX_LABELS_MAGIC, 1, as_many_labels)
    if len(labels) and labels.max() >= num_classes:
        raise ValueError(f"{name}: {labels_path} contains label {labels.max()}, "
                         f"expected labels below {num_classes}")
    x = (images.astype(np.float32) / np.float32(255.0))[:, None, :, :]
    return ArrayDataset(x, labels.astype(np.int64), num_classes, name)


_MNIST_DIRS = {"mnist": ("MNIST/raw", "mnist"), "fashion": ("FashionMNIST/raw", "fashion-mnist")}


def _find_first(dirs: list[Path], names: list[str]) -> Path | None:
    for d in dirs:
        for n in names:
            if (d / n).is_file():
                return d / n
    return None


def load_mnist_dir(root, kind: str = "mnist") -> tuple[ArrayDataset, ArrayDataset]:
    """MNIST or Fashion-MNIST (train, test) from the four standard IDX files.

    Looks in `root` and in torchvision's layout (`root/MNIST/raw`, `root/FashionMNIST/raw`);
    accepts `train-images-idx3-ubyte`, the `train-images.idx3-ubyte` spelling, and `.gz`.
    """
    if kind not in _MNIST_DIRS:
        raise ValueError(f"unknown kind {kind!r}; choose one of: {', '.join(_MNIST_DIRS)}")
    root = Path(root)
    sub, name = _MNIST_DIRS[kind]
    dirs = [root, root / "raw", root / sub]
    found = {}
    for stem, suffix in [("train-images", "idx3-ubyte"), ("train-labels", "idx1-ubyte"),
                         ("t10k-images", "idx3-ubyte"), ("t10k-labels", "idx1-ubyte")]:
        names = [f"{stem}-{suffix}", f"{stem}.{suffix}"]
        names += [n + ".gz" for n in names]
        path = _find_first(dirs, names)
        if path is None:
            raise FileNotFoundError(
                f"{name}: none of {', '.join(names)} found in {', '.join(map(str, dirs))}; "
                f"expected the files train-images-idx3-ubyte, train-labels-idx1-ubyte, "
                f"t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (optionally .gz)")
        found[stem] = path
    return (load_idx(found["train-images"], found["train-labels"], name, image_shape=(28, 28)),
            load_idx(found["t10k-images"], found["t10k-labels"], name + "-test", image_shape=(28, 28)))


class _Dtype:
    """numpy.dtype(code, align, copy) and its BUILD state, as a pickle rebuilds a plain numeric
    dtype: checked field by field here, never handed to numpy's own __setstate__ (which a damaged
    state can crash)."""

    CODES = ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f4", "f8", "b1")

    def __init__(self, code, align=False, copy=True):
        code = code.decode("latin1") if isinstance(code, bytes) else code  # a Python 2 str
        if code not in self.CODES or align not in (0, False) or copy not in (1, True):
            raise ValueError(f"dtype {code!r} is not a plain numeric dtype")
        self.dtype = np.dtype(code)

    def __setstate__(self, state) -> None:
        if not (isinstance(state, tuple) and len(state) == 8 and state[0] == 3 and state[2:5] == (None, None, None)
                and all(isinstance(v, int) for v in state[5:])):
            raise ValueError(f"unexpected dtype state {state!r:.80}")
        order = state[1].decode("latin1") if isinstance(state[1], bytes) else state[1]
        if order not in ("|", "<", ">", "="):
            raise ValueError(f"unexpected byte order {order!r}")
        self.dtype = self.dtype.newbyteorder(order) if order in "<>" else self.dtype


def _array(raw, dtype, shape, order: str) -> np.ndarray:
    """An array from a pickle's raw bytes, every field checked first; native byte order, a copy."""
    if not isinstance(dtype, _Dtype):
        raise ValueError("an array without a plain numeric dtype")
    raw = raw.raw() if isinstance(raw, pickle.PickleBuffer) else raw
    raw = raw.encode("latin1") if isinstance(raw, str) else raw
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise ValueError(f"array data is {type(raw).__name__}, not bytes")
    if not (isinstance(shape, tuple) and len(shape) <= 8 and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ValueError(f"bad array shape {shape!r:.80}")
    if len(raw) != math.prod(shape) * dtype.dtype.itemsize:
        raise ValueError(f"array of shape {shape} and dtype {dtype.dtype} holds {len(raw)} bytes")
    flat = np.frombuffer(bytes(raw), dtype=dtype.dtype)
    return flat.reshape(shape, order="F" if order == "F" else "C").astype(dtype.dtype.newbyteorder("="), order="C")


class _PickledArray:
    """What numpy's `_reconstruct` starts, filled by its BUILD state (version, shape, dtype,
    Fortran order, raw bytes): checked here instead of by numpy's __setstate__."""

    array: np.ndarray | None = None

    def __setstate__(self, state) -> None:
        if not (isinstance(state, tuple) and len(state) == 5 and state[0] == 1 and isinstance(state[3], bool)):
            raise ValueError(f"unexpected array state {state!r:.80}")
        _version, shape, dtype, fortran, raw = state
        self.array = _array(raw, dtype, shape, "F" if fortran else "C")


_NDARRAY = object()  # numpy.ndarray, as _reconstruct's first argument


def _reconstruct(cls, shape, code) -> _PickledArray:
    if cls is not _NDARRAY or shape != (0,) or code not in (b"b", "b"):
        raise ValueError("not numpy's array reconstruction")
    return _PickledArray()


def _frombuffer(buf, dtype, shape, order="C") -> np.ndarray:
    if order not in ("C", "F"):
        raise ValueError(f"unexpected array order {order!r}")
    return _array(buf, dtype, shape, order)


def _scalar(dtype, raw) -> Any:
    return _array(raw, dtype, (), "C")[()]


def _latin1(text, encoding) -> bytes:
    """_codecs.encode: how protocol-2 pickles written by Python 3 store bytes."""
    if encoding != "latin1" or not isinstance(text, str):
        raise ValueError(f"unexpected encoding {encoding!r}")
    return text.encode("latin1")


class _NumpyOnlyUnpickler(pickle._Unpickler):
    """Unpickler that rebuilds plain numpy arrays and nothing else, with its own checked stand-ins.

    The CIFAR-10 python batches are only distributed as pickles, and unpickling can run
    arbitrary code. Every global but numpy's array reconstructors is refused, and those are
    replaced by functions that check what they are given before building an array with
    np.frombuffer: numpy's own dtype and array __setstate__ crash the process on some damaged
    states. The pure-Python unpickler, over the file's bytes in memory, keeps its memo in a dict
    and never allocates what a damaged length field claims (the C one made a 9-byte file take
    gigabytes).
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct, ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.multiarray", "scalar"): _scalar, ("numpy._core.multiarray", "scalar"): _scalar,
        ("numpy.core.numeric", "_frombuffer"): _frombuffer, ("numpy._core.numeric", "_frombuffer"): _frombuffer,
        ("numpy", "ndarray"): _NDARRAY, ("numpy", "dtype"): _Dtype,
        ("_codecs", "encode"): _latin1,
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset file")
        return self._ALLOWED[(module, name)]


def _arrays(obj):
    """The unpickled batch with the checked arrays in place of their stand-ins."""
    if isinstance(obj, _PickledArray):
        if obj.array is None:
            raise ValueError("an array without its data")
        return obj.array
    if isinstance(obj, dict):
        return {k: _arrays(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_arrays(v) for v in obj]
    if isinstance(obj, _Dtype) or obj is _NDARRAY:
        raise ValueError("a dtype where data belongs")
    return obj


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        data_bytes = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        # encoding="bytes" is the official way to read these Python 2 pickles (keys are bytes)
        batch = _arrays(_NumpyOnlyUnpickler(io.BytesIO(data_bytes), encoding="bytes").load())
    except Exception as e:  # whatever a damaged pickle makes the unpickler raise: not a batch
        raise ValueError(f"{path}: not a readable CIFAR-10 batch ({type(e).__name__}: {e})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path}: expected a dict with b'data' and b'labels'")
    try:
        data = np.asarray(batch[b"data"])
        labels = np.asarray(batch[b"labels"])
    except (ValueError, TypeError) as e:  # e.g. labels nested at uneven depth
        raise ValueError(f"{path}: b'data' and b'labels' must be arrays ({e})") from None
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"{path}: b'data' must be uint8 [n, 3072], got {data.dtype} {data.shape}")
    if labels.ndim != 1 or len(labels) != len(data) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: b'labels' must be {len(data)} integers, got {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must be in 0..9, got [{labels.min()}, {labels.max()}]")
    return data, labels.astype(np.int64)


def _cifar_dataset(paths: list[Path], name: str) -> ArrayDataset:
    parts = [_read_cifar_batch(p) for p in paths]
    data = np.concatenate([d for d, _ in parts])
    labels = np.concatenate([lab for _, lab in parts])
    # Each row is 1024 red, then 1024 green, then 1024 blue values, rows of 32 pixels.
    x = data.reshape(-1, 3, 32, 32).astype(np.float32) / np.float32(255.0)
    return ArrayDataset(x, labels, 10, name)


def load_cifar10_dir(root) -> tuple[ArrayDataset, ArrayDataset]:
    """CIFAR-10 (train, test) from the python batches: x [n, 3, 32, 32] float32 in [0, 1].

    Looks in `root` and `root/cifar-10-batches-py` for `data_batch_1`..`data_batch_5` and `test_batch`.
    """
    root = Path(root)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for d in (root, root / "cifar-10-batches-py"):
        if all((d / n).is_file() for n in names):
            paths = [d / n for n in names]
            return _cifar_dataset(paths[:5], "cifar10"), _cifar_dataset(paths[5:], "cifar10-test")
    raise FileNotFoundError(f"cifar10: expected {', '.join(names)} in {root} "
                            f"or {root / 'cifar-10-batches-py'}")


def _read_svhn(path: Path, name: str) -> ArrayDataset:
    import scipy.io

    from fedal.data.mat_v5 import check_numeric_mat_v5

    try:
        if scipy.io.matlab.matfile_version(path)[0] == 1:  # v5: scipy's reader crashes on a bad tag
            check_numeric_mat_v5(path)
        mat = scipy.io.loadmat(path)
    except Exception as e:  # scipy raises many types for a damaged file; all mean "corrupt"
        raise ValueError(f"{path}: not a readable SVHN .mat file ({type(e).__name__}: {e})") from e
    if "X" not in mat or "y" not in mat:
        raise ValueError(f"{path}: expected variables 'X' and 'y'")
    xs, ys = np.asarray(mat["X"]), np.asarray(mat["y"])
    if not (ys.ndim == 1 or (ys.ndim == 2 and ys.shape[1] == 1)) or np.iscomplexobj(ys):
        raise ValueError(f"{path}: 'y' must be real labels of shape [n] or [n, 1], got {ys.dtype} {list(ys.shape)}")
    ys = ys.reshape(-1)
    if xs.dtype != np.uint8 or xs.ndim != 4 or xs.shape[:3] != (32, 32, 3):
        raise ValueError(f"{path}: 'X' must be uint8 [32, 32, 3, n], got {xs.dtype} {xs.shape}")
    if xs.shape[3] != len(ys):
        raise ValueError(f"{path}: {xs.shape[3]} images but {len(ys)} labels")
    if not np.issubdtype(ys.dtype, np.number) or (len(ys) and (ys.min() < 1 or ys.max() > 10)) \
            or not np.all(ys == np.round(ys)):
        raise ValueError(f"{path}: labels must be integers in 1..10")
    y = ys.astype(np.int64)
    y[y == 10] = 0  # SVHN stores digit 0 as label 10
    # [H, W, C, n] -> [n, C, H, W], made C-contiguous before scaling
    x = np.ascontiguousarray(xs.transpose(3, 2, 0, 1), dtype=np.float32) / np.float32(255.0)
    return ArrayDataset(x, y, 10, name)


def load_svhn_dir(root) -> tuple[ArrayDataset, ArrayDataset]:
    """SVHN cropped digits (train, test) from `train_32x32.mat` and `test_32x32.mat` in `root`:
    x [n, 3, 32, 32] float32 in [0, 1], label 10 mapped to digit 0."""
    root = Path(root)
    paths = [root / "train_32x32.mat", root / "test_32x32.mat"]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"svhn: expected train_32x32.mat and test_32x32.mat in {root}; "
                                f"missing {', '.join(missing)}")
    return _read_svhn(paths[0], "svhn"), _read_svhn(paths[1], "svhn-test")
