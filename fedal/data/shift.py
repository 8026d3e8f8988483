"""FedAKD's partitions: power-law sizes (POW) and covariate shift (ALGORITHMS.md section 3).

Unlike the label-skew partitioners in `partition.py`, these look at the features: a client's
inputs come from its own region of feature space while its labels follow whatever lives there.

- `pow`: uniformly random samples, client k (1-based) gets |D| / (k^a * H) of them (H the
  normaliser, a = 1 in the paper); features stay i.i.d. across clients.
- `covariate-shift` (the paper's Algorithm 2): estimate mu, Sigma of the flattened inputs; for
  each client draw delta_k with delta_k^T Sigma^-1 delta_k = C and weight every sample by
  exp(-1/2 (x - mu - delta_k)^T Sigma^-1 (x - mu - delta_k)).
- `covariate-shift-pca` (the published code's variant, devide.py): sort by the first principal
  component and cut the lowest |D| samples into contiguous blocks; C plays no part.
Each comes in an equal-size form (the paper's BCS / the code's ECS) and a `-pow` form (ICS /
PECS). |D| = num_clients * samples_per_client, or half the pool when unset (Algorithm 2's
M = |D_g| / 2; the code halves every dataset the same way).

Deviation from Algorithm 2 as printed, on purpose: it samples n_k pairs *with replacement* and
independently per client. Its weights are the shifted Gaussian density itself, which is so
peaked in whitened space that few samples carry the mass (on MNIST-1D, 40 dimensions, C = 5:
an effective sample size of about 50 out of 9600), so clients would mostly hold copies of a few
dozen samples, overlap each other, and a local test split could contain copies of training
rows. Here every sample goes to at most one client and at most once: clients take turns (in
proportion to their sizes) and each takes the remaining sample its weights favour, drawn by
Gumbel-top-k, i.e. successive sampling without replacement with probability proportional to
the same weights. Sigma^-1 is the pseudo-inverse over the directions the data spans (pixels
that never vary carry no shift).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FEATURE_PARTITIONERS", "pow_sizes", "pow_split", "covariate_shift", "covariate_shift_pca",
           "whiten", "whitening", "shift_directions", "mahalanobis_sq", "first_principal_component", "feature_partition"]


def pow_sizes(total: int, num_clients: int, exponent: float = 1.0) -> np.ndarray:
    """Client k (0-based) gets floor(total * w_k), w_k proportional to 1 / (k + 1)^exponent; the
    remainder goes one each to clients 0, 1, ... (as the published code does)."""
    if int(num_clients) < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    if not exponent >= 0:
        raise ValueError(f"the power-law exponent must be non-negative, got {exponent}")
    w = 1.0 / np.arange(1, num_clients + 1, dtype=np.float64) ** exponent
    w /= w.sum()
    sizes = np.floor(w * total).astype(np.int64)
    for i in range(int(total - sizes.sum())):
        sizes[i % num_clients] += 1
    if sizes.min() < 1:
        raise ValueError(f"{total} samples cannot give {num_clients} clients power-law sizes: the smallest "
                         f"would get none; use more samples or fewer clients")
    return sizes


def _total(pool: int, num_clients: int, samples_per_client: int | None) -> int:
    if int(num_clients) < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    total = pool // 2 if samples_per_client is None else int(num_clients) * int(samples_per_client)
    if samples_per_client is not None and int(samples_per_client) < 1:
        raise ValueError(f"samples_per_client must be at least 1, got {samples_per_client}")
    if total > pool:
        raise ValueError(f"cannot give {num_clients} clients {samples_per_client} samples each on average: "
                         f"{total} needed, {pool} available")
    if total < num_clients:
        raise ValueError(f"{pool} samples are too few for {num_clients} clients")
    return total


def _sizes(total: int, num_clients: int, sizes: str) -> np.ndarray:
    if sizes == "pow":
        return pow_sizes(total, num_clients)
    if sizes == "equal":
        return np.full(num_clients, total // num_clients, dtype=np.int64)
    raise ValueError(f"sizes must be 'equal' or 'pow', got {sizes!r}")


def pow_split(n: int, num_clients: int, samples_per_client: int | None, rng: np.random.Generator) -> list[np.ndarray]:
    """POW: disjoint uniformly random subsets of `n` samples with power-law sizes."""
    sizes = pow_sizes(_total(n, num_clients, samples_per_client), num_clients)
    perm = rng.permutation(n)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [np.sort(perm[bounds[k]:bounds[k + 1]]).astype(np.int64) for k in range(num_clients)]


_CHUNK = 4096  # rows at a time: CIFAR-10 flattened in float64 would be over a gigabyte at once


def _rows(x) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim < 2 or len(x) < 2:
        raise ValueError(f"features must be [n >= 2, ...], got shape {x.shape}")
    return x.reshape(len(x), -1)


def _chunks(flat: np.ndarray):
    for i in range(0, len(flat), _CHUNK):
        yield flat[i:i + _CHUNK].astype(np.float64)


def _moments(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean, and the eigenvalues / eigenvectors of the sample covariance (ascending)."""
    mean = sum(c.sum(axis=0) for c in _chunks(flat)) / len(flat)
    cov = sum((c - mean).T @ (c - mean) for c in _chunks(flat)) / (len(flat) - 1)
    eigval, eigvec = np.linalg.eigh(cov)
    return mean, eigval, eigvec


def whitening(x) -> tuple[np.ndarray, np.ndarray]:
    """(mu, P) with u = (x - mu) @ P over the directions of non-negligible variance, so that
    (x - y)^T Sigma^+ (x - y) = |u_x - u_y|^2."""
    flat = _rows(x)
    mean, eigval, eigvec = _moments(flat)
    keep = eigval > max(eigval.max(), 0.0) * 1e-9
    if not keep.any():
        raise ValueError("the features do not vary: no covariate shift is possible")
    return mean, eigvec[:, keep] / np.sqrt(eigval[keep])


def whiten(x) -> np.ndarray:
    """The whitened coordinates u of every row of `x` (see `whitening`)."""
    mean, proj = whitening(x)
    return np.concatenate([(c - mean) @ proj for c in _chunks(_rows(x))])


def covariate_shift(x, num_clients: int, c: float, samples_per_client: int | None, rng: np.random.Generator,
                    sizes: str = "equal") -> list[np.ndarray]:
    """Algorithm 2 with disjoint draws (see the module docstring): returns one sorted index array
    per client into `x`; every shift has Mahalanobis norm^2 exactly `c`."""
    if not c > 0:
        raise ValueError(f"the shift C must be positive, got {c}")
    flat = _rows(x)
    mean, proj = whitening(flat)
    n_k = _sizes(_total(len(flat), num_clients, samples_per_client), num_clients, sizes)
    z = shift_directions(proj, num_clients, c, rng)
    sq = np.concatenate([mahalanobis_sq((ch - mean) @ proj, z) for ch in _chunks(flat)])
    # log w_ik = -1/2 d_ik^2, plus Gumbel noise: taking the best remaining score is a draw
    # proportional to w over the remaining samples.
    scores = -0.5 * sq + rng.gumbel(size=sq.shape)
    order = np.argsort(-scores, axis=0, kind="stable")  # [n, K]: each client's preference list
    return _draft(order, n_k, rng)


def shift_directions(proj: np.ndarray, num_clients: int, c: float, rng: np.random.Generator) -> np.ndarray:
    """[K, k]: each client's delta_k in whitened space, |z_k|^2 = C. An isotropic draw in the
    features' own space, projected on the principal axes (isotropic there too): drawn on the axes
    themselves, it would depend on the signs (and, for equal variances, the rotation) eigh happens
    to give them, which another machine's LAPACK may choose otherwise, and a Ray actor there
    would build other partitions."""
    axes = proj / np.linalg.norm(proj, axis=0)  # the unit eigenvectors: proj's columns are v / sqrt(lambda)
    z = rng.normal(size=(num_clients, proj.shape[0])) @ axes
    return z * (np.sqrt(c) / np.linalg.norm(z, axis=1, keepdims=True))


def mahalanobis_sq(u: np.ndarray, z: np.ndarray) -> np.ndarray:
    """[n, K] squared distances |u_i - z_k|^2 between whitened rows and whitened shifted means."""
    return np.maximum((u ** 2).sum(axis=1)[:, None] - 2.0 * u @ z.T + (z ** 2).sum(axis=1)[None, :], 0.0)


def _draft(order: np.ndarray, n_k: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Clients take turns (client k's j-th pick at time (j + 0.5) / n_k, ties in random order),
    each taking its most preferred sample nobody has taken yet."""
    k_count = len(n_k)
    times = np.concatenate([(np.arange(n) + 0.5) / n for n in n_k])
    who = np.repeat(np.arange(k_count), n_k)
    turns = who[np.lexsort((rng.permutation(len(who)), times))]
    taken = np.zeros(order.shape[0], dtype=bool)
    pointer = np.zeros(k_count, dtype=np.int64)
    parts: list[list[int]] = [[] for _ in range(k_count)]
    for k in turns:
        p = pointer[k]
        while taken[order[p, k]]:
            p += 1
        i = order[p, k]
        taken[i] = True
        pointer[k] = p + 1
        parts[k].append(int(i))
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def first_principal_component(x) -> np.ndarray:
    """Projection of every sample on the first principal component; the sign is fixed so that
    the component's largest-magnitude loading is positive (as sklearn's svd_flip does)."""
    flat = _rows(x)
    mean, _, eigvec = _moments(flat)
    v = eigvec[:, -1]
    if v[np.argmax(np.abs(v))] < 0:
        v = -v
    return np.concatenate([(c - mean) @ v for c in _chunks(flat)])


def covariate_shift_pca(x, num_clients: int, samples_per_client: int | None, sizes: str = "equal") -> list[np.ndarray]:
    """The published code's variant: sort by the first principal component (ascending), keep the
    lowest |D| samples, and cut them into contiguous blocks (client 0 lowest). Deterministic."""
    pc1 = first_principal_component(x)
    n_k = _sizes(_total(len(pc1), num_clients, samples_per_client), num_clients, sizes)
    ranked = np.argsort(pc1, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(n_k)])
    return [np.sort(ranked[bounds[k]:bounds[k + 1]]).astype(np.int64) for k in range(num_clients)]


# Name -> how it splits (features, num_clients, C, samples_per_client, rng).
FEATURE_PARTITIONERS = {
    "pow": lambda x, n, c, s, rng: pow_split(len(x), n, s, rng),
    "covariate-shift": lambda x, n, c, s, rng: covariate_shift(x, n, c, s, rng, sizes="equal"),
    "covariate-shift-pow": lambda x, n, c, s, rng: covariate_shift(x, n, c, s, rng, sizes="pow"),
    "covariate-shift-pca": lambda x, n, c, s, rng: covariate_shift_pca(x, n, s, sizes="equal"),
    "covariate-shift-pca-pow": lambda x, n, c, s, rng: covariate_shift_pca(x, n, s, sizes="pow"),
}


def feature_partition(name: str, x, num_clients: int, shift_c: float, samples_per_client: int | None,
                      rng: np.random.Generator) -> list[np.ndarray]:
    """Split the rows of `x` with the partition `name` (a key of FEATURE_PARTITIONERS)."""
    try:
        fn = FEATURE_PARTITIONERS[name]
    except KeyError:
        raise ValueError(f"unknown feature partition {name!r}; choose one of: {', '.join(FEATURE_PARTITIONERS)}") from None
    return fn(x, num_clients, shift_c, samples_per_client, rng)
