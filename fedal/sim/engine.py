"""In-process round engine: moves a strategy's tasks and results without a network.

Every message crosses the same wire encoding the MQTT runtime uses (encode, then decode), so
the bytes counted here are the bytes a deployment would send and a strategy cannot rely on
anything that would not survive the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedal.protocol import Message, decode, encode
from fedal.strategies import ClientHalf, InvalidResult, ServerHalf


@dataclass
class RoundRecord:
    round: int
    bytes_up: int = 0
    bytes_down: int = 0
    phases: int = 0
    rejected: int = 0
    reject_reasons: list[str] = field(default_factory=list)
    server_metrics: dict[str, float] = field(default_factory=dict)


class InProcessEngine:
    def __init__(self, server: ServerHalf, clients: dict[str, ClientHalf]):
        missing = set(server.client_ids) - set(clients)
        if missing:
            raise ValueError(f"no client half for {sorted(missing)}")
        self.server = server
        self.clients = clients

    def run_round(self, round_idx: int) -> RoundRecord:
        record = RoundRecord(round_idx)
        phase = self.server.begin_round(round_idx)
        while phase is not None:
            record.phases += 1
            results: dict[str, Message] = {}
            for cid, task in phase.tasks.items():
                wire_task = encode(task)
                record.bytes_down += len(wire_task)
                wire_result = encode(self.clients[cid].handle(decode(wire_task)))
                record.bytes_up += len(wire_result)
                result = decode(wire_result)
                try:
                    self.server.validate(phase, cid, result)
                except InvalidResult as exc:
                    record.rejected += 1
                    record.reject_reasons.append(f"{cid}: {exc}")
                    continue
                results[cid] = result
            phase = self.server.collect(phase, results)
        record.server_metrics = self.server.round_metrics()
        return record
