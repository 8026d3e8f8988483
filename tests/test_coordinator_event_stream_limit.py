"""Live event streams are bounded (api.max_event_streams): each open one holds a queue and a task
on the coordinator, so idle connections without end would cost without end. One past the limit
is refused with 503 and a Retry-After, counted and logged; a closed stream frees its place."""

from __future__ import annotations

import json
import socket

import httpx

from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager
from tests.event_streams import open_stream, serving
from tests.waiting import wait_until

LIMIT = 3


def test_one_stream_past_the_limit_is_refused_and_a_closed_one_frees_its_place(tmp_path):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state", api={"max_event_streams": LIMIT}))
    streams: list[socket.socket] = []
    with serving(runs, streams) as port:
        streams += [open_stream(port) for _ in range(LIMIT)]
        wait_until(lambda: len(runs.events._subscribers) == LIMIT, timeout_s=30, what="every stream subscribed")
        base = f"http://127.0.0.1:{port}"
        with httpx.stream("GET", f"{base}/api/v1/events", timeout=10) as refused:  # a stream would never end
            assert refused.status_code == 503
            detail = json.loads(refused.read())["detail"]
        assert refused.headers["retry-after"] == "30"
        assert "3 event streams are open" in detail and "max_event_streams" in detail
        assert 'fedal_api_refused_requests_total{status="503"} 1.0' in httpx.get(f"{base}/metrics", timeout=10).text
        assert len(runs.events._subscribers) == LIMIT  # the refused one took no place
        streams.pop().close()
        wait_until(lambda: len(runs.events._subscribers) == LIMIT - 1, timeout_s=30, what="the closed stream to leave")
        streams.append(open_stream(port))
        wait_until(lambda: len(runs.events._subscribers) == LIMIT, timeout_s=30, what="a new stream in its place")
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
