"""A coordinator stopped by SIGTERM while a dashboard holds the live event stream open
(GET /api/v1/events) stops at once, as docs/runtime.md says: the stream is ended, the round
engine stops, `stopped` is published and the process exits 0. uvicorn's graceful shutdown waits
for every open response, and an event stream never ends by itself: the process used to live on,
its run still `running`, for as long as the dashboard stayed."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
import time

from coordinator.config import load_coordinator_config
from coordinator.events import CLOSED, EventHub
from coordinator.runs import RunManager
from coordinator.store import RunStore, default_store_url
from fedal.protocol import parse_broker_url, topics
from fedal.sim import load_config
from tests.deployment import Deployment
from tests.local_api import local_client
from tests.waiting import wait_until


def test_a_closed_hub_ends_every_subscription_now_and_to_come():
    hub = EventHub(max_queue=2)
    q = hub.subscribe()
    for i in range(5):  # a full queue: the oldest event makes room for CLOSED
        hub.publish("round", round=i)
    hub.close()
    seen = [q.get(timeout=1) for _ in range(2)]
    assert seen[-1] is CLOSED and hub.closed
    hub.publish("round", round=9)  # nobody is subscribed any more
    assert q.empty()
    late = hub.subscribe()
    assert late.get(timeout=1) is CLOSED
    hub.close()  # idempotent


def test_the_event_stream_ends_when_the_hub_is_closed(tmp_path):
    """In process: an open GET /api/v1/events returns once the event hub is closed (what the
    service does when it shuts down); before, it ran until the client left."""
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state"))
    api = local_client(runs)
    box: dict = {}

    def listen() -> None:
        box["resp"] = api.get("/api/v1/events")

    listener = threading.Thread(target=listen, daemon=True)
    try:
        listener.start()
        wait_until(lambda: runs.events._subscribers, timeout_s=30, what="the event stream to subscribe")
        runs.events.close()
        listener.join(timeout=15)
        assert not listener.is_alive(), "the event stream did not end when the hub was closed"
    finally:
        runs.events.close()
        runs.store.close()
    resp = box["resp"]
    assert resp.status_code == 200 and resp.text.startswith("event: hello\n")


class ManifestStates:
    """A raw paho subscriber to the run's manifest: the states it was sent, in order."""

    def __init__(self, url: str, run_id: str):
        import paho.mqtt.client as mqtt

        addr = parse_broker_url(url)
        self.states: list[str] = []
        subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"stop-watcher-{time.monotonic_ns()}")
        self.client.on_message = lambda _c, _u, msg: msg.payload and self.states.append(json.loads(msg.payload)["state"])
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.connect(addr.host, addr.port)
        self.client.loop_start()
        self.client.subscribe(topics.run_manifest(run_id), qos=1)
        assert subscribed.wait(10)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


class EventStream:
    """A real HTTP client holding GET /api/v1/events open (as the dashboard's EventSource does),
    reading on its own thread until the server ends the response or the connection."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(b"GET /api/v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
        self.received = b""
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # a connection reset or cut also ends the stream (ended_cleanly tells which)
            while chunk := self.sock.recv(65536):
                self.received += chunk
        self.ended_at = time.monotonic()

    @property
    def ended_cleanly(self) -> bool:
        """The chunked response was ended by the server (its last, empty chunk), not cut off."""
        return self.received.endswith(b"\r\n0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=5)


def test_sigterm_stops_the_coordinator_while_an_event_stream_is_open(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=3, public_size=60, seed=0))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    log = dep.workdir / "coordinator" / "coordinator.log"
    watcher = ManifestStates(mosquitto, "demo")
    stream = None
    try:
        dep.start_coordinator()  # no agent joins: the run is published and its engine waits for them
        wait_until(lambda: "running" in watcher.states, timeout_s=120, what="the run's manifest", interval_s=0.2)
        stream = EventStream(dep.port)
        wait_until(lambda: b"event: hello" in stream.received, timeout_s=30, what="the event stream's hello")
        time.sleep(1.5)  # a keep-alive or two: the stream is open and idle, as a dashboard's is
        assert stream.ended_at is None and dep.coordinator.poll() is None

        stopped_at = time.monotonic()
        dep.coordinator.send_signal(signal.SIGTERM)
        try:
            returncode = dep.coordinator.wait(timeout=30)
        except Exception:
            raise AssertionError(f"the coordinator is still running 30 s after SIGTERM with an event stream open\n"
                                 f"{log.read_text()[-3000:]}") from None
        took = time.monotonic() - stopped_at
        assert returncode == 0, log.read_text()[-3000:]
        assert took < 20, f"the coordinator took {took:.1f} s to stop"  # (it waited for ever)
        wait_until(lambda: stream.ended_at is not None, timeout_s=10, what="the event stream to end")
        assert stream.ended_cleanly, stream.received[-200:]  # ended by the app, not cut by a timeout
        assert stream.ended_at - stopped_at < 15
        wait_until(lambda: "stopped" in watcher.states, timeout_s=10, what="`stopped` to be published")
    finally:
        if stream is not None:
            stream.close()
        watcher.close()
        dep.close()
    saved = RunStore(default_store_url(dep.workdir / "coordinator" / "state")).load("demo")
    assert saved.state == "stopped"
