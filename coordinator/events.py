"""Live run events for Server-Sent Events subscribers: round, phase, client and run changes.

The round engine publishes from its own thread; each subscriber has a bounded queue, so a slow
or vanished dashboard never blocks the engine (its oldest events are dropped instead). When the
service stops, close() ends every subscription: each subscriber then reads CLOSED, so an open
event stream ends and never holds the shutdown up.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import threading
import time
from typing import Any

CLOSED: dict[str, Any] = {"type": "_closed"}  # what a subscriber reads once the hub is closed (compare with `is`)


class TooManySubscribers(Exception):
    """The hub holds as many subscribers as it may (each one an open stream: a queue and a task)."""


class EventHub:
    def __init__(self, max_queue: int = 1000):
        self.max_queue = max_queue
        self._subscribers: set[queue.Queue] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, kind: str, **data: Any) -> None:
        """Every subscriber gets events in the order of their ids: numbered and queued under one
        lock (`_put` never blocks), so two publishers cannot interleave."""
        with self._lock:
            event = {"id": next(self._ids), "type": kind, "ts": time.time(), **data}
            for q in self._subscribers:
                _put(q, event)

    def subscribe(self, limit: int | None = None) -> queue.Queue:
        """A new subscriber's queue; on a closed hub it holds CLOSED alone. TooManySubscribers
        where `limit` subscribers are there already (counted under the lock: two at once cannot
        both take the last place)."""
        q: queue.Queue = queue.Queue(maxsize=self.max_queue)
        with self._lock:
            if self._closed:
                q.put_nowait(CLOSED)
                return q
            if limit is not None and len(self._subscribers) >= limit:
                raise TooManySubscribers(len(self._subscribers))
            self._subscribers.add(q)
        return q

    def close(self) -> None:
        """End every subscription, now and to come: each subscriber reads CLOSED next (after at
        most what it has queued). Called when the service shuts down; idempotent."""
        with self._lock:
            self._closed = True
            subscribers = list(self._subscribers)
            self._subscribers.clear()
        for q in subscribers:
            _put(q, CLOSED)

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            self._subscribers.discard(q)


def _put(q: queue.Queue, item: dict[str, Any]) -> None:
    while True:
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            with contextlib.suppress(queue.Empty):  # another reader may have emptied it
                q.get_nowait()  # drop the oldest


def sse_format(event: dict[str, Any]) -> str:
    """One SSE message; an event without an id (the stream's hello) leaves the client's
    last event id as it was."""
    ident = f"id: {event['id']}\n" if "id" in event else ""
    return f"{ident}event: {event['type']}\ndata: {json.dumps(event)}\n\n"
