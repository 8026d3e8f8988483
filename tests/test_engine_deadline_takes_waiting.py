"""A phase that closes at its deadline first takes the answers its clients sent in time and that
still wait in the coordinator's inbox (docs/protocol.md section 8): the engine handles one
message at a time, and when handling is slow (a large result to check, a burst of statuses) an
answer that reached the broker well before the deadline was counted late and left out of the
phase. An answer that comes after the deadline is still late. And a phase's latencies are
measured to each answer's arrival, not to the moment the engine got to it."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import paho.mqtt.client as mqtt
import pytest

from coordinator.config import CoordinatorBrokerSettings, CoordinatorConfig
from coordinator.inbox import OVERHEAD_BYTES, Inbox
from coordinator.transport import MqttTransport
from fedal.engine import rounds
from fedal.engine.inprocess import SimulatedTransport
from fedal.engine.rounds import RoundEngine
from fedal.engine.transport import Arrival
from fedal.protocol import Message, decode, encode, parse_broker_url, topics
from fedal.strategies import InvalidResult
from fedal.strategies.base import PhaseTasks

RUN = "drain"
CLIENTS = ["pi-1", "pi-2", "pi-3"]
CHECK_S = 0.4  # what the server takes to check one result: two of them outlast the deadline
DEADLINE_S = 0.5


class EchoDevices:
    """Devices on the broker that answer each task with an empty result, `delay_s[cid]` after it."""

    def __init__(self, url: str, delay_s: dict[str, float]):
        broker = parse_broker_url(url)
        self.delay_s = delay_s
        self.timers: list[threading.Timer] = []
        self.ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="echo-devices")
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(f"{topics.ROOT}/{RUN}/down/+", qos=1)
        self.client.on_subscribe = lambda c, u, mid, rc, p: self.ready.set()
        self.client.on_message = self._on_task
        self.client.connect(broker.host, broker.port)
        self.client.loop_start()
        assert self.ready.wait(10), "the echo devices never subscribed"

    def _on_task(self, client, userdata, message) -> None:
        cid = message.topic.rsplit("/", 1)[-1]
        task = decode(bytes(message.payload))
        answer = encode(Message({"epoch": task.meta["epoch"], "seq": task.meta["seq"]}))
        timer = threading.Timer(self.delay_s.get(cid, 0.0),
                                lambda: self.client.publish(topics.result(RUN, cid), answer, qos=1))
        self.timers.append(timer)
        timer.start()

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.client.loop_stop()
        self.client.disconnect()


def _slow_server():
    def validate(phase, cid, msg) -> None:
        time.sleep(CHECK_S)

    return SimpleNamespace(client_ids=CLIENTS, validate=validate)


@pytest.mark.parametrize("pi3_after_s, pi3_late", [(0.0, False), (1.5, True)], ids=["in_time", "after_deadline"])
def test_answers_that_came_in_time_are_taken_before_the_phase_closes(mosquitto, pi3_after_s, pi3_late):
    transport = MqttTransport(CoordinatorBrokerSettings(url=mosquitto), RUN, CLIENTS)
    phases = CoordinatorConfig().phases.model_copy(update={"deadline_s": DEADLINE_S, "quorum": 0.5, "resend_s": 1e9})
    engine = RoundEngine(_slow_server(), transport, run_id=RUN, phases=phases, phase_kinds={}, rounds=1)
    devices = None
    try:
        assert transport.start(threading.Event())
        devices = EchoDevices(mosquitto, {"pi-3": pi3_after_s})
        phase = PhaseTasks("transfer", 0, 0, {c: Message({"phase": "transfer", "round": 0, "iteration": 0})
                                              for c in CLIENTS})
        opened = time.monotonic()
        state = engine.run_phase(phase)
        took = time.monotonic() - opened
        # pi-1 and pi-2 alone keep the engine busy past the deadline (2 x CHECK_S), and they are the quorum
        assert took >= 2 * CHECK_S
        # each answer's latency runs to its arrival, not to its turn after the others' checks
        assert len(state.latencies) == len(state.results) and max(state.latencies) < CHECK_S / 2
        if pi3_late:
            assert set(state.results) == {"pi-1", "pi-2"} and state.pending == {"pi-3"}
            assert engine.clients["pi-3"].late == 1
            assert took < pi3_after_s  # closed at once, not kept open for an answer after the deadline
        else:
            # pi-3's answer reached the broker within milliseconds of the tasks: not late for
            # having waited behind the other two
            assert set(state.results) == set(CLIENTS) and not state.pending
            assert all(info.late == 0 for info in engine.clients.values())
    finally:
        if devices is not None:
            devices.close()
        transport.stop()


def test_the_inbox_gives_what_came_by_a_time_from_the_senders_asked_only():
    inbox = Inbox(per_sender_bytes=10 * (100 + OVERHEAD_BYTES))
    inbox.put((topics.result(RUN, "pi-1"), b"a" * 100))
    inbox.put((topics.status(RUN, "pi-2"), b"s" * 100))  # not a result: keeps its place
    inbox.put((topics.result(RUN, "pi-2"), b"b" * 100))
    inbox.put((topics.result(RUN, "pi-2"), b"c" * 100))
    cut = time.monotonic()
    time.sleep(0.01)
    inbox.put((topics.result(RUN, "pi-3"), b"d" * 100))  # after the cut
    inbox.put((topics.result(RUN, "pi-2"), b"e" * 100))  # after the cut
    pi3, pi23 = {topics.result(RUN, "pi-3")}, {topics.result(RUN, "pi-2"), topics.result(RUN, "pi-3")}
    assert inbox.get_received_by(cut, pi3) is None  # its only message came later
    assert inbox.get_received_by(cut, pi23)[1] == b"b" * 100
    assert inbox.get_received_by(cut, pi23)[1] == b"c" * 100
    assert inbox.get_received_by(cut, pi23) is None
    assert inbox.waiting_bytes("pi-2") == 2 * (100 + OVERHEAD_BYTES)  # the taken ones are off its budget
    # the rest in the senders' turns as before: pi-1 was never asked for, pi-2's status kept its turn
    assert [inbox.get(timeout=1)[1][:1] for _ in range(4)] == [b"a", b"s", b"d", b"e"]
    assert inbox.waiting_bytes("pi-2") == 0


def _offline_engine(validate, deadline_s: float):
    """The coordinator's engine and MQTT transport without a broker: what arrives is put into the
    inbox as paho's thread would; the tasks sent are recorded."""
    transport = MqttTransport(CoordinatorBrokerSettings(url="mqtt://127.0.0.1:1"), RUN, CLIENTS)
    sent: list[str] = []
    transport.send = lambda cid, packet: sent.append(cid) or packet.size  # type: ignore[method-assign]
    phases = CoordinatorConfig().phases.model_copy(update={"deadline_s": deadline_s, "quorum": 0.5, "resend_s": 1e9})
    engine = RoundEngine(SimpleNamespace(client_ids=CLIENTS, validate=validate), transport, run_id=RUN, phases=phases,
                         phase_kinds={}, rounds=1)
    return engine, transport, sent


def _answer(cid: str, **meta) -> tuple[str, bytes]:
    return topics.result(RUN, cid), encode(Message({"epoch": 0, "seq": 1, **meta}))


def _phase() -> PhaseTasks:
    return PhaseTasks("transfer", 0, 0, {c: Message({"phase": "transfer", "round": 0, "iteration": 0}) for c in CLIENTS})


def test_a_pending_clients_status_waits_for_its_turn_and_re_sends_nothing():
    """A status taken at the deadline ("online" after a reconnect) re-sent the whole task of a
    phase about to close: the device computed it for nothing, ahead of the next phase's task."""
    engine, transport, sent = _offline_engine(lambda phase, cid, msg: time.sleep(0.2), deadline_s=0.3)
    for item in (_answer("pi-1"), _answer("pi-2"),
                 (topics.status(RUN, "pi-3"), json.dumps({"state": "online", "ts": time.time() + 60}).encode())):
        transport.inbox.put(item)
    state = engine.run_phase(_phase())
    assert set(state.results) == {"pi-1", "pi-2"} and state.pending == {"pi-3"}
    assert sorted(sent) == CLIENTS  # each task once
    assert transport.inbox.waiting_bytes("pi-3") > 0  # the status is still there, for the next turn


def test_a_pending_clients_backlog_of_bad_results_holds_the_phase_open_only_so_long(monkeypatch):
    monkeypatch.setattr(rounds, "DRAIN_MIN_S", 0.3)

    def validate(phase, cid, msg) -> None:
        time.sleep(0.1)
        if cid == "pi-3":
            raise InvalidResult("not an answer")

    engine, transport, _ = _offline_engine(validate, deadline_s=0.25)
    transport.inbox.put(_answer("pi-1"))
    transport.inbox.put(_answer("pi-2"))
    for i in range(30):  # 3 s of checks, all of them sent in time
        transport.inbox.put(_answer("pi-3", n=i))
    opened = time.monotonic()
    state = engine.run_phase(_phase())
    took = time.monotonic() - opened
    assert set(state.results) == {"pi-1", "pi-2"} and engine.clients["pi-3"].late == 1
    assert 2 <= engine.clients["pi-3"].rejected < 12 and took < 1.5  # not the 3 s the whole backlog takes


class _Queued(SimulatedTransport):
    def _compute(self, items):
        raise AssertionError("nothing is computed here")

    def client_states(self):
        return {}  # it hosts no clients

    def load_client_states(self, states):
        assert states == {}


def test_a_simulated_transport_gives_the_earliest_due_arrival_of_the_clients_asked():
    transport = _Queued(RUN, CLIENTS, CoordinatorConfig().phases, {})
    for at, cid in [(5.0, "pi-1"), (2.0, "pi-2"), (9.0, "pi-2"), (1.0, "pi-3")]:
        transport._arrive(at, Arrival("result", cid, RUN))
    transport._arrive(0.5, Arrival("status", "pi-1", RUN))  # not a result: never taken here
    transport.clock = 6.0
    first = transport.arrived_by(6.0, {"pi-1", "pi-2"})
    assert first is not None and first.client == "pi-2"
    second = transport.arrived_by(6.0, {"pi-1", "pi-2"})
    assert second is not None and second.client == "pi-1"
    assert transport.arrived_by(6.0, {"pi-1", "pi-2"}) is None  # pi-2's next is due at 9
    assert transport.clock == 6.0  # taking what was due does not move the clock
    assert [(a.kind, a.client) for a in (transport.receive(0.0), transport.receive(0.0))] == [
        ("status", "pi-1"), ("result", "pi-3")]  # the others left in their order


def test_a_simulated_transports_queue_and_clock_survive_a_checkpoint(tmp_path):
    """What a simulation's checkpoint keeps of its transport (fedal/sim/checkpoint.py): the clock,
    the arrivals still due (a straggler's result, its message whole) in their order, through a
    file read with weights_only; the restored transport hands them out as the first would."""
    import numpy as np
    import torch

    from fedal.protocol import Message

    first = _Queued(RUN, CLIENTS, CoordinatorConfig().phases, {})
    late = Message({"epoch": 0, "seq": 7, "acc": 0.5}, {"logits": np.arange(6, dtype=np.float32).reshape(2, 3)})
    first._arrive(9.0, Arrival("result", "pi-2", RUN, wire_bytes=120, message=late))
    first._arrive(4.0, Arrival("status", "pi-1", RUN, payload=b'{"state": "online"}'))
    first._arrive(4.0, Arrival("result", "pi-3", RUN))
    first.clock = 3.5
    torch.save(first.saved(), tmp_path / "t.pt")
    second = _Queued(RUN, CLIENTS, CoordinatorConfig().phases, {})
    second.restore_saved(torch.load(tmp_path / "t.pt", weights_only=True))
    assert second.clock == 3.5
    for _ in range(3):
        a, b = first.receive(10.0), second.receive(10.0)
        assert (a.kind, a.client, a.payload, a.wire_bytes) == (b.kind, b.client, b.payload, b.wire_bytes)
        assert (a.message is None) == (b.message is None) and first.clock == second.clock
        if a.message is not None:
            assert a.message.meta == b.message.meta and np.array_equal(a.message.tensors["logits"], b.message.tensors["logits"])
    first._arrive(1.0, Arrival("result", "pi-1", RUN))
    second._arrive(1.0, Arrival("result", "pi-1", RUN))
    assert first._queue[0][1] == second._queue[0][1]  # the arrivals' order goes on where it stood
