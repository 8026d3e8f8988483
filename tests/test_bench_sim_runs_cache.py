"""The accuracy benchmarks' run cache takes a cached run only for the config it ran: a default
changed since (a simulation's clients stacked by default) made every table mix old per-client
runs with new stacked ones, without a word."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from sim_runs import simulate_cached  # noqa: E402


def test_a_cached_run_is_taken_only_for_the_config_it_ran(tmp_path, one_torch_thread):
    config = dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, strategy_params={"tau": 1},
                  public_size=50, seed=0)
    path = tmp_path / "run.json"
    simulate_cached(config, str(path))
    path.write_text(path.read_text().replace('"final"', '"final_marked"', 1))  # a mark a rerun would lose
    simulate_cached(config, str(path))
    assert '"final_marked"' in path.read_text()  # the same resolved config: read, not run
    simulate_cached({**config, "vectorize": False}, str(path))  # another path: run again
    assert '"final_marked"' not in path.read_text() and '"vectorize": false' in path.read_text()
