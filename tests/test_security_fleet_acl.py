"""Security of a live run on a broker provisioned by `fedal fleet init` (its password and ACL files):
an anonymous client, or one with a wrong password, cannot connect; a client holding another
device's credentials can read the run manifest but neither another device's feedback nor its
results, and nothing it forges (results, statuses, tasks, a manifest) reaches the coordinator or
any agent; the coordinator's REST write endpoints refuse requests without the right token.

The run: a real coordinator (its own broker account) and three emulated devices, each on its own
generated account. An auditor on the coordinator's account sees everything the broker delivers
under the run's topics, so "the forgery never got through" is checked at the broker itself.
"""

from __future__ import annotations

import json
import queue
import time
import tomllib
import urllib.error
import urllib.request

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from fedal.protocol import Message, encode, topics
from hil.coordinator_setup import get_json, start_coordinator, stop_process, wait_for_run, write_coordinator_config
from hil.fleet import Fleet, device_credentials
from tests.fleet_broker import acl_only_broker
from tests.waiting import free_port

RUN = "secure"
TOKEN = "s3cret-token"
DEVICES = ["dev-1", "dev-2", "dev-3"]
ROUNDS, TAU = 3, 2
MARK = b"FORGED"


class Client:
    """A raw paho client that records what it receives and how its CONNECT ended."""

    def __init__(self, port: int, user: str | None, password: str | None, name: str):
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.rc: queue.Queue[int] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{name}-{time.monotonic_ns()}",
                             protocol=mqtt.MQTTv311)
        if user is not None:
            self.c.username_pw_set(user, password)
        self.c.on_connect = lambda c, u, f, rc, p: self.rc.put(rc.value)
        self.c.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload)))
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        try:
            self.code = self.rc.get(timeout=10)
        except queue.Empty:
            self.code = -1

    def drain(self) -> list[tuple[str, bytes]]:
        out = []
        while True:
            try:
                out.append(self.messages.get_nowait())
            except queue.Empty:
                return out

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def post(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, method="POST", headers=headers, data=b"{}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture()
def fleet_files(tmp_path):
    out, broker = acl_only_broker(tmp_path, RUN)
    yield out, broker
    broker.stop()


def test_other_credentials_and_anonymous_clients_cannot_touch_a_run(fleet_files, tmp_path):
    out, broker = fleet_files
    account = tomllib.loads((out / "coordinator" / "broker.toml").read_text())["broker"]
    # this broker has the fleet's password and ACL files on one listener, not the generated
    # fedal.conf's coordinator listener (tests/test_security_clientid.py runs that one)
    account["url"] = broker.url
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    config = write_coordinator_config(tmp_path / "coordinator", broker.url, RUN, DEVICES, api_port=api_port,
                                      rounds=ROUNDS, tau=TAU,
                                      # the intrusion lands while the run holds before round 2, however fast it is
                                      phases={"quorum": 1.0, "resend_s": 60.0, "pause_at": [{"round": 2}]},
                                      extra={"broker": account, "api": {"token": TOKEN}})
    coordinator = start_coordinator(config, tmp_path / "coordinator.log")
    fleet = Fleet(broker.url, RUN, DEVICES, credentials=device_credentials(out / "devices", DEVICES)).start()
    creds = device_credentials(out / "devices", DEVICES)
    auditor = Client(broker.port, account["username"], account["password"], "auditor")
    auditor.c.subscribe(f"{topics.ROOT}/{RUN}/#", qos=1)
    clients = [auditor]
    try:
        assert auditor.code == 0
        held = wait_for_run(api, RUN, lambda r: r["state"] == "paused" and r["held_before"] is not None, 180, coordinator)
        assert held["held_before"]["round"] == 2 and held["completed_rounds"] == 1

        # no account, or a wrong password: refused at CONNECT
        anonymous = Client(broker.port, None, None, "anonymous")
        wrong = Client(broker.port, "dev-1", "not-the-password", "wrong")
        clients += [anonymous, wrong]
        assert anonymous.code != 0 and wrong.code != 0

        # dev-3's credentials in another client's hands, speaking for dev-1 and for the coordinator
        intruder = Client(broker.port, "dev-3", creds["dev-3"][1], "intruder")
        clients.append(intruder)
        assert intruder.code == 0
        for topic in (topics.task(RUN, "dev-1"), topics.result(RUN, "dev-1"), topics.status(RUN, "dev-1"),
                      topics.run_manifest(RUN), f"{topics.ROOT}/{RUN}/#"):
            intruder.c.subscribe(topic, qos=1)
        forged = {"run": RUN, "client": "dev-1", "epoch": 0, "seq": 1, "phase": "transfer", "round": 0, "iteration": 0,
                  "note": MARK.decode()}
        logits = np.zeros((32, 10), np.float32)
        reader = Client(broker.port, account["username"], account["password"], "reader")
        clients.append(reader)
        reader.c.subscribe(topics.run_manifest(RUN), qos=1)
        manifest = json.loads(get_retained(reader, topics.run_manifest(RUN)))
        for seq in range(1, 40):  # every key this run could be at
            intruder.publish(topics.result(RUN, "dev-1"), encode(Message({**forged, "seq": seq}, {"logits": logits})))
        intruder.publish(topics.status(RUN, "dev-1"), json.dumps({"state": "offline", "ts": time.time(),
                                                                   "note": MARK.decode()}).encode(), retain=True)
        intruder.publish(topics.task(RUN, "dev-1"), encode(Message({**forged, "instance": manifest["instance"],
                                                                    "seq": 10**6})))
        intruder.publish(topics.run_manifest(RUN), json.dumps({**manifest, "state": "finished",
                                                               "note": MARK.decode()}).encode(), retain=True)

        # the REST API: reads are open, writes need the token
        run_url = f"{api}/api/v1/runs/{RUN}"
        assert get_json(run_url)["run_id"] == RUN
        assert post(f"{run_url}/pause") == 401
        assert post(f"{run_url}/pause", "wrong-token") == 403
        assert post(f"{run_url}/stop") == 401
        assert post(f"{api}/api/v1/runs") == 401  # creating a run is a write too
        assert get_json(run_url)["state"] == "paused"  # still held: nothing above touched the run
        assert post(f"{run_url}/pause", TOKEN) == 200 and post(f"{run_url}/resume", TOKEN) == 200  # the token works

        final = wait_for_run(api, RUN, lambda r: r["state"] in ("finished", "failed"), 240, coordinator)
        assert fleet.wait_finished(30)
        time.sleep(0.5)
        seen = auditor.drain()
        intruded = intruder.drain()
    finally:
        for c in clients:
            c.close()
        fleet.stop()
        stop_process(coordinator)

    assert final["state"] == "finished" and final["completed_rounds"] == ROUNDS
    assert final["counters"].get("rejected", 0) == 0 and final["counters"].get("stale", 0) == 0
    assert final["counters"].get("duplicates", 0) == 0
    for cid, info in final["clients"].items():
        assert info["answered"] == ROUNDS * (TAU + 2) and info["rejected"] == 0, (cid, info)

    assert not [t for t, p in seen if MARK in p], "a forged message got through the broker"
    assert any(t == topics.task(RUN, "dev-1") for t, _ in seen)  # the auditor does see dev-1's feedback
    assert any(t == topics.result(RUN, "dev-1") for t, _ in seen)
    # with dev-3's account it reads what dev-3 may read (the manifest, dev-3's own tasks), nothing of another device
    assert {t for t, _ in intruded} <= {topics.run_manifest(RUN), topics.task(RUN, "dev-3")}, sorted({t for t, _ in intruded})
    assert any(t == topics.run_manifest(RUN) for t, _ in intruded)

    totals = fleet.totals()
    assert totals.get("rejected", 0) == 0 and totals.get("stale", 0) == 0  # no forged task or manifest arrived
    assert totals["tasks"] == len(DEVICES) * ROUNDS * (TAU + 2)


def get_retained(client: Client, topic: str, timeout_s: float = 10) -> bytes:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            t, payload = client.messages.get(timeout=0.5)
        except queue.Empty:
            continue
        if t == topic and payload:
            return payload
    raise AssertionError(f"no retained message on {topic}")


@pytest.mark.parametrize("any_run_id", [False, True])
def test_a_device_writes_only_under_the_fleets_run_id_unless_any_run_id_is_asked(tmp_path, any_run_id):
    """Under a `+` at the run level a device could leave retained messages under any number of run
    ids nobody reads (the broker keeps them for ever, on disk with persistence)."""
    out, broker = acl_only_broker(tmp_path, RUN, ("--any-run-id",) if any_run_id else ())
    creds = device_credentials(out / "devices", DEVICES)
    account = tomllib.loads((out / "coordinator" / "broker.toml").read_text())["broker"]
    clients = []
    try:
        device = Client(broker.port, "dev-3", creds["dev-3"][1], "dev-3")
        clients.append(device)
        assert device.code == 0
        for run in (RUN, "junk00001"):
            device.publish(topics.status(run, "dev-3"), MARK + run.encode(), retain=True)
        device.c.subscribe(topics.run_manifest("junk00001"), qos=1)
        reader = Client(broker.port, account["username"], account["password"], "reader")
        clients.append(reader)
        reader.c.subscribe(f"{topics.ROOT}/+/status/+", qos=1)
        time.sleep(1.0)  # the retained messages come at subscribing
        retained = {t for t, p in reader.drain() if p.startswith(MARK)}
        assert topics.status(RUN, "dev-3") in retained
        assert (topics.status("junk00001", "dev-3") in retained) == any_run_id
        acl = (out / "broker" / "acl").read_text()
        assert (f"topic write fedal/v1/{RUN}/status/dev-3" in acl) != any_run_id
    finally:
        for c in clients:
            c.close()
        broker.stop()
