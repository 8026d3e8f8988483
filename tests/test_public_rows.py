"""The public rows of a transfer iteration, computed by both ends (docs/protocol.md "Public
rows"): the documented algorithm, written out naively here, gives the same rows."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

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
