"""An evaluate result's privacy values are checked as any other phase's: its epsilon goes into
the client's ledger, which the API serves as JSON (a NaN there failed GET /api/v1/clients for
every run) and which only grows (max(nan, x) is nan for ever)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from coordinator.config import CoordinatorConfig
from fedal.engine.rounds import RoundEngine
from fedal.engine.transport import Arrival
from fedal.protocol import Message
from fedal.strategies.base import PhaseTasks
from tests.helpers import ScriptedTransport

CLIENTS = ["pi-1", "pi-2"]


def _engine() -> tuple[RoundEngine, ScriptedTransport]:
    transport = ScriptedTransport()
    phases = CoordinatorConfig().phases.model_copy(update={"quorum": 0.5, "deadline_s": 60.0, "resend_s": 1e9})
    server = SimpleNamespace(client_ids=CLIENTS, validate=lambda phase, cid, msg: None)
    return RoundEngine(server, transport, run_id="r", phases=phases, phase_kinds={}, rounds=1), transport


def _evaluate() -> PhaseTasks:
    return PhaseTasks("evaluate", 0, 0, {c: Message({"phase": "evaluate", "round": 0, "iteration": 0}) for c in CLIENTS})


def _answer(cid: str, **meta) -> Arrival:
    return Arrival("result", cid, "r", message=Message({"epoch": 0, "seq": 1, "acc": 0.5, **meta}))


@pytest.mark.parametrize("bad", [{"epsilon": "nan"}, {"epsilon": -3.0}, {"epsilon": True}, {"epsilon": "1.0"},
                                 {"noise_multiplier": -7.0}, {"noise_multiplier": "1.0"}, {"dp_exhausted": 1}])
def test_an_evaluate_result_with_a_malformed_privacy_value_is_refused_and_counted(bad):
    engine, transport = _engine()
    transport.queue.extend([_answer("pi-1", **bad), _answer("pi-2", epsilon=1.5, noise_multiplier=1.1)])
    state = engine.run_phase(_evaluate())
    assert set(state.results) == {"pi-2"} and state.pending == {"pi-1"}  # refused: still waited for
    assert engine.reject_reasons["privacy"] == 1 and engine.clients["pi-1"].rejected == 1
    one = engine.clients["pi-1"]
    assert one.epsilon is None and one.noise_multiplier is None and one.dp_exhausted is False
    assert engine.clients["pi-2"].epsilon == 1.5 and engine.clients["pi-2"].noise_multiplier == 1.1
    json.dumps([vars(info) for info in engine.clients.values()], allow_nan=False)  # what the API can serve
