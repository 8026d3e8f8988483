"""`simulate` as a library call: the thread count it runs at is its config's, and the caller's
comes back afterwards (a notebook's torch settings are its own)."""

from __future__ import annotations

import torch

from fedal.sim import load_config, simulate


def test_simulate_gives_the_callers_thread_count_back():
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    seen: list[int] = []
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=60, seed=1,
                                    threads=want))
    try:
        simulate(config, progress=lambda *_a, **_k: seen.append(torch.get_num_threads()))
        assert seen and set(seen) == {want}  # the run's own
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
