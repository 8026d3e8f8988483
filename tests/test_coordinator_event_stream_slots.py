"""An event stream gives its slot back however it ends, also when its client leaves while the
server is blocked sending to it (a peer that reads nothing: its socket buffer full). Before,
such a stream held its slot until a full garbage collection, and `api.max_event_streams` of
them answered every new dashboard 503."""

from __future__ import annotations

import asyncio
import gc

from coordinator.app import create_app
from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager


def stream_scope() -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "GET", "scheme": "http", "path": "/api/v1/events", "raw_path": b"/api/v1/events",
            "query_string": b"", "root_path": "", "headers": [(b"host", b"127.0.0.1")],
            "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80)}


async def one_stream(app, block_send: bool, sent: list) -> None:
    async def receive():
        await asyncio.sleep(0.3)
        return {"type": "http.disconnect"}  # the client leaves

    async def send(message):
        sent.append(message)
        if block_send and message["type"] == "http.response.body":
            await asyncio.sleep(3600)  # its socket's buffer is full: the send never completes

    await app(stream_scope(), receive, send)


def test_a_client_leaving_while_a_send_is_blocked_gives_its_slot_back(tmp_path):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state", api={"max_event_streams": 2}))
    app = create_app(runs)
    gc.disable()  # the slot must come back without the cyclic collector's help
    try:
        async def main() -> list:
            sent: list = []
            for block in (False, True, True, True):
                await asyncio.wait_for(one_stream(app, block, sent), timeout=10)
                assert not runs.events._subscribers, f"a slot is still held after a stream ended (blocked: {block})"
            return sent

        sent = asyncio.run(main())
    finally:
        gc.enable()
        runs.events.close()
        runs.store.close()
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    assert start["status"] == 200 and headers["x-accel-buffering"] == "no"  # not buffered by a proxy
    first = next(m for m in sent if m["type"] == "http.response.body")["body"].decode()
    assert first.startswith("event: hello\n")  # no id: a reconnecting client's Last-Event-ID is kept
