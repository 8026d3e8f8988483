"""The coordinator's MQTT side under junk: retained results are cleared on their own topics only
(a run named `up` kept its clients' statuses), the topics it cleared are not remembered for ever,
and a client's ever-new bad answers do not grow an open phase's memory."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from coordinator import bus as bus_module
from coordinator.bus import CoordinatorBus
from fedal.engine.accounting import REFUSED_KEPT, PhaseState


def arriving(topic: str, retain: bool = True, payload: bytes = b"x"):
    return SimpleNamespace(topic=topic, payload=payload, retain=retain)


def test_only_retained_results_are_cleared_whatever_the_run_is_called():
    cleared: list[str] = []
    stub = SimpleNamespace(clear_retained=cleared.append, inbox=SimpleNamespace(put=lambda item: None))
    for topic in ("fedal/v1/up/status/c0", "fedal/v1/up/run", "fedal/v1/r1/status/c0", "fedal/v1/r1/up/c0",
                  "fedal/v1/up/up/c1"):
        CoordinatorBus._on_message(stub, None, None, arriving(topic))
    assert cleared == ["fedal/v1/r1/up/c0", "fedal/v1/up/up/c1"]


def test_the_topics_it_cleared_are_forgotten_after_their_window(monkeypatch):
    """Retained junk under ever-new topics grew the record of cleared topics without bound."""
    bus = object.__new__(CoordinatorBus)
    bus._clears, bus._clear_timers, bus._clear_lock = {}, {}, threading.Lock()
    published: list[str] = []
    bus.client = SimpleNamespace(publish=lambda topic, *a, **k: published.append(topic))
    clock = [1000.0]
    monkeypatch.setattr(bus_module.time, "monotonic", lambda: clock[0])
    for i in range(5 * bus_module.CLEARS_KEPT):
        clock[0] += 0.01
        bus.clear_retained(f"fedal/v1/r1/up/junk-{i}")
    assert len(published) == 5 * bus_module.CLEARS_KEPT  # each topic cleared once
    assert len(bus._clears) <= bus_module.CLEARS_KEPT + 1


def test_a_client_sending_ever_new_bad_answers_is_remembered_within_a_bound():
    state = PhaseState.__new__(PhaseState)
    state.refused = {}
    for i in range(10 * REFUSED_KEPT):
        state.refuse("c0", i.to_bytes(8, "big"))
    kept = state.refused["c0"]
    assert len(kept) == REFUSED_KEPT
    assert (10 * REFUSED_KEPT - 1).to_bytes(8, "big") in kept  # the latest: what a re-send repeats


def test_a_results_bytes_are_its_own_chunks_not_an_abandoned_messages():
    """The chunk bytes of a client's message it never finished were charged to its next result:
    a 10-byte answer counted the 40 KB of chunks before it."""
    import numpy as np

    from coordinator.config import CoordinatorBrokerSettings
    from coordinator.transport import MqttTransport
    from fedal.protocol import Message, encode, split

    transport = MqttTransport(CoordinatorBrokerSettings(url="mqtt://127.0.0.1:1"), "r1", ["c0"])
    big = encode(Message({"phase": "p"}, {"x": np.zeros(10_000, np.float32)}))
    chunks = split(big, 8192)
    assert len(chunks) > 2
    for chunk in chunks[:-1]:  # all but its last: never finished
        assert transport.arrival("fedal/v1/r1/up/c0", chunk) is None
    small = encode(Message({"phase": "p"}, {}))
    arrival = transport.arrival("fedal/v1/r1/up/c0", small)
    assert arrival is not None and arrival.wire_bytes == len(small)
    for chunk in split(big, 8192):  # a whole chunked result: the bytes of all its chunks
        arrival = transport.arrival("fedal/v1/r1/up/c0", chunk)
    assert arrival is not None and arrival.wire_bytes == sum(len(c) for c in split(big, 8192))
