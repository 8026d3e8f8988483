"""Per-client and per-phase bookkeeping the engine keeps and the API, the store and the
results report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedal.protocol import Message, Packet
from fedal.strategies import PhaseTasks

REFUSED_KEPT = 64  # refused answers remembered per client and phase (PhaseState.refuse)


@dataclass
class ClientInfo:
    online: bool = False
    last_seen: float | None = None
    answered: int = 0
    late: int = 0
    rejected: int = 0
    duplicates: int = 0
    declined: int = 0  # tasks it declined (a restarted agent sitting out a round, or missing a step of it)
    bytes_up: int = 0
    bytes_down: int = 0
    last_acc: float | None = None
    last_local_acc: float | None = None
    epsilon: float | None = None  # differential privacy: the epsilon it last reported (at the run's delta)
    dp_exhausted: bool = False  # it reported that more private training would exceed its epsilon_budget
    noise_multiplier: float | None = None  # the DP noise multiplier it reported (its own under target_epsilon)
    health: dict[str, Any] | None = None  # the last valid fields of its status's `health` (fedal/engine/health.py)


@dataclass
class PhaseState:
    phase: PhaseTasks
    key: tuple[int, int]
    packets: dict[str, Packet]  # each client's task
    pending: set[str]
    started: float  # on the transport's clock
    wall_started: float  # epoch seconds, to compare with the timestamps clients put in their status
    results: dict[str, Message] = field(default_factory=dict)
    refused: dict[str, dict[bytes, None]] = field(default_factory=dict)  # digests of each client's refused answers

    def refuse(self, cid: str, digest: bytes) -> None:
        """Remember a refused answer (its re-send is then a duplicate), at most REFUSED_KEPT of a
        client's: re-sends repeat its latest answers, and a client sending ever-new bad answers
        must not grow the phase's memory."""
        kept = self.refused.setdefault(cid, {})
        kept[digest] = None
        if len(kept) > REFUSED_KEPT:
            del kept[next(iter(kept))]
    declined: dict[str, str] = field(default_factory=dict)  # clients that declined their task: why
    latencies: list[float] = field(default_factory=list)  # from sending to each accepted result
    reconnect_sent: dict[str, float] = field(default_factory=dict)  # a task re-sent on a client's reconnect, when
    compute_s: float = 0.0  # the server half producing this phase's tasks (begin_round / collect)
    wall_s: float = 0.0  # from the server half starting on this phase to the phase closing


class PhaseStats:
    """Per phase name over one round: response latencies (p50/p95), participation, and the mean
    server-half compute time and end-to-end time of one phase (e.g. one transfer iteration)."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {}
        self.sent: dict[str, int] = {}
        self.answered: dict[str, int] = {}
        self.declined: dict[str, int] = {}
        self.compute: dict[str, list[float]] = {}
        self.wall: dict[str, list[float]] = {}

    def add(self, state: PhaseState) -> None:
        name = state.phase.phase
        self.latencies.setdefault(name, []).extend(state.latencies)
        self.sent[name] = self.sent.get(name, 0) + len(state.phase.tasks)
        self.answered[name] = self.answered.get(name, 0) + len(state.results)
        self.declined[name] = self.declined.get(name, 0) + len(state.declined)
        self.compute.setdefault(name, []).append(state.compute_s)
        self.wall.setdefault(name, []).append(state.wall_s)

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        out = {}
        for name, sent in self.sent.items():
            lat = self.latencies.get(name) or []
            out[name] = {
                "count": sent,
                "participation": round(self.answered[name] / sent, 4) if sent else None,
                "p50_s": round(float(np.percentile(lat, 50)), 4) if lat else None,
                "p95_s": round(float(np.percentile(lat, 95)), 4) if lat else None,
                "compute_s": round(float(np.mean(self.compute[name])), 4),
                "wall_s": round(float(np.mean(self.wall[name])), 4),
            }
            if self.declined.get(name):  # only where some did: the record of a run without any stays as it was
                out[name]["declined"] = self.declined[name]
        return out
