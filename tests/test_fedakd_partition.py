"""FedAKD's partitions: POW sizes follow the power law, covariate shift moves each client
towards its own shifted mean, the PCA variant cuts contiguous blocks, and every client's
training data, local test split and the public set stay disjoint."""

from __future__ import annotations

import numpy as np
import pytest

from fedal.data import build_federated
from fedal.data.shift import (
    covariate_shift,
    covariate_shift_pca,
    first_principal_component,
    pow_sizes,
    pow_split,
    shift_directions,
    whitening,
)
from fedal.sim import ConfigError, load_config


def blobs(n=1200, d=12, seed=0):
    """Correlated Gaussian features with a constant column (Sigma is singular there)."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d, d))
    x = rng.normal(size=(n, d)) @ a + rng.normal(size=d)
    x[:, 3] = 1.5
    return x.astype(np.float32)


def assert_disjoint(parts, n):
    allidx = np.concatenate(parts)
    assert all(p.dtype == np.int64 and np.all(np.diff(p) > 0) for p in parts)  # sorted, no duplicates
    assert len(np.unique(allidx)) == len(allidx), "clients share samples"
    assert allidx.min() >= 0 and allidx.max() < n


def test_pow_sizes_follow_the_power_law():
    total, k = 4300, 10
    sizes = pow_sizes(total, k)
    h = sum(1 / j for j in range(1, k + 1))
    assert sizes.sum() == total and np.all(np.diff(sizes) <= 0)
    ideal = total / (np.arange(1, k + 1) * h)  # |D| / (k H_K)
    assert np.all(np.abs(sizes - ideal) <= 1.0)
    assert sizes[0] / sizes[9] == pytest.approx(10, rel=0.02)
    assert list(pow_sizes(11, 3)) == [6, 3, 2]  # 11 * (1, 1/2, 1/3) / (11/6)
    assert list(pow_sizes(13, 3)) == [8, 3, 2]  # floor(7.09, 3.55, 2.36) = 12; the one left goes to client 0
    assert list(pow_sizes(12, 3, exponent=0)) == [4, 4, 4]
    with pytest.raises(ValueError, match="smallest would get none"):
        pow_sizes(5, 10)


def test_pow_split_is_random_disjoint_and_sized():
    parts = pow_split(1000, 5, None, np.random.default_rng(0))  # half the pool: 500
    assert [len(p) for p in parts] == list(pow_sizes(500, 5))
    assert_disjoint(parts, 1000)
    again = pow_split(1000, 5, None, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    parts = pow_split(1000, 4, 100, np.random.default_rng(1))  # 4 x 100 in all, power-law shares
    assert sum(len(p) for p in parts) == 400 and len(parts[0]) == 192
    with pytest.raises(ValueError, match="available"):
        pow_split(100, 4, 30, np.random.default_rng(0))


@pytest.mark.parametrize("sizes", ["equal", "pow"])
def test_covariate_shift_moves_each_client_towards_its_own_shifted_mean(sizes):
    x = blobs()
    c, k = 5.0, 6
    parts = covariate_shift(x, k, c, None, np.random.default_rng(3), sizes=sizes)
    assert_disjoint(parts, len(x))
    want = pow_sizes(600, k) if sizes == "pow" else np.full(k, 100)
    assert [len(p) for p in parts] == list(want)
    # the same generator gives the shifts: delta_k^T Sigma^+ delta_k = C, so |z_k|^2 = C in whitened space
    mean, proj = whitening(x)
    u = (x.astype(np.float64) - mean) @ proj
    z = shift_directions(proj, k, c, np.random.default_rng(3))
    np.testing.assert_allclose((z ** 2).sum(axis=1), c)
    along = np.array([[float((u[p] @ z[j]).mean()) for j in range(k)] for p in parts])  # client x shift direction
    for i in range(k):
        assert along[i, i] > 1.0, along  # the pool's mean along any direction is 0
        assert along[i, i] > np.delete(along[i], i).max() + 0.5, along
    # deterministic for a seed, different for another
    again = covariate_shift(x, k, c, None, np.random.default_rng(3), sizes=sizes)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = covariate_shift(x, k, c, None, np.random.default_rng(4), sizes=sizes)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_the_partition_does_not_depend_on_the_signs_eigh_gives_the_axes(monkeypatch):
    """Another machine's LAPACK may return eigenvectors of other signs: the same seed must give
    the same clients there (a Ray actor rebuilds its clients' partitions itself)."""
    import fedal.data.shift as shift

    x = blobs()
    before = covariate_shift(x, 5, 5.0, None, np.random.default_rng(3))
    eigh = np.linalg.eigh

    def flipped(cov):
        val, vec = eigh(cov)
        return val, vec * np.where(np.arange(vec.shape[1]) % 2, -1.0, 1.0)  # every other axis reversed

    monkeypatch.setattr(shift.np.linalg, "eigh", flipped)
    after = covariate_shift(x, 5, 5.0, None, np.random.default_rng(3))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_larger_c_shifts_further():
    x = blobs(n=2000, d=8, seed=1)
    mean, proj = whitening(x)
    u = (x.astype(np.float64) - mean) @ proj

    def mean_shift(c):
        parts = covariate_shift(x, 4, c, None, np.random.default_rng(0))
        z = shift_directions(proj, 4, 1.0, np.random.default_rng(0))
        return np.mean([float((u[p] @ z[i]).mean()) for i, p in enumerate(parts)])

    assert mean_shift(10.0) > mean_shift(2.0) + 0.3


def test_pca_variant_cuts_contiguous_blocks_of_the_first_component():
    x = blobs(n=1000)
    pc1 = first_principal_component(x)
    parts = covariate_shift_pca(x, 4, None, sizes="pow")
    assert_disjoint(parts, len(x))
    assert [len(p) for p in parts] == list(pow_sizes(500, 4))
    for lo, hi in zip(parts, parts[1:]):
        assert pc1[lo].max() <= pc1[hi].min()  # client 0 lowest, blocks in order
    assert np.array_equal(np.sort(np.concatenate(parts)), np.sort(np.argsort(pc1, kind="stable")[:500]))  # the lowest half
    equal = covariate_shift_pca(x, 4, 50, sizes="equal")
    assert [len(p) for p in equal] == [50] * 4
    # the component is the direction of largest variance, with a fixed sign
    flat = x.astype(np.float64) - x.mean(axis=0)
    assert np.var(pc1, ddof=1) == pytest.approx(np.linalg.eigvalsh(np.cov(flat, rowvar=False)).max(), rel=1e-6)
    np.testing.assert_array_equal(first_principal_component(x), pc1)


@pytest.mark.parametrize("partition", ["pow", "covariate-shift", "covariate-shift-pow", "covariate-shift-pca",
                                       "covariate-shift-pca-pow"])
def test_build_federated_keeps_train_local_test_and_public_apart(partition):
    data = build_federated("digits", num_clients=4, partition=partition, public_size=100, seed=2,
                           local_test_fraction=0.25, shift_c=2.0)
    public = set(data.public_indices.tolist())
    seen = set()
    for train_idx, test_idx, train, test in zip(data.client_indices, data.client_test_indices, data.clients,
                                                data.client_tests):
        tr, te = set(train_idx.tolist()), set(test_idx.tolist())
        assert tr and te and not tr & te, "a client's local test split overlaps its training data"
        assert not (tr | te) & public and not (tr | te) & seen, "clients or the public set share samples"
        seen |= tr | te
        assert len(te) == round(0.25 * (len(tr) + len(te)))  # drawn from the client's own share
        assert len(train) == len(tr) and len(test) == len(te)
    assert len(seen) == (1437 - 100) // 2  # half the pool, as Algorithm 2 and the published code use
    if partition.endswith("pow") or partition == "pow":
        shares = [len(a) + len(b) for a, b in zip(data.client_indices, data.client_test_indices)]
        assert shares == list(pow_sizes(len(seen), 4))


def test_covariate_shift_depends_on_c_and_run_config_names_the_partitions():
    a = build_federated("digits", num_clients=3, partition="covariate-shift", public_size=50, seed=0, shift_c=2.0)
    b = build_federated("digits", num_clients=3, partition="covariate-shift", public_size=50, seed=0, shift_c=10.0)
    assert not all(np.array_equal(p, q) for p, q in zip(a.client_indices, b.client_indices))
    cfg = load_config(None, dict(partition="covariate-shift-pca-pow", shift_c=10.0))
    assert cfg.partition == "covariate-shift-pca-pow" and cfg.shift_c == 10.0
    with pytest.raises(ConfigError, match="shift_c"):
        load_config(None, dict(partition="covariate-shift", shift_c=0))
    with pytest.raises(ConfigError, match="covariate-shift-pca"):  # the message lists the valid choices
        load_config(None, dict(partition="covariate"))
    with pytest.raises(ValueError, match="shift C must be positive"):
        covariate_shift(blobs(), 3, -1.0, None, np.random.default_rng(0))
