"""A coordinator API served by uvicorn in a thread on a free loopback port, and raw event-stream
connections to it: for tests of what many open /api/v1/events streams do."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from coordinator.runs import RunManager
from tests.local_api import served


def open_stream(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
    return sock


@contextlib.contextmanager
def serving(runs: RunManager, streams: list[socket.socket]) -> Iterator[int]:
    """The API of `runs` listening (its port); at the end `streams` are closed, the event hub
    closed (so open streams end), the server stopped and the store closed."""
    try:
        with served(runs) as port:
            try:
                yield port
            finally:
                for sock in streams:
                    sock.close()
                runs.events.close()  # before the server stops: open streams end
    finally:
        runs.store.close()
