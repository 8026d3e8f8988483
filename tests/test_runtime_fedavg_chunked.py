"""FedAvg weights over Mosquitto with a small packet limit: chunked both ways, same result
as the in-process simulation."""

from __future__ import annotations

from fedal.sim import load_config, simulate
from tests.deployment import Deployment


def test_fedavg_weights_chunked_over_mosquitto_match_simulation(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedavg", dataset="digits", clients=3, rounds=2, tau=3, public_size=100,
                                    seed=5, models=["smallcnn"]))
    small = {"broker": {"max_payload": 8192}}
    dep = Deployment(config, tmp_path / "dep", mosquitto, coordinator=small, agent=small)
    try:
        dep.start_all()
        results = dep.finish()
    finally:
        dep.close()
    expected = simulate(config)
    assert results["final"]["client_acc"] == expected["final"]["client_acc"]
    # a smallcnn's weights are far above 8 KiB: every weight message went as several chunks
    assert results["rounds"][-1]["bytes_down"] > 3 * 8192
