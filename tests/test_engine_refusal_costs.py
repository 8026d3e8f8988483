"""What a misbehaving client costs the round engine stays bounded: a status toggled offline and
online re-sends its whole task at most once per `resend_s` (it was once per toggle: 45 bytes of
statuses for a whole model), and a refused message's reason is clipped, kept among a bounded
number, and logged at a limited rate per client."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

from coordinator.config import CoordinatorConfig
from fedal.engine.accounting import PhaseState
from fedal.engine.rounds import MAX_REJECT_REASONS, RoundEngine
from fedal.engine.transport import Arrival, Transport
from fedal.protocol import Packet


class ClockTransport(Transport):
    def __init__(self):
        self.t = 100.0
        self.sent: list[str] = []

    def start(self, should_stop) -> bool:
        return True

    def send(self, client_id: str, packet) -> int:
        self.sent.append(client_id)
        return packet.size

    def receive(self, timeout_s: float) -> Arrival | None:
        return None

    def now(self) -> float:
        return self.t


def _engine(resend_s: float = 30.0) -> tuple[RoundEngine, ClockTransport]:
    transport = ClockTransport()
    phases = CoordinatorConfig().phases.model_copy(update={"resend_s": resend_s})
    engine = RoundEngine(SimpleNamespace(client_ids=["pi-1", "pi-2"]), transport, run_id="r", phases=phases,
                         phase_kinds={}, rounds=1)
    return engine, transport


def _status(cid: str, state: str) -> Arrival:
    return Arrival("status", cid, "r", json.dumps({"state": state, "ts": time.time()}).encode())


def test_a_status_toggled_offline_and_online_re_sends_the_task_at_most_once_per_resend_s():
    engine, transport = _engine(resend_s=30.0)
    packets = {cid: Packet(payload=b"t" * 1000) for cid in ("pi-1", "pi-2")}
    engine.current = PhaseState(SimpleNamespace(), (0, 1), packets, {"pi-1", "pi-2"}, started=transport.t,
                                wall_started=time.time() - 1)
    for _ in range(200):
        engine.handle(_status("pi-1", "offline"))
        engine.handle(_status("pi-1", "online"))
    assert transport.sent == ["pi-1"]  # the first reconnect: the task sent while it was away is re-sent
    transport.t += 30.0
    for _ in range(5):
        engine.handle(_status("pi-1", "offline"))
        engine.handle(_status("pi-1", "online"))
    engine.handle(_status("pi-2", "online"))  # another client's reconnect is its own
    assert transport.sent == ["pi-1", "pi-1", "pi-2"]


def test_reject_reasons_are_clipped_bounded_and_logged_at_a_limited_rate_per_client(caplog):
    caplog.set_level(logging.WARNING, logger="fedal.engine")
    engine, _ = _engine()
    huge = "\x01" * 65_535
    for _ in range(MAX_REJECT_REASONS + 50):
        engine.handle(Arrival("invalid", "pi-1", "r", reason=f"tensor {huge!r}: unknown dtype", reject_kind="envelope"))
    engine.handle(Arrival("invalid", "pi-2", "r", reason="one of pi-2's", reject_kind="envelope"))
    assert engine.counters["rejected"] == engine.round_rejected == MAX_REJECT_REASONS + 51
    assert engine.clients["pi-1"].rejected == MAX_REJECT_REASONS + 50
    assert len(engine.round_rejects) == MAX_REJECT_REASONS and engine.round_rejects[-1] == "pi-2: one of pi-2's"
    assert max(len(r) for r in engine.round_rejects) < 400 and "more characters)" in engine.round_rejects[0]
    from_pi1 = [r for r in caplog.records if "from pi-1" in r.getMessage()]
    assert 1 <= len(from_pi1) <= 12 and max(len(r.getMessage()) for r in caplog.records) < 400
    assert any("from pi-2" in r.getMessage() for r in caplog.records)  # its own allowance
