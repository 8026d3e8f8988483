"""FedDF-AL over Mosquitto with agent processes: weights go up and group averages come down
chunked under a small packet limit, and `fedal demo` gives exactly what `fedal simulate` gives."""

from __future__ import annotations

import threading

import numpy as np
import paho.mqtt.client as mqtt

from coordinator.demo import RUN_ID, run_demo
from fedal.protocol import decode, parse_broker_url
from fedal.protocol.topics import ROOT
from fedal.sim import load_config
from tests.helpers import simulated_run

MAX_PAYLOAD = 8192


class WireSpy:
    """Subscribes to the run's task and result topics and notes every payload's size and chunking."""

    def __init__(self, broker_url: str):
        addr = parse_broker_url(broker_url)
        self.seen: list[tuple[str, int, int]] = []  # (down | up, bytes, chunk count; 0: whole; -1: no envelope)
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="feddf-wire-spy")
        self.client.on_message = self._on_message
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *_args: subscribed.set()
        self.client.connect(addr.host, addr.port)
        self.client.subscribe([(f"{ROOT}/{RUN_ID}/down/+", 1), (f"{ROOT}/{RUN_ID}/up/+", 1)])
        self.client.loop_start()
        assert subscribed.wait(30), "the broker did not acknowledge the spy's subscription"

    def _on_message(self, _client, _userdata, message) -> None:
        payload = bytes(message.payload)
        try:
            meta = decode(payload).meta
            count = int(meta["count"]) if "chunk_of" in meta else 0
        except Exception:  # noted, never raised into paho's network thread
            count = -1
        with self.lock:
            self.seen.append((message.topic.split("/")[3], len(payload), count))

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def simulate_with_models(config):
    data, clients, _ = simulated_run(config)
    return [c.evaluate(data.test.x, data.test.y) for c in clients.values()], [c.predict(data.test.x).numpy() for c in clients.values()]


def test_feddf_al_demo_over_mosquitto_chunks_weights_and_matches_simulation(mosquitto, tmp_path, monkeypatch):
    # mlp, lenet5, mlp: the two MLPs form a group; per-class Dirichlet gives them unequal data sizes
    config = load_config(None, dict(strategy="feddf-al", dataset="digits", clients=3, models=["mlp", "lenet5"], rounds=2,
                                    tau=2, public_size=100, partition="dirichlet-class", alpha=1.0, seed=3))
    for prog in ("COORD", "AGENT"):  # what a deployment behind a small broker packet limit would set
        monkeypatch.setenv(f"FEDAL_{prog}_BROKER__MAX_PAYLOAD", str(MAX_PAYLOAD))
    spy = WireSpy(mosquitto)
    try:
        results = run_demo(config, tmp_path / "demo", broker=mosquitto, quiet=True, timeout_s=300)
    finally:
        spy.close()
    accs, outputs = simulate_with_models(config)
    assert results["final"]["client_acc"] == accs
    for i, cid in enumerate(c["id"] for c in results["clients"]):
        remote = np.load(tmp_path / "demo" / "agents" / cid / "final" / "test_logits.npy")
        assert np.max(np.abs(remote - outputs[i])) <= 1e-6
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert results["deployment"]["counters"].get("rejected", 0) == 0
    server = results["rounds"][-1]["server"]
    assert server["groups"] == 2 and server["param_participation"] == 1.0 and "disc_loss" in server

    # every packet stayed under the limit; weights went up and group averages came down in pieces
    assert max(size for _, size, _ in spy.seen) <= MAX_PAYLOAD
    assert all(count >= 0 for _, _, count in spy.seen)  # every payload was a valid envelope
    chunked = {d: [n for direction, _, n in spy.seen if direction == d and n > 1] for d in ("up", "down")}
    assert min(chunked["up"]) > 1 and min(chunked["down"]) > 1
    # 2 rounds x (3 uploads, 2 group averages) of about 70-85 KB: at least 8 chunks each
    assert len(chunked["up"]) >= 2 * 3 * 8 and len(chunked["down"]) >= 2 * 2 * 8


def test_demo_and_simulate_offer_every_strategy(tmp_path):
    from click.testing import CliRunner

    from coordinator.demo import demo_cmd
    from fedal.cli.simulate import simulate_cmd
    from fedal.strategies import STRATEGY_NAMES

    assert {"fedavg", "fedmd", "fedmd-lf", "feddf-al", "feddf"} <= set(STRATEGY_NAMES)
    for cmd in (demo_cmd, simulate_cmd):
        (opt,) = [p for p in cmd.params if p.name == "strategy"]
        assert tuple(opt.type.choices) == STRATEGY_NAMES
    # parameter averaging of one model for all clients: refused with heterogeneous models before anything starts
    res = CliRunner().invoke(demo_cmd, ["--strategy", "fedavg", "--dataset", "mnist1d", "--workdir", str(tmp_path / "w"),
                                       "--out", str(tmp_path / "r.json"), "--quiet"])
    assert res.exit_code == 2 and "one model for all clients" in res.output
    assert not (tmp_path / "w").exists()
