"""Bad input over a real broker never crashes the coordinator or an agent, and is counted.

Client c02 is not an agent process but this test, speaking the protocol from outside with a raw
MQTT client: it answers its tasks, but first throws every kind of bad result at the coordinator.
"""

from __future__ import annotations

import json
import queue
import threading
import uuid

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest

from fedal.protocol import Message, decode, encode, parse_broker_url, topics
from fedal.sim import load_config
from tests.deployment import Deployment

RUN = "demo"


class ScriptedClient:
    def __init__(self, broker_url: str, cid: str):
        self.cid = cid
        self.tasks: queue.Queue[Message] = queue.Queue()
        addr = parse_broker_url(broker_url)
        self.mqtt = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"scripted-{uuid.uuid4().hex[:6]}")
        self.mqtt.on_message = lambda c, u, m: self.tasks.put(decode(m.payload)) if m.topic == topics.task(RUN, cid) else None
        self.mqtt.connect(addr.host, addr.port)
        self.mqtt.subscribe(topics.task(RUN, cid), qos=1)
        self.mqtt.loop_start()
        self.publish_raw(topics.status(RUN, cid), json.dumps({"state": "online"}).encode(), retain=True)

    def publish_raw(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.mqtt.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def reply(self, task: Message, tensors=None, topic_client=None, **meta) -> None:
        base = {k: task.meta[k] for k in ("phase", "round", "iteration", "epoch", "seq")}
        base.update(run=RUN, client=self.cid, msg_id=uuid.uuid4().hex)
        base.update(meta)
        self.publish_raw(topics.result(RUN, topic_client or self.cid), encode(Message(base, tensors or {})))

    def close(self) -> None:
        self.mqtt.loop_stop()
        self.mqtt.disconnect()


B, TAU = 32, 2  # the run's public batch and tau (the fixture's config)


def wants_logits(task: Message) -> bool:
    """Results that open a transfer iteration carry logits on its public rows (computed, not sent)."""
    return task.meta["phase"] == "local_train" or (task.meta["phase"] == "transfer" and task.meta["iteration"] + 1 < TAU)


def attack_on_logits(c: ScriptedClient, task: Message, k: int) -> None:
    b = B
    good = np.random.default_rng(0).normal(size=(b, k)).astype(np.float32)
    up = topics.result(RUN, c.cid)
    c.publish_raw(up, b"\x00\x01garbage")                                         # malformed envelope
    c.reply(task, {"logits": good[:, :-1].copy()})                                  # wrong shape
    nan = good.copy()
    nan[0, 0] = np.nan
    c.reply(task, {"logits": nan})                                                  # NaN
    inf = good.copy()
    inf[1, 1] = np.inf
    c.reply(task, {"logits": inf})                                                  # Inf
    c.reply(task, {"logits": good.astype(np.int32)})                                # wrong dtype
    key = {"e": task.meta["epoch"], "s": task.meta["seq"]}
    data = ["f4", [b, k], good.tobytes()]
    c.publish_raw(up, msgpack.packb([1, key, {"logits": data}]))                    # protocol version 1
    c.publish_raw(up, msgpack.packb([2, {**key, "seq": 1}, {"logits": data}]))      # a protocol key's long name
    c.reply(task, {"logits": good}, seq=int(task.meta["seq"]) - 1)                  # stale
    c.reply(task, {"logits": np.zeros((b * 4000, k), np.float32)})                  # oversized, wrong shape
    chunk = Message({"chunk_of": "x", "index": 0, "count": 2, "size": 50_000_000}, {"data": np.zeros(10, np.uint8)})
    c.publish_raw(up, encode(chunk))                                                # chunk beyond the size limit
    c.publish_raw(topics.result(RUN, "intruder"), encode(Message({"phase": "logits"})))  # unknown client
    c.publish_raw(topics.status(RUN, "c01"), b"{not json")                          # malformed status
    c.publish_raw(topics.status(RUN, "c01"), b'{"state": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")  # deep nesting
    c.publish_raw(up, msgpack.packb([2, {**key, "e": float("inf")}, {"logits": data}]))  # epoch overflows
    c.publish_raw(up, msgpack.packb([2, key, {"logits": ["f4", [0, 2**62], b""]}]))  # empty, no array holds its shape
    c.reply(task, {"logits": good})                                                 # finally, valid
    c.reply(task, {"logits": good})                                                 # and a duplicate


def attack_agent(c: ScriptedClient, instance: str) -> None:
    down = topics.task(RUN, "c00")
    own = {"instance": instance}
    c.publish_raw(down, b"not an envelope")
    c.publish_raw(down, msgpack.packb([2, {"p": "transfer", "x": instance, "epoch": 0, "s": 99}, {}]))  # a long key
    c.publish_raw(down, encode(Message({"phase": "transfer", **own})))  # no sequence number
    c.publish_raw(down, encode(Message({"phase": "transfer", **own, "instance": "an-earlier-run", "epoch": 0, "seq": 10**6})))
    # feedback for a round c00 never uploaded logits in: declined as a missed step (the decline,
    # forged key and all, is stale at the coordinator)
    c.publish_raw(down, encode(Message({"phase": "transfer", **own, "epoch": 0, "seq": 10**6,
                                        "round": 99, "iteration": 0}, {"fbar": np.zeros((3, 3), np.float32)})))
    c.publish_raw(down, msgpack.packb([2, {"p": "transfer", "x": instance, "e": 0, "s": 10**6},
                                       {"fbar": ["f4", [0, 2**62], b""]}]))  # empty, no array holds its shape


@pytest.fixture()
def deployment(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=3, tau=2, public_size=100, seed=3))
    dep = Deployment(config, tmp_path / "dep", mosquitto,
                     phases={"deadline_s": 30.0, "train_deadline_s": 60.0, "quorum": 1.0, "resend_s": 30.0},
                     coordinator={"broker": {"max_message_bytes": 1_000_000}})
    yield dep
    dep.close()


def test_bad_input_is_rejected_counted_and_survived(deployment, mosquitto):
    dep = deployment
    k = 10
    dep.start_coordinator()
    dep.start_agent("c00")
    dep.start_agent("c01")
    c = ScriptedClient(mosquitto, "c02")
    attacked = {"logits": False, "evaluate": False, "agent": False}
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                task = c.tasks.get(timeout=0.2)
            except queue.Empty:
                continue
            phase = task.meta["phase"]
            if wants_logits(task):
                if not attacked["logits"]:
                    attacked["logits"] = True
                    attack_on_logits(c, task, k)
                else:
                    c.reply(task, {"logits": np.zeros((B, k), np.float32)})
            elif phase == "evaluate":
                if not attacked["evaluate"]:
                    attacked["evaluate"] = True
                    c.reply(task, acc=1.5)  # not an accuracy
                c.reply(task, acc=0.5)
            else:
                if not attacked["agent"] and phase == "transfer":
                    attacked["agent"] = True
                    attack_agent(c, task.meta["instance"])
                c.reply(task, loss=0.0)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        final = dep.wait_for(lambda r: r["state"] == "finished", timeout_s=240, what="the run to finish")
    finally:
        done.set()
        server.join(5)
        c.close()
    assert all(attacked.values())
    counters = final["counters"]
    # garbage, shape, NaN, Inf, dtype, version 1, a long key, oversized, chunk limit, intruder, bad status,
    # deeply nested status, overflowing epoch, an impossible empty shape, bad accuracy
    assert counters["rejected"] >= 15, counters
    assert final["rejects"]["envelope"] >= 3, final["rejects"]  # garbage, version 1, the empty shape
    # the stale sequence number, and the duplicate (counted as a duplicate, or as stale once its phase closed)
    assert counters.get("stale", 0) + counters.get("duplicates", 0) >= 2, counters
    assert final["completed_rounds"] == 3
    # every phase counted c02 once: 3 rounds x (local_train + 2 transfers) + 3 evaluations
    assert final["clients"]["c02"]["answered"] == 3 * (1 + 2) + 3
    assert dep.coordinator.poll() is None  # still serving

    for cid in ("c00", "c01"):
        assert dep.agents[cid].wait(timeout=60) == 0
    status = json.loads((dep.agent_path("c00").parent / "agent-status.json").read_text())
    assert status["counters"]["rejected"] >= 4 and status["counters"]["missed_step"] >= 1, status
    assert status["rejects"].get("envelope", 0) >= 2 and not status["counters"].get("errors"), status
    assert status["counters"]["stale"] >= 1, status  # the task of another run instance
    results = dep.results()
    assert results["final"]["client_acc"][2] == 0.5
