"""A coordinator API served by uvicorn in a thread on a free loopback port, and raw event-stream
connections to it: for tests of what many open /api/v1/events streams do."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import uvicorn

from coordinator.app import create_app
from coordinator.runs import RunManager
from tests.waiting import free_port, wait_until


def open_stream(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
    return sock


@contextlib.contextmanager
def serving(runs: RunManager, streams: list[socket.socket]) -> Iterator[int]:
    """The API of `runs` listening (its port); at the end `streams` are closed, the event hub
    closed (so open streams end), the server stopped and the store closed."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(runs), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout_s=30, what="the API to listen")
        yield port
    finally:
        for sock in streams:
            sock.close()
        runs.events.close()
        server.should_exit = True
        thread.join(timeout=15)
        runs.store.close()
