"""Live run events for Server-Sent Events subscribers: round, phase, client and run changes.

The round engine publishes from its own thread; each subscriber has a bounded queue, so a slow
or vanished dashboard never blocks the engine (its oldest events are dropped instead).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import threading
import time
from typing import Any


class EventHub:
    def __init__(self, max_queue: int = 1000):
        self.max_queue = max_queue
        self._subscribers: set[queue.Queue] = set()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def publish(self, kind: str, **data: Any) -> None:
        event = {"id": next(self._ids), "type": kind, "ts": time.time(), **data}
        with self._lock:
            subscribers = list(self._subscribers)
        for q in subscribers:
            while True:
                try:
                    q.put_nowait(event)
                    break
                except queue.Full:
                    with contextlib.suppress(queue.Empty):  # another reader may have emptied it
                        q.get_nowait()  # drop the oldest

    def subscribe(self) -> queue.Queue:
        q: queue.Queue = queue.Queue(maxsize=self.max_queue)
        with self._lock:
            self._subscribers.add(q)
        return q

    def unsubscribe(self, q: queue.Queue) -> None:
        with self._lock:
            self._subscribers.discard(q)


def sse_format(event: dict[str, Any]) -> str:
    return f"id: {event['id']}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n"
