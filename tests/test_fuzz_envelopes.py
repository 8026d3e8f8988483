"""Fuzzing over a real broker: more than 10,000 random and mutated messages (hypothesis) at every
topic a live coordinator and a live agent subscribe to, while the run is paused.

Every message is classified beforehand by an oracle that replays the receiver's own rules on a
mirror of its chunk reassembler: rejected (counted as `rejected`), stale, a valid status, a partial
chunk, or ignored. The assertion is exact: the coordinator's and the agent's counters grow by
exactly what the oracle predicts, so every message was either counted as a reject or handled as
valid, and none was lost to an exception. Afterwards the processes are alive, and the run,
resumed, completes. Messages that would be *accepted* as a genuine task, result or manifest are
not sent: taking over a session that way is what broker ACLs prevent (tests/test_security_*.py).

The junk is published with QoS 1 on the run's topics, so the broker also queues it for every
*offline* persistent session subscribed to them: agents of earlier tests on the shared broker with
the same run id. Nothing is retained, but those queues would greet a later test's agent with over
a thousand junk manifests; the test discards those sessions when it ends.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import replace

import msgpack
import numpy as np
import paho.mqtt.client as mqtt
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from fedal.protocol import (
    EnvelopeError,
    ManifestError,
    Message,
    Reassembler,
    RunManifest,
    encode,
    parse_broker_url,
    split,
    topics,
)
from fedal.sim import load_config
from fedal.sim.runner import client_ids
from hil.fleet import Fleet
from hil.fleet import client_ids as fleet_ids
from tests.deployment import RUN_ID, Deployment

TOKEN = "fuzz-token"
AGENT, EMULATED = "c00", "c01"
ENROLLED = (AGENT, EMULATED)
N_MESSAGES = 10_000
UP, STATUS, DOWN, RUN = "up", "status", "down", "run"


# -- oracles: the receivers' rules, in the order the receivers apply them ----------------------------
class CoordinatorOracle:
    """The coordinator's MQTT transport and round engine on one message, epoch 0 (a fresh run)."""

    def __init__(self, max_size: int):
        self.mirror = Reassembler(max_size=max_size)

    def outcome(self, topic: str, payload: bytes) -> str:
        try:
            t = topics.parse(topic)
        except topics.TopicError:
            return "rejected"
        if t.run != RUN_ID or t.client not in ENROLLED:
            return "rejected"
        if not payload and t.kind in (STATUS, UP):
            return "ignored"  # a cleared retained message (the coordinator clears junk it rejected)
        if t.kind == "status":
            try:
                status = json.loads(payload)
                status["state"], float(status.get("ts", 0.0))
            except Exception:  # the specific handler or the engine's catch-all: a reject either way
                return "rejected"
            return "status"
        try:
            msg = self.mirror.feed(t.client, payload)
        except Exception:
            return "rejected"
        if msg is None:
            return "partial"
        meta = msg.meta  # the sender is the topic's client
        key = (meta.get("epoch"), meta.get("seq"))
        if not all(type(v) is int for v in key):
            return "rejected"
        return "unsafe" if key[0] == 0 else "stale"  # epoch 0 might be the current phase's key


class AgentOracle:
    """Agent._on_manifest / _on_task for a joined agent whose last key is at least (0, 1)."""

    def __init__(self, instance: str):
        self.instance = instance
        self.mirror = Reassembler()

    def outcome(self, topic: str, payload: bytes) -> str:
        if topic == topics.run_manifest(RUN_ID):
            if not payload:
                return "ignored"
            try:
                m = RunManifest.from_json(payload)
            except ManifestError:
                return "rejected"
            except Exception:  # e.g. RecursionError: the agent's worker counts it under errors
                return "errors"
            if m.run_id != RUN_ID or not set(ENROLLED) & set(m.clients):
                return "rejected"
            return "unsafe"  # a manifest this agent (or the emulated one) would adopt
        try:
            task = self.mirror.feed("coordinator", payload)
        except EnvelopeError:
            return "rejected"
        except Exception:
            return "errors"
        if task is None:
            return "partial"
        meta = task.meta  # addressed by its topic
        if meta.get("instance") != self.instance:
            return "stale"
        key = (meta.get("epoch"), meta.get("seq"))
        if not all(type(v) is int for v in key):
            return "rejected"
        return "stale" if key < (0, 1) else "unsafe"


# -- message generators -----------------------------------------------------------------------------
def _bases(instance: str) -> dict[str, list[bytes]]:
    """Valid envelopes to mutate: results for the coordinator (epoch 1000: stale there), tasks for the
    agent (epoch -1: older than anything it handled), and chunked versions of both."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((32, 10), dtype=np.float32)
    up = []
    for _ in ENROLLED:  # the same results on each enrolled client's topic
        own = {"epoch": 1000, "seq": 3}
        up += [
            encode(Message({"phase": "transfer", "round": 0, "iteration": 0, "loss_kd": 0.5, **own}, {"logits": logits})),
            encode(Message({"phase": "evaluate", "round": 0, "iteration": 0, "acc": 0.5, "num_test": 10, **own})),
            encode(Message({"phase": "local_train", "round": 1, "iteration": 0, "loss": 1.0, **own}, {"logits": logits})),
        ]
        up += split(encode(Message({"phase": "transfer", "round": 0, "iteration": 1, **own},
                                   {"logits": rng.standard_normal((300, 10), dtype=np.float32)})), 4096)
    own = {"instance": instance, "epoch": -1, "seq": 7}
    down = [
        encode(Message({"phase": "transfer", "round": 0, "iteration": 0, "n_avg": 2, **own},
                       {"fbar": logits, "grad": logits})),
        encode(Message({"phase": "local_train", "round": 1, "iteration": 0, "steps": 2, **own})),
        encode(Message({"phase": "evaluate", "round": 0, "iteration": 0, **own})),
    ]
    down += split(encode(Message({"phase": "transfer", "round": 0, "iteration": 1, "n_avg": 2, **own},
                                 {"fbar": rng.standard_normal((300, 10), dtype=np.float32)})), 4096)
    return {UP: up, DOWN: down}


DTYPES = ["f4", "f8", "f2", "i4", "i8", "u1", "i1", "b1", "bf16", "c8", "<f4", "F32", "", 4, None, ["f4"]]
ODD_VALUES = [0, 1, -1, 2**40, 2**63, -(2**63), 1.5, -0.0, True, False, None, "1", "", "x" * 70, [], {}, [1, 2],
              {"a": 1}, b"\x00", float("inf"), float("nan")]
META_KEYS = ["v", "p", "r", "i", "e", "s", "x", "phase", "round", "epoch", "chunk_of", "index", "count", "size",
             "n_avg", "acc", "logits"]
DEEP = "[" * 100_000 + "]" * 100_000  # beyond any JSON parser's recursion limit
DEEP_PACK = b"\x91" * 100_000 + b"\x90"  # the same depth of MessagePack arrays
STATUS_ODD = [b"", b"{", b'{"state": "online", "ts": 1' + b"0" * 400 + b"}", b'{"state": ' + DEEP.encode() + b"}",
              b"\xff\xfe{}", '{"state": "online"}'.encode("utf-16"), b'{"state": "online", "ts": NaN}']
# Mosquitto disconnects a client that publishes on a topic with control characters, surrogates or
# noncharacters: leave those out (and the separators and wildcards)
ID_CHARS = st.characters(blacklist_categories=("Cs", "Cc", "Cn"), blacklist_characters="/+#")
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                      st.text(max_size=12))
JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=4), max_leaves=12)


class Drawn:
    """Choices drawn by hypothesis (its boundary-seeking generation)."""

    def __init__(self, draw):
        self.draw = draw

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def pick(self, seq):
        return self.draw(st.sampled_from(seq))

    def bytes(self, lo: int, hi: int) -> bytes:
        return self.draw(st.binary(min_size=lo, max_size=hi))

    def json(self):
        return self.draw(JSON)

    def client_part(self) -> str:
        return self.draw(st.text(ID_CHARS, max_size=70))


class Seeded(Drawn):
    """The same choices from a generator seeded by hypothesis: volume at a fraction of the cost."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def int(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi, endpoint=True))

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def bytes(self, lo: int, hi: int) -> bytes:
        return self.rng.bytes(self.int(lo, hi))

    def json(self, depth: int = 0):
        kind = self.int(0, 7 if depth < 3 else 4)
        if kind <= 4:
            return [None, True, self.int(-(2**62), 2**62), float(self.rng.normal() * 1e3), self.bytes(0, 8).hex()][kind]
        if kind == 5:
            return [self.json(depth + 1) for _ in range(self.int(0, 4))]
        return {self.bytes(0, 3).hex(): self.json(depth + 1) for _ in range(self.int(0, 4))}

    def client_part(self) -> str:
        return "".join(self.pick("abcXYZ09_.-é ~!") for _ in range(self.int(0, 70)))


def _odd_json(value) -> str:
    return json.dumps(value).replace("Infinity", "1e400")  # 1e400: a literal that overflows to infinity


def mutated_envelope(src: Drawn, bases: list[bytes]) -> bytes:
    base = src.pick(bases)
    op = src.pick(["flip", "truncate", "overwrite", "append", "dtype", "shape", "data", "drop", "tensor_spec",
                   "meta_value", "meta_drop", "meta_map", "version", "top", "extra_tensor", "deep"])
    buf = bytearray(base)
    if op == "flip":
        for _ in range(src.int(1, 8)):
            buf[src.int(0, len(buf) - 1)] ^= 1 << src.int(0, 7)
        return bytes(buf)
    if op == "truncate":
        return bytes(buf[: src.int(0, len(buf) - 1)])
    if op == "overwrite":
        pos, chunk = src.int(0, len(buf) - 1), src.bytes(1, 16)
        buf[pos : pos + len(chunk)] = chunk
        return bytes(buf)
    if op == "append":
        return bytes(buf) + src.bytes(1, 64)
    version, meta, tensors = msgpack.unpackb(base)
    names = sorted(tensors)
    if op in ("dtype", "shape", "data", "drop", "tensor_spec") and names:
        name = src.pick(names)
        code, shape, data = tensors[name]
        if op == "dtype":
            tensors[name][0] = src.pick(DTYPES)
        elif op == "shape":
            tensors[name][1] = src.pick([shape[::-1], shape + [1], shape[:-1], [0], [-1], [2**40], [2**64 - 1],
                                         [d * 2 for d in shape], [1] * 9, "x", None, [1.5]])
        elif op == "data":
            tensors[name][2] = src.pick([data[:-1], data + b"\x00", b"", data[: len(data) // 2], "text", None])
        elif op == "drop":
            del tensors[name]
        else:
            tensors[name] = src.pick([[code, shape], [code, shape, data, 1], {"dtype": code}, None, data])
    elif op == "meta_value":
        meta[src.pick(META_KEYS)] = src.pick(ODD_VALUES)
    elif op == "meta_drop" and meta:
        meta.pop(src.pick(sorted(meta)))
    elif op == "meta_map":
        meta = src.pick([None, [], "meta", 1, {1: 2}, {b"p": "x"}])
    elif op == "version":
        version = src.pick([1, 3, -2, 2.0, "2", None, True, []])
    elif op == "top":
        return msgpack.packb(src.pick([[version, meta], [version, meta, tensors, 0], {"v": version}, version, None]))
    elif op == "extra_tensor":
        tensors[src.pick(["zz", "", "logits", "grad"])] = src.pick([["f4", [2], b"\x00" * 8], ["f4", [0], b""], 1])
    else:
        return src.pick([DEEP_PACK, msgpack.packb([version, {"x": [[[[1]]]]}, tensors])])
    try:
        return msgpack.packb([version, meta, tensors])
    except (TypeError, ValueError, OverflowError):  # a mutation msgpack itself cannot write: send the base flipped
        buf[-1] ^= 1
        return bytes(buf)


def status_payload(src: Drawn) -> bytes:
    kind = src.int(0, 5)
    if kind == 0:
        return src.bytes(0, 64)
    if kind == 1:
        return json.dumps(src.json()).encode()
    if kind == 2:  # the right shape with odd values
        doc = {"state": src.pick(["online", "offline", "", "paused", 1, None, [], {}])}
        if src.int(0, 1):
            doc["ts"] = src.pick(["nan", "inf", "1e400", "12.5", [], {}, None, True, -1, 2**80, 1.5e300, src.json()])
        return json.dumps(doc).encode()
    if kind == 3:
        return src.pick(STATUS_ODD)
    raw = json.dumps({"state": "online", "ts": src.int(0, 2_000_000_000) / 7}).encode()
    return raw[: src.int(0, len(raw))]  # truncated (whole: a valid status)


def manifest_payload(src: Drawn, manifest: dict) -> bytes:
    kind = src.int(0, 4)
    if kind == 0:
        return src.bytes(0, 64)
    if kind == 1:
        return json.dumps(src.json()).encode()
    if kind == 2:
        return src.pick([b"", DEEP.encode(), b"{}", b"null"])
    doc = dict(manifest)
    for _ in range(src.int(1, 3)):
        doc[src.pick(sorted(doc) + ["extra"])] = src.pick(ODD_VALUES[:14] + ["other-run", ["zz"], 2, "finished"])
    raw = _odd_json(doc).encode()
    return raw if kind == 3 else raw[: src.int(0, len(raw))]


def fuzz_case(src: Drawn, bases: dict[str, list[bytes]], manifest: dict) -> tuple[str, bytes]:
    """One message for one topic of the run: up/<client>, status/<client>, down/<agent> or run."""
    target = src.pick([UP] * 8 + [STATUS] * 3 + [DOWN] * 7 + [RUN] * 2)
    if target == DOWN:
        return topics.task(RUN_ID, AGENT), mutated_envelope(src, bases[DOWN]) if src.int(0, 3) else src.bytes(0, 300)
    if target == RUN:
        return topics.run_manifest(RUN_ID), manifest_payload(src, manifest)
    who = src.pick(ENROLLED) if src.int(0, 3) else src.client_part()
    topic = f"{topics.ROOT}/{RUN_ID}/{target}/{who}"
    if target == STATUS:
        return topic, status_payload(src)
    return topic, mutated_envelope(src, bases[UP]) if src.int(0, 4) else src.bytes(0, 300)


BATCH = 20  # messages per hypothesis example: one from its own draws, the rest from a seed it draws


@st.composite
def fuzz_batch(draw, bases: dict[str, list[bytes]], manifest: dict) -> list[tuple[str, bytes]]:
    first = fuzz_case(Drawn(draw), bases, manifest)
    seeded = Seeded(draw(st.integers(0, 2**63 - 1)))
    return [first] + [fuzz_case(seeded, bases, manifest) for _ in range(BATCH - 1)]


# -- the test ------------------------------------------------------------------------------------------
def post(url: str, token: str | None) -> int:
    req = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


class Publisher:
    def __init__(self, broker_url: str):
        host, port = broker_url.removeprefix("mqtt://").split(":")
        self.retained: dict[str, bytes] = {}
        self.got = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fuzzer-{time.monotonic_ns()}")
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.loop_start()
        self.inflight: list = []

    def _on_message(self, _c, _u, msg) -> None:
        self.retained[msg.topic] = bytes(msg.payload)
        self.got.set()

    def read_retained(self, topic: str, timeout_s: float = 10) -> bytes:
        self.got.clear()
        self.client.subscribe(topic, qos=1)
        assert self.got.wait(timeout_s), f"nothing retained on {topic}"
        self.client.unsubscribe(topic)
        return self.retained[topic]

    def publish(self, topic: str, payload: bytes) -> None:
        self.inflight.append(self.client.publish(topic, payload, qos=1))
        if len(self.inflight) >= 200:
            self.flush()

    def flush(self) -> None:
        for info in self.inflight:
            info.wait_for_publish(30)
            assert info.is_published()
        self.inflight.clear()

    def close(self) -> None:
        self.flush()
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture()
def deployment(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=2, rounds=3, tau=2, public_size=100, seed=5))
    dep = Deployment(config, tmp_path / "dep", mosquitto, coordinator={"api": {"token": TOKEN}},
                     phases={"quorum": 1.0, "deadline_s": 60.0, "train_deadline_s": 60.0, "resend_s": 60.0,
                             "pause_at": [{"round": 2}]})  # the fuzz lands while the run holds, however fast it is
    yield dep
    dep.close()
    discard_sessions(mosquitto, [f"fedal-agent-{RUN_ID}-{cid}" for cid in client_ids(100) + fleet_ids(100)])


def discard_sessions(broker_url: str, mqtt_ids: list[str]) -> None:
    """Connect once with a clean session under each MQTT client id: the broker drops the persistent
    session of that id and every message queued for it (real agents and emulated fleets of this
    run id, as the project names them)."""
    addr = parse_broker_url(broker_url)
    for mqtt_id in mqtt_ids:
        cid = mqtt_id.encode()
        body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(cid).to_bytes(2, "big") + cid  # MQTT 3.1.1, clean session
        assert len(body) < 128
        with socket.create_connection((addr.host, addr.port), timeout=10) as s:
            s.sendall(bytes([0x10, len(body)]) + body)
            connack = b""
            while len(connack) < 4 and (chunk := s.recv(4 - len(connack))):
                connack += chunk
            assert connack == b"\x20\x02\x00\x00", (mqtt_id, connack)
            s.sendall(b"\xe0\x00")  # DISCONNECT: a clean session ends with its connection


def test_fuzzed_envelopes_are_all_counted_and_survived(deployment, mosquitto):
    dep = deployment
    api = f"{dep.api}/api/v1/runs/{RUN_ID}"
    fleet = Fleet(mosquitto, RUN_ID, [EMULATED], seed=3)
    pub = None
    try:
        dep.start_coordinator()
        dep.start_agent(AGENT)
        fleet.start()
        held = dep.wait_held(2, timeout_s=180)  # round 1 done, no phase open, none starts
        assert held["completed_rounds"] == 1
        before = held["counters"]
        fleet_before = fleet.totals()

        pub = Publisher(mosquitto)
        manifest = json.loads(pub.read_retained(topics.run_manifest(RUN_ID)))
        coord = CoordinatorOracle(max_size=dep.coord_config.get("broker", {}).get("max_message_bytes", 64 * 1024 * 1024))
        agent = AgentOracle(manifest["instance"])
        bases = _bases(manifest["instance"])
        want: dict[str, Counter] = {"coordinator": Counter(), "agent": Counter(), "manifest": Counter()}
        sent = {"n": 0, "skipped": 0}

        fuzz_seed = int(os.environ.get("FEDAL_FUZZ_SEED") or random.getrandbits(32))
        print(f"fuzz seed {fuzz_seed} (FEDAL_FUZZ_SEED={fuzz_seed} repeats this run's messages)")

        @seed(fuzz_seed)
        @settings(max_examples=int(N_MESSAGES * 1.1) // BATCH, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(fuzz_batch(bases, manifest))
        def throw(batch):
            for topic, payload in batch:
                judge_and_send(topic, payload)

        def judge_and_send(topic: str, payload: bytes) -> None:
            kind = topic.split("/")[3]
            side, oracle = ("agent", agent) if kind in (DOWN, RUN) else ("coordinator", coord)
            saved = _snapshot(oracle.mirror)
            outcome = oracle.outcome(topic, payload)
            if outcome == "unsafe":  # not sent: the receiver never sees it, so neither may its mirror
                oracle.mirror._open = saved
                sent["skipped"] += 1
                return
            want[side][outcome] += 1
            if kind == RUN:
                want["manifest"][outcome] += 1
            pub.publish(topic, payload)
            sent["n"] += 1

        throw()
        pub.flush()
        assert sent["n"] >= N_MESSAGES, sent
        print(f"sent {sent}; expected outcomes {dict(want['coordinator'])} (coordinator), {dict(want['agent'])} (agent)")

        expected_rejected = before.get("rejected", 0) + want["coordinator"].get("rejected", 0)
        expected_stale = before.get("stale", 0) + want["coordinator"].get("stale", 0)
        counters = _settle(dep, lambda c: (c.get("rejected", 0), c.get("stale", 0)), (expected_rejected, expected_stale))
        assert (counters.get("rejected", 0), counters.get("stale", 0)) == (expected_rejected, expected_stale), (
            counters, want["coordinator"])
        assert counters.get("duplicates", 0) == before.get("duplicates", 0)
        assert dep.coordinator.poll() is None and dep.agents[AGENT].poll() is None  # both alive

        assert post(f"{api}/resume", TOKEN) == 200
        final = dep.wait_for(lambda r: r["state"] == "finished", timeout_s=240, what="the resumed run to finish")
        assert dep.agents[AGENT].wait(timeout=60) == 0
        assert fleet.wait_finished(30)
    finally:
        if pub is not None:
            pub.close()
        fleet.stop()
    assert final["completed_rounds"] == 3
    assert all(info["late"] == 0 for info in final["clients"].values())

    status = json.loads((dep.agent_path(AGENT).parent / "agent-status.json").read_text())
    got = status["counters"]
    assert got.get("rejected", 0) == want["agent"].get("rejected", 0), (got, want["agent"])
    assert got.get("errors", 0) == want["agent"].get("errors", 0), (got, want["agent"])
    assert got.get("stale", 0) >= want["agent"].get("stale", 0), (got, want["agent"])
    emulated = fleet.totals()  # it heard the manifest fuzz too, and judged it the same way
    assert emulated["rejected"] - fleet_before["rejected"] == want["manifest"]["rejected"], want["manifest"]
    assert emulated["errors"] - fleet_before["errors"] == want["manifest"]["errors"], want["manifest"]


def _settle(dep, read, target, timeout_s: float = 90.0) -> dict:
    """The coordinator's counters once they reach `target` (or stop moving short of it)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        counters = dep.run()["counters"]
        value = read(counters)
        if value == target:
            return counters
        if value != last:
            last, since = value, time.monotonic()
        elif time.monotonic() - since > 15:
            return counters
        time.sleep(0.3)
    return dep.run()["counters"]


def _snapshot(mirror: Reassembler) -> dict:
    """The mirror's open partial messages, copied deep enough to roll a feed back."""
    return {k: replace(p, parts=dict(p.parts)) for k, p in mirror._open.items()}
