"""One device with valid credentials cannot make the coordinator's memory grow without bound or
hold back the other clients' messages by flooding its own topics (a fleet provisioned by
`fedal fleet init`, its broker config run by a real Mosquitto, the coordinator's own transport and
engine): paho reads everything off the socket at once, so the coordinator's inbox keeps each
sender within a byte budget, and what comes beyond is dropped unread and counted against it."""

from __future__ import annotations

import json
import queue
import threading
import time
from types import SimpleNamespace

from coordinator.config import CoordinatorConfig
from coordinator.inbox import OVERHEAD_BYTES, UNKNOWN_SENDERS, Inbox
from coordinator.transport import INBOX_SLACK_BYTES, MqttTransport
from fedal.engine.rounds import RoundEngine
from fedal.protocol import topics
from tests.fleet_broker import RawClient, provision, start_broker

RUN = "fleet"


def test_the_inbox_keeps_each_sender_within_its_budget_and_in_order():
    inbox = Inbox(per_sender_bytes=3 * (1000 + OVERHEAD_BYTES))
    for i in range(5):
        inbox.put((topics.status(RUN, "pi-3"), bytes([i]) * 1000))
    inbox.put((topics.status(RUN, "pi-1"), b"x" * 1000))
    inbox.put(("$connected", b""))
    got = [inbox.get(timeout=1) for _ in range(5)]
    # the senders take turns, each one's messages in their order: pi-3's backlog waits behind
    # no one, and no one waits behind it
    assert [g[0] for g in got] == [topics.status(RUN, "pi-3"), topics.status(RUN, "pi-1"), "$connected",
                                   topics.status(RUN, "pi-3"), topics.status(RUN, "pi-3")]
    assert [g[1][0] for g in got if g[0] == topics.status(RUN, "pi-3")] == [0, 1, 2]
    assert inbox.take_dropped() == {"pi-3": 2} and inbox.take_dropped() == {}
    inbox.put((topics.status(RUN, "pi-3"), b"y" * 1000))  # room again once handled
    assert inbox.get(timeout=1)[1] == b"y" * 1000 and inbox.waiting_bytes("pi-3") == 0
    t0 = time.monotonic()
    try:
        inbox.get(timeout=0.2)
        raise AssertionError("an empty inbox returned an item")
    except queue.Empty:
        assert time.monotonic() - t0 >= 0.15


def test_a_senders_backlog_does_not_hold_back_the_others():
    """In one queue a device's budget of small messages (a few hundred thousand) went ahead of
    every other client's: another client's status waited tens of seconds behind it."""
    inbox = Inbox(per_sender_bytes=100_000 * (1 + OVERHEAD_BYTES))
    for _ in range(100_000):
        inbox.put((topics.result(RUN, "pi-3"), b"j"))
    inbox.put((topics.status(RUN, "pi-1"), b"online"))
    assert [inbox.get(timeout=1)[0] for _ in range(2)] == [topics.result(RUN, "pi-3"), topics.status(RUN, "pi-1")]
    assert all(inbox.get(timeout=1)[0] == topics.result(RUN, "pi-3") for _ in range(99_999))
    assert inbox.waiting_bytes("pi-3") == 0


def test_made_up_sender_ids_share_one_budget():
    """On a broker without the fleet's ACL anyone may publish under any number of made-up ids:
    with a budget each, the inbox would hold without bound."""
    inbox = Inbox(per_sender_bytes=2 * (1000 + OVERHEAD_BYTES), known=["pi-1"])
    for i in range(100):
        inbox.put((topics.status(RUN, f"made-up-{i}"), b"z" * 1000))
    inbox.put((topics.status(RUN, "pi-1"), b"real"))
    assert inbox.waiting_bytes(UNKNOWN_SENDERS) == 2 * (1000 + OVERHEAD_BYTES)
    assert inbox.take_dropped() == {UNKNOWN_SENDERS: 98}
    got = [inbox.get(timeout=1) for _ in range(3)]
    assert [g[1] for g in got] == [b"z" * 1000, b"real", b"z" * 1000]  # the client's own budget untouched


def test_a_device_flooding_its_status_topic_is_cut_off_and_counted_while_others_get_through(tmp_path):
    files = provision(tmp_path, 3, run_id=RUN)
    broker = start_broker(files, tmp_path / "mosquitto")
    settings = files.coordinator_settings(max_message_bytes=64 * 1024)
    transport = MqttTransport(settings, RUN, ["pi-1", "pi-2", "pi-3"])
    server = SimpleNamespace(client_ids=["pi-1", "pi-2", "pi-3"])
    engine = RoundEngine(server, transport, run_id=RUN, phases=CoordinatorConfig().phases, phase_kinds={}, rounds=1)
    stop = threading.Event()
    attacker = honest = None
    try:
        assert transport.start(stop)
        attacker = RawClient(files.port, "pi-3", files.password("pi-3"), "pi-3")
        honest = RawClient(files.port, "pi-1", files.password("pi-1"), "pi-1")
        assert attacker.accepted and honest.accepted
        junk = json.dumps({"state": "online", "ts": 1, "pad": "x" * 60_000}).encode()
        sent = 60  # 3.6 MB, while the coordinator handles nothing
        for _ in range(sent):
            attacker.c.publish(topics.status(RUN, "pi-3"), junk, qos=1).wait_for_publish(10)
        honest.c.publish(topics.status(RUN, "pi-1"), json.dumps({"state": "online", "ts": 1}).encode(),
                         qos=1).wait_for_publish(10)
        budget = transport.inbox.per_sender_bytes
        assert budget == 64 * 1024 + INBOX_SLACK_BYTES
        deadline = time.monotonic() + 30
        while not transport.inbox.waiting_bytes("pi-1") and time.monotonic() < deadline:
            time.sleep(0.05)  # the honest status is in, behind what the budget let through
        assert transport.inbox.waiting_bytes("pi-3") <= budget
        handled = 0
        while not engine.clients["pi-1"].online and handled < 100:
            arrival = transport.receive(1.0)
            if arrival is not None:
                engine.handle(arrival)
                handled += 1
        assert engine.clients["pi-1"].online
        kept = budget // (len(junk) + OVERHEAD_BYTES)
        assert handled <= kept + 3  # the rest was never queued: dropped unread
        for _ in range(20):  # what is left of the attacker's, and the report of its drops
            arrival = transport.receive(0.2)
            if arrival is not None:
                engine.handle(arrival)
        assert engine.reject_reasons["flood"] == sent - kept
        assert engine.reject_reasons["status"] == kept  # each larger than a status may be
        assert engine.clients["pi-3"].rejected == sent
        assert engine.clients["pi-1"].rejected == 0
    finally:
        for c in (attacker, honest):
            if c is not None:
                c.close()
        transport.stop()
        broker.stop()
