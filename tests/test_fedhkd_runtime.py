"""FedHKD over a real Mosquitto with agent processes (`fedal demo`'s path): the run completes,
knowledge travels, and every accuracy equals `fedal simulate`'s, the coordinator's global_acc
of the aggregated model included."""

from __future__ import annotations

import numpy as np

from coordinator.demo import run_demo
from fedal.sim import load_config, simulate


def test_fedhkd_demo_over_mosquitto_matches_simulation(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedhkd", dataset="digits", clients=2, rounds=2, tau=3, seed=2,
                                    models=["mlp"], partition="dirichlet-class", alpha=0.5, local_test_fraction=0.25,
                                    hkd_nu=0.1))
    results = run_demo(config, tmp_path / "demo", broker=mosquitto, quiet=True, timeout_s=300)
    expected = simulate(config)
    final, want = results["final"], expected["final"]
    for key in ("client_acc", "client_local_acc", "global_acc", "personal_acc"):
        assert final[key] == want[key], key
    assert final["personal_acc"] == final["local_mean_acc"]
    assert 0.0 <= final["global_acc"] <= 1.0
    assert results["deployment"]["counters"].get("rejected", 0) == 0
    # round 2 trained with the global knowledge of round 1, as in the simulation
    assert results["rounds"][-1]["server"]["hkd_classes"] == expected["rounds"][-1]["server"]["hkd_classes"] > 0
    assert np.isclose(results["rounds"][-1]["server"]["hkd_feature"], expected["rounds"][-1]["server"]["hkd_feature"])
    assert [r["global_acc"] for r in results["rounds"]] == [r["global_acc"] for r in expected["rounds"]]
