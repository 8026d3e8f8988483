"""build_federated: public set held out and unlabeled, clients disjoint, deterministic, clear errors."""

import gzip
import hashlib
import struct

import numpy as np
import pytest

from fedal.data import DATASETS, FederatedData, build_federated, content_hash, load_dataset, split_public
from fedal.data.arrays import ArrayDataset


@pytest.fixture(scope="module")
def mnist1d_dir(tmp_path_factory):
    """One generated MNIST-1D (about 5 s) shared by this module's tests."""
    d = tmp_path_factory.mktemp("mnist1d-cache")
    load_dataset("mnist1d", d)
    return d


def rows(x: np.ndarray) -> set[bytes]:
    return {r.tobytes() for r in x.reshape(len(x), -1)}


def test_mnist1d_public_disjoint_from_clients(mnist1d_dir):
    fd = build_federated("mnist1d", 10, alpha=0.5, samples_per_client=700, public_size=1000,
                         seed=3, data_dir=mnist1d_dir)
    train, test = load_dataset("mnist1d", mnist1d_dir)
    assert isinstance(fd, FederatedData)
    assert len(rows(train.x)) == len(train)  # rows are unique, so row identity is meaningful
    assert fd.public_x.shape == (1000, 40) and fd.public_x.dtype == np.float32
    assert fd.input_shape == (40,) and fd.num_classes == 10
    assert [len(c) for c in fd.clients] == [700] * 10
    public_rows = rows(fd.public_x)
    seen = set(public_rows)
    for c in fd.clients:
        crow = rows(c.x)
        assert not crow & seen, "a public row (or another client's row) is in a client's data"
        seen |= crow
    # indices map back to the training split
    assert np.array_equal(fd.public_x, train.x[fd.public_indices])
    for c, idx in zip(fd.clients, fd.client_indices):
        assert np.array_equal(c.x, train.x[idx]) and np.array_equal(c.y, train.y[idx])
    assert not rows(test.x) & seen  # test split separate
    assert np.array_equal(fd.test.x, test.x)
    # labels are dropped: the public set is bare inputs
    assert isinstance(fd.public_x, np.ndarray) and not hasattr(fd, "public_y")
    assert fd.partition_stats.shape == (10, 10)
    assert fd.partition_stats.tolist() == [np.bincount(c.y, minlength=10).tolist()
                                           for c in fd.clients]


def test_mnist1d_deterministic_and_hash(mnist1d_dir):
    kw = dict(num_clients=5, alpha=1.0, samples_per_client=300, public_size=500, data_dir=mnist1d_dir)
    a = build_federated("mnist1d", seed=1, **kw)
    b = build_federated("mnist1d", seed=1, **kw)
    assert a.public_hash == b.public_hash == content_hash(a.public_x)
    assert np.array_equal(a.public_x, b.public_x)
    assert all(np.array_equal(x.x, y.x) and np.array_equal(x.y, y.y)
               for x, y in zip(a.clients, b.clients))
    c = build_federated("mnist1d", seed=2, **kw)
    assert c.public_hash != a.public_hash
    # the public set depends on dataset, size and seed only, not on the partition settings
    d = build_federated("mnist1d", seed=1, **(kw | dict(alpha=0.1, num_clients=3)))
    assert d.public_hash == a.public_hash
    assert not np.array_equal(d.partition_stats[:3], a.partition_stats[:3])


def test_content_hash():
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    h = content_hash(x)
    assert len(h) == 64 and h == content_hash(x.copy()) == content_hash(np.asfortranarray(x))
    # pinned: the same content must give the same hash in every run and on every machine
    assert h == "f338246dc2cf3b39fd360dcede1e85d939ebbdb26dcd08b12b4926b75a1daf28"
    assert h == hashlib.sha256(b"<f4|(6, 4)|" + x.tobytes()).hexdigest()  # dtype, shape, bytes
    assert content_hash(x.astype(">f4")) == h  # byte order normalised
    y = x.copy()
    y[3, 2] += 1e-3
    assert content_hash(y) != h
    assert content_hash(x.reshape(4, 6)) != h
    assert content_hash(x.astype(np.float64)) != h


def test_split_public():
    x = np.arange(50, dtype=np.float32).reshape(25, 2)
    ds = ArrayDataset(x, np.arange(25) % 3, 3, "t")
    pub, rest = split_public(ds, 10, np.random.default_rng(0))
    assert pub.shape == (10, 2) and rest.dtype == np.int64 and len(rest) == 15
    assert not rows(pub) & rows(x[rest])
    assert rows(pub) | rows(x[rest]) == rows(x)
    with pytest.raises(ValueError):
        split_public(ds, 26, np.random.default_rng(0))


@pytest.mark.parametrize("partition", ["dirichlet-client", "dirichlet-class", "iid"])
def test_digits_partitions(partition):
    fd = build_federated("digits", 4, partition=partition, alpha=0.5, public_size=200, seed=0)
    train, _ = load_dataset("digits")
    sizes = [len(c) for c in fd.clients]
    pool = len(train) - 200
    if partition == "dirichlet-class":
        assert sum(sizes) == pool and min(sizes) >= 1
    else:
        assert sizes == [pool // 4] * 4
    idx = np.concatenate([fd.public_indices, *fd.client_indices])
    assert len(np.unique(idx)) == len(idx)
    assert fd.input_shape == (1, 8, 8) and fd.public_x.shape == (200, 1, 8, 8)
    assert fd.partition_stats.sum() == sum(sizes)


def test_dirichlet_class_with_samples_per_client():
    fd = build_federated("digits", 4, partition="dirichlet-class", alpha=0.5,
                         samples_per_client=100, public_size=200, seed=0)
    assert sum(len(c) for c in fd.clients) == 400


def test_bad_names_and_requests():
    with pytest.raises(ValueError, match="mnist1d, digits, mnist, fashion-mnist, cifar10, svhn, cinic10, celeba"):
        build_federated("imagenet", 3)
    with pytest.raises(ValueError, match="dirichlet-client, dirichlet-class, iid"):
        build_federated("digits", 3, partition="pathological")
    for name in ("mnist", "fashion-mnist", "cifar10", "svhn", "cinic10", "celeba"):
        with pytest.raises(ValueError, match="data_dir"):
            build_federated(name, 3)
    with pytest.raises(ValueError, match="available"):
        build_federated("digits", 3, samples_per_client=1000, public_size=100)
    with pytest.raises(ValueError, match="public_size"):
        build_federated("digits", 3, public_size=10_000)
    assert DATASETS == ("mnist1d", "digits", "mnist", "fashion-mnist", "cifar10", "svhn", "cinic10", "celeba")


def test_file_dataset_through_build(tmp_path):
    with pytest.raises(FileNotFoundError):
        build_federated("mnist", 2, data_dir=tmp_path)
    rng = np.random.default_rng(0)
    for prefix, n in [("train", 60), ("t10k", 10)]:
        imgs = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labs = (np.arange(n) % 10).astype(np.uint8)
        (tmp_path / f"{prefix}-images-idx3-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">iiii", 2051, n, 28, 28) + imgs.tobytes()))
        (tmp_path / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(struct.pack(">ii", 2049, n) + labs.tobytes()))
    fd = build_federated("mnist", 2, partition="iid", public_size=20, data_dir=tmp_path)
    assert [len(c) for c in fd.clients] == [20, 20] and fd.public_x.shape == (20, 1, 28, 28)
    assert len(fd.test) == 10


def test_local_test_splits_come_from_each_clients_share_and_never_overlap():
    base = build_federated("digits", 4, partition="dirichlet-client", alpha=0.3, samples_per_client=120,
                           public_size=100, seed=5)
    fd = build_federated("digits", 4, partition="dirichlet-client", alpha=0.3, samples_per_client=120,
                         public_size=100, seed=5, local_test_fraction=0.25)
    assert fd.public_hash == base.public_hash  # the option touches neither P nor the partition
    for n in range(4):
        train_idx, test_idx = fd.client_indices[n], fd.client_test_indices[n]
        assert len(test_idx) == 30 and len(train_idx) == 90
        assert not set(train_idx) & set(test_idx)
        assert sorted(set(train_idx) | set(test_idx)) == sorted(base.client_indices[n])
        # the local test split follows the client's own (skewed) label distribution
        assert set(fd.client_tests[n].y) <= set(base.clients[n].y)
        assert np.array_equal(fd.client_tests[n].y, load_dataset("digits")[0].y[test_idx])
    again = build_federated("digits", 4, partition="dirichlet-client", alpha=0.3, samples_per_client=120,
                            public_size=100, seed=5, local_test_fraction=0.25)
    assert all(np.array_equal(a, b) for a, b in zip(fd.client_test_indices, again.client_test_indices))
    # fraction 0: no local tests and exactly the training data of a run without the option
    assert all(len(t) == 0 for t in base.client_tests)
    assert all(np.array_equal(a.x, b.x) for a, b in zip(base.clients,
               build_federated("digits", 4, partition="dirichlet-client", alpha=0.3, samples_per_client=120,
                               public_size=100, seed=5, local_test_fraction=0.0).clients))
    with pytest.raises(ValueError, match="local_test_fraction"):
        build_federated("digits", 4, samples_per_client=10, public_size=100, local_test_fraction=1.0)
