"""Device health: the agent's report read from fake sysfs/procfs trees (a Pi with and without the
firmware's get_throttled file, a PC, missing and garbage files), what the round engine keeps of a
status's `health` (never more than it can check, never a crash, the status still an online
status), the coordinator's flags, and the agent's MQTT link refreshing it over a real broker at
most every health_every_s with `offline` still its last word."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import paho.mqtt.client as mqtt
import pytest

from coordinator.config import CoordinatorConfig
from edge_agent.config import AgentConfig
from edge_agent.health import HealthProbe
from edge_agent.mqtt_link import MqttLink, status_payload
from fedal.engine import Arrival, RoundEngine, Transport
from fedal.engine.health import FLAGS, HealthLimits, health_flags, throttle_conditions, validate_health
from fedal.protocol import parse_broker_url, topics
from tests.health_trees import PI_MODEL, common_tree, pi_tree, write
from tests.waiting import wait_until

# -- the agent's probe ----------------------------------------------------------------------------


def test_pi_tree_with_the_firmware_file(tmp_path):
    root = pi_tree(tmp_path / "root", temp_mc=71_234, throttled="50005", mem_total_kb=1_000_000,
                   mem_available_kb=250_000, rss_kb=190_000, load="3.10 2.05 1.00")
    probe = HealthProbe(root, disk_path=tmp_path, vcgencmd="/nonexistent/vcgencmd")  # the file wins: never run
    h = probe.sample()
    assert h["cpu_temp_c"] == 71.2
    assert h["throttled"] == 0x50005
    assert throttle_conditions(h["throttled"]) == ["under_voltage", "throttled", "under_voltage_occurred",
                                                   "throttled_occurred"]
    assert (h["load1"], h["load5"], h["load15"]) == (3.10, 2.05, 1.00)
    assert (h["mem_total_bytes"], h["mem_available_bytes"]) == (1_000_000 * 1024, 250_000 * 1024)
    assert h["rss_bytes"] == 190_000 * 1024
    st = os.statvfs(tmp_path)
    assert h["disk_total_bytes"] == st.f_blocks * st.f_frsize and 0 < h["disk_free_bytes"] <= h["disk_total_bytes"]
    v = h["versions"]
    assert v["board"] == PI_MODEL  # NUL terminator stripped
    assert v["os"] == "Debian GNU/Linux 12 (bookworm)" and v["kernel"] == "6.6.51+rpt-rpi-v8"
    assert v["fedal"] and v["python"] and v["torch"]
    # what the agent sends is, field by field, what the coordinator accepts
    accepted, problems = validate_health(json.loads(json.dumps(h)))
    assert problems == [] and accepted == h
    assert len(status_payload("online", h)) < 1024  # small: it is retained and re-sent on every subscribe


def fake_vcgencmd(tmp_path: Path, output: str, rc: int = 0) -> tuple[str, Path]:
    calls = tmp_path / "vcgencmd-calls"
    script = tmp_path / "vcgencmd"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho '{output}'\nexit {rc}\n")
    script.chmod(0o755)
    return str(script), calls


def test_pi_without_the_firmware_file_asks_vcgencmd(tmp_path):
    root = pi_tree(tmp_path / "root", throttled=None)
    tool, calls = fake_vcgencmd(tmp_path, "throttled=0x4")
    probe = HealthProbe(root, disk_path=tmp_path, vcgencmd=tool)
    assert probe.sample()["throttled"] == 0x4
    assert probe.sample()["throttled"] == 0x4
    assert calls.read_text().splitlines() == ["get_throttled", "get_throttled"]


def test_a_failing_vcgencmd_is_asked_once(tmp_path, caplog):
    root = pi_tree(tmp_path / "root", throttled=None)
    tool, calls = fake_vcgencmd(tmp_path, "VCHI initialization failed", rc=255)
    probe = HealthProbe(root, disk_path=tmp_path, vcgencmd=tool)
    assert "throttled" not in probe.sample()
    assert "throttled" not in probe.sample()
    assert calls.read_text().splitlines() == ["get_throttled"]
    assert "VCHI initialization failed" in caplog.text


def test_vcgencmd_is_only_looked_up_on_the_real_root(tmp_path, monkeypatch):
    tool, calls = fake_vcgencmd(tmp_path, "throttled=0x1")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert HealthProbe(tmp_path / "root").vcgencmd is None  # a fake tree never runs the device's tool
    assert HealthProbe("/").vcgencmd == tool


def test_a_pc_picks_its_cpu_zone_and_has_no_pi_fields(tmp_path):
    root = common_tree(tmp_path / "root")
    write(root, "sys/class/thermal/thermal_zone0/type", "acpitz\n")
    write(root, "sys/class/thermal/thermal_zone0/temp", "27800\n")
    write(root, "sys/class/thermal/thermal_zone10/type", "x86_pkg_temp\n")
    write(root, "sys/class/thermal/thermal_zone10/temp", "48000\n")
    write(root, "sys/class/thermal/cooling_device0/type", "Processor\n")
    h = HealthProbe(root, disk_path=tmp_path).sample()
    assert h["cpu_temp_c"] == 48.0
    assert "throttled" not in h and "board" not in h["versions"]
    assert validate_health(h)[1] == []


def test_missing_and_garbage_files_leave_fields_out(tmp_path):
    empty = HealthProbe(tmp_path / "nothing-here", disk_path=tmp_path / "not" / "made" / "yet").sample()
    assert set(empty) == {"ts", "disk_total_bytes", "disk_free_bytes", "versions"}  # disk: its nearest existing parent
    assert set(empty["versions"]) >= {"fedal", "python"} and "os" not in empty["versions"]

    root = tmp_path / "garbage"
    write(root, "sys/class/thermal/thermal_zone0/temp", "not a number\n")
    write(root, "sys/devices/platform/soc/soc:firmware/get_throttled", "zz\n")
    write(root, "proc/loadavg", "\n")
    write(root, "proc/meminfo", "MemTotal: lots\n")
    write(root, "proc/self/status", b"\xff\xfe binary")
    write(root, "proc/device-tree/model", b"\x00\x00")
    write(root, "etc/os-release", "NAME=x\n")
    h = HealthProbe(root, disk_path=tmp_path).sample()
    assert set(h) == {"ts", "disk_total_bytes", "disk_free_bytes", "versions"}
    assert "board" not in h["versions"] and "os" not in h["versions"]
    assert validate_health(h)[1] == []


def test_a_board_string_is_cleaned_to_what_the_coordinator_accepts(tmp_path):
    root = pi_tree(tmp_path / "root", model="Raspberry Pi\x07 5 " + "x" * 300)
    board = HealthProbe(root, disk_path=tmp_path).versions()["board"]
    assert board.startswith("Raspberry Pi 5 x") and len(board) == 128
    assert validate_health({"versions": {"board": board}}) == ({"versions": {"board": board}}, [])


# -- what the engine keeps, and the flags ---------------------------------------------------------


class NoTransport(Transport):
    def start(self, should_stop) -> bool:
        return True

    def send(self, client_id: str, packet) -> int:
        return packet.size

    def receive(self, timeout_s: float) -> Arrival | None:
        return None

    def now(self) -> float:
        return 0.0


def engine() -> RoundEngine:
    server = SimpleNamespace(client_ids=["pi-1", "pi-2"])
    return RoundEngine(server, NoTransport(), run_id="r", phases=CoordinatorConfig().phases, phase_kinds={}, rounds=1)


def status(cid: str, body) -> Arrival:
    return Arrival("status", cid, "r", body if isinstance(body, bytes) else json.dumps(body).encode())


GOOD = {"ts": 1.7e9, "cpu_temp_c": 55.5, "throttled": 0, "load1": 0.5, "mem_total_bytes": 4 << 30,
        "mem_available_bytes": 3 << 30, "disk_total_bytes": 32 << 30, "disk_free_bytes": 20 << 30,
        "rss_bytes": 200 << 20, "versions": {"fedal": "0.1.0", "board": PI_MODEL}}


def test_the_engine_keeps_a_valid_health_report():
    e = engine()
    e.handle(status("pi-1", {"state": "online", "ts": 1.0, "health": GOOD}))
    info = e.clients["pi-1"]
    assert info.online and info.health == GOOD
    assert not e.counters["rejected"] and not e.counters["health_ignored"]
    e.handle(status("pi-1", {"state": "offline", "ts": 2.0}))  # the Will: the last report stays, with its ts
    assert not info.online and info.health == GOOD


@pytest.mark.parametrize("health, kept, ignored", [
    ({**GOOD, "cpu_temp_c": "hot"}, {k: v for k, v in GOOD.items() if k != "cpu_temp_c"}, 1),
    ({**GOOD, "throttled": True}, {k: v for k, v in GOOD.items() if k != "throttled"}, 1),
    ({**GOOD, "throttled": -1}, {k: v for k, v in GOOD.items() if k != "throttled"}, 1),
    ({**GOOD, "rss_bytes": 1.5}, {k: v for k, v in GOOD.items() if k != "rss_bytes"}, 1),
    ({**GOOD, "load1": float("nan")}, {k: v for k, v in GOOD.items() if k != "load1"}, 1),
    ({**GOOD, "mem_total_bytes": 10**30}, {k: v for k, v in GOOD.items() if k != "mem_total_bytes"}, 1),
    ({**GOOD, "cpu_temp_c": 10**400}, {k: v for k, v in GOOD.items() if k != "cpu_temp_c"}, 1),  # no float holds it
    ({**GOOD, "cpu_temp_c": -10**400}, {k: v for k, v in GOOD.items() if k != "cpu_temp_c"}, 1),
    ({**GOOD, "gpu_temp_c": 40}, GOOD, 1),  # a field of a newer agent: ignored, counted
    ({**GOOD, "versions": {"board": "x" * 129, "fedal": "0.1.0", "bios": "1"}}, {**GOOD, "versions": {"fedal": "0.1.0"}}, 1),
    ({**GOOD, "versions": ["torch"]}, {k: v for k, v in GOOD.items() if k != "versions"}, 1),
    ({**GOOD, "cpu_temp_c": None}, {k: v for k, v in GOOD.items() if k != "cpu_temp_c"}, 0),  # null: absent
    ({**GOOD, "load5": [[[]]], "versions": {"os": {"name": "x"}}}, {**{k: v for k, v in GOOD.items() if k != "versions"}}, 1),
])
def test_bad_fields_are_left_out_and_counted(health, kept, ignored):
    e = engine()
    e.handle(status("pi-1", {"state": "online", "ts": 1.0, "health": health}))
    info = e.clients["pi-1"]
    assert info.online and info.health == kept
    assert e.counters["health_ignored"] == ignored and not e.counters["rejected"]


@pytest.mark.parametrize("health", ["fine", 42, [GOOD], {"nested": {"deeper": [1, 2, {"x": None}]}}, {}])
def test_unusable_health_keeps_the_last_report_and_the_online_status(health):
    e = engine()
    e.handle(status("pi-1", {"state": "online", "ts": 1.0, "health": GOOD}))
    e.handle(status("pi-1", {"state": "online", "ts": 2.0, "health": health}))
    info = e.clients["pi-1"]
    assert info.online and info.health == GOOD and not e.counters["rejected"]
    assert e.counters["health_ignored"] == (0 if health == {} else 1)


def test_nested_and_big_values_are_left_out_and_named_briefly(caplog):
    deep = b"[" * 500 + b"]" * 500
    big = json.dumps(list(range(2_000))).encode()  # 9 kB: a status may be up to 16 KiB
    e = engine()
    e.handle(status("pi-1", b'{"state": "online", "ts": 1, "health": {"cpu_temp_c": 40, "load1": ' + deep
                    + b', "versions": ' + big + b"}}"))
    assert e.clients["pi-1"].online and e.clients["pi-1"].health == {"cpu_temp_c": 40.0}
    assert e.counters["health_ignored"] == 1 and not e.counters["rejected"]
    assert validate_health({"load1": [[1]], "rss_bytes": {"a": 1}, "cpu_temp_c": "x" * 10_000})[1] == [
        "load1: a JSON array is not a number in [0, 10000]",
        "rss_bytes: a JSON object is not an integer in [0, 1125899906842624]",
        "cpu_temp_c: 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx... is not a number in [-60, 200]"]
    assert max(len(r.message) for r in caplog.records) < 300


def test_a_status_too_large_for_one_is_refused_before_it_is_parsed(caplog):
    """A device flooding megabyte statuses cost the coordinator 50 ms of parsing each."""
    from fedal.engine.rounds import MAX_STATUS_BYTES

    e = engine()
    padded = b'{"state": "online", "ts": 1, "health": {"cpu_temp_c": 40}, "x": "' + b"y" * MAX_STATUS_BYTES + b'"}'
    e.handle(status("pi-1", padded))
    assert not e.clients["pi-1"].online and e.clients["pi-1"].health is None
    assert e.reject_reasons["status"] == 1 and e.clients["pi-1"].rejected == 1
    assert f"status message of {len(padded)} bytes (at most {MAX_STATUS_BYTES})" in caplog.text
    e.handle(status("pi-1", {"state": "online", "ts": 2, "health": GOOD}))  # its next, ordinary one is taken
    assert e.clients["pi-1"].online


def test_a_repeated_problem_is_counted_every_time_and_warned_once(caplog):
    caplog.set_level(logging.DEBUG, logger="fedal.engine")
    e = engine()
    for ts in range(3):
        e.handle(status("pi-1", {"state": "online", "ts": ts, "health": {**GOOD, "load1": -1}}))
    assert e.counters["health_ignored"] == 3
    assert [r.levelname for r in caplog.records if "health report" in r.message] == ["WARNING", "DEBUG", "DEBUG"]


def test_a_status_with_health_is_still_an_old_style_online_status():
    body = json.loads(status_payload("online", GOOD))
    assert body["state"] == "online" and isinstance(body["ts"], float)  # what earlier coordinators read
    assert set(json.loads(status_payload("online"))) == {"state", "ts"}  # health off: the status as before


def test_flags_follow_the_limits():
    limits = CoordinatorConfig(health={"max_cpu_temp_c": 70, "min_memory_available_mb": 512,
                                       "min_disk_free_mb": 1024}).health.limits()
    assert limits == HealthLimits(70.0, 512 << 20, 1024 << 20)
    assert health_flags(None, limits) == [] and health_flags({}, limits) == []
    assert health_flags(GOOD, limits) == []
    assert health_flags({**GOOD, "throttled": 0x50000}, limits) == []  # only in the past: not flagged
    assert health_flags({**GOOD, "throttled": 0x1}, limits) == ["under_voltage"]
    assert health_flags({**GOOD, "throttled": 0x8}, limits) == ["throttled"]  # soft temperature limit
    assert health_flags({**GOOD, "throttled": 0x50005, "cpu_temp_c": 70.0, "mem_available_bytes": (512 << 20) - 1,
                         "disk_free_bytes": 1 << 20}, limits) == list(FLAGS)
    defaults = CoordinatorConfig().health.limits()
    assert health_flags({"cpu_temp_c": 79.9, "mem_available_bytes": 100 << 20, "disk_free_bytes": 500 << 20},
                        defaults) == []


# -- the agent's link over a real broker ----------------------------------------------------------


def link_config(tmp_path: Path, broker: str, every: float, root: Path) -> AgentConfig:
    return AgentConfig(client_id="pi-1", run_id=f"health-{uuid.uuid4().hex[:6]}", model="mlp",
                       data_file=tmp_path / "unused.npz", workspace=tmp_path / "ws", broker={"url": broker},
                       health_every_s=every, health_root=root)


class StatusWatcher:
    """Every status of one client, as a subscriber sees them."""

    def __init__(self, broker: str, topic: str):
        self.seen: queue.Queue[tuple[dict, bool]] = queue.Queue()
        addr = parse_broker_url(broker)
        subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"watch-{uuid.uuid4().hex[:6]}")
        self.client.on_message = lambda c, u, m: self.seen.put((json.loads(m.payload), m.retain)) if m.payload else None
        self.client.on_subscribe = lambda *a: subscribed.set()
        self.client.connect(addr.host, addr.port)
        self.client.loop_start()
        self.client.subscribe(topic, qos=1)
        assert subscribed.wait(10)

    def next(self, timeout_s: float = 30) -> dict:
        return self.seen.get(timeout=timeout_s)[0]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_the_link_refreshes_the_health_at_most_every_n_seconds_and_ends_offline(mosquitto, tmp_path):
    root = pi_tree(tmp_path / "root", throttled="50005")
    cfg = link_config(tmp_path, mosquitto, 0.5, root)
    link = MqttLink(cfg, queue.Queue())
    watcher = StatusWatcher(mosquitto, topics.status(cfg.run_id, cfg.client_id))
    try:
        link.start()
        first = watcher.next()  # at connect: the last sample there is, none yet
        assert first["state"] == "online" and "health" not in first
        reports = [watcher.next() for _ in range(4)]
        assert all(r["state"] == "online" and r["health"]["throttled"] == 0x50005 for r in reports)
        assert all(r["health"]["versions"]["board"] == PI_MODEL for r in reports)
        stamps = [r["health"]["ts"] for r in reports]
        # at most every 0.5 s (a loaded machine only spaces them more); the ms rounding of ts aside
        assert all(b - a >= 0.5 - 0.002 for a, b in zip(stamps, stamps[1:])), stamps
    finally:
        link.stop()
    while True:  # drain: whatever came after, the last word is `offline`
        try:
            last = watcher.seen.get(timeout=2)[0]
        except queue.Empty:
            break
    watcher.close()
    assert last["state"] == "offline" and "health" not in last
    late = StatusWatcher(mosquitto, topics.status(cfg.run_id, cfg.client_id))  # the retained one
    try:
        assert late.next()["state"] == "offline"
    finally:
        late.close()


def test_health_every_s_0_sends_the_plain_status(mosquitto, tmp_path):
    cfg = link_config(tmp_path, mosquitto, 0, pi_tree(tmp_path / "root"))
    link = MqttLink(cfg, queue.Queue())
    watcher = StatusWatcher(mosquitto, topics.status(cfg.run_id, cfg.client_id))
    try:
        link.start()
        first = watcher.next()
        assert set(first) == {"state", "ts"} and first["state"] == "online"
        assert not link.health_thread.is_alive()
    finally:
        link.stop()
        watcher.close()


def test_a_reconnect_sends_a_fresh_report(mosquitto, tmp_path):
    root = pi_tree(tmp_path / "root", temp_mc=50_000)
    cfg = link_config(tmp_path, mosquitto, 3600, root)  # no periodic report within the test
    link = MqttLink(cfg, queue.Queue())
    watcher = StatusWatcher(mosquitto, topics.status(cfg.run_id, cfg.client_id))
    try:
        link.start()
        assert "health" not in watcher.next()  # at the first connect there is no sample yet
        assert watcher.next()["health"]["cpu_temp_c"] == 50.0
        write(root, "sys/class/thermal/thermal_zone0/temp", "83000\n")
        connects = link.connects
        # a client with the agent's id takes its session over: the broker drops the agent, which reconnects
        addr = parse_broker_url(mosquitto)
        intruder = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fedal-agent-{cfg.run_id}-pi-1")
        intruder.connect(addr.host, addr.port)
        intruder.disconnect()
        wait_until(lambda: link.connects > connects, 60, "the agent to reconnect")
        report = watcher.next()
        while report["state"] != "online":
            report = watcher.next()
        assert report["health"]["cpu_temp_c"] == 50.0  # at connect: the last sample, at once
        assert watcher.next()["health"]["cpu_temp_c"] == 83.0  # then a fresh one
    finally:
        link.stop()
        watcher.close()


def test_a_slow_health_sample_never_holds_the_connection(mosquitto, tmp_path):
    """vcgencmd may take seconds: sampled on paho's network thread, it held the connect (and
    keepalive, and every message) until it answered."""
    root = pi_tree(tmp_path / "root", throttled=None)  # no firmware file: vcgencmd is asked
    calls = tmp_path / "vcgencmd-calls"
    tool = tmp_path / "vcgencmd"
    tool.write_text(f"#!/bin/sh\necho call >> {calls}\nsleep 4\necho throttled=0x4\n")
    tool.chmod(0o755)
    cfg = link_config(tmp_path, mosquitto, 3600, root)
    link = MqttLink(cfg, queue.Queue())
    link.health = HealthProbe(root, cfg.workspace, vcgencmd=str(tool))
    watcher = StatusWatcher(mosquitto, topics.status(cfg.run_id, cfg.client_id))
    try:
        start = time.monotonic()
        link.start()
        assert link.connected.wait(3), "the connect waited for the health sample"
        first = watcher.next()
        assert first["state"] == "online" and "health" not in first and time.monotonic() - start < 3
        fresh = watcher.next(20)
        assert fresh["health"]["throttled"] == 0x4 and calls.read_text().count("call") == 1
    finally:
        link.stop()
        watcher.close()


class RacyEvent(threading.Event):
    """The link's wake event, letting another thread act right after the health thread's first
    look at it (where a connect's or a stop's wake-up was once lost)."""

    def __init__(self, between):
        super().__init__()
        self.between, self.armed = between, True

    def _fire(self):
        if self.armed and threading.current_thread().name == "fedal-health":
            self.armed = False
            self.between()

    def is_set(self):
        value = super().is_set()
        self._fire()
        return value

    def clear(self):
        super().clear()
        self._fire()


def offline_link(tmp_path: Path, wake_between) -> MqttLink:
    """A link whose MQTT client is a recorder (never connected), counting its health samples."""
    cfg = link_config(tmp_path, "mqtt://127.0.0.1:1", 3600, pi_tree(tmp_path / "root"))
    link = MqttLink(cfg, queue.Queue())
    link.samples = 0  # type: ignore[attr-defined]

    def sample():
        link.samples += 1  # type: ignore[attr-defined]
        return {"ts": time.time(), "cpu_temp_c": 50.0}

    link.health.sample = sample  # type: ignore[union-attr,method-assign]
    link.client = SimpleNamespace(publish=lambda *a, **k: SimpleNamespace(wait_for_publish=lambda t: None),
                                  subscribe=lambda *a: None, disconnect=lambda: None, loop_stop=lambda: None)
    link.wake = RacyEvent(wake_between)
    link.health_thread = threading.Thread(target=link._report_health, name="fedal-health", daemon=True)
    return link


def test_a_connect_racing_the_health_thread_still_gets_its_fresh_sample(tmp_path):
    link = offline_link(tmp_path, lambda: link._on_connect(link.client, None, None, SimpleNamespace(is_failure=False),
                                                           None))
    link.connected.set()
    link.health_sent = time.monotonic()  # the last sample was just taken: the periodic one is an hour away
    link.health_thread.start()
    try:
        wait_until(lambda: link.samples == 1, 10, "the fresh sample after the connect")
        assert link.connects == 1
    finally:
        link.stop()


def test_a_stop_racing_the_health_thread_ends_it_at_once(tmp_path):
    stopped: dict[str, float] = {}

    def stop_now():
        def run():
            start = time.monotonic()
            link.stop()
            stopped["s"] = time.monotonic() - start
        threading.Thread(target=run).start()
        time.sleep(0.2)  # stop() has set `stopping` and the wake-up by now, and joins the thread
    link = offline_link(tmp_path, stop_now)  # disconnected (the broker away): the thread would wait an hour
    link.health_thread.start()
    wait_until(lambda: "s" in stopped, 15, "stop() to return")
    assert stopped["s"] < 5 and not link.health_thread.is_alive()


def test_a_health_interval_below_the_floor_is_refused(tmp_path):
    """Each report is a retained publish: an interval of a millisecond flooded the broker."""
    root = pi_tree(tmp_path / "root")
    with pytest.raises(ValueError, match="0 \\(no health reports\\) or at least 0.5 s"):
        link_config(tmp_path, "mqtt://127.0.0.1:1", 0.001, root)
    assert link_config(tmp_path, "mqtt://127.0.0.1:1", 0, root).health_every_s == 0
    assert link_config(tmp_path, "mqtt://127.0.0.1:1", 0.5, root).health_every_s == 0.5


def test_a_disconnected_health_thread_waits_for_a_connect_without_waking(tmp_path):
    waits: list[float | None] = []

    class CountingEvent(threading.Event):
        def wait(self, timeout=None):
            waits.append(timeout)
            return super().wait(timeout)

    link = offline_link(tmp_path, lambda: None)
    link.wake = CountingEvent()
    link.health_thread.start()
    time.sleep(0.5)
    try:
        assert waits == [None] and link.samples == 0  # one wait, no timeout: nothing is due while away
    finally:
        link.stop()
    assert not link.health_thread.is_alive()
