"""What the round engine needs from a way of reaching clients, and nothing more.

A transport carries tasks out and hands back what arrives: results, status changes,
its own reconnects, and input it could not even attribute (a bad topic). It also owns the clock
that deadlines are measured on, so a simulation can let deadlines pass without waiting.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Literal

from fedal.protocol import Message, Packet

ArrivalKind = Literal["result", "status", "connected", "invalid"]


@dataclass(frozen=True)
class Arrival:
    kind: ArrivalKind
    client: str | None = None
    run: str | None = None
    payload: bytes = b""
    wire_bytes: int = 0  # what crossed the link for it (chunks included)
    reason: str = ""  # kind "invalid": why it is unusable
    reject_kind: str = "topic"  # kind "invalid": the reason it is counted under
    topic: str = ""  # where it came from, for the transport's own use (refused())
    message: Message | None = None  # kind "result": already decoded by the transport (else payload is decoded)
    retained: bool = False  # kind "status": the broker's retained copy (sent at subscribing), not a live message
    count: int = 1  # kind "invalid": how many messages it stands for (dropped unread, counted as one arrival)
    # kind "result": when it reached this side, on the transport's clock (its last chunk's); None:
    # when the engine handles it. A phase's latencies are measured to it, not to the handling.
    received_at: float | None = None


class Transport(ABC):
    @abstractmethod
    def start(self, should_stop: Callable[[], bool] | threading.Event) -> bool:
        """Connect (as long as it takes); False if `should_stop()` became true first."""

    @abstractmethod
    def send(self, client_id: str, packet: Packet) -> int:
        """Send one task (a real link sends `packet.payload`); returns the bytes that crossed the link."""

    @abstractmethod
    def receive(self, timeout_s: float) -> Arrival | None:
        """The next arrival within timeout_s of the transport's clock, else None."""

    def arrived_by(self, t: float, clients: Set[str]) -> Arrival | None:
        """A result from one of `clients` that reached this side at or before `t` (the
        transport's clock) and still waits to be handled; None at once if there is none. A phase
        closing at its deadline takes these first: an answer that came in time is not late for
        having waited behind others. Only results: a status taken here could re-send the task of
        a phase about to close. The default is for a transport that keeps nothing waiting."""
        return None

    @abstractmethod
    def now(self) -> float:
        """Seconds on the clock deadlines are measured on (monotonic)."""

    def refused(self, arrival: Arrival) -> None:
        """The engine rejected what `arrival` carried (MQTT: clear it should it be retained)."""
        return None

    def exhausted(self) -> bool:
        """True when nothing can arrive any more (only a simulation can know)."""
        return False

    def stop(self) -> None:
        return None
