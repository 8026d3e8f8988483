"""The live event stream's keep-alive comes every second (docs/api.md) however many dashboards
hold a stream open: the streams wait on the event loop, not in a worker thread each (with the
loop's few threads shared among a few dozen streams, each stream's keep-alive came seconds late)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from coordinator.app import create_app
from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager
from tests.waiting import free_port, wait_until

STREAMS = 30


def open_stream(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
    return sock


def test_keep_alives_come_every_second_with_many_streams_open(tmp_path):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(runs), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    streams: list[socket.socket] = []
    try:
        wait_until(lambda: server.started, timeout_s=30, what="the API to listen")
        streams = [open_stream(port) for _ in range(STREAMS)]
        wait_until(lambda: len(runs.events._subscribers) == STREAMS, timeout_s=30, what="every stream subscribed")
        watched = streams[-1]
        watched.settimeout(0.5)
        seen, started = b"", time.monotonic()
        while time.monotonic() - started < 5.0:
            with contextlib.suppress(TimeoutError):
                seen += watched.recv(65536)
        assert seen.count(b": keep-alive") >= 3, seen[-500:]  # about 5; a thread per stream gave 1-2
    finally:
        for sock in streams:
            sock.close()
        runs.events.close()
        server.should_exit = True
        thread.join(timeout=15)
        runs.store.close()
