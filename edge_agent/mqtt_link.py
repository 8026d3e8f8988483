"""The agent's MQTT session (paho-mqtt 2.x, VERSION2 callbacks).

The network loop runs in paho's own thread; callbacks only enqueue what arrives, so training
never blocks keepalive pings. A retained `online` status is published on every (re)connect and
the broker publishes the retained Last Will `offline` if the device disappears. paho reconnects
by itself with exponential backoff between reconnect_min_s and reconnect_max_s. With
health_every_s the `online` status carries the device's health, refreshed at most that often by
a thread of its own (never per message: the status stays small and rare). A sample may take
seconds (`vcgencmd`), so it is never taken on paho's thread: a connect publishes `online` at once
with the last sample the agent has, and the health thread follows it with a fresh one.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from typing import Any

import paho.mqtt.client as mqtt

from edge_agent.config import AgentConfig
from edge_agent.health import HealthProbe
from fedal.protocol import parse_broker_url, split, topics
from mqtt_link import connect_failure, new_client

log = logging.getLogger("edge_agent.mqtt")
INBOX_MESSAGES = 4  # tasks of the largest size that may wait for the worker at once


def status_payload(state: str, health: dict[str, Any] | None = None) -> bytes:
    status: dict[str, Any] = {"state": state, "ts": time.time()}
    if health:
        status["health"] = health
    return json.dumps(status).encode()


class MqttLink:
    def __init__(self, config: AgentConfig, inbox: queue.Queue[tuple[str, bytes]]):
        self.config = config
        self.inbox = inbox
        self.connected = threading.Event()
        self.connects = 0
        run, cid = config.run_id, config.client_id
        self.task_topic = topics.task(run, cid)
        self.result_topic = topics.result(run, cid)
        self.status_topic = topics.status(run, cid)
        self.manifest_topic = topics.run_manifest(run)

        b = config.broker
        addr = parse_broker_url(b.url)
        self.address = addr
        # clean_session False: the broker keeps QoS 1 tasks across short disconnects
        self.client = new_client(b, addr, f"fedal-agent-{run}-{cid}", clean_session=False)
        self.client.will_set(self.status_topic, status_payload("offline"), qos=1, retain=True)
        self.client.reconnect_delay_set(min_delay=b.reconnect_min_s, max_delay=b.reconnect_max_s)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_message = self._on_message
        self.health = HealthProbe(config.health_root, config.workspace) if config.health_every_s > 0 else None
        self.status_lock = threading.Lock()  # one `online` publisher at a time, and none once stopping
        self.stopping = threading.Event()
        self.health_sent = -float("inf")  # time.monotonic() of the last sample
        self.last_health: dict[str, Any] | None = None  # what a connect's `online` carries
        self.wake = threading.Event()  # a (re)connect or a stop: the health thread looks again
        self.health_thread = threading.Thread(target=self._report_health, name="fedal-health", daemon=True)
        self.last_result: mqtt.MQTTMessageInfo | None = None  # the last result part handed to paho
        # what paho's thread lets into the inbox: no message above max_message_bytes (a whole
        # envelope is at most that), and tasks waiting at most INBOX_MESSAGES of it (re-sends of a
        # task pile up while one trains); the manifest always passes. Dropped ones are counted
        # here and reported by the worker (take_dropped).
        self.max_message_bytes = b.max_message_bytes
        self.inbox_bytes = INBOX_MESSAGES * b.max_message_bytes
        self._waiting = 0
        self._dropped: Counter[str] = Counter()
        self._inbox_lock = threading.Lock()

    def start(self) -> None:
        self.client.connect_async(self.address.host, self.address.port, keepalive=self.config.broker.keepalive)
        self.client.loop_start()
        if self.health is not None:
            self.health_thread.start()

    def stop(self) -> None:
        with self.status_lock:
            self.stopping.set()  # no `online` may follow the `offline` below
        self.wake.set()
        if self.health_thread.is_alive():
            self.health_thread.join(timeout=10)
        if self.connected.is_set():
            self.client.publish(self.status_topic, status_payload("offline"), qos=1, retain=True).wait_for_publish(5)
        self.client.disconnect()
        self.client.loop_stop()

    def publish_result(self, payload: bytes) -> int:
        """Publish one result envelope (chunked if large); returns the bytes sent."""
        sent = 0
        for part in split(payload, self.config.broker.max_payload):
            self.last_result = self.client.publish(self.result_topic, part, qos=1)
            sent += len(part)
        return sent

    def wait_result_delivered(self, timeout_s: float) -> bool:
        """Whether the broker acknowledged the last result published (waiting up to `timeout_s`):
        the crash test hook's after_publish point is then one exact step, not a race with the
        network thread."""
        info = self.last_result
        if info is None:
            return False
        try:
            info.wait_for_publish(timeout_s)
            return info.is_published()
        except (RuntimeError, ValueError):  # published while disconnected (sent after a reconnect) or refused
            return False

    # -- paho callbacks: network thread, enqueue only ----------------------------------------
    def _on_connect(self, client, _userdata, _flags, reason_code, _properties) -> None:
        if reason_code.is_failure:
            log.warning("broker refused the connection: %s", reason_code)
            return
        self.connects += 1
        client.subscribe([(self.manifest_topic, 1), (self.task_topic, 1)])
        self._publish_online(self.last_health)
        self.connected.set()
        self.wake.set()  # a fresh health report follows, from the health thread
        log.info("connected to %s", self.address.redacted())

    def _publish_online(self, health: dict[str, Any] | None) -> None:
        """The retained `online` status, with `health` when there is one."""
        with self.status_lock:
            if self.stopping.is_set():
                return
            self.client.publish(self.status_topic, status_payload("online", health), qos=1, retain=True)

    def _report_health(self) -> None:
        """Thread: a fresh health report right after each connect (which restarts the interval),
        and every health_every_s while connected."""
        assert self.health is not None  # started only with health reports on
        every = self.config.health_every_s
        reported = 0  # the connects a fresh sample has followed
        while True:
            self.wake.clear()  # first: whatever sets it from here on ends the wait below
            if self.stopping.is_set():
                return
            connects, now, due = self.connects, time.monotonic(), self.health_sent + every
            if not self.connected.is_set():
                self.wake.wait()  # a connect or a stop wakes it: none is due while disconnected
                continue
            if connects == reported and now < due:
                self.wake.wait(due - now)
                continue
            reported = connects
            try:
                health = self.health.sample()
            except Exception:  # a report is never worth the link
                log.exception("cannot read the device's health")
                health = None
            self.health_sent = time.monotonic()
            if health is not None:
                self.last_health = health
            self._publish_online(self.last_health)  # a failed sample keeps the last report retained

    def _on_connect_fail(self, client, _userdata) -> None:
        log.warning("cannot connect to %s: %s; retrying with backoff", self.address.redacted(),
                    connect_failure(client.last_connect_error))

    def _on_disconnect(self, _client, _userdata, _flags, reason_code, _properties) -> None:
        self.connected.clear()
        if reason_code != 0:
            log.warning("disconnected (%s); paho reconnects with backoff", reason_code)

    def _on_message(self, _client, _userdata, message) -> None:
        payload, topic = bytes(message.payload), message.topic
        with self._inbox_lock:
            if len(payload) > self.max_message_bytes:
                self._dropped["size"] += 1
                return
            if topic != self.manifest_topic:
                if self._waiting + len(payload) > self.inbox_bytes:
                    self._dropped["flood"] += 1
                    return
                self._waiting += len(payload)
        self.inbox.put((topic, payload))

    def taken(self, topic: str, payload: bytes) -> None:
        """The worker took this message from the inbox: its bytes no longer wait."""
        if topic != self.manifest_topic:
            with self._inbox_lock:
                self._waiting -= len(payload)

    def take_dropped(self) -> Counter[str]:
        """Messages dropped unread since the last call, by why ("size", "flood")."""
        with self._inbox_lock:
            dropped, self._dropped = self._dropped, Counter()
        return dropped
