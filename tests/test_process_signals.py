"""Stopping a command that started processes stops them all: `fedal demo` and `fedal hil fleet
--start-coordinator` ended by SIGTERM (systemd, `timeout`), SIGHUP (a closed terminal) or even
SIGKILL leave no coordinator, agent or broker behind holding its port; and a coordinator stopped
by SIGTERM/SIGINT/SIGHUP publishes its run's `stopped` state, saves it and exits 0."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from coordinator.store import RunStore, default_store_url
from fedal.protocol import parse_broker_url, topics
from fedal.sim import load_config
from tests.deployment import Deployment, poll_run
from tests.waiting import free_port, wait_until

SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL]


def fedal(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("fedal")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "fedal_cli.main", *args]


def children_of(pid: int) -> set[int]:
    """Every live descendant of pid (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """A zombie (dead, not yet reaped by whoever inherited it) counts as gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # fails only while someone listens there
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def stop_and_check(proc: subprocess.Popen, sig: int, ports: list[int]) -> int:
    """Send sig to proc once its children run; every one of them must be gone and the ports free."""
    children = children_of(proc.pid)
    assert children, "the command started no process"
    proc.send_signal(sig)
    returncode = proc.wait(timeout=120)
    wait_until(lambda: not any(alive(c) for c in children), timeout_s=90,
               what=f"the processes of the run to end after {signal.Signals(sig).name} ({sorted(children)})")
    for port in ports:
        wait_until(lambda port=port: port_free(port), timeout_s=30, what=f"port {port} to be free")
    return returncode


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_demo_stopped_by_a_signal_leaves_nothing_running(tmp_path, sig):
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    log = tmp_path / "demo.log"
    with open(log, "wb") as out:
        demo = subprocess.Popen(fedal("demo", "--dataset", "digits", "--clients", "2", "--strategy", "fedmd",
                                      "--rounds", "5000", "--public-size", "60", "--api-port", str(api_port),
                                      "--workdir", str(tmp_path / "ws"), "--out", str(tmp_path / "results.json")),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: (poll_run(api) or {}).get("completed_rounds", 0) >= 1 or demo.poll() is not None,
                   timeout_s=300, what="the demo's first round", interval_s=0.3)
        assert demo.poll() is None, log.read_text()[-3000:]
        broker_port = int(re.search(r"broker mqtt://127\.0\.0\.1:(\d+)", log.read_text()).group(1))
        returncode = stop_and_check(demo, sig, [api_port, broker_port])
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    if sig != signal.SIGKILL:  # the same orderly shutdown as Ctrl-C, reported as the signal's status
        assert returncode == 128 + sig, log.read_text()[-3000:]
        assert f"stopped by {signal.Signals(sig).name}" in log.read_text()
    # even after SIGKILL the coordinator was stopped (SIGTERM from the kernel), not killed: state saved
    saved = RunStore(default_store_url(tmp_path / "ws" / "coordinator" / "state")).load("demo")
    assert saved.state == "stopped" and saved.completed_rounds >= 1


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_hil_fleet_with_its_coordinator_stopped_by_a_signal(mosquitto, tmp_path, sig):
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    run_id = f"sig{int(sig)}"
    log = tmp_path / "fleet.log"
    with open(log, "wb") as out:
        fleet = subprocess.Popen(fedal("hil", "fleet", "--clients", "3", "--run-id", run_id, "--broker", mosquitto,
                                       "--start-coordinator", "--rounds", "100000", "--public-size", "64",
                                       "--api-port", str(api_port), "--workdir", str(tmp_path / "ws"), "--quiet"),
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: (poll_run(api, run_id) or {}).get("completed_rounds", 0) >= 1 or fleet.poll() is not None,
                   timeout_s=300, what="the fleet's first round", interval_s=0.3)
        assert fleet.poll() is None, log.read_text()[-3000:]
        returncode = stop_and_check(fleet, sig, [api_port])
    finally:
        if fleet.poll() is None:
            fleet.kill()
            fleet.wait()
    if sig != signal.SIGKILL:
        assert returncode == 128 + sig and '"outcome": "interrupted"' in log.read_text(), log.read_text()[-3000:]
    saved = RunStore(default_store_url(tmp_path / "ws" / "state")).load(run_id)
    assert saved.state == "stopped"


class StateWatcher:
    """A raw paho subscriber to the run's retained manifest: the states it was sent, in order."""

    def __init__(self, url: str, run_id: str):
        import paho.mqtt.client as mqtt

        addr = parse_broker_url(url)
        self.states: list[str] = []
        self.retained: list[str] = []
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"state-watcher-{time.monotonic_ns()}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: self.subscribed.set()
        self.client.connect(addr.host, addr.port)
        self.client.loop_start()
        self.client.subscribe(topics.run_manifest(run_id), qos=1)
        assert self.subscribed.wait(10)

    def _on_message(self, _c, _u, msg) -> None:
        if msg.payload:
            state = json.loads(msg.payload)["state"]
            (self.retained if msg.retain else self.states).append(state)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: signal.Signals(s).name)
def test_coordinator_stopped_by_a_signal_publishes_stopped_and_exits_0(mosquitto, tmp_path, sig):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=3, public_size=60, seed=0))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    watcher = StateWatcher(mosquitto, "demo")
    try:
        dep.start_coordinator()  # no agent joins: the run is published and waits for them
        wait_until(lambda: "running" in watcher.states + watcher.retained, timeout_s=120,
                   what="the run's manifest", interval_s=0.2)
        dep.coordinator.send_signal(sig)
        assert dep.coordinator.wait(timeout=60) == 0, (dep.workdir / "coordinator" / "coordinator.log").read_text()[-3000:]
        wait_until(lambda: "stopped" in watcher.states, timeout_s=10, what="`stopped` to be published")
    finally:
        watcher.close()
        dep.close()
    saved = RunStore(default_store_url(dep.workdir / "coordinator" / "state")).load("demo")
    assert saved.state == "stopped"
    late = StateWatcher(mosquitto, "demo")  # a subscriber that comes later is told by the retained manifest
    try:
        wait_until(lambda: late.retained, timeout_s=10, what="the retained manifest")
        assert late.retained == ["stopped"]
    finally:
        late.close()


def test_a_child_spawned_from_a_short_lived_thread_outlives_that_thread_not_the_process(tmp_path):
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: children of other threads are forked
    by fedal.procs' long-lived spawner thread, so they live as long as the process that wants them."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, threading, time\n"
        "from fedal import procs\n"
        "box = []\n"
        "t = threading.Thread(target=lambda: box.append(procs.spawn(['sleep', '120'], stdout=sys.stdout)))\n"
        "t.start(); t.join()\n"
        "print(box[0].pid, flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # the thread that asked for it is gone by now
        assert alive(child)
        parent.kill()
        parent.wait()
        wait_until(lambda: not alive(child), timeout_s=30, what="the child to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_coordinator_waiting_for_an_unreachable_broker_stops_at_once(tmp_path):
    """SIGTERM while no broker answers (a systemd stop during a broker outage): the coordinator
    notices the stop within a second or two, not at its next still-waiting warning."""
    config = load_config(None, dict(strategy="local", dataset="digits", clients=2, rounds=1, seed=0))
    dead = f"mqtt://127.0.0.1:{free_port()}"  # a loopback port nobody listens on
    dep = Deployment(config, tmp_path / "dep", dead)
    try:
        dep.start_coordinator()
        wait_until(lambda: (poll_run(dep.api) or {}).get("state") == "pending", timeout_s=60,
                   what="the API", interval_s=0.2)
        time.sleep(1.0)
        stopped_at = time.monotonic()
        dep.coordinator.send_signal(signal.SIGTERM)
        assert dep.coordinator.wait(timeout=20) == 0
        assert time.monotonic() - stopped_at < 15.0  # the next still-waiting warning would be 30 s on
    finally:
        dep.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_driver_that_dies_with_its_parent_ends_when_its_script_is_killed(tmp_path):
    """arm64-smoke.sh runs its driver and unmounts after it: a SIGKILL of the script left the
    driver running the whole federated run on its own. procs.die_with_parent ends it."""
    driver = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
              "from fedal import procs\nprocs.die_with_parent()\nimport time\nprint('up', flush=True)\ntime.sleep(120)\n")
    script = subprocess.Popen(["bash", "-c", f'{sys.executable} -c "$0" & echo $!; wait', driver],
                              stdout=subprocess.PIPE, text=True)
    try:
        pid = int(script.stdout.readline())
        assert script.stdout.readline().strip() == "up"
        script.kill()
        script.wait(10)
        wait_until(lambda: not Path(f"/proc/{pid}").exists() or "(Z)" in Path(f"/proc/{pid}/stat").read_text()
                   or " Z " in Path(f"/proc/{pid}/stat").read_text(), timeout_s=10, what="the driver to end")
    finally:
        script.kill()
        script.stdout.close()
