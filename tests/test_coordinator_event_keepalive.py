"""The live event stream's keep-alive comes every second (docs/api.md) however many dashboards
hold a stream open: the streams wait on the event loop, not in a worker thread each (with the
loop's few threads shared among a few dozen streams, each stream's keep-alive came seconds late)."""

from __future__ import annotations

import contextlib
import socket
import time

from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager
from tests.event_streams import open_stream, serving
from tests.waiting import wait_until

STREAMS = 30


def test_keep_alives_come_every_second_with_many_streams_open(tmp_path):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state"))
    streams: list[socket.socket] = []
    with serving(runs, streams) as port:
        streams += [open_stream(port) for _ in range(STREAMS)]
        wait_until(lambda: len(runs.events._subscribers) == STREAMS, timeout_s=30, what="every stream subscribed")
        watched = streams[-1]
        watched.settimeout(0.5)
        seen, started = b"", time.monotonic()
        while time.monotonic() - started < 5.0:
            with contextlib.suppress(TimeoutError):
                seen += watched.recv(65536)
        assert seen.count(b": keep-alive") >= 3, seen[-500:]  # about 5; a thread per stream gave 1-2
