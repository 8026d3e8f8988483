"""Fault decisions and their accounting, apart from any socket so they can be tested alone.

Every decision comes from a random stream of its own per (seed, client id, direction), and every
packet draws the same four numbers from it whatever the settings, so the same seed and the same
packet sequence give the same faults, and one client's traffic never shifts another client's luck.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import logging
import random
import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Any

from paho.mqtt.client import topic_matches_sub

from hil.profiles import DIRECTIONS, FaultRule, Faults, FaultSettings, Partition, Profile

log = logging.getLogger("hil.faults")

UNIDENTIFIED = "(before CONNECT)"  # stats key for connections that never named a client
EMPTY_CLIENT_ID = "(empty client id)"  # stats key for clients that connect without an id (the broker names them)


@dataclass(frozen=True)
class LinkFaults:
    """The faults in force on one direction of one client's link, every field resolved."""

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_kbps: float = 0.0
    drop: float = 0.0
    drop_mode: str = "reset"
    duplicate: float = 0.0
    reset: float = 0.0
    topics: tuple[str, ...] = ("#",)

    def applies_to(self, topic: str) -> bool:
        return self.topics == ("#",) or _matches(self.topics, topic)


@functools.lru_cache(maxsize=65536)
def _matches(filters: tuple[str, ...], topic: str) -> bool:
    """paho's matcher, cached: a run uses a handful of topics per client, over and over."""
    return any(topic_matches_sub(f, topic) for f in filters)


@dataclass(frozen=True)
class Decision:
    """What happens to one packet. `delay_s` is latency + jitter (bandwidth is the link's job)."""

    delay_s: float
    drop: bool = False
    duplicate: bool = False
    reset: bool = False
    eligible: bool = False  # a PUBLISH on a topic the drop/duplicate rates apply to


def resolve(faults: Faults, client_id: str, direction: str) -> LinkFaults:
    """default, default.<dir>, the first matching client rule, its .<dir>: later layers win."""
    layers: list[FaultSettings | None] = [faults.default, faults.default.up if direction == "up" else faults.default.down]
    rule = match_rule(faults.clients, client_id)
    if rule is not None:
        layers += [rule, rule.up if direction == "up" else rule.down]
    values: dict[str, Any] = {}
    for layer in layers:
        if layer is None:
            continue
        for name in (f.name for f in fields(LinkFaults)):
            v = getattr(layer, name)
            if v is not None:
                values[name] = tuple(v) if name == "topics" else v
    return LinkFaults(**values)


def match_rule(rules: dict[str, FaultRule], client_id: str) -> FaultRule | None:
    """An exact id wins over patterns; among patterns, the first in the file."""
    if client_id in rules:
        return rules[client_id]
    return next((r for pattern, r in rules.items() if fnmatch.fnmatchcase(client_id, pattern)), None)


def stream_seed(seed: int, client_id: str, direction: str) -> int:
    digest = hashlib.sha256(f"{seed}\0{client_id}\0{direction}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass
class ClientStats:
    connections: int = 0
    refused: int = 0  # connection attempts during a partition
    partition_cuts: int = 0  # live connections cut when a partition started
    malformed: int = 0
    resets: int = 0  # live connections cut on request (POST /reset); drawn resets count under up/down
    up: Counter = field(default_factory=Counter)
    down: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"connections": self.connections, "refused": self.refused, "partition_cuts": self.partition_cuts,
                "malformed": self.malformed, "resets": self.resets, "up": dict(self.up), "down": dict(self.down)}


class FaultEngine:
    """The proxy's brain: current faults, partitions, decisions, counters and the fault log."""

    def __init__(self, profile: Profile, seed: int | None = None, clock=time.monotonic, max_events: int = 10_000):
        self.seed = seed if seed is not None else (profile.seed if profile.seed is not None else 0)
        self.profile_name = profile.name
        self.faults = Faults(default=profile.default, clients=profile.clients)
        self.partitions: list[Partition] = list(profile.partitions)
        self.clock = clock
        self.t0 = clock()
        self._rngs: dict[tuple[str, str], random.Random] = {}
        self._resolved: dict[tuple[str, str], LinkFaults] = {}
        self.stats: dict[str, ClientStats] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.fault_counts: Counter = Counter()

    # -- configuration -----------------------------------------------------------------------
    def set_faults(self, faults: Faults) -> None:
        self.faults = faults
        self._resolved.clear()
        log.info("faults replaced: %s", faults.model_dump_json(exclude_none=True))

    def add_partition(self, client: str, duration_s: float, start_in_s: float = 0.0) -> Partition:
        start = self.elapsed() + start_in_s
        p = Partition(client=client, start_s=start, end_s=start + duration_s)
        self.partitions.append(p)
        log.info("partition scheduled: %s from %.3f s to %.3f s", client, p.start_s, p.end_s)
        return p

    def link(self, client_id: str, direction: str) -> LinkFaults:
        key = (client_id, direction)
        if key not in self._resolved:
            self._resolved[key] = resolve(self.faults, client_id, direction)
        return self._resolved[key]

    # -- decisions ---------------------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def partitioned(self, client_id: str) -> bool:
        now = self.elapsed()
        return any(p.start_s <= now < p.end_s and p.matches(client_id) for p in self.partitions)

    def decide(self, client_id: str, direction: str, topic: str | None, qos: int | None = None) -> Decision:
        """One packet's fate. `topic` is the PUBLISH topic, None for any other packet type."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")
        key = (client_id, direction)
        rng = self._rngs.get(key)
        if rng is None:
            rng = self._rngs[key] = random.Random(stream_seed(self.seed, client_id, direction))
        u_jitter, u_drop, u_dup, u_reset = rng.random(), rng.random(), rng.random(), rng.random()
        f = self.link(client_id, direction)
        delay_s = (f.latency_ms + u_jitter * f.jitter_ms) / 1000.0
        reset = u_reset < f.reset
        if topic is None or not f.applies_to(topic):
            return Decision(delay_s, reset=reset)
        drop = u_drop < f.drop
        # QoS 2 already delivers exactly once: a copy would only exercise the peer's state machine
        duplicate = not drop and u_dup < f.duplicate and qos != 2
        return Decision(delay_s, drop=drop, duplicate=duplicate, reset=reset, eligible=True)

    # -- accounting --------------------------------------------------------------------------
    def client(self, client_id: str) -> ClientStats:
        s = self.stats.get(client_id)
        if s is None:
            s = self.stats[client_id] = ClientStats()
        return s

    def count(self, client_id: str, direction: str, what: str, n: int = 1) -> None:
        getattr(self.client(client_id), direction)[what] += n

    def fault(self, kind: str, client_id: str, direction: str | None = None, **details: Any) -> None:
        """An injected fault (or a refused input): counted, logged, kept in the event log."""
        self.fault_counts[kind] += 1
        stats = self.client(client_id)
        if kind in ("refused", "partition_cuts", "malformed"):
            setattr(stats, kind, getattr(stats, kind) + 1)
        if kind == "reset" and direction is None:  # not a link's draw: the operator's cut
            stats.resets += 1
        if direction is not None:
            getattr(stats, direction)[kind] += 1
        event = {"t": round(self.elapsed(), 4), "fault": kind, "client": client_id, "direction": direction, **details}
        self.events.append(event)
        log.info("fault %s client=%s%s %s", kind, client_id, f" {direction}" if direction else "",
                 " ".join(f"{k}={v}" for k, v in details.items()))

    def snapshot(self) -> dict[str, Any]:
        return {"profile": self.profile_name, "seed": self.seed, "elapsed_s": round(self.elapsed(), 3),
                "faults": dict(self.fault_counts), "clients": {c: s.as_dict() for c, s in sorted(self.stats.items())}}
