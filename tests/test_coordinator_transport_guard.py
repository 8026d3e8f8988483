"""Whatever a result payload holds, the coordinator's transport turns it into a refusal the
engine counts: an error no envelope check foresaw included (the run never ends on a payload)."""

from __future__ import annotations

import msgpack

from coordinator.config import CoordinatorBrokerSettings
from coordinator.transport import MqttTransport
from fedal.protocol import topics


def test_an_error_no_check_foresaw_is_an_envelope_refusal(monkeypatch):
    transport = MqttTransport(CoordinatorBrokerSettings(url="mqtt://127.0.0.1:1"), "run", ["c00"])

    def broken(sender: str, payload: bytes):
        raise MemoryError("an allocation the size checks did not see")

    monkeypatch.setattr(transport.reassembler, "feed", broken)
    arrival = transport.arrival(topics.result("run", "c00"), msgpack.packb([2, {}, {}]))
    assert arrival is not None and arrival.kind == "invalid" and arrival.reject_kind == "envelope"
    assert arrival.client == "c00" and "unusable envelope: MemoryError" in arrival.reason
