"""One compromised device during a run, on a broker provisioned by `fedal fleet init` (its password
and ACL files) with a real coordinator: with dev-3's credentials the attacker floods chunks that
never complete (24 chunks of 8 MiB under one chunk_of declaring 1000 bytes, messages whose
missing last chunk never comes, one larger than a client's reassembly budget), sends logits of
magnitude 3.4e38 with the current key, and leaves junk retained on dev-3's result and status
topics (one before the coordinator even subscribes). Each is refused and counted by reason in
the API and /metrics, the junk is gone from the broker's retained store, and the run finishes
with exactly the numbers of the same run without the attacker.

dev-1 and dev-2 are emulated agents (hil/fleet.py); dev-3 is the same emulated agent driven here,
which in the attacked run sends the junk first, on its own connection, so it reaches the
coordinator before each honest answer (MQTT keeps one publisher's order).
"""

from __future__ import annotations

import json
import queue
import threading
import time
import tomllib
import urllib.request
import uuid

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedal.protocol import Message, decode, encode, topics
from hil.coordinator_setup import get_json, start_coordinator, stop_process, wait_for_run, write_coordinator_config
from hil.emulated_agent import EmulatedAgent
from hil.fleet import Fleet, device_credentials
from hil.mosquitto import free_port
from tests.fleet_broker import acl_only_broker

RUN = "attacked"
TOKEN = "attack-token"
DEVICES = ["dev-1", "dev-2", "dev-3"]
ROUNDS, TAU = 3, 2
MiB = 1024 * 1024
BUDGET = 16 * MiB  # broker.reassembly_bytes_per_client of the coordinator


def chunk(chunk_of: str, index: int, count: int, size: int, length: int) -> bytes:
    return encode(Message({"chunk_of": chunk_of, "index": index, "count": count, "size": size},
                          {"data": np.zeros(length, np.uint8)}))


class Device:
    """dev-3's emulated agent on its own MQTT connection; `attack` adds the junk."""

    def __init__(self, port: int, user: str, password: str, attack: bool):
        self.agent = EmulatedAgent(RUN, "dev-3", index=2, seed=0)
        self.attack = attack
        self.attacked: set[str] = set()
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        will = self.agent.will()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.agent.mqtt_client_id, clean_session=False,
                             protocol=mqtt.MQTTv311)
        self.c.username_pw_set(user, password)
        self.c.will_set(will.topic, will.payload, qos=1, retain=True)
        self.c.on_connect = self._on_connect
        self.c.on_message = lambda c, u, m: self.inbox.put((m.topic, bytes(m.payload)))
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _on_connect(self, client, _u, _f, rc, _p) -> None:
        client.subscribe(self.agent.subscriptions())
        for p in self.agent.on_connected():
            client.publish(p.topic, p.payload, qos=1, retain=p.retain)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(60)

    def _work(self) -> None:
        while not self.agent.finished:
            try:
                topic, payload = self.inbox.get(timeout=0.2)
            except queue.Empty:
                pubs = self.agent.tick()
            else:
                if self.attack and topic == self.agent.task_topic:
                    self._junk(decode(payload))
                pubs = self.agent.on_message(topic, payload)
            for p in pubs:
                self.publish(p.topic, p.payload, p.retain)

    def _junk(self, task: Message) -> None:
        up, status = topics.result(RUN, "dev-3"), topics.status(RUN, "dev-3")
        if task.phase == "local_train" and "magnitude" not in self.attacked:  # its result carries logits
            self.attacked.add("magnitude")
            meta = {k: task.meta[k] for k in ("epoch", "seq")}
            huge = np.full((32, 10), 3.4e38, np.float32)  # the run's public batch of logits
            huge[::2] *= -1
            self.publish(up, encode(Message(meta, {"logits": huge})))
        if task.phase == "transfer" and "chunks" not in self.attacked:
            self.attacked.add("chunks")
            flood = uuid.uuid4().hex
            for i in range(24):  # as reported: 8 MiB each, the message declaring 1000 bytes
                self.publish(up, chunk(flood, i, 24, 1000, 8 * MiB))
            for _ in range(6):  # well-formed, 8 MiB of a 16 MiB message each, never completed
                self.publish(up, chunk(uuid.uuid4().hex, 0, 2, 16 * MiB, 8 * MiB))
            self.publish(up, chunk(uuid.uuid4().hex, 0, 4, 2 * BUDGET, 8 * MiB))  # beyond the budget
            self.publish(status, b"{not json", retain=True)
            self.publish(up, b"junk left retained", retain=True)

    def close(self) -> None:
        self.agent.finished = True
        self.thread.join(10)
        self.c.loop_stop()
        self.c.disconnect()


def retained(port: int, user: str, password: str, topic: str, wait_s: float = 1.5) -> list[bytes]:
    """What a fresh subscriber receives retained on `topic`."""
    got: list[bytes] = []
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fresh-{uuid.uuid4().hex[:8]}", protocol=mqtt.MQTTv311)
    c.username_pw_set(user, password)
    c.on_message = lambda _c, _u, m: got.append(bytes(m.payload)) if m.retain else None
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.subscribe(topic, qos=1)
    time.sleep(wait_s)
    c.loop_stop()
    c.disconnect()
    return got


def metrics(api: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{api}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture()
def fleet_files(tmp_path):
    out, broker = acl_only_broker(tmp_path, RUN)
    yield out, broker
    broker.stop()


def run_once(out, broker, workdir, attack: bool) -> tuple[dict, dict, dict]:
    """One run; (its final status, its results, /metrics at the end)."""
    account = tomllib.loads((out / "coordinator" / "broker.toml").read_text())["broker"]
    creds = device_credentials(out / "devices", DEVICES)
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    config = write_coordinator_config(workdir, broker.url, RUN, DEVICES, api_port=api_port, rounds=ROUNDS, tau=TAU,
                                      phases={"quorum": 1.0, "resend_s": 60.0},
                                      extra={"broker": {**account, "url": broker.url, "reassembly_bytes_per_client": BUDGET},
                                             "api": {"token": TOKEN}})
    dev3 = Device(broker.port, *creds["dev-3"], attack=attack)
    if attack:  # junk retained before the coordinator subscribes: delivered to it flagged as retained
        dev3.publish(topics.result(RUN, "dev-3"), b"junk retained early", retain=True)
    coordinator = start_coordinator(config, workdir / "coordinator.log")
    fleet = Fleet(broker.url, RUN, DEVICES[:2], credentials=creds).start()
    try:
        final = wait_for_run(api, RUN, lambda r: r["state"] in ("finished", "failed"), 300, coordinator)
        if attack:
            assert dev3.attacked == {"magnitude", "chunks"}
        results = get_json(f"{api}/api/v1/runs/{RUN}/results")
        scraped = metrics(api)
        assert fleet.wait_finished(30)
    finally:
        fleet.stop()
        dev3.close()
        stop_process(coordinator)
    return final, results, scraped


def test_a_compromised_device_is_refused_counted_and_changes_nothing(fleet_files, tmp_path):
    out, broker = fleet_files
    account = tomllib.loads((out / "coordinator" / "broker.toml").read_text())["broker"]
    user, password = account["username"], account["password"]

    final, results, scraped = run_once(out, broker, tmp_path / "attacked", attack=True)
    assert final["state"] == "finished" and final["completed_rounds"] == ROUNDS
    rejects = final["rejects"]
    # the flood, chunk by chunk: each refused as a chunk, or dropped unread by dev-3's inbox budget
    # while the coordinator was busy (counted under flood; which of the two depends on the machine)
    assert rejects.get("chunk", 0) + rejects.get("flood", 0) >= 24, rejects
    assert rejects.get("chunk_budget", 0) == 1, rejects  # the message beyond dev-3's budget
    assert rejects.get("magnitude", 0) == 1, rejects
    assert rejects.get("status", 0) >= 1 and rejects.get("envelope", 0) >= 2, rejects  # the retained junk
    assert final["counters"]["rejected"] == sum(rejects.values())
    assert final["counters"].get("evicted", 0) == 5  # its own older unfinished messages made room
    run = (("run", RUN),)
    for reason, count in rejects.items():
        assert scraped[("fedal_rejects_total", (("reason", reason), *run))] == count
    assert scraped[("fedal_messages_total", (("outcome", "evicted"), *run))] == 5
    for cid in ("dev-1", "dev-2"):
        info = final["clients"][cid]
        assert info["rejected"] == 0 and info["late"] == 0 and info["answered"] == ROUNDS * (TAU + 2), (cid, info)
    assert final["clients"]["dev-3"]["answered"] == ROUNDS * (TAU + 2)  # its honest half still took part

    # the broker keeps none of the junk for later subscribers
    assert retained(broker.port, user, password, topics.result(RUN, "dev-3")) == []
    for payload in retained(broker.port, user, password, topics.status(RUN, "dev-3")):
        assert json.loads(payload)["state"] in ("online", "offline")  # only a status dev-3 itself sent since

    clean_final, clean, _ = run_once(out, broker, tmp_path / "clean", attack=False)
    assert clean_final["state"] == "finished" and clean_final["counters"].get("rejected", 0) == 0
    assert results["final"] == clean["final"]
    assert [r["server"] for r in results["rounds"]] == [r["server"] for r in clean["rounds"]]
    assert [r.get("client_acc") for r in results["rounds"]] == [r.get("client_acc") for r in clean["rounds"]]
