"""FedAKD end to end: `fedal simulate` trains the standalone baseline itself and reports CF, and
`fedal demo` reports the same CF for its deployment."""

from __future__ import annotations

import json

from fedal.sim import load_config, simulate
from fedal.sim.fairness import collaborative_fairness, standalone_config
from fedal_cli.demo import run_demo
from tests.helpers import per_client

SMALL = dict(strategy="fedakd", dataset="digits", clients=3, partition="covariate-shift-pow", shift_c=5.0,
             public_size=50, local_test_fraction=0.25, rounds=2, seed=5, models=["mlp"], batch_size=16)


def test_simulate_reports_cf_against_its_own_standalone_run(one_torch_thread, tmp_path):
    config = load_config(None, SMALL)
    results = simulate(per_client(config))
    final = results["final"]
    assert results["config"]["strategy_params"]["local_epochs"] == 1
    # the standalone baseline is the `local` strategy on the same clients, data and seed, with the
    # personal models' training budget (one epoch per round)
    alone = standalone_config(config)
    assert alone.strategy == "local" and alone.strategy_params.local_epochs == 1
    assert alone.model_dump(exclude={"strategy"}) == config.resolved().model_dump(exclude={"strategy"})
    assert len(final["standalone_acc"]) == len(final["standalone_local_acc"]) == 3
    assert final["standalone_local_acc"] != final["client_local_acc"]  # the federation changed something
    assert final["cf_on"] == "local_test"
    assert final["cf"] == collaborative_fairness(final["standalone_local_acc"], final["client_local_acc"])
    assert final["max_acc"] == max(final["client_acc"]) and final["local_max_acc"] == max(final["client_local_acc"])
    # what each round's clients selected and how much, for the record
    server = results["rounds"][-1]["server"]
    assert 0.0 <= server["selected_frac"] <= 1.0 and server["participation"] == 1.0
    json.dumps(results, allow_nan=False)  # a strict JSON document


def test_demo_reports_cf_like_simulate(mosquitto, tmp_path, one_torch_thread):
    """`fedal demo` adds the standalone baseline and CF that the coordinator does not compute
    (parity of everything else: tests/test_strategy_contract.py)."""
    config = load_config(None, SMALL)
    final = run_demo(config, tmp_path / "demo", broker=mosquitto, quiet=True, timeout_s=300)["final"]
    simulated = simulate(per_client(config))["final"]
    for key in ("standalone_acc", "standalone_local_acc", "cf", "cf_on", "client_local_acc"):
        assert final[key] == simulated[key], key
    assert final["cf"] is not None
