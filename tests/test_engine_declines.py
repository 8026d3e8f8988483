"""A client that will not answer its task says so (`declined`, docs/protocol.md section 8): the
phase stops waiting for it and closes once the others have answered, never at its deadline; a
malformed decline is rejected (the client stays pending), a repeated one is a duplicate."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from coordinator.config import CoordinatorConfig
from fedal.engine.rounds import RoundEngine
from fedal.engine.transport import Arrival
from fedal.protocol import Message
from fedal.session import declining
from fedal.strategies.base import PhaseTasks
from tests.helpers import ScriptedTransport

CLIENTS = ["pi-1", "pi-2", "pi-3"]


def _engine(quorum: float = 0.5) -> tuple[RoundEngine, ScriptedTransport]:
    transport = ScriptedTransport()
    phases = CoordinatorConfig().phases.model_copy(update={"quorum": quorum, "deadline_s": 60.0, "resend_s": 1e9})
    server = SimpleNamespace(client_ids=CLIENTS, validate=lambda phase, cid, msg: None)
    return RoundEngine(server, transport, run_id="r", phases=phases, phase_kinds={}, rounds=1), transport


def _phase() -> PhaseTasks:
    return PhaseTasks("transfer", 1, 0, {cid: Message({"phase": "transfer", "round": 1, "iteration": 0}) for cid in CLIENTS})


def _result(cid: str, msg: Message) -> Arrival:
    return Arrival("result", cid, "r", message=msg)


def _decline(cid: str, key: tuple[int, int] = (0, 1), reason: str = "sat_out") -> Arrival:
    packet = declining(Message({"epoch": key[0], "seq": key[1]}), reason)
    assert packet is not None
    return _result(cid, packet.message)


def test_a_phase_whose_other_clients_declined_closes_at_once():
    engine, transport = _engine(quorum=1.0)
    transport.queue.extend([_result("pi-1", Message({"epoch": 0, "seq": 1})), _decline("pi-2"), _decline("pi-3")])
    state = engine.run_phase(_phase())
    assert transport.t < 1.0  # never near its 60 s deadline (quorum 1.0 without declines: it waited for ever)
    assert set(state.results) == {"pi-1"} and state.declined == {"pi-2": "sat_out", "pi-3": "sat_out"}
    assert engine.counters["declined"] == 2 and engine.clients["pi-2"].declined == 1
    assert engine.counters["quorum_missed"] == 0  # the quorum counts the clients that did not decline
    assert all(info.late == 0 and info.rejected == 0 for info in engine.clients.values())


def test_the_quorum_at_the_deadline_counts_the_clients_that_did_not_decline():
    engine, transport = _engine(quorum=0.5)
    transport.queue.extend([_decline("pi-2"), _result("pi-1", Message({"epoch": 0, "seq": 1}))])
    state = engine.run_phase(_phase())  # pi-3 never answers: 1 of 2 is the quorum, so the deadline closes it
    assert 60.0 <= transport.t < 61.0
    assert set(state.results) == {"pi-1"} and state.pending == {"pi-3"} and engine.clients["pi-3"].late == 1
    assert engine.counters["quorum_missed"] == 0 and engine.clients["pi-2"].late == 0


def test_a_malformed_decline_is_rejected_and_a_repeated_one_is_a_duplicate():
    engine, transport = _engine(quorum=1.0)
    transport.queue.extend([
        _result("pi-1", Message({"epoch": 0, "seq": 1, "declined": 7})),
        _result("pi-1", Message({"epoch": 0, "seq": 1, "declined": ""})),
        _result("pi-1", Message({"epoch": 0, "seq": 1, "declined": "x" * 65})),
        _result("pi-1", Message({"epoch": 0, "seq": 1, "declined": "sat_out"}, {"logits": np.zeros(2, np.float32)})),
        _decline("pi-1", key=(0, 9)),  # another phase's: stale
        _decline("pi-1"), _decline("pi-1"),
        _result("pi-2", Message({"epoch": 0, "seq": 1})), _decline("pi-3"),
    ])
    state = engine.run_phase(_phase())
    assert engine.clients["pi-1"].rejected == 4 and engine.counters["stale"] == 1
    assert engine.clients["pi-1"].declined == 1 and engine.clients["pi-1"].duplicates == 1
    assert set(state.declined) == {"pi-1", "pi-3"} and set(state.results) == {"pi-2"}
    assert sum(engine.reject_reasons.values()) == 4 and all("declined" in r for r in engine.round_rejects)


def test_a_decline_names_its_task_and_nothing_else():
    packet = declining(Message({"phase": "transfer", "round": 3, "iteration": 1, "epoch": 2, "seq": 40}), "sat_out")
    assert packet is not None and packet.message.meta == {"declined": "sat_out", "epoch": 2, "seq": 40}
    assert not packet.message.tensors
    assert declining(Message({"epoch": 2.0, "seq": 40}), "sat_out") is None  # no answer could name it


def _phase_of(cids: list[str], name: str = "transfer") -> PhaseTasks:
    return PhaseTasks(name, 1, 0, {c: Message({"phase": name, "round": 1, "iteration": 0}) for c in cids})


def test_a_client_cannot_decline_a_task_it_was_not_sent():
    """FedAvg's init phase lists one client: others declining it (by guessing its key) neither
    count nor lower its quorum, so it waits for its client as before."""
    engine, transport = _engine(quorum=0.5)
    transport.queue.extend([_decline("pi-2"), _decline("pi-3"), _decline("pi-3")])
    waited = transport.receive

    def receive(timeout_s):
        if transport.t > 300:  # five deadlines: it waits for pi-1, as documented
            transport.queue.append(_result("pi-1", Message({"epoch": 0, "seq": 1})))
        return waited(timeout_s)

    transport.receive = receive  # type: ignore[method-assign]
    state = engine.run_phase(_phase_of(["pi-1"], "init"))
    assert set(state.results) == {"pi-1"} and not state.declined and transport.t > 300
    assert engine.clients["pi-2"].rejected == 1 and engine.clients["pi-3"].rejected == 1
    assert engine.clients["pi-3"].duplicates == 1  # its re-send: refused once, then a duplicate
    assert engine.counters["declined"] == 0 and engine.clients["pi-1"].late == 0


def test_a_re_sent_malformed_decline_is_rejected_once_and_a_decline_proves_the_client_online():
    engine, transport = _engine(quorum=1.0)
    bad = Message({"epoch": 0, "seq": 1, "declined": 7})
    transport.queue.extend([_result("pi-1", bad), _result("pi-1", bad), _result("pi-1", bad), _decline("pi-1"),
                            _decline("pi-2"), _result("pi-3", Message({"epoch": 0, "seq": 1}))])
    assert not engine.clients["pi-1"].online
    events: list[tuple[str, dict]] = []
    engine.notify = lambda kind, **fields: events.append((kind, fields))
    engine.run_phase(_phase())
    assert ("client", {"client": "pi-1", "online": True}) in events
    assert engine.clients["pi-1"].rejected == 1 and engine.clients["pi-1"].duplicates == 2
    assert engine.clients["pi-1"].declined == 1 and engine.clients["pi-1"].online
