"""`fedal demo` over its embedded broker gives exactly what `fedal simulate` gives (every
strategy over Mosquitto: tests/test_strategy_contract.py)."""

from __future__ import annotations

import paho.mqtt.client as mqtt

from fedal.protocol import RunManifest, parse_broker_url, topics
from fedal.sim import load_config
from fedal_cli.demo import RUN_ID, run_demo
from tests.helpers import simulated_run


def simulated_accuracies(config) -> list[float]:
    data, clients, _ = simulated_run(config)
    return [c.evaluate(data.test.x, data.test.y) for c in clients.values()]


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
    assert results["final"]["client_acc"] == simulated_accuracies(config)
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in results["rounds"])
