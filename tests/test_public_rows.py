"""The public rows of a transfer iteration, computed by both ends (docs/protocol.md "Public
rows"): the documented algorithm, written out naively here, gives the same rows."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from fedal.strategies.public_rows import public_rows


def documented_rows(key: int, t: int, i: int, n: int, b: int) -> list[int]:
    """docs/protocol.md's recipe, as another implementation would follow it: a full list."""
    rows = list(range(n))
    for k in range(min(b, n)):
        digest = hashlib.sha256(f"fedal-rows/{key}/{t}/{i}/{k}".encode()).digest()
        j = k + int.from_bytes(digest[:8], "little") % (n - k)
        rows[k], rows[j] = rows[j], rows[k]
    return rows[: min(b, n)]


@pytest.mark.parametrize("key, t, i, n, b", [(0, 0, 0, 1000, 32), (7, 3, 4, 50, 16), (2**40, 59, 0, 60000, 128),
                                             (1, 0, 1, 10, 32), (3, 2, 2, 1, 1)])
def test_rows_follow_the_documented_recipe(key, t, i, n, b):
    rows = public_rows(key, t, i, n, b)
    assert rows.dtype == np.int64 and rows.tolist() == documented_rows(key, t, i, n, b)
    assert len(set(rows.tolist())) == len(rows) == min(b, n) and rows.min() >= 0 and rows.max() < n


def test_rows_differ_by_key_round_and_iteration_and_cover_the_set():
    base = public_rows(0, 0, 0, 1000, 32).tolist()
    assert all(public_rows(*args, 1000, 32).tolist() != base for args in ((1, 0, 0), (0, 1, 0), (0, 0, 1)))
    seen = np.concatenate([public_rows(0, t, i, 100, 10) for t in range(50) for i in range(5)])
    counts = np.bincount(seen, minlength=100)  # 2500 draws over 100 rows: each about 25 times
    assert counts.min() > 5 and counts.max() < 60


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="public rows"):
        public_rows(0, 0, 0, 0, 32)


def test_public_inputs_are_gathered_once_per_public_set_and_iteration():
    """Clients holding the very same public set share one gather per (round, iteration); the
    rows are public_rows', the inputs the set at those rows; a set written to since, another
    set, or an iteration older than the kept ones gets a fresh gather."""
    import torch

    from fedal.strategies.public_rows import KEPT_INPUTS, public_inputs

    public = torch.randn(50, 4)
    idx, x = public_inputs(public, 3, 2, 1, 8)
    assert torch.equal(idx, torch.from_numpy(public_rows(3, 2, 1, 50, 8)))
    assert torch.equal(x, public[idx])
    again = public_inputs(public, 3, 2, 1, 8)
    assert again[0] is idx and again[1] is x  # shared, not gathered again
    assert public_inputs(public.clone(), 3, 2, 1, 8)[1] is not x  # another set
    assert public_inputs(public, 3, 2, 2, 8)[1] is not x  # another iteration
    public.mul_(2)  # written to: what was gathered before is stale
    idx2, x2 = public_inputs(public, 3, 2, 1, 8)
    assert torch.equal(idx2, idx) and torch.equal(x2, 2 * x)
    for i in range(KEPT_INPUTS):  # the kept ones are the last few
        public_inputs(public, 3, 3, i, 8)
    assert public_inputs(public, 3, 2, 1, 8)[1] is not x2


def test_a_simulations_clients_share_one_public_set_and_each_iterations_inputs():
    """build_run gives every client the same public tensor, so public_inputs gathers an iteration's
    public inputs once for all of them (not once per client)."""
    from fedal.sim import build_run, load_config
    from fedal.strategies.public_rows import public_inputs

    config = load_config(None, {"strategy": "fedal", "dataset": "digits", "clients": 3, "rounds": 1,
                                "public_size": 50}).resolved()
    _, clients, _ = build_run(config)
    publics = {id(c.public_x) for c in clients.values()}
    assert len(publics) == 1
    gathered = {id(public_inputs(c.public_x, 0, 1, 2, 8)[1]) for c in clients.values()}
    assert len(gathered) == 1
    # a vectorized group reads that one batch once per client (a view), not a stack of copies
    from fedal.strategies.stacked_training import public_batch

    group = list(clients.values())
    idx, x = public_batch(group, 1, 2)
    assert x.shape[0] == 3 and x.stride(0) == 0 and torch.equal(x[2], group[2].public_x[idx[2]])
    group[1].public_x = group[1].public_x.clone()  # a client with a public set of its own
    idx, x = public_batch(group, 1, 2)
    assert x.stride(0) != 0 and all(torch.equal(x[k], group[k].public_x[idx[k]]) for k in range(3))
