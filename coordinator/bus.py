"""The coordinator's MQTT session (paho-mqtt 2.x, VERSION2 callbacks).

Callbacks run in paho's network thread and only enqueue; the round engine thread does all
decoding and computing. Results larger than the broker packet limit arrive chunked.
"""

from __future__ import annotations

import logging
import threading
import time

from coordinator.config import CoordinatorBrokerSettings
from coordinator.inbox import Inbox
from fedal.protocol import parse_broker_url, split, topics
from mqtt_link import connect_failure, new_client

log = logging.getLogger("coordinator.mqtt")
CLEAR_EVERY_S = 1.0  # at most one clearing publish per topic this often: a junk flood is not echoed 1:1
CLEARS_KEPT = 1024  # past this many topics remembered, those not cleared within CLEAR_EVERY_S are forgotten


class CoordinatorBus:
    def __init__(self, settings: CoordinatorBrokerSettings, run_id: str, inbox: Inbox):
        self.settings = settings
        self.run_id = run_id
        self.inbox = inbox
        self.connected = threading.Event()
        self.stopping = False
        self.bytes_down = 0
        self.tasks_held = 0  # task sends skipped while disconnected (the reconnect re-sends)
        self._clears: dict[str, float] = {}  # topic -> when it was last cleared
        self._clear_timers: dict[str, threading.Timer] = {}
        self._clear_lock = threading.Lock()
        addr = parse_broker_url(settings.url)
        self.address = addr
        self.client = new_client(settings, addr, f"fedal-coordinator-{run_id}", clean_session=True)
        self.client.reconnect_delay_set(min_delay=1, max_delay=30)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_message = self._on_message

    def start(self, stop: threading.Event, warn_every_s: float = 30) -> bool:
        """Connect, waiting as long as it takes (paho retries with backoff); False if stopped."""
        self.client.connect_async(self.address.host, self.address.port, keepalive=self.settings.keepalive)
        self.client.loop_start()
        warn_at = time.monotonic() + warn_every_s
        while not self.connected.wait(0.2):  # a stop is noticed at once, not at the next warning
            if stop.is_set():
                return False
            if time.monotonic() >= warn_at:
                warn_at = time.monotonic() + warn_every_s
                log.warning("still waiting for the broker at %s", self.address.redacted())
        return True

    def stop(self) -> None:
        self.stopping = True  # the disconnect that follows is ours: no warning, no reconnect said
        self.client.disconnect()
        self.client.loop_stop()

    def publish_task(self, client_id: str, payload: bytes) -> int:
        """Bytes sent; 0 while the broker is away. The client would queue the task for the
        reconnect, a copy per re-send, and then send them all at once (each agent answering each
        copy with its whole result); the engine re-sends every open task once when the
        connection is back (`$connected`)."""
        if not self.connected.is_set():
            self.tasks_held += 1
            return 0
        sent = 0
        for part in split(payload, self.settings.max_payload):
            self.client.publish(topics.task(self.run_id, client_id), part, qos=1)
            sent += len(part)
        self.bytes_down += sent
        return sent

    def publish_manifest(self, payload: bytes) -> None:
        self.client.publish(topics.run_manifest(self.run_id), payload, qos=1, retain=True)

    def clear_retained(self, topic: str) -> None:
        """Publish an empty retained message on `topic`, so the broker forgets what is retained
        there; within CLEAR_EVERY_S of the last clear it is done once at the end of that window."""
        with self._clear_lock:
            if topic in self._clear_timers:
                return  # a clear is already due
            wait = self._clears.get(topic, float("-inf")) + CLEAR_EVERY_S - time.monotonic()
            if wait > 0:
                timer = threading.Timer(wait, self._clear_now, (topic,))
                timer.daemon = True
                self._clear_timers[topic] = timer
                timer.start()
                return
            self._clears[topic] = time.monotonic()
            if len(self._clears) > CLEARS_KEPT:  # only the last second's matter: retained junk under
                since = time.monotonic() - CLEAR_EVERY_S  # ever-new topics must not grow it for ever
                self._clears = {t: at for t, at in self._clears.items() if at >= since}
        self.client.publish(topic, b"", qos=1, retain=True)

    def _clear_now(self, topic: str) -> None:
        with self._clear_lock:
            self._clear_timers.pop(topic, None)
            self._clears[topic] = time.monotonic()
        self.client.publish(topic, b"", qos=1, retain=True)

    def _on_connect(self, client, _userdata, _flags, reason_code, _properties) -> None:
        if reason_code.is_failure:
            log.warning("broker refused the connection: %s", reason_code)
            return
        client.subscribe([(topics.results_filter(self.run_id), 1), (topics.status_filter(self.run_id), 1)])
        self.connected.set()
        self.inbox.put(("$connected", b""))
        log.info("connected to %s", self.address.redacted())

    def _on_connect_fail(self, client, _userdata) -> None:
        log.warning("cannot connect to %s: %s; retrying with backoff", self.address.redacted(),
                    connect_failure(client.last_connect_error))

    def _on_disconnect(self, _client, _userdata, _flags, reason_code, _properties) -> None:
        self.connected.clear()
        if self.stopping:
            log.info("disconnected from the broker")
            return
        log.warning("disconnected from the broker (%s); reconnecting", reason_code)

    def _on_message(self, _client, _userdata, message) -> None:
        if message.retain and message.payload and message.topic.split("/")[3:4] == ["up"]:  # fedal/v1/<run>/up/<id>
            self.clear_retained(message.topic)  # results are never retained: whatever it is, the broker drops it
        self.inbox.put((message.topic, bytes(message.payload), bool(message.retain)))
