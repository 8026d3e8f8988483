"""A round engine's state between rounds, as tensors and plain data.

What a simulation's checkpoint (fedal/sim/checkpoint.py) keeps of the engine, besides the server
half's and the clients' own state: task numbering, what it knows of each client, its counts.
Only what torch.load(weights_only=True) reads back, so a tampered checkpoint cannot run code.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

from fedal.engine.accounting import ClientInfo
from fedal.engine.rounds import RoundEngine
from fedal.engine.transport import Arrival
from fedal.protocol import decode, encode


def engine_saved(engine: RoundEngine) -> dict[str, Any]:
    with engine.lock:
        return {"instance": engine.instance, "epoch": engine.epoch, "seq": engine.seq,
                "clients": {cid: dataclasses.asdict(info) for cid, info in engine.clients.items()},
                "counters": dict(engine.counters), "reject_reasons": dict(engine.reject_reasons),
                "held_s": engine.held_s, "connects": engine.connects}


def restore_engine(engine: RoundEngine, state: dict[str, Any]) -> None:
    """`engine` as engine_saved gave it; its clients must be the saved ones."""
    if set(state["clients"]) != set(engine.clients):
        raise ValueError("the saved run has other clients")
    known = {f.name for f in dataclasses.fields(ClientInfo)}
    with engine.lock:
        engine.instance, engine.epoch, engine.seq = state["instance"], int(state["epoch"]), int(state["seq"])
        engine.clients = {cid: ClientInfo(**{k: v for k, v in info.items() if k in known})
                          for cid, info in state["clients"].items()}
        engine.counters = Counter(state["counters"])
        engine.reject_reasons = Counter(state["reject_reasons"])
        engine.held_s = float(state["held_s"])
        engine.connects = int(state["connects"])


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def arrival_saved(arrival: Arrival) -> dict[str, Any]:
    """An arrival still queued (a straggler's result due later), its message as its envelope."""
    fields = {f.name: getattr(arrival, f.name) for f in dataclasses.fields(Arrival)}
    fields["payload"] = _bytes_tensor(arrival.payload)
    fields["message"] = None if arrival.message is None else _bytes_tensor(encode(arrival.message))
    return fields


def arrival_restored(saved: dict[str, Any]) -> Arrival:
    message = saved["message"]
    return Arrival(**{**saved, "payload": bytes(saved["payload"].numpy().tobytes()),
                      "message": None if message is None else decode(bytes(message.numpy().tobytes()))})
