"""The MQTT transport of the round engine: the coordinator's side of docs/protocol.md.

paho's network thread only enqueues (coordinator/bus.py); this transport, on the engine's
thread, turns what arrived into the engine's arrivals: topics parsed, chunks reassembled within
their budgets, the wire bytes of each result counted, cleared retained messages skipped. The
engine knows nothing of topics, chunks or brokers.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from collections.abc import Set

from coordinator.bus import CoordinatorBus
from coordinator.config import CoordinatorBrokerSettings
from coordinator.inbox import UNKNOWN_SENDERS, Inbox
from fedal.engine import Arrival, Transport
from fedal.protocol import EnvelopeError, Packet, Reassembler, topics

log = logging.getLogger("coordinator.transport")

INBOX_SLACK_BYTES = 1 << 20  # beyond a whole result: statuses and a re-sent chunk or two


class MqttTransport(Transport):
    def __init__(self, settings: CoordinatorBrokerSettings, run_id: str, client_ids: list[str]):
        self.run_id = run_id
        self.clients = set(client_ids)
        per_client = settings.reassembly_bytes_per_client or settings.max_message_bytes
        # (topic, payload, retained); a client's whole result may wait in it, and its statuses beside
        self.inbox = Inbox(per_sender_bytes=per_client + INBOX_SLACK_BYTES, known=self.clients)
        self.bus = CoordinatorBus(settings, run_id, self.inbox)
        self.reassembler = Reassembler(max_size=settings.max_message_bytes,
                                       max_sender_bytes=settings.reassembly_bytes_per_client,
                                       max_total_bytes=settings.reassembly_bytes_total)
        self._dropped: Counter[str] = Counter()  # messages the inbox dropped, not yet reported to the engine

    def start(self, should_stop) -> bool:
        return self.bus.start(should_stop, warn_every_s=5)

    def stop(self) -> None:
        self.bus.stop()

    def now(self) -> float:
        return time.monotonic()

    def send(self, client_id: str, packet: Packet) -> int:
        return self.bus.publish_task(client_id, packet.payload)

    def publish_manifest(self, payload: bytes) -> None:
        self.bus.publish_manifest(payload)

    def receive(self, timeout_s: float) -> Arrival | None:
        dropped = self.inbox.take_dropped()
        if dropped:  # counted against each sender, ahead of what is waiting
            for cid, n in dropped.items():
                self._dropped[cid] += n
        if self._dropped:
            cid, n = self._dropped.popitem()
            who = "senders that are not the run's clients" if cid == UNKNOWN_SENDERS else "this client"
            return Arrival("invalid", cid, self.run_id, count=n, reject_kind="flood",
                           reason=f"{n} message(s) dropped unread: more than {self.inbox.per_sender_bytes} bytes "
                                  f"from {who} were waiting to be handled")
        try:
            topic, payload, *retain = self.inbox.get(timeout=timeout_s)  # (topic, payload[, retained])
        except queue.Empty:
            return None
        return self.arrival(topic, payload, bool(retain and retain[0]), self.inbox.taken_at)

    def arrived_by(self, t: float, clients: Set[str]) -> Arrival | None:
        """The next result (or a chunk of one: fed on) from those clients that the inbox holds
        since before `t` (time.monotonic(), as now()); their statuses wait for their turn."""
        answers = {topics.result(self.run_id, cid) for cid in clients}
        while (item := self.inbox.get_received_by(t, answers)) is not None:
            topic, payload, *retain = item
            arrival = self.arrival(topic, payload, bool(retain and retain[0]), self.inbox.taken_at)
            if arrival is not None:
                return arrival
        return None

    def arrival(self, topic: str, payload: bytes, retained: bool = False,
                received_at: float | None = None) -> Arrival | None:
        """What the engine gets for one MQTT message; None for nothing to handle. received_at:
        when it reached the inbox (now()'s clock)."""
        if topic == "$connected":
            return Arrival("connected")
        try:
            t = topics.parse(topic)
        except topics.TopicError as exc:
            return Arrival("invalid", reason=f"bad topic: {exc}", reject_kind="topic", topic=topic)
        if t.run != self.run_id or t.client not in self.clients:
            return Arrival("invalid", t.client, t.run, reason=f"message from unknown client {t.client!r} (run {t.run!r})",
                           reject_kind="topic", topic=topic)
        if t.kind not in ("status", "up"):
            return None
        if not payload:
            return None  # a retained message cleared (by the coordinator itself, or the broker's tooling)
        if t.kind == "status":
            return Arrival("status", t.client, t.run, payload, topic=topic, retained=retained)
        try:
            msg = self.reassembler.feed(t.client, payload)
        except EnvelopeError as exc:
            return Arrival("invalid", t.client, t.run, reason=f"malformed envelope: {exc}", reject_kind=exc.kind, topic=topic)
        except Exception as exc:  # whatever a payload holds, it never ends the run: counted as an envelope refused
            log.debug("unusable envelope from %s", t.client, exc_info=True)  # the engine logs the reason (rate-limited)
            return Arrival("invalid", t.client, t.run, reason=f"unusable envelope: {type(exc).__name__}: {exc}",
                           reject_kind="envelope", topic=topic)
        if msg is None:
            return None  # a chunk of a larger result
        return Arrival("result", t.client, t.run, wire_bytes=self.reassembler.last_wire_bytes, topic=topic, message=msg,
                       received_at=received_at)

    def refused(self, arrival: Arrival) -> None:
        """A rejected message on a device's result or status topic may have been published
        retained: later subscribers must not get it (an empty retained message clears it)."""
        if arrival.topic and arrival.client in self.clients and arrival.kind in ("status", "result", "invalid"):
            try:
                t = topics.parse(arrival.topic)
            except topics.TopicError:
                return
            if t.kind in ("up", "status"):
                self.bus.clear_retained(arrival.topic)

    def counters(self) -> dict[str, int]:
        """Unfinished chunked messages the reassembler dropped: `evicted` for a sender's newer
        ones, `expired` after its timeout; `held_offline`: task sends skipped while the broker was
        away (the reconnect re-sends each open task once)."""
        evicted, expired = sum(self.reassembler.evicted.values()), self.reassembler.expired
        return {k: v for k, v in (("evicted", evicted), ("expired", expired), ("held_offline", self.bus.tasks_held)) if v}

