"""The public rows of a transfer iteration: a pure function of (key, round, iteration).

Both ends compute them, so no task carries them (docs/protocol.md, "Public rows"): at the
paper's B = 32 the rows would cost 64-128 bytes per task, 2.5-5 % of the feedback itself. The
function is a partial Fisher-Yates shuffle driven by SHA-256, so any language reproduces it.
"""

from __future__ import annotations

import functools
import hashlib
import threading

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

KEPT_INPUTS = 8  # gathered public batches kept per public set (an iteration's, and a few before)
_INPUTS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_INPUTS_LOCK = threading.Lock()


def public_rows(key: int, round_idx: int, iteration: int, public_size: int, batch: int) -> np.ndarray:
    """min(batch, public_size) distinct rows of 0..public_size-1, the same on every machine:
    step k swaps position k with k + (first 8 bytes of SHA-256("fedal-rows/key/round/iteration/k"),
    little-endian) mod (public_size - k), and takes what lands at k. A fresh array each call (a
    simulation's clients and server ask for the same rows: they are computed once)."""
    return _rows(int(key), int(round_idx), int(iteration), int(public_size), int(batch)).copy()


@functools.lru_cache(maxsize=64)
def _rows(key: int, round_idx: int, iteration: int, public_size: int, batch: int) -> np.ndarray:
    if public_size < 1 or batch < 1:
        raise ValueError(f"public rows need a public set and a batch, got {public_size} rows and batch {batch}")
    prefix = f"fedal-rows/{key}/{round_idx}/{iteration}/".encode()
    moved: dict[int, int] = {}  # the positions a swap changed (a sparse shuffle of 0..n-1)
    rows = np.empty(min(batch, public_size), dtype=np.int64)
    for k in range(len(rows)):
        draw = int.from_bytes(hashlib.sha256(prefix + str(k).encode()).digest()[:8], "little")
        j = k + draw % (public_size - k)
        rows[k] = moved.get(j, j)
        moved[j] = moved.get(k, k)
    return rows


def public_inputs(public_x: torch.Tensor, key: int, round_idx: int, iteration: int,
                  batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The public rows of (round, iteration) and `public_x` at those rows. Clients of one process
    that hold the very same public set (a simulation's) share one gather per iteration instead
    of one each: the last KEPT_INPUTS are kept per public set (as long as it is not written to).
    Both tensors are shared: read them, never write to them."""
    at = (int(key), int(round_idx), int(iteration), int(batch), public_x._version)
    with _INPUTS_LOCK:  # agents in threads of one process may ask at once
        kept = _INPUTS.get(public_x)
        if kept is None:
            kept = _INPUTS[public_x] = {}
        hit = kept.get(at)
        if hit is None:
            idx = torch.from_numpy(public_rows(key, round_idx, iteration, len(public_x), batch))
            hit = kept[at] = (idx, public_x[idx])
            while len(kept) > KEPT_INPUTS:
                del kept[next(iter(kept))]
    return hit
