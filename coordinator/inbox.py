"""What paho's network thread hands the engine's thread: each sender's messages in their arrival
order, the senders taking turns, each within a byte budget.

paho reads every message off the socket at once; an unbounded queue would hold a flooding
device's backlog in the coordinator's memory. A sender (the last topic level: a client id) may
have at most `per_sender_bytes` waiting; what comes beyond is dropped unread and counted against
that sender alone. Senders that are not the run's clients share one budget: on a broker without
the fleet's ACL anyone may publish under any number of made-up ids, and each must not get a
budget of its own. And the senders take turns (one message each, round robin): in one queue a
device's backlog of small messages (a budget's worth is a few hundred thousand) went ahead of
every other client's results and statuses, tens of seconds against a phase's deadline.
Each message keeps the moment it arrived, so that a phase closing at its deadline still takes
what its clients had sent in time (`get_received_by`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Collection, Set

__all__ = ["Inbox", "OVERHEAD_BYTES", "UNKNOWN_SENDERS"]

OVERHEAD_BYTES = 256  # what a message costs beyond its payload (an empty one is not free)
UNKNOWN_SENDERS = "*"  # the budget every sender that is not a known client shares (never a client id)


class Inbox:
    def __init__(self, per_sender_bytes: int, known: Collection[str] | None = None):
        """known: the run's client ids (None: every sender has a budget of its own)."""
        self.per_sender_bytes = per_sender_bytes
        self.known = None if known is None else frozenset(known)
        # per sender ("" for the bus itself), oldest first: (time.monotonic() at arrival, item)
        self._queues: dict[str, deque[tuple[float, tuple]]] = {}
        self._turns: deque[str] = deque()  # the senders with messages waiting, in the order they are served
        self._ready = threading.Condition()
        self._waiting: Counter[str] = Counter()  # bytes waiting, per sender
        self._dropped: Counter[str] = Counter()  # messages dropped since take_dropped(), per sender
        self.taken_at = 0.0  # when the item last taken arrived (time.monotonic()); read by the taking thread

    def put(self, item: tuple) -> None:
        """item: (topic, payload[, retained]); from paho's network thread."""
        sender, cost = self._sender(item[0]), len(item[1]) + OVERHEAD_BYTES
        with self._ready:
            if sender is not None:
                if self._waiting[sender] + cost > self.per_sender_bytes:
                    self._dropped[sender] += 1
                    return
                self._waiting[sender] += cost
            key = sender or ""
            waiting = self._queues.get(key)
            if waiting is None:
                waiting = self._queues[key] = deque()
                self._turns.append(key)
            waiting.append((time.monotonic(), item))
            self._ready.notify()

    def get(self, timeout: float) -> tuple:
        """The next sender's oldest item (senders take turns); queue.Empty after `timeout`
        seconds without one."""
        deadline = time.monotonic() + timeout
        with self._ready:
            while not self._turns:
                left = deadline - time.monotonic()
                if left <= 0 or not self._ready.wait(left):
                    if not self._turns:
                        raise queue.Empty
            return self._take(self._turns[0])

    def get_received_by(self, by: float, topics: Set[str]) -> tuple | None:
        """The oldest item on one of `topics` (in its sender's turn) that arrived at or before
        `by` (time.monotonic()); None at once if there is none. A phase closing at its deadline
        takes its clients' answers that came in time but still wait here behind other work; their
        other messages keep their place. A set lookup per item: paho's thread waits for the lock."""
        senders = {topic.rsplit("/", 1)[-1] for topic in topics}
        with self._ready:
            for key in self._turns:
                if key not in senders:
                    continue
                for i, (at, item) in enumerate(self._queues[key]):
                    if at > by:
                        break
                    if item[0] in topics:
                        return self._take(key, i)
            return None

    def _take(self, key: str, index: int = 0) -> tuple:
        """Item `index` of sender `key`'s queue; the lock is held. The oldest (index 0) is taken
        in the sender's turn, which then goes to the back; another leaves the turns as they are."""
        waiting = self._queues[key]
        self.taken_at, item = waiting[index]
        del waiting[index]
        if index == 0:
            self._turns.remove(key)
            if waiting:
                self._turns.append(key)  # its next message after every other sender's
        if not waiting:
            if key in self._turns:
                self._turns.remove(key)
            del self._queues[key]
        sender = self._sender(item[0])
        if sender is not None:
            self._waiting[sender] -= len(item[1]) + OVERHEAD_BYTES
            if self._waiting[sender] <= 0:
                del self._waiting[sender]
        return item

    def _sender(self, topic: str) -> str | None:
        if not topic.startswith("fedal/"):
            return None  # "$connected": the bus itself
        sender = topic.rsplit("/", 1)[-1]
        return sender if self.known is None or sender in self.known else UNKNOWN_SENDERS

    def take_dropped(self) -> dict[str, int]:
        """Messages dropped per sender since the last call."""
        with self._ready:
            dropped, self._dropped = dict(self._dropped), Counter()
            return dropped

    def waiting_bytes(self, sender: str) -> int:
        with self._ready:
            return self._waiting.get(sender, 0)
