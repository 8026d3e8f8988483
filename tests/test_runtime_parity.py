"""Over a real broker, `fedal demo` gives exactly what `fedal simulate` gives."""

from __future__ import annotations

import numpy as np
import pytest

import paho.mqtt.client as mqtt

from coordinator.demo import RUN_ID, run_demo
from coordinator.store import RunStore, default_store_url
from fedal.protocol import RunManifest, parse_broker_url, topics
from fedal.sim import load_config
from tests.helpers import simulated_run


def simulate_with_models(config):
    """simulate()'s loop, keeping the client halves to compare their final outputs."""
    data, clients, _ = simulated_run(config)
    accs = [c.evaluate(data.test.x, data.test.y) for c in clients.values()]
    outputs = [c.predict(data.test.x).numpy() for c in clients.values()]
    local = [c.evaluate(t.x, t.y) for c, t in zip(clients.values(), data.client_tests) if len(t)]
    return accs, outputs, local


@pytest.mark.parametrize("strategy", ["fedal", "fedmd"])
def test_demo_over_mosquitto_matches_simulation(strategy, mosquitto, tmp_path):
    config = load_config(None, dict(strategy=strategy, dataset="digits", clients=3, rounds=3, tau=2, public_size=120,
                                    seed=4, eval_every=1, local_test_fraction=0.2))
    results = run_demo(config, tmp_path / "demo", broker=mosquitto, quiet=True, timeout_s=300)
    accs, outputs, local = simulate_with_models(config)
    assert results["final"]["client_acc"] == accs
    # each agent evaluated on its own held-out split; the coordinator saw only the numbers
    assert len(local) == 3 and results["final"]["client_local_acc"] == local
    assert all("local_mean_acc" in r for r in results["rounds"])
    for i, cid in enumerate(c["id"] for c in results["clients"]):
        remote = np.load(tmp_path / "demo" / "agents" / cid / "final" / "test_logits.npy")
        assert np.max(np.abs(remote - outputs[i])) <= 1e-6
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    assert results["deployment"]["counters"].get("rejected", 0) == 0
    # the coordinator persisted its progress after every round
    stored = RunStore(default_store_url(tmp_path / "demo" / "coordinator" / "state")).load(RUN_ID)
    assert stored.completed_rounds == 3 and stored.state == "finished"
    assert [r["round"] for r in stored.records] == [1, 2, 3]


def publish_stale_finished_manifest(broker_url: str) -> None:
    """What an earlier run under the same run id leaves retained on the broker."""
    addr = parse_broker_url(broker_url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="stale-publisher")
    client.connect(addr.host, addr.port)
    client.loop_start()
    stale = RunManifest(run_id=RUN_ID, strategy="fedavg", strategy_params={"tau": 1}, num_classes=10,
                        clients=["c00", "c01", "c02"], rounds=1, state="finished", instance="an-earlier-run")
    client.publish(topics.run_manifest(RUN_ID), stale.to_json(), qos=1, retain=True).wait_for_publish(5)
    client.loop_stop()
    client.disconnect()


def test_demo_over_the_embedded_broker(embedded_broker, tmp_path):
    publish_stale_finished_manifest(embedded_broker)  # agents must not mistake it for their run
    config = load_config(None, dict(strategy="fedmd-lf", dataset="digits", clients=3, rounds=2, tau=2, public_size=100, seed=1))
    results = run_demo(config, tmp_path / "demo", broker=embedded_broker, quiet=True, timeout_s=300)
    accs, _, _ = simulate_with_models(config)
    assert results["final"]["client_acc"] == accs
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in results["rounds"])
