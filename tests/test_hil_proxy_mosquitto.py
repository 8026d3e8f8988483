"""The emulated broker in front of a real Mosquitto, driven by raw paho clients.

Assertions count messages against the proxy's own fault counters; the only timing assertion is
a lower bound (a bandwidth cap can only make things slower).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from urllib.parse import urlsplit

import httpx
import paho.mqtt.client as mqtt
import pytest
from amqtt.mqtt import PublishPacket
from fastapi.testclient import TestClient

from fedal.protocol import parse_broker_url
from hil.broker import EmulatedBroker
from hil.control import build_app
from hil.faults import FaultEngine
from hil.profiles import Profile, parse_profile
from hil.proxy import Proxy
from tests.test_hil_proxy import connect_bytes
from tests.waiting import free_port, wait_for_port, wait_until


class Peer:
    """A paho client that records what it receives and how often it (re)connected."""

    def __init__(self, url: str, client_id: str, clean: bool = True, subscribe: str | None = None,
                 will: str | None = None):
        addr = parse_broker_url(url)
        self.id = client_id
        self.messages: list[mqtt.MQTTMessage] = []
        self.connects = 0
        self.disconnects = 0
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean,
                                  protocol=mqtt.MQTTv311)
        self.client.reconnect_delay_set(min_delay=1, max_delay=1)
        if will:
            self.client.will_set(will, b"gone", qos=1)
        self.subscribe = subscribe
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.subacks = 0
        self.client.on_subscribe = self._on_subscribe
        self.client.connect_async(addr.host, addr.port, keepalive=30)
        self.client.loop_start()
        wait_until(lambda: self.connects >= 1, what=f"{client_id} to connect")
        if subscribe:  # nothing published before the broker has the subscription may be missed
            wait_until(lambda: self.subacks >= 1, what=f"{client_id} to subscribe")

    def _on_connect(self, client, _u, _f, reason, _p):
        if reason.is_failure:
            return
        if self.subscribe:
            client.subscribe(self.subscribe, qos=1)
        self.connects += 1

    def _on_subscribe(self, *_):
        self.subacks += 1

    def _on_disconnect(self, *_):
        self.disconnects += 1

    def _on_message(self, _c, _u, msg):
        with self.lock:
            self.messages.append(msg)

    def payloads(self, topic: str | None = None) -> list[bytes]:
        with self.lock:
            return [m.payload for m in self.messages if topic is None or m.topic == topic]

    def publish_many(self, topic: str, n: int, qos: int = 1, size: int = 0) -> list[mqtt.MQTTMessageInfo]:
        return [self.client.publish(topic, str(i).encode().ljust(size, b"."), qos=qos) for i in range(n)]

    def close(self):
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture()
def make_broker(mosquitto):
    """Start an emulated broker in front of the session's Mosquitto with a profile given as TOML."""
    addr = parse_broker_url(mosquitto)
    started = []

    def make(profile_text: str = "", seed: int = 0) -> EmulatedBroker:
        b = EmulatedBroker(parse_profile(profile_text, "test"), (addr.host, addr.port), seed=seed).start()
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


@pytest.fixture()
def peers():
    made: list[Peer] = []

    def make(*args, **kwargs) -> Peer:
        p = Peer(*args, **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def uid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


# A link's fault stream is drawn from (seed, client id, direction): a test that needs at least one
# drop names its client, so its stream is the same every run. Each of these ids was picked because
# its stream drops several of the first publishes (whatever few packets come before them).
DROPPING_PUB_ID = {"unacked": "pub-unacked-1", "reset": "pub-reset-0", "cli": "pub-cli-1"}


def stats(b: EmulatedBroker) -> dict:
    return b.run(b.engine.snapshot)


def link(b: EmulatedBroker, client: str, direction: str) -> dict:
    return stats(b)["clients"].get(client, {}).get(direction, {})


def test_clean_profile_passes_everything_through(make_broker, peers):
    b = make_broker("")
    topic = uid("t")
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    pub = peers(b.url, uid("pub"), will=f"{topic}/will")
    big = bytes(range(256)) * 4096  # 1 MiB: spans many TCP reads
    infos = pub.publish_many(f"{topic}/q1", 30, qos=1) + pub.publish_many(f"{topic}/q0", 30, qos=0)
    infos.append(pub.client.publish(f"{topic}/big", big, qos=1))
    for i in infos:
        i.wait_for_publish(10)
    wait_until(lambda: len(sub.payloads()) == 61, what="61 messages")
    assert sub.payloads(f"{topic}/q1") == [str(i).encode() for i in range(30)]
    assert sub.payloads(f"{topic}/big") == [big]
    s = link(b, pub.id, "up")
    assert s["publishes"] == 61 and s["bytes"] > len(big)
    assert stats(b)["faults"] == {}
    # a reset is a dead link: no DISCONNECT reaches the broker, so the client's Will is published
    assert b.run(b.proxy.reset_clients, pub.id) == 1
    wait_until(lambda: sub.payloads(f"{topic}/will") == [b"gone"], what="the Will")
    wait_until(lambda: pub.connects == 2, what="the publisher to reconnect")
    assert stats(b)["faults"] == {"reset": 1}
    assert stats(b)["clients"][pub.id]["resets"] == 1 and not stats(b)["clients"][sub.id]["resets"]


def test_dropped_publishes_follow_the_rate_and_the_counters(make_broker, peers):
    topic = uid("t")
    b = make_broker(f'[clients."pub-*".up]\ndrop = 0.2\ndrop_mode = "lost"\ntopics = ["{topic}/#"]', seed=5)
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    pub = peers(b.url, uid("pub"))
    for i in pub.publish_many(f"{topic}/x", 300):
        i.wait_for_publish(10)  # "lost" drops are acknowledged by the proxy: nothing stays in flight
    dropped = link(b, pub.id, "up")["dropped"]
    assert 30 <= dropped <= 90
    wait_until(lambda: len(sub.payloads()) == 300 - dropped, what="every publish that was not dropped")
    time.sleep(0.3)
    got = sub.payloads()
    assert len(got) == len(set(got)) == 300 - dropped
    events = b.run(lambda: [e for e in b.engine.events if e["fault"] == "dropped"])
    assert len(events) == dropped and {e["topic"] for e in events} == {f"{topic}/x"}
    assert not link(b, sub.id, "down").get("dropped")


def test_duplicated_publishes_arrive_twice_and_extra_acks_are_absorbed(make_broker, peers):
    topic = uid("t")
    b = make_broker('[clients."pub-*".up]\nduplicate = 0.1\n[clients."sub-*".down]\nduplicate = 0.2', seed=3)
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    pub = peers(b.url, uid("pub"))
    for i in pub.publish_many(f"{topic}/x", 200):
        i.wait_for_publish(10)
    dup_up = link(b, pub.id, "up")["duplicated"]
    wait_until(lambda: link(b, sub.id, "down").get("publishes", 0) == 200 + dup_up, what="the broker's deliveries")
    dup_down = link(b, sub.id, "down")["duplicated"]
    assert dup_up > 5 and dup_down > 20
    wait_until(lambda: len(sub.payloads()) == 200 + dup_up + dup_down, what="originals and copies")
    got = sub.payloads()
    assert len(set(got)) == 200
    assert sum(m.dup for m in sub.messages) >= dup_down  # the proxy's copies carry the DUP flag
    # each QoS 1 copy is acknowledged too; the proxy keeps that second PUBACK from the sender
    wait_until(lambda: link(b, sub.id, "up").get("acks_swallowed") == dup_down, what="the copies' PUBACKs")
    assert link(b, pub.id, "down")["acks_swallowed"] == dup_up


def test_unacked_drops_wait_in_flight_until_a_reconnect_retransmits_them(make_broker, peers):
    topic = uid("t")
    b = make_broker(f'[clients."pub-*".up]\ndrop = 0.3\ndrop_mode = "unacked"\ntopics = ["{topic}/#"]', seed=11)
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    pub = peers(b.url, DROPPING_PUB_ID["unacked"])
    infos = pub.publish_many(f"{topic}/x", 20)
    dropped = wait_until(lambda: link(b, pub.id, "up").get("dropped"), what="drops")
    wait_until(lambda: len(sub.payloads()) + link(b, pub.id, "up")["dropped"] == 20, what="the rest")
    dropped = link(b, pub.id, "up")["dropped"]
    # the others are acknowledged; the dropped ones stay in flight at the sender
    wait_until(lambda: sum(not i.is_published() for i in infos) == dropped, what="the acknowledgements")
    time.sleep(0.5)
    assert sum(not i.is_published() for i in infos) == dropped
    with httpx.Client(base_url=b.control_url) as api:
        assert api.put("/faults", json={}).status_code == 200  # stop dropping, then cut the link
        assert api.post("/reset", json={"client": pub.id}).json() == {"reset": 1}
    for i in infos:
        i.wait_for_publish(15)  # paho resent them (DUP) after reconnecting
    wait_until(lambda: len(set(sub.payloads())) == 20, what="the retransmitted messages")
    assert pub.connects == 2


def test_reset_mode_drops_cost_a_reconnect_but_lose_nothing(make_broker, peers):
    topic = uid("t")
    b = make_broker(f'[clients."pub-*".up]\ndrop = 0.1\ndrop_mode = "reset"\ntopics = ["{topic}/#"]', seed=2)
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    pub = peers(b.url, DROPPING_PUB_ID["reset"])
    # 60 messages: this client's stream drops 6 of them, the first within the first ten
    for i in range(60):  # one in flight at a time, as an agent's results are
        pub.client.publish(f"{topic}/x", str(i).encode(), qos=1).wait_for_publish(30)
    wait_until(lambda: len(set(sub.payloads())) == 60, timeout_s=60, what="every message")
    s = stats(b)["clients"][pub.id]
    assert s["up"]["dropped"] >= 1 and s["connections"] == 1 + s["up"]["dropped"]


def test_partition_cuts_a_client_refuses_it_and_lets_it_back(make_broker, peers):
    topic = uid("t")
    b = make_broker("")
    sub = peers(b.url, uid("sub"), clean=False, subscribe=f"{topic}/#")  # a persistent session, as agents have
    pub = peers(b.url, uid("pub"))
    with httpx.Client(base_url=b.control_url) as api:
        window = api.post("/partition", json={"client": sub.id, "duration_s": 2.5}).json()
    assert window["end_s"] - window["start_s"] == 2.5
    wait_until(lambda: sub.disconnects >= 1, what="the partition to cut the subscriber")
    for i in pub.publish_many(f"{topic}/x", 10):
        i.wait_for_publish(10)
    wait_until(lambda: sub.connects >= 2, timeout_s=20, what="the subscriber to come back")
    wait_until(lambda: len(sub.payloads()) == 10, what="the messages queued during the partition")
    s = stats(b)["clients"][sub.id]
    assert s["partition_cuts"] == 1 and s["refused"] >= 1  # paho retried every second inside the window
    assert b.run(b.engine.partitioned, sub.id) is False
    assert pub.connects == 1  # the others never noticed


def test_bandwidth_cap_holds_traffic_back(make_broker, peers):
    topic = uid("t")
    b = make_broker('[clients."pub-*".up]\nbandwidth_kbps = 160')  # 20 kB/s
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    pub = peers(b.url, uid("pub"))
    t0 = time.monotonic()
    for i in pub.publish_many(f"{topic}/x", 20, size=2000):  # 40 kB
        i.wait_for_publish(30)
    wait_until(lambda: len(sub.payloads()) == 20, what="the throttled messages")
    assert time.monotonic() - t0 >= 1.8
    up = link(b, pub.id, "up")
    # each waited at least its own time on the link (about 100 ms for 2 kB at 20 kB/s); how long
    # behind the ones before it depends on when each reached the proxy, which a busy machine moves
    assert up["delayed"] >= 19 and up["delay_ms"] >= 20 * 100
    assert not link(b, sub.id, "down").get("delayed")


def test_control_api_reads_counters_and_changes_faults_live(make_broker, peers):
    topic = uid("t")
    b = make_broker("")
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    pub = peers(b.url, uid("pub"))
    with httpx.Client(base_url=b.control_url) as api:
        assert api.get("/faults").json()["default"] == {}
        bad = api.put("/faults", json={"default": {"drop": 2}})
        assert bad.status_code == 422 and "drop" in bad.text
        nan = api.put("/faults", content=b'{"default": {"drop": NaN}}', headers={"Content-Type": "application/json"})
        assert nan.status_code == 422 and "drop" in nan.text  # (a 500: the default answer could not quote NaN)
        huge = api.put("/faults", content=b'{"default": {"latency_ms": 1e999}}', headers={"Content-Type": "application/json"})
        assert huge.status_code == 422 and "latency_ms" in huge.text
        far = api.post("/partition", json={"client": "x", "duration_s": 1, "start_in_s": 1e17})
        assert far.status_code == 422 and "start_in_s" in far.text
        r = api.put("/faults", json={"clients": {pub.id: {"up": {"drop": 1, "drop_mode": "lost", "topics": [f"{topic}/drop"]}}}})
        assert r.status_code == 200
        assert api.get(f"/faults/{pub.id}").json()["up"]["drop"] == 1
        assert api.get(f"/faults/{sub.id}").json()["up"]["drop"] == 0
        for i in pub.publish_many(f"{topic}/drop", 10) + pub.publish_many(f"{topic}/keep", 10):
            i.wait_for_publish(10)
        wait_until(lambda: len(sub.payloads(f"{topic}/keep")) == 10, what="the kept topic")
        st = api.get("/stats").json()
        assert st["clients"][pub.id]["up"]["dropped"] == 10 and st["faults"]["dropped"] == 10
        assert sorted(st["connections"]) == sorted([pub.id, sub.id])
        assert len(api.get("/events", params={"fault": "dropped", "client": pub.id}).json()) == 10
        assert api.put("/faults", json={}).status_code == 200
        pub.publish_many(f"{topic}/drop", 1)[0].wait_for_publish(10)
        wait_until(lambda: len(sub.payloads(f"{topic}/drop")) == 1, what="the topic after the fault was lifted")
        assert api.get("/healthz").json()["connections"] == 2
    assert sub.payloads(f"{topic}/drop") == [b"0"]


def test_the_control_api_refuses_names_that_are_not_its_own(make_broker):
    """A web page that points a name of its own at 127.0.0.1 (DNS rebinding) cannot change a
    run's faults: the control API answers loopback's names and addresses only."""
    b = make_broker("")
    with httpx.Client(base_url=b.control_url) as api:
        refused = api.put("/faults", json={"default": {"drop": 1}}, headers={"Host": "rebind.example"})
        assert refused.status_code == 400 and "'rebind.example' is not a name" in refused.json()["detail"]
        assert api.get("/faults").json()["default"] == {}  # nothing changed
        port = urlsplit(b.control_url).port
        for host in ("localhost", f"localhost:{port}", "127.0.0.1"):
            assert api.get("/healthz", headers={"Host": host}).status_code == 200, host
        assert api.get("/stats", headers={"Host": "rebind.example"}).status_code == 400
        # counted as refused, where the control API reports itself
        assert api.get("/healthz").json()["refused_requests"] == 2
        assert api.get("/stats").json()["refused_requests"] == 2


def test_the_control_api_answers_the_name_it_is_bound_to(caplog):
    app = build_app(Proxy(FaultEngine(Profile()), ("127.0.0.1", 1)), "hil-box.lab")
    assert TestClient(app, base_url="http://hil-box.lab:8090").get("/healthz").status_code == 200
    caplog.set_level(logging.WARNING, logger="hil.control")
    assert TestClient(app, base_url="http://other-box.lab:8090").get("/healthz").status_code == 400
    assert "control API: refused GET '/healthz' from testclient: 400 Host 'other-box.lab' is not a name" in caplog.text


def raw_exchange(port: int, data: bytes, then: bytes | None = None) -> bytes:
    """Send bytes (and, after the first reply, more bytes); read until the proxy hangs up."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        if then is not None:
            out = s.recv(4096)
            s.sendall(then)
        s.shutdown(socket.SHUT_WR)
        while chunk := s.recv(4096):
            out += chunk
        return out


def test_malformed_bytes_are_counted_and_the_proxy_keeps_serving(make_broker, peers):
    b = make_broker("")
    port = b.proxy.port
    cid = uid("bad")
    assert raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") == b""
    assert raw_exchange(port, b"\x10\xff\xff\xff\xff\x7f") == b""
    assert raw_exchange(port, connect_bytes(uid("v5"), level=5)) == b""
    pub_first = PublishPacket.build("t", b"x", None, False, 0, False).to_bytes()
    assert raw_exchange(port, pub_first) == b""  # the first packet must be a CONNECT
    # a valid session that then sends a reserved packet type: the proxy hangs up on it
    assert raw_exchange(port, connect_bytes(cid), then=b"\xf0\x00") == b"\x20\x02\x00\x00"  # only the CONNACK
    wait_until(lambda: stats(b)["faults"].get("malformed") == 5, what="5 malformed")
    st = stats(b)
    assert st["clients"][cid]["malformed"] == 1 and st["clients"]["(before CONNECT)"]["malformed"] == 4
    topic = uid("t")
    sub = peers(b.url, uid("sub"), subscribe=f"{topic}/#")
    peers(b.url, uid("pub")).publish_many(f"{topic}/x", 1)[0].wait_for_publish(10)
    wait_until(lambda: sub.payloads() == [b"0"], what="traffic after the garbage")


def test_cli_runs_the_emulated_broker_as_a_process(mosquitto, peers, tmp_path):
    listen, control = free_port(), free_port()
    profile = tmp_path / "lossy.toml"
    profile.write_text('description = "test"\n[default]\njitter_ms = 20\ndrop = 0.05\ndrop_mode = "lost"\nduplicate = 0.05\n')
    log = open(tmp_path / "hil.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "hil", "broker", "--upstream", mosquitto, "--listen",
                             f"127.0.0.1:{listen}", "--profile", str(profile), "--control", f"127.0.0.1:{control}",
                             "--seed", "3"], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for_port(control, timeout_s=60), (tmp_path / "hil.log").read_text()
        url = f"mqtt://127.0.0.1:{listen}"
        topic = uid("t")
        sub = peers(url, uid("sub"), subscribe=f"{topic}/#")
        pub = peers(url, DROPPING_PUB_ID["cli"])
        for i in pub.publish_many(f"{topic}/x", 60):
            i.wait_for_publish(10)
        api = f"http://127.0.0.1:{control}"
        faults = httpx.get(f"{api}/faults").json()
        assert faults["profile"] == "lossy" and faults["seed"] == 3 and faults["default"]["drop"] == 0.05

        def consistent():
            st = httpx.get(f"{api}/stats").json()["clients"]
            up, down = st[pub.id]["up"], st[sub.id]["down"]
            delivered = 60 - up.get("dropped", 0) + up.get("duplicated", 0)
            expected = delivered - down.get("dropped", 0) + down.get("duplicated", 0)
            return down.get("publishes") == delivered and len(sub.payloads()) == expected

        wait_until(consistent, what="received = sent - drops + copies, on both legs")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        log.close()
    assert code == 0, (tmp_path / "hil.log").read_text()
    text = (tmp_path / "hil.log").read_text()
    assert "listening on 127.0.0.1" in text and "fault dropped" in text


def test_the_control_api_listens_on_an_ipv6_address(mosquitto, tmp_path):
    """`--control [::1]:PORT` failed with "Address family for hostname not supported", though
    `--listen` takes IPv6."""
    listen, control = free_port(), free_port()
    log = open(tmp_path / "hil.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "hil", "broker", "--upstream", mosquitto, "--listen",
                             f"127.0.0.1:{listen}", "--control", f"[::1]:{control}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        announced = f"control API http://[::1]:{control}"
        wait_until(lambda: announced in (tmp_path / "hil.log").read_text() or proc.poll() is not None, timeout_s=60,
                   what="the broker to announce its control API")
        assert proc.poll() is None, (tmp_path / "hil.log").read_text()
        assert httpx.get(f"http://[::1]:{control}/healthz", timeout=10).json()["ok"] is True
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def test_a_fleet_behind_a_lossy_proxy_with_its_coordinator_on_the_real_broker(mosquitto, tmp_path):
    """`hil fleet --start-coordinator --coordinator-broker`: the emulated agents' link is faulted
    (the built-in wifi-lossy profile), the coordinator's is not, and the run finishes."""
    listen, control = free_port(), free_port()
    log = open(tmp_path / "hil.log", "wb")
    proxy = subprocess.Popen([sys.executable, "-m", "hil", "broker", "--upstream", mosquitto, "--listen",
                              f"127.0.0.1:{listen}", "--profile", "wifi-lossy", "--control", f"127.0.0.1:{control}",
                              "--seed", "1"], stdout=log, stderr=subprocess.STDOUT)
    workdir = tmp_path / "coordinator"
    try:
        assert wait_for_port(control, timeout_s=60), (tmp_path / "hil.log").read_text()
        fleet = subprocess.run([sys.executable, "-m", "hil", "fleet", "--clients", "10", "--run-id", uid("lossy"),
                                "--broker", f"mqtt://127.0.0.1:{listen}", "--coordinator-broker", mosquitto,
                                "--start-coordinator", "--workdir", str(workdir), "--rounds", "2", "--tau", "2",
                                "--public-size", "100", "--resend-s", "2", "--timeout", "150", "--quiet"],
                               capture_output=True, text=True, timeout=200)
        assert fleet.returncode == 0, (fleet.stdout[-2000:], fleet.stderr[-3000:])
        assert json.loads(fleet.stdout)["outcome"] == "finished"
        assert tomllib.loads((workdir / "coordinator.toml").read_text())["broker"]["url"] == mosquitto
        stats = httpx.get(f"http://127.0.0.1:{control}/stats", timeout=10).json()
        behind = set(stats["clients"])
        assert sum(c.startswith("fedal-agent-") for c in behind) == 10, behind  # the agents' link was faulted
        assert not any(c.startswith("fedal-coordinator-") for c in behind), behind
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(timeout=30)
        log.close()
    bad = subprocess.run([sys.executable, "-m", "hil", "fleet", "--clients", "2", "--run-id", "r",
                          "--coordinator-broker", mosquitto], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--coordinator-broker is for the coordinator --start-coordinator starts" in bad.stderr


def test_clients_without_an_id_share_one_entry(make_broker):
    """The parser names an empty client id at random: each reconnect of such a client was a new
    client in the stats (and a new fault stream, out of the reach of per-client rules)."""
    from hil.faults import EMPTY_CLIENT_ID
    from tests.test_hil_proxy import connect_bytes

    b = make_broker("")
    for _ in range(3):
        assert raw_exchange(b.proxy.port, connect_bytes(""), then=b"\xe0\x00") == b"\x20\x02\x00\x00"  # CONNACK
    wait_until(lambda: stats(b)["clients"].get(EMPTY_CLIENT_ID, {}).get("connections") == 3,
               what="three connections of the id-less client")
    assert not [c for c in stats(b)["clients"] if c.startswith("amqtt/")]
