"""A device's account cannot take over another device's or the coordinator's MQTT connection on
a broker provisioned by `fedal fleet init` (its generated fedal.conf run by a real Mosquitto).

MQTT lets a new connection with a client id already in use disconnect the old one. With one
stolen device password, reconnecting with pi-2's or the coordinator's client id once a second
used to knock them off the broker again and again. The generated config binds client ids to
accounts on the devices' listener and gives the coordinator a listener of its own.
"""

from __future__ import annotations

import itertools
import queue
import re
import threading
import time

from coordinator.bus import CoordinatorBus
from edge_agent.mqtt_link import MqttLink
from fedal.protocol import topics
from hil.coordinator_setup import start_coordinator, stop_process, wait_for_run, write_coordinator_config
from hil.fleet import Fleet, device_credentials
from tests.fleet_broker import RawClient, provision, start_broker, wait_for
from tests.waiting import free_port

RUN = "lab"


def record(client, callback: str) -> list:
    """Record every call of a real client object's callback (its reason code), then let it run."""
    seen: list = []
    handler = getattr(client, callback)

    def wrapper(*args):
        seen.append(args[3])
        handler(*args)

    setattr(client, callback, wrapper)
    return seen


def test_a_device_account_cannot_disconnect_another_device_or_the_coordinator(tmp_path):
    files = provision(tmp_path, 3, run_id=RUN)
    broker = start_broker(files, tmp_path / "mosquitto")
    coord_inbox: queue.Queue[tuple] = queue.Queue()
    bus = CoordinatorBus(files.coordinator_settings(), RUN, coord_inbox)  # the coordinator's own code and settings
    bus_drops, bus_connects = record(bus.client, "on_disconnect"), record(bus.client, "on_connect")
    link_inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
    link = MqttLink(files.agent_config("pi-2"), link_inbox)  # pi-2's agent with its generated config
    link_drops, link_connects = record(link.client, "on_disconnect"), record(link.client, "on_connect")
    stop = threading.Event()
    try:
        assert bus.start(stop, warn_every_s=10)
        link.start()
        # its online status follows its SUBSCRIBE on the same connection: its subscriptions are in place
        wait_for(coord_inbox, lambda m: m[0] == topics.status(RUN, "pi-2") and b'"online"' in m[1])
        # the victims talk before the attack
        bus.publish_task("pi-2", b"task 0")
        wait_for(link_inbox, lambda m: m == (topics.task(RUN, "pi-2"), b"task 0"))

        # pi-1's password, every client id pi-2's agent and the coordinator use (and the bare names)
        victims = [f"fedal-coordinator-{RUN}", f"fedal-agent-{RUN}-pi-2", "pi-2", "coordinator"]
        for i, victim_id in enumerate(victims * 3, start=1):
            attacker = RawClient(files.port, "pi-1", files.password("pi-1"), client_id=victim_id)
            assert attacker.accepted  # the broker lets pi-1 in, as pi-1
            bus.publish_task("pi-2", f"task {i}".encode())
            link.publish_result(f"result {i}".encode())
            wait_for(link_inbox, lambda m, i=i: m == (topics.task(RUN, "pi-2"), f"task {i}".encode()))
            wait_for(coord_inbox, lambda m, i=i: m == (topics.result(RUN, "pi-2"), f"result {i}".encode()))
            attacker.close()

        # the coordinator's listener takes the coordinator's account only, whatever the client id
        for user, password in (("pi-1", files.password("pi-1")), (None, None), ("coordinator", "wrong")):
            intruder = RawClient(files.coordinator_port, user, password, client_id=f"fedal-coordinator-{RUN}")
            assert intruder.rc is not None and not intruder.accepted, (user, intruder.rc)
            intruder.close()
        bus.publish_task("pi-2", b"last task")
        link.publish_result(b"last result")
        wait_for(link_inbox, lambda m: m == (topics.task(RUN, "pi-2"), b"last task"))
        wait_for(coord_inbox, lambda m: m == (topics.result(RUN, "pi-2"), b"last result"))

        assert bus_drops == [] and link_drops == [], (bus_drops, link_drops)
        assert bus.connected.is_set() and link.connected.is_set()
        assert len(bus_connects) == 1 and len(link_connects) == 1 and link.connects == 1
    finally:
        stop.set()
        link.stop()
        bus.stop()
        broker.stop()
    # the broker renamed every one of pi-1's connections to pi-1, whatever id it sent
    ids = re.findall(r"New client connected from \S+ as (\S+) \(.*u'pi-1'\)", broker.log_file.read_text())
    assert ids == ["pi-1"] * len(victims) * 3, ids


def test_persistent_session_and_last_will_survive_the_binding(tmp_path):
    """The broker keys pi-2's session by its account: QoS 1 tasks queued while it was away are
    delivered when it comes back, and its Last Will still reaches the coordinator."""
    files = provision(tmp_path, 2, run_id=RUN)
    broker = start_broker(files, tmp_path / "mosquitto")
    watcher = RawClient(files.coordinator_port, "coordinator", files.account()["password"])
    link = None
    try:
        assert watcher.accepted
        watcher.subscribe(topics.status(RUN, "pi-2"))
        first: queue.Queue[tuple[str, bytes]] = queue.Queue()
        link = MqttLink(files.agent_config("pi-2"), first)
        link.start()
        wait_for(watcher.messages, lambda m: b'"online"' in m[1])  # after its SUBSCRIBE: the session has them
        link.client.disconnect()  # leaves the session on the broker (clean_session false), no Will
        link.client.loop_stop()
        watcher.c.publish(topics.task(RUN, "pi-2"), b"queued while away", qos=1).wait_for_publish(10)

        second: queue.Queue[tuple[str, bytes]] = queue.Queue()
        link = MqttLink(files.agent_config("pi-2"), second)
        link.start()
        wait_for(second, lambda m: m == (topics.task(RUN, "pi-2"), b"queued while away"))

        link.client.loop_stop()
        link.client.socket().close()  # the connection dies without DISCONNECT: the broker sends the Will
        wait_for(watcher.messages, lambda m: m[0] == topics.status(RUN, "pi-2") and b'"offline"' in m[1], timeout_s=90)
    finally:
        if link is not None:
            link.client.loop_stop()
        watcher.close()
        broker.stop()


def test_a_run_finishes_while_a_stolen_device_reconnects_with_the_others_client_ids(tmp_path):
    """A FedAL run (coordinator process, two emulated devices on their own accounts) while a third,
    stolen device's account reconnects over and over with the coordinator's and the devices' client
    ids: every phase is answered in time, nobody is disconnected, the coordinator connects once."""
    rounds, tau = 3, 2
    enrolled = ["dev-1", "dev-2"]
    files = provision(tmp_path, 3, prefix="dev-", run_id=RUN)
    broker = start_broker(files, tmp_path / "mosquitto")
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    config = write_coordinator_config(tmp_path / "coordinator", files.url, RUN, enrolled, api_port=api_port,
                                      rounds=rounds, tau=tau, phases={"quorum": 1.0, "resend_s": 60.0},
                                      extra={"broker": files.account()})
    log_path = tmp_path / "coordinator.log"
    coordinator = start_coordinator(config, log_path)
    stop = threading.Event()
    attacks: list[bool] = []

    def attack() -> None:
        ids = itertools.cycle([f"fedal-coordinator-{RUN}", f"fedal-agent-{RUN}-dev-1", "dev-2", "coordinator"])
        while not stop.is_set():
            c = RawClient(files.port, "dev-3", files.password("dev-3"), client_id=next(ids))
            attacks.append(c.accepted)
            time.sleep(0.25)
            c.close()

    attacker = threading.Thread(target=attack, daemon=True)
    fleet = None
    try:
        wait_for_run(api, RUN, lambda r: r["state"] == "running", 180, coordinator)
        attacker.start()
        time.sleep(2)  # the coordinator waits for its clients under attack
        fleet = Fleet(files.url, RUN, enrolled, credentials=device_credentials(files.out / "devices", enrolled),
                      exit_on_finish=False).start()  # they stay connected: any disconnection is the attack's
        final = wait_for_run(api, RUN, lambda r: r["state"] in ("finished", "failed"), 300, coordinator)
        during = len(attacks)
        assert fleet.wait_finished(30)
        fleet_drops = dict(fleet.counters)
        log = log_path.read_text()  # before the coordinator is stopped (its own clean disconnect)
    finally:
        stop.set()
        attacker.join(timeout=10)
        if fleet is not None:
            fleet.stop()
        stop_process(coordinator)
        broker.stop()

    assert during >= 8 and all(attacks), attacks  # the attack ran the whole time, each connection accepted
    assert final["state"] == "finished" and final["completed_rounds"] == rounds, final
    for cid, info in final["clients"].items():
        assert info["answered"] == rounds * (tau + 2) and info["late"] == 0, (cid, info)
    assert fleet_drops.get("disconnects", 0) == 0 and fleet_drops.get("connect_failures", 0) == 0, fleet_drops
    assert log.count("connected to mqtt://") == 1 and "disconnected from the broker" not in log, log[-3000:]


def test_one_coordinator_account_drives_several_runs_at_once(tmp_path):
    """The coordinator keeps one connection per run (its own client ids) on its listener: two
    runs' connections under the one account live side by side (devices provisioned for any run id)."""
    files = provision(tmp_path, 2, run_id=RUN, extra=("--any-run-id",))
    broker = start_broker(files, tmp_path / "mosquitto")
    stop = threading.Event()
    buses = {}
    try:
        for run in ("run-a", "run-b"):
            inbox: queue.Queue[tuple] = queue.Queue()
            bus = CoordinatorBus(files.coordinator_settings(), run, inbox)
            buses[run] = (bus, inbox, record(bus.client, "on_disconnect"))
            assert bus.start(stop, warn_every_s=10)
        pi1 = RawClient(files.port, "pi-1", files.password("pi-1"))
        assert pi1.accepted
        for run in buses:
            pi1.c.publish(topics.result(run, "pi-1"), run.encode(), qos=1).wait_for_publish(10)
        for run, (_bus, inbox, _drops) in buses.items():
            wait_for(inbox, lambda m, run=run: m == (topics.result(run, "pi-1"), run.encode()))
        time.sleep(1)
        assert all(drops == [] and bus.connected.is_set() for bus, _, drops in buses.values())
        pi1.close()
    finally:
        stop.set()
        for bus, _, _ in buses.values():
            bus.stop()
        broker.stop()
