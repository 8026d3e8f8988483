"""Splitting a labelled pool among clients (ALGORITHMS.md section 2).

Every partitioner takes the label array of the pool and a `np.random.Generator`, and returns one
sorted int64 index array per client; the arrays are pairwise disjoint and index into `labels`.
Two non-IID schemes are offered because the papers disagree: the FedAL paper draws a class
distribution per client (`dirichlet_per_client`), FedHKD and most code draw a client
distribution per class (`dirichlet_per_class`, Hsu et al. 2019). Experiments must name which.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["dirichlet_per_client", "allocate_quotas", "dirichlet_per_class", "iid", "by_identity",
           "PARTITIONERS", "label_histogram"]


def _check_labels(labels) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    if labels.size and labels.min() < 0:
        raise ValueError("labels must be non-negative")
    return labels.astype(np.int64, copy=False)


def _check_counts(labels: np.ndarray, num_clients: int, samples_per_client: int | None) -> int:
    if int(num_clients) < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    if samples_per_client is None:  # as many as fit equally
        samples_per_client = len(labels) // num_clients
    if int(samples_per_client) < 1:
        raise ValueError(f"samples_per_client must be at least 1, got {samples_per_client} "
                         f"({len(labels)} samples for {num_clients} clients)")
    if num_clients * samples_per_client > len(labels):
        raise ValueError(f"cannot give {num_clients} clients {samples_per_client} samples each: "
                         f"{num_clients * samples_per_client} needed, {len(labels)} available")
    return int(samples_per_client)


def allocate_quotas(q: np.ndarray, capacity: np.ndarray, samples_per_client: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Integer class quotas [N, K] for all clients at once: every row sums to
    `samples_per_client`, column k sums to at most `capacity[k]`, rows follow `q` [N, K].

    Water-filling over all clients together: desired counts q_n * S; an over-subscribed class
    is scaled down by the same factor for every client that wants it; each client's shortfall
    is topped up from classes with spare samples in proportion to its own q_n renormalised over
    those classes (uniformly by spare room if its q_n is zero there). Repeats until no class is
    over-subscribed (each pass saturates at least one class). Rounding to integers hands the
    leftover units by largest remaining shortfall, clients visited in random order, so no
    client position is favoured. Filling clients one after another would instead leave the
    last client with whatever the others did not take.
    """
    q = np.asarray(q, dtype=np.float64)
    capacity = np.asarray(capacity, dtype=np.int64)
    n_clients, n_classes = q.shape
    s = int(samples_per_client)
    if capacity.shape != (n_classes,) or (capacity < 0).any():
        raise ValueError(f"capacity must be {n_classes} non-negative counts, got {capacity}")
    if n_clients * s > capacity.sum():
        raise ValueError(f"{n_clients} x {s} samples requested, only {capacity.sum()} available")
    if not np.isfinite(q).all() or (q < 0).any():
        raise ValueError("q must be finite and non-negative")
    cap = capacity.astype(np.float64)
    available = capacity > 0

    def normalise(w: np.ndarray, allowed: np.ndarray, fallback: np.ndarray) -> np.ndarray:
        w = w * allowed
        sums = w.sum(axis=1, keepdims=True)
        empty = sums[:, 0] <= 0
        if empty.any():  # client wants none of the allowed classes: spread over them
            spread = fallback * allowed
            w[empty] = spread if spread.sum() > 0 else allowed.astype(np.float64)
            sums[empty] = w[empty].sum(axis=1, keepdims=True)
        return w / sums

    pref = normalise(q, available, cap)
    f = pref * s  # desired (fractional) counts
    saturated = ~available
    for _ in range(n_classes + 1):
        col = f.sum(axis=0)
        over = col > cap * (1 + 1e-12) + 1e-9
        if not over.any():
            break
        f[:, over] *= cap[over] / col[over]
        saturated |= over
        deficit = s - f.sum(axis=1)
        spare = np.maximum(cap - f.sum(axis=0), 0.0)
        open_ = ~saturated & (spare > 1e-9)
        if not open_.any():  # only float noise is left (N*S == pool size); rounding fixes it
            break
        w = normalise(pref, open_, spare)
        f += np.maximum(deficit, 0.0)[:, None] * w

    quotas = np.floor(f + 1e-9).astype(np.int64)
    # Guard against float noise pushing a floored column above its capacity.
    excess = quotas.sum(axis=0) - capacity
    for k in np.flatnonzero(excess > 0):
        for n in np.argsort(f[:, k] - quotas[:, k])[: excess[k]]:
            quotas[n, k] -= 1
    room = (capacity - quotas.sum(axis=0)).astype(np.int64)
    for n in rng.permutation(n_clients):
        for _ in range(s - int(quotas[n].sum())):
            score = np.where(room > 0, f[n] - quotas[n], -np.inf)
            j = int(np.argmax(score))
            quotas[n, j] += 1
            room[j] -= 1
    assert (quotas.sum(axis=1) == s).all() and (quotas.sum(axis=0) <= capacity).all()
    return quotas


def dirichlet_per_client(labels, num_clients: int, alpha: float, samples_per_client: int | None,
                         rng: np.random.Generator, *, num_classes: int | None = None
                         ) -> list[np.ndarray]:
    """FedAL paper's scheme: client n draws q_n ~ Dir(alpha * 1_K); every client gets
    `samples_per_client` samples with class counts from `allocate_quotas` (all clients
    together), drawn without replacement from shuffled per-class pools.

    K is `num_classes` if given, else max(labels) + 1; classes with no samples in the pool are
    renormalised away. `samples_per_client=None` means len(labels) // num_clients.
    """
    labels = _check_labels(labels)
    s = _check_counts(labels, num_clients, samples_per_client)
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    k = int(num_classes) if num_classes is not None else int(labels.max()) + 1
    if labels.max() >= k:
        raise ValueError(f"labels go up to {labels.max()} but num_classes is {k}")
    q = rng.dirichlet(np.full(k, float(alpha)), size=num_clients)
    capacity = np.bincount(labels, minlength=k)
    quotas = allocate_quotas(q, capacity, s, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(k):
        pool = rng.permutation(np.flatnonzero(labels == c))
        bounds = np.concatenate([[0], np.cumsum(quotas[:, c])])
        for n in range(num_clients):
            parts[n].append(pool[bounds[n]:bounds[n + 1]])
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def dirichlet_per_class(labels, num_clients: int, beta: float, rng: np.random.Generator,
                        min_size: int = 1, *, max_tries: int = 1000) -> list[np.ndarray]:
    """Hsu et al. (2019): for every class, split its samples over clients with proportions
    ~ Dir(beta * 1_N). Uses the whole pool, so client sizes differ. The whole draw is repeated
    until every client has at least `min_size` samples (at most `max_tries` times)."""
    labels = _check_labels(labels)
    if int(num_clients) < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if num_clients * min_size > len(labels):
        raise ValueError(f"cannot give {num_clients} clients at least {min_size} samples each "
                         f"from {len(labels)} samples")
    pools = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for pool in pools:
            pool = rng.permutation(pool)
            p = rng.dirichlet(np.full(num_clients, float(beta)))
            cuts = (np.cumsum(p) * len(pool)).astype(np.int64)[:-1]
            for n, chunk in enumerate(np.split(pool, cuts)):
                parts[n].append(chunk)
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(o) for o in out) >= min_size:
            return out
    raise ValueError(f"no Dir({beta}) per-class partition gave all {num_clients} clients "
                     f"at least {min_size} samples in {max_tries} tries; raise beta or "
                     f"lower min_size/num_clients")


def iid(labels, num_clients: int, samples_per_client: int | None,
        rng: np.random.Generator) -> list[np.ndarray]:
    """Uniformly random disjoint subsets of equal size (`None`: len(labels) // num_clients)."""
    labels = _check_labels(labels)
    s = _check_counts(labels, num_clients, samples_per_client)
    chosen = rng.permutation(len(labels))[: num_clients * s].reshape(num_clients, s)
    return [np.sort(row).astype(np.int64) for row in chosen]


def by_identity(groups, num_clients: int, samples_per_client: int | None,
                rng: np.random.Generator) -> list[np.ndarray]:
    """LEAF's CelebA split for a run's fixed number of clients: each client is a set of whole
    identities (celebrities), so no person's images are on two clients.

    The distinct identities, sorted and then permuted by `rng`, are dealt one at a time to the
    client holding the fewest images so far (the lowest client index on a tie): shares stay close
    in size and which identities a client gets is fixed by the seed. `samples_per_client` None
    deals every identity of the pool; a number stops dealing once every client holds at least that
    many images, and each client then keeps that many of its images, drawn uniformly.
    """
    groups = _check_labels(groups)  # the same checks: a 1-D array of non-negative integers
    if int(num_clients) < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    identities = np.unique(groups)
    if len(identities) < num_clients:
        raise ValueError(f"cannot give {num_clients} clients an identity each: "
                         f"the pool holds {len(identities)} identities")
    if samples_per_client is not None and int(samples_per_client) < 1:
        raise ValueError(f"samples_per_client must be at least 1, got {samples_per_client}")
    order = np.argsort(groups, kind="stable")
    starts = np.searchsorted(groups[order], identities)
    members = np.split(order, starts[1:])  # members[j]: the pool indices of identities[j]
    heap = [(0, n) for n in range(num_clients)]
    dealt: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j in rng.permutation(len(identities)):
        if samples_per_client is not None and heap[0][0] >= samples_per_client:
            break
        load, n = heapq.heappop(heap)
        dealt[n].append(members[j])
        heapq.heappush(heap, (load + len(members[j]), n))
    if samples_per_client is not None and heap[0][0] < samples_per_client:
        raise ValueError(f"cannot give {num_clients} clients {samples_per_client} images each by whole identities: "
                         f"{len(groups)} images in the pool")
    parts = [np.sort(np.concatenate(d)).astype(np.int64) for d in dealt]
    if samples_per_client is not None:
        parts = [np.sort(rng.choice(p, int(samples_per_client), replace=False)) for p in parts]
    return parts


# Name -> partitioner, as used in configs and by `build_federated`. The signatures differ:
# "dirichlet-class" takes a concentration but no per-client size.
PARTITIONERS: dict[str, Callable[..., Any]] = {
    "dirichlet-client": dirichlet_per_client,
    "dirichlet-class": dirichlet_per_class,
    "iid": iid,
}


def label_histogram(labels, parts, num_classes: int) -> np.ndarray:
    """Per-client class counts [N, K] (int64), e.g. to log the partition with the run."""
    labels = _check_labels(labels)
    if labels.size and labels.max() >= num_classes:
        raise ValueError(f"labels go up to {labels.max()} but num_classes is {num_classes}")
    hist = np.zeros((len(parts), num_classes), dtype=np.int64)
    for n, p in enumerate(parts):
        hist[n] = np.bincount(labels[np.asarray(p, dtype=np.int64)], minlength=num_classes)
    return hist
