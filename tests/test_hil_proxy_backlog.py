"""The emulated broker with what a shared broker accumulates: retained junk, a persistent session's
backlog of queued messages, packets its codec cannot parse. None of it may lock a client out.

Regression: a persistent agent session that had queued ~1,100 fuzzed manifests, reconnecting
through the `wifi-lossy` profile, lost every connection before its CONNACK arrived (a reset-mode
drop cut the link at once, taking the packets queued ahead of the lost one with it), and never
got through the backlog.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from fedal.protocol import parse_broker_url
from hil.proxy import Unparsed, parse_bytes
from tests.test_hil_proxy import connect_bytes
from tests.test_hil_proxy_mosquitto import make_broker, stats, uid, wait_until  # noqa: F401 (fixture)

DEEP = b"[" * 100_000 + b"]" * 100_000  # the fuzz test's manifest beyond any JSON parser's recursion limit
JUNK = {"deep": DEEP, "binary": os.urandom(300_000), "utf16": '{"state": "online"}'.encode("utf-16"),
        "bom": b"\xff\xfe{}", "nul": b"\x00" * 70, "one": b"{"}


class Client:
    """A paho client with a short reconnect backoff that records messages and connections."""

    def __init__(self, url: str, client_id: str, clean: bool):
        addr = parse_broker_url(url)
        self.connects = self.disconnects = self.subacks = 0
        self.messages: list[mqtt.MQTTMessage] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean,
                                  protocol=mqtt.MQTTv311)
        self.client.reconnect_delay_set(0.5, 2)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda *_: setattr(self, "disconnects", self.disconnects + 1)
        self.client.on_subscribe = lambda *_: setattr(self, "subacks", self.subacks + 1)
        self.client.on_message = self._on_message
        self.topic: str | None = None
        self.client.connect_async(addr.host, addr.port, keepalive=30)
        self.client.loop_start()

    def _on_connect(self, client, _u, _f, reason, _p):
        if not reason.is_failure:
            self.connects += 1
            if self.topic:
                client.subscribe(self.topic, qos=1)

    def subscribe(self, topic: str) -> None:
        self.topic = topic
        if self.connects:
            self.client.subscribe(topic, qos=1)

    def _on_message(self, _c, _u, msg):
        with self.lock:
            self.messages.append(msg)

    def payloads(self) -> dict[str, bytes]:
        with self.lock:
            return {m.topic: m.payload for m in self.messages}

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def publish_all(url: str, items: list[tuple[str, bytes]], retain: bool = False) -> None:
    c = Client(url, uid("pub"), clean=True)
    try:
        wait_until(lambda: c.connects, what="the publisher to connect")
        for info in [c.client.publish(t, p, qos=1, retain=retain) for t, p in items]:
            info.wait_for_publish(30)
    finally:
        c.close()


def test_retained_junk_reaches_a_subscriber_through_the_proxy(mosquitto, make_broker):
    b = make_broker("")
    prefix = uid("junk")
    publish_all(mosquitto, [(f"{prefix}/{k}", v) for k, v in JUNK.items()], retain=True)
    sub = Client(b.url, uid("sub"), clean=True)
    try:
        sub.subscribe(f"{prefix}/#")
        wait_until(lambda: len(sub.payloads()) == len(JUNK), what="every retained message")
        time.sleep(0.3)
        assert sub.payloads() == {f"{prefix}/{k}": v for k, v in JUNK.items()}
        assert sub.connects == 1 and sub.disconnects == 0
        s = stats(b)
        assert s["faults"] == {} and s["clients"][sub.client._client_id.decode()]["connections"] == 1
    finally:
        sub.close()
        publish_all(mosquitto, [(f"{prefix}/{k}", b"") for k in JUNK], retain=True)  # leave nothing retained


def test_a_queued_backlog_drains_through_a_lossy_link(mosquitto, make_broker):
    """Every reset-mode drop costs one connection, but the packets ahead of the lost one (the
    CONNACK first) still arrive, so every connection is established and the backlog shrinks."""
    # the client's id draws its fault stream: this one drops 6 of the 120, the first among the first 30
    topic, cid, n = uid("backlog"), "agent-backlog-0", 120
    first = Client(mosquitto, cid, clean=False)  # a persistent session, subscribed, then offline
    first.subscribe(f"{topic}/#")
    wait_until(lambda: first.subacks, what="the subscription")
    first.close()
    items = [(f"{topic}/{i}", (DEEP if i % 40 == 0 else b"x" * 2000) + str(i).encode()) for i in range(n)]
    publish_all(mosquitto, items)
    b = make_broker('[default]\nlatency_ms = 20\njitter_ms = 60\nbandwidth_kbps = 10000\ndrop = 0.05\n'
                    'drop_mode = "reset"\n', seed=1)
    agent = Client(b.url, cid, clean=False)
    try:
        wait_until(lambda: len(agent.payloads()) == n, timeout_s=120, what="the whole backlog")
        assert agent.payloads() == dict(items)
        s = stats(b)
        dropped, connections = s["faults"].get("dropped", 0), s["clients"][cid]["connections"]
        assert dropped >= 1 and connections == 1 + dropped  # one death per connection, no more
        wait_until(lambda: agent.connects == connections, what="a CONNACK on every connection")
    finally:
        agent.close()
        Client(mosquitto, cid, clean=True).close()  # discard the persistent session


def test_a_packet_the_codec_cannot_parse_is_forwarded_raw_and_counted(make_broker):
    reserved = b"\xf0\x00"  # framing intact, type 15 unknown to MQTT 3.1.1
    with pytest.raises(Unparsed) as err:
        asyncio.run(parse_bytes(reserved))
    assert err.value.raw == reserved and err.value.packet_type == 15
    b = make_broker("")
    cid = uid("odd")
    with socket.create_connection(("127.0.0.1", b.proxy.port), timeout=10) as s:
        s.sendall(connect_bytes(cid))
        assert s.recv(4096) == b"\x20\x02\x00\x00"
        s.sendall(reserved)  # the broker, not the proxy, judges it (Mosquitto hangs up)
        rest = b""
        while chunk := s.recv(4096):
            rest += chunk
    assert rest == b""
    wait_until(lambda: stats(b)["clients"][cid]["up"].get("unparsed") == 1, what="the unparsed count")
    st = stats(b)["clients"][cid]
    assert st["malformed"] == 1 and st["up"]["bytes"] == len(connect_bytes(cid)) + len(reserved)
