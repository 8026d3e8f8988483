"""Loaders read the official file formats (written here in miniature) and the embedded datasets."""

import contextlib
import gzip
import io
import pickle
import random
import struct
import subprocess
import sys
import tracemalloc
import zipfile

import numpy as np
import pytest

from fedal.data import embedded
from fedal.data.arrays import ArrayDataset
from fedal.data.embedded import load_digits, load_mnist1d
from fedal.data.files import load_cifar10_dir, load_idx, load_mnist_dir, load_svhn_dir

# ---------------------------------------------------------------- ArrayDataset

def test_array_dataset_validates_and_subsets():
    x = np.zeros((4, 3), np.float32)
    y = np.array([0, 1, 2, 1], np.int64)
    ds = ArrayDataset(x, y, 3, "t")
    assert len(ds) == 4 and ds.input_shape == (3,)
    sub = ds.subset([3, 1])
    assert sub.y.tolist() == [1, 1] and sub.name == "t"
    assert len(ds.subset([])) == 0
    for bad in [dict(x=x.astype(np.float64)), dict(y=y.astype(np.int32)), dict(y=y[:3]),
                dict(y=np.array([0, 1, 3, 1])), dict(num_classes=0), dict(x=np.zeros(4, np.float32))]:
        kw = dict(x=x, y=y, num_classes=3, name="t") | bad
        with pytest.raises(ValueError):
            ArrayDataset(**kw)


# ---------------------------------------------------------------- IDX (MNIST / Fashion-MNIST)

def idx_images(imgs: np.ndarray) -> bytes:
    n, r, c = imgs.shape
    return struct.pack(">iiii", 2051, n, r, c) + imgs.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">ii", 2049, len(labels)) + labels.astype(np.uint8).tobytes()


def write(path, data: bytes, gz: bool):
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.fixture
def mnist_arrays():
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, size=(5, 28, 28)), np.array([3, 0, 9, 1, 7])


@pytest.mark.parametrize("gz", [False, True])
def test_load_idx(tmp_path, mnist_arrays, gz):
    imgs, labs = mnist_arrays
    sfx = ".gz" if gz else ""
    ip = write(tmp_path / f"i{sfx}", idx_images(imgs), gz)
    lp = write(tmp_path / f"l{sfx}", idx_labels(labs), gz)
    ds = load_idx(ip, lp, "mnist")
    assert ds.x.shape == (5, 1, 28, 28) and ds.x.dtype == np.float32 and ds.y.dtype == np.int64
    assert 0.0 <= ds.x.min() and ds.x.max() <= 1.0
    np.testing.assert_allclose(ds.x[:, 0] * 255, imgs, atol=1e-4)
    assert ds.y.tolist() == labs.tolist()


@pytest.mark.parametrize("corrupt", ["magic", "truncated", "count_mismatch", "bad_gzip"])
def test_load_idx_corrupt(tmp_path, mnist_arrays, corrupt):
    imgs, labs = mnist_arrays
    img_bytes, lab_bytes = idx_images(imgs), idx_labels(labs)
    if corrupt == "magic":
        img_bytes = struct.pack(">i", 2049) + img_bytes[4:]
    elif corrupt == "truncated":
        img_bytes = img_bytes[:-10]
    elif corrupt == "count_mismatch":
        lab_bytes = idx_labels(labs[:4])
    ip = write(tmp_path / "i", img_bytes, False)
    if corrupt == "bad_gzip":
        ip.write_bytes(gzip.compress(img_bytes)[:-20])
    lp = write(tmp_path / "l", lab_bytes, False)
    with pytest.raises(ValueError):
        load_idx(ip, lp, "mnist")


def test_load_mnist_dir(tmp_path, mnist_arrays):
    imgs, labs = mnist_arrays
    raw = tmp_path / "FashionMNIST" / "raw"  # torchvision's layout, mixing gz and raw files
    raw.mkdir(parents=True)
    write(raw / "train-images-idx3-ubyte.gz", idx_images(imgs), True)
    write(raw / "train-labels-idx1-ubyte.gz", idx_labels(labs), True)
    write(raw / "t10k-images-idx3-ubyte", idx_images(imgs[:2]), False)
    write(raw / "t10k-labels-idx1-ubyte", idx_labels(labs[:2]), False)
    train, test = load_mnist_dir(tmp_path, kind="fashion")
    assert len(train) == 5 and len(test) == 2 and train.name == "fashion-mnist"
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        load_mnist_dir(tmp_path, kind="mnist")
    with pytest.raises(ValueError):
        load_mnist_dir(tmp_path, kind="emnist")


def test_mnist_images_must_be_28x28(tmp_path, mnist_arrays):
    """Another image size is no MNIST: refused up front, not trained on (or failed at the first
    evaluation for a test set of another size than the training set)."""
    imgs, labs = mnist_arrays
    write(tmp_path / "train-images-idx3-ubyte", idx_images(imgs), False)
    write(tmp_path / "train-labels-idx1-ubyte", idx_labels(labs), False)
    write(tmp_path / "t10k-images-idx3-ubyte", idx_images(imgs[:2, :14, :14]), False)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_labels(labs[:2]), False)
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte holds 14x14 images, mnist-test images are 28x28"):
        load_mnist_dir(tmp_path)
    with pytest.raises(ValueError, match=r"holds 0x0 images"):  # any IDX pair: images of no pixel
        load_idx(write(tmp_path / "i", struct.pack(">iiii", 2051, 3, 0, 0), False),
                 write(tmp_path / "l", idx_labels(labs[:3]), False), "mine")


def test_idx_dimensions_whose_product_overflows_int64_are_refused_by_size(tmp_path, mnist_arrays):
    ip = write(tmp_path / "i", struct.pack(">iiii", 2051, 2**30, 2**30, 16), False)  # 2**64 bytes: 0 in int64
    lp = write(tmp_path / "l", struct.pack(">ii", 2049, 2**30), False)
    with pytest.raises(ValueError, match=r"promises 18446744073709551616 bytes of data, more than"):
        load_idx(ip, lp, "mnist")


def test_a_gzip_idx_is_read_no_further_than_its_header_promises(tmp_path, mnist_arrays):
    """A small .gz that inflates far beyond what its header promises is refused after at most
    one byte past the promise: memory bounded by the header, not by the file's expansion."""
    imgs, labs = mnist_arrays
    path = tmp_path / "i.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(idx_images(imgs))
        for _ in range(8):
            f.write(bytes(16 << 20))  # 128 MiB of zeros: about 130 KB compressed
    assert path.stat().st_size < 1 << 20


    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="promises 3920 bytes of data, file has more than that"):
            load_idx(path, write(tmp_path / "l", idx_labels(labs), False), "mnist")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


# ---------------------------------------------------------------- CIFAR-10 python batches

class Py2Pickler(pickle._Pickler):
    """Writes str and bytes as Python 2's cPickle wrote its 8-bit str (the official batches)."""

    def save_bytes(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    def save_str(self, obj):
        self.save_bytes(obj.encode("latin1"))

    dispatch = dict(pickle._Pickler.dispatch)
    dispatch[bytes] = save_bytes
    dispatch[str] = save_str


def dumps(obj, protocol) -> bytes:
    if protocol != "py2":
        return pickle.dumps(obj, protocol=protocol)
    buf = io.BytesIO()
    Py2Pickler(buf, protocol=2).dump({k.decode(): v for k, v in obj.items()})  # py2 str keys
    # numpy < 2 (which wrote the real files) named its module numpy.core
    return buf.getvalue().replace(b"numpy._core.", b"numpy.core.")


def write_cifar(root, n_train=4, n_test=3, protocol="py2"):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    batches = {}
    for name, n in [(f"data_batch_{i}", n_train) for i in range(1, 6)] + [("test_batch", n_test)]:
        batch = {b"batch_label": name.encode(), b"labels": rng.integers(0, 10, n).tolist(),
                 b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
                 b"filenames": [b"x.png"] * n}
        (root / name).write_bytes(dumps(batch, protocol))
        batches[name] = batch
    return batches


@pytest.mark.parametrize("protocol", ["py2", 2, 4, 5])
def test_load_cifar10_dir(tmp_path, protocol):
    batches = write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    train, test = load_cifar10_dir(tmp_path)
    assert train.x.shape == (20, 3, 32, 32) and test.x.shape == (3, 3, 32, 32)
    assert train.x.dtype == np.float32 and 0 <= train.x.min() and train.x.max() <= 1
    first = batches["data_batch_1"]
    # channel-first layout: the first 1024 values are the red plane, row by row
    np.testing.assert_allclose(train.x[0, 0].reshape(-1) * 255, first[b"data"][0, :1024], atol=1e-4)
    np.testing.assert_allclose(train.x[0, 2, 31, 31] * 255, first[b"data"][0, -1], atol=1e-4)
    assert train.y[:4].tolist() == first[b"labels"]
    assert test.y.tolist() == batches["test_batch"][b"labels"]


def test_load_cifar10_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        load_cifar10_dir(tmp_path)
    write_cifar(tmp_path)
    (tmp_path / "data_batch_3").write_bytes(b"\x80\x02garbage")
    with pytest.raises(ValueError):
        load_cifar10_dir(tmp_path)
    # a well-formed pickle that would call something other than numpy is refused
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps({b"data": random.Random}, protocol=2))
    with pytest.raises(ValueError, match="refusing"):
        load_cifar10_dir(tmp_path)
    bad = {b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(ValueError, match="3072"):
        load_cifar10_dir(tmp_path)
    ragged = {b"data": np.zeros((10, 3072), np.uint8), b"labels": [[1, 2], [3]] + [1] * 8}
    (tmp_path / "data_batch_3").write_bytes(pickle.dumps(ragged, protocol=2))
    with pytest.raises(ValueError, match=r"data_batch_3: b'data' and b'labels' must be arrays"):
        load_cifar10_dir(tmp_path)


def test_a_cifar_batch_with_an_impossible_length_field_is_one_error(tmp_path):
    """A bytes object whose length field says 2**62 bytes (the unpickler asks for them before
    reading: MemoryError) is a damaged file, said in one line, not a traceback."""
    write_cifar(tmp_path)
    good = pickle.dumps({b"data": np.full((1, 3072), 7, np.uint8), b"labels": [1]}, protocol=3)
    at = good.index(bytes([7]) * 3072) - 5  # BINBYTES, its 4-byte length, the array's bytes
    assert good[at:at + 1] == pickle.BINBYTES and struct.unpack("<I", good[at + 1:at + 5])[0] == 3072
    damaged = good[:at] + pickle.BINBYTES8 + struct.pack("<Q", 2**62) + good[at + 5:]
    (tmp_path / "data_batch_3").write_bytes(damaged)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"data_batch_3: not a readable CIFAR-10 batch \("):
            load_cifar10_dir(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # the five good batches, never what the length field claims


def test_damaged_cifar_batches_are_refused_without_crashing_or_filling_memory(tmp_path):
    """numpy's own dtype and array __setstate__ crashed the process on some damaged states (one
    changed byte: a segfault); the C unpickler allocated a memo of what a 9-byte file claimed
    (gigabytes); other damage escaped as LookupError or SystemError tracebacks."""
    write_cifar(tmp_path)
    target = tmp_path / "data_batch_2"
    good = pickle.dumps({b"labels": [1, 2], b"data": np.zeros((2, 3072), np.uint8)}, protocol=4)
    segfaulted = bytearray(good)
    segfaulted[good.index(b"N", good.index(b"dtype"))] = 77  # the dtype state's None: BININT2
    cases = {
        "dtype state": bytes(segfaulted),
        "huge memo index": b"\x80\x02}r" + struct.pack("<I", 100_000_000) + b".",
        "unknown codec": pickle.dumps({b"labels": [1], b"data": np.zeros((1, 3072), np.uint8)},
                                      protocol=2).replace(b"latin1", b"latin0", 1),
        "short array data": good.replace(b"\x00" * 6144, b"\x00" * 6000, 1),
    }
    tracemalloc.start()
    try:
        for what, payload in cases.items():
            target.write_bytes(payload)
            with pytest.raises(ValueError, match="data_batch_2: "):
                load_cifar10_dir(tmp_path)
            assert tracemalloc.get_traced_memory()[1] < 64 << 20, what
    finally:
        tracemalloc.stop()
    rng = np.random.default_rng(7)  # and any one or two bytes changed: a batch or a ValueError
    for _ in range(300):
        damaged = bytearray(good)
        for at in rng.integers(0, len(damaged), rng.integers(1, 3)):
            damaged[at] = int(rng.integers(0, 256))
        target.write_bytes(bytes(damaged))
        with contextlib.suppress(ValueError):  # a batch, or its one error: never a crash or another error
            load_cifar10_dir(tmp_path)


# ---------------------------------------------------------------- SVHN .mat

def write_svhn(path, n, labels=None):
    import scipy.io
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(32, 32, 3, n), dtype=np.uint8)
    y = (np.arange(n) % 10 + 1 if labels is None else np.asarray(labels)).reshape(n, 1).astype(np.uint8)
    scipy.io.savemat(path, {"X": x, "y": y})
    return x, y


def test_load_svhn_dir(tmp_path):
    x, y = write_svhn(tmp_path / "train_32x32.mat", 12)
    write_svhn(tmp_path / "test_32x32.mat", 5)
    train, test = load_svhn_dir(tmp_path)
    assert train.x.shape == (12, 3, 32, 32) and test.x.shape == (5, 3, 32, 32)
    assert train.x.dtype == np.float32 and train.x.flags.c_contiguous
    assert 0 <= train.x.min() and train.x.max() <= 1
    np.testing.assert_allclose(train.x[4, 1, 7, 3] * 255, x[7, 3, 1, 4], atol=1e-4)  # [H,W,C,n]
    assert train.y.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]  # label 10 means digit 0


def test_load_svhn_errors(tmp_path):
    write_svhn(tmp_path / "train_32x32.mat", 3)
    with pytest.raises(FileNotFoundError, match="test_32x32.mat"):
        load_svhn_dir(tmp_path)
    (tmp_path / "test_32x32.mat").write_bytes(b"MATLAB 5.0 nonsense" * 3)
    with pytest.raises(ValueError):
        load_svhn_dir(tmp_path)
    write_svhn(tmp_path / "test_32x32.mat", 3, labels=[1, 11, 2])
    with pytest.raises(ValueError, match="1..10"):
        load_svhn_dir(tmp_path)
    import scipy.io

    x = np.zeros((32, 32, 3, 12), np.uint8)
    for y in (np.ones((6, 2), np.uint8), np.full((12, 1), 1 + 1j)):  # 12 labels as a matrix; complex
        scipy.io.savemat(tmp_path / "test_32x32.mat", {"X": x, "y": y})
        with pytest.raises(ValueError, match=r"'y' must be real labels of shape \[n\] or \[n, 1\]"):
            load_svhn_dir(tmp_path)


# ---------------------------------------------------------------- embedded

def test_mnist1d_generates_caches_and_reloads(tmp_path, monkeypatch):
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    train, test = load_mnist1d(num_samples=600, seed=7, cache_dir=tmp_path)
    assert np.array_equal(np.random.get_state()[1], before), "caller's global RNG was reseeded"
    assert train.x.shape == (480, 40) and test.x.shape == (120, 40)
    assert train.x.dtype == np.float32 and train.y.dtype == np.int64 and train.num_classes == 10
    cached = list(tmp_path.glob("mnist1d-*.npz"))
    assert len(cached) == 1 and not list(tmp_path.glob("*.tmp"))

    def no_generation(args):
        raise AssertionError("should have read the cache")
    monkeypatch.setattr(embedded, "_generate_mnist1d", no_generation)
    train2, test2 = load_mnist1d(num_samples=600, seed=7, cache_dir=tmp_path)
    assert np.array_equal(train.x, train2.x) and np.array_equal(test.y, test2.y)
    with pytest.raises(AssertionError, match="cache"):  # other args -> other file
        load_mnist1d(num_samples=600, seed=8, cache_dir=tmp_path)


def test_mnist1d_corrupt_cache_is_regenerated(tmp_path):
    train, _ = load_mnist1d(num_samples=100, seed=1, cache_dir=tmp_path)
    (path,) = tmp_path.glob("mnist1d-*.npz")
    good = path.read_bytes()
    central = good.index(b"PK\x01\x02")
    for damaged in (b"not a zip", good[: len(good) // 2],
                    good[:central + 6] + b"Z" + good[central + 7:],  # zip "version 9.0": NotImplementedError
                    good[:central + 8] + b"\x01" + good[central + 9:]):  # "encrypted": RuntimeError
        path.write_bytes(damaged)
        again, _ = load_mnist1d(num_samples=100, seed=1, cache_dir=tmp_path)
        assert np.array_equal(train.x, again.x)
        with np.load(path) as z:  # rewritten with the regenerated arrays
            assert np.array_equal(z["x"], train.x)


def test_a_cache_whose_array_header_claims_an_absurd_shape_is_made_again(tmp_path):
    """numpy allocates what a .npy header says before reading a byte: a MemoryError, every run,
    until the user found and removed the file."""
    train, _ = load_mnist1d(num_samples=100, seed=1, cache_dir=tmp_path)
    (path,) = tmp_path.glob("mnist1d-*.npz")
    with zipfile.ZipFile(path) as z:
        members = {name: z.read(name) for name in z.namelist()}
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False,
                                                "shape": (train.x.shape[0], 40_000_000_000_000)})
    members["x.npy"] = head.getvalue() + train.x.tobytes()  # (a valid zip: its CRC is the new bytes')
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    again, _ = load_mnist1d(num_samples=100, seed=1, cache_dir=tmp_path)
    assert np.array_equal(train.x, again.x)
    with np.load(path) as z:
        assert np.array_equal(z["x"], train.x)


def test_an_idx_header_promising_more_than_a_dataset_holds_is_refused_before_inflating(tmp_path, mnist_arrays):
    """A small gzip file can inflate to anything: what its header promises is checked first (the
    size, and the image size a dataset needs), so nothing is inflated for a header that cannot be."""
    _, labs = mnist_arrays
    lp = write(tmp_path / "l", idx_labels(labs[:3]), False)
    bomb = gzip.compress(struct.pack(">iiii", 2051, 2**31 - 1, 28, 28) + bytes(64 << 20))  # 64 MiB of zeros
    assert len(bomb) < 1 << 20
    with pytest.raises(ValueError, match=r"more than the 4294967296 an IDX file may hold"):
        load_idx(write(tmp_path / "i.gz", bomb, False), lp, "mine", image_shape=(28, 28))
    many = gzip.compress(struct.pack(">ii", 2049, 2**31 - 1) + bytes(64 << 20))  # labels: as many as the images
    ip = write(tmp_path / "three", idx_images(np.zeros((3, 28, 28), np.uint8)), False)
    with pytest.raises(ValueError, match=r"has 3 images but .* has 2147483647 labels"):
        load_idx(ip, write(tmp_path / "l.gz", many, False), "mine", image_shape=(28, 28))
    wrong = gzip.compress(struct.pack(">iiii", 2051, 80_000, 29, 28) + bytes(64 << 20))
    with pytest.raises(ValueError, match=r"holds 29x28 images, mine images are 28x28"):
        load_idx(write(tmp_path / "w.gz", wrong, False), lp, "mine", image_shape=(28, 28))


def test_mnist1d_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDAL_CACHE_DIR", str(tmp_path / "c"))
    load_mnist1d(num_samples=100, seed=1)
    assert len(list((tmp_path / "c").glob("mnist1d-*.npz"))) == 1


def test_a_cached_dataset_loads_without_importing_its_package(tmp_path):
    """A fresh process that finds MNIST-1D and digits in the cache never imports mnist1d (which
    imports matplotlib and scipy) or scikit-learn: a second or more at every start otherwise.
    The arrays are the ones the first process made (and not the other way round)."""
    script = (
        "import sys, numpy as np\n"
        "from fedal.data.embedded import load_digits, load_mnist1d\n"
        f"cache = {str(tmp_path / 'c')!r}\n"
        "(tr, te), (dtr, dte) = load_mnist1d(num_samples=200, seed=5, cache_dir=cache), load_digits(cache_dir=cache)\n"
        "np.savez(sys.argv[1], x=tr.x, y=te.y, dx=dtr.x, dy=dte.y)\n"
        "print(sorted(m for m in ('mnist1d', 'sklearn', 'scipy', 'matplotlib') if m in sys.modules))\n"
    )
    first = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a.npz")], capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    assert "mnist1d" in first.stdout and "sklearn" in first.stdout  # made: both packages were needed
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "c").glob("*.npz")) == ["digits", "mnist1d"]
    second = subprocess.run([sys.executable, "-c", script, str(tmp_path / "b.npz")], capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "[]"
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        assert all(np.array_equal(a[k], b[k]) for k in ("x", "y", "dx", "dy"))


def test_digits_cache_is_keyed_by_its_split(tmp_path):
    train, test = load_digits(cache_dir=tmp_path)
    other, _ = load_digits(test_fraction=0.3, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("digits-*.npz"))) == 2 and len(other) < len(train)
    again, _ = load_digits(cache_dir=tmp_path)
    assert np.array_equal(again.x, train.x) and np.array_equal(again.y, train.y)


def test_digits():
    train, test = load_digits()
    assert train.x.shape[1:] == (1, 8, 8) and len(train) + len(test) == 1797
    assert abs(len(test) - 0.2 * 1797) < 2
    assert train.x.dtype == np.float32 and train.x.min() == 0.0 and train.x.max() == 1.0
    assert np.array_equal(np.bincount(test.y) > 30, np.ones(10, bool))  # stratified
    again, _ = load_digits()
    assert np.array_equal(train.x, again.x)


def test_an_empty_test_split_is_refused_when_the_data_is_loaded(tmp_path, mnist_arrays):
    """Well-formed files with no test images loaded fine: a run trained, wrote results with no
    accuracy at all and then crashed on the missing `mean_acc`."""
    from fedal.data.federated import load_dataset

    imgs, labs = mnist_arrays
    write(tmp_path / "train-images-idx3-ubyte", idx_images(imgs), False)
    write(tmp_path / "train-labels-idx1-ubyte", idx_labels(labs), False)
    write(tmp_path / "t10k-images-idx3-ubyte", idx_images(imgs[:0]), False)
    write(tmp_path / "t10k-labels-idx1-ubyte", idx_labels(labs[:0]), False)
    with pytest.raises(ValueError, match=f"mnist: its test split is empty \\(in {tmp_path}\\)"):
        load_dataset("mnist", tmp_path)
    out = subprocess.run([sys.executable, "-m", "fedal_cli.main", "simulate", "--dataset", "mnist", "--data-dir",
                          str(tmp_path), "--clients", "2", "--rounds", "1", "--public-size", "2", "--models", "mlp",
                          "--out", str(tmp_path / "r.json"), "--quiet"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "its test split is empty" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "r.json").exists()
