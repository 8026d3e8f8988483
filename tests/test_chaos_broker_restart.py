"""Chaos: the broker dies mid-round (SIGKILL, no persistence: retained messages and sessions are
gone) and comes back on the same port. The coordinator and the agents reconnect by themselves,
the run goes on and finishes, every phase gets every client's answer, and no agent applies any
feedback twice (emulated agents count each application; a real agent computes each task once).

What the product guarantees, with or without broker persistence: both sides reconnect with
backoff; agents re-subscribe and re-announce themselves on every CONNACK; the coordinator
re-publishes the manifest and re-sends its open tasks after reconnecting, and re-sends to
pending online clients every resend_s; agents answer a task they already handled from the cached
result, never recomputing it.
"""

from __future__ import annotations

import json
import time

import pytest

from fedal.sim import load_config
from hil.fleet import Fleet, client_ids
from hil.mosquitto import Mosquitto
from tests.deployment import RUN_ID, Deployment, get
from tests.waiting import free_port

ROUNDS, TAU = 3, 2
REAL = ["c00", "c01"]


@pytest.fixture()
def broker(tmp_path):
    # restarted on the same port: one the kernel never gives an outgoing connection meanwhile
    mq = Mosquitto(tmp_path / "mosquitto", free_port(), persistence=False).start()
    yield mq
    mq.kill()


def test_broker_restart_mid_round_loses_nothing(broker, tmp_path):
    emulated = client_ids(20, "e")
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=2, rounds=ROUNDS, tau=TAU,
                                    public_size=100, seed=4))
    dep = Deployment(config, tmp_path / "dep", broker.url,
                     phases={"quorum": 1.0, "deadline_s": 60.0, "train_deadline_s": 60.0, "resend_s": 2.0,
                             "pause_at": [{"round": 2, "phase": "transfer", "iteration": 1}]},
                     coordinator={"client_ids": REAL + emulated},
                     agent={"broker": {"reconnect_max_s": 2.0}})
    fleet = Fleet(broker.url, RUN_ID, emulated, seed=1, reconnect_min_s=1.0, reconnect_max_s=2.0)
    try:
        dep.start_coordinator()
        for cid in REAL:
            dep.start_agent(cid)
        fleet.start()
        # mid-round by construction: the run holds before round 2's second transfer however fast it is
        held = dep.wait_held(2, "transfer", 1, timeout_s=180)
        assert held["completed_rounds"] == 1
        broker.kill()  # retained manifest and statuses, sessions, queued messages: all gone
        time.sleep(0.5)
        assert dep.control("resume")["state"] == "running"  # the second transfer's tasks go out to no broker
        time.sleep(1.0)
        broker.start()
        final = dep.finish(timeout_s=240)
        state = dep.run()
        health = get(f"{dep.api}/healthz")
        for cid in REAL:
            assert dep.agents[cid].wait(timeout=60) == 0
        assert fleet.wait_finished(30)
    finally:
        fleet.stop()
        dep.close()
    summary = fleet.summary()

    assert [r["round"] for r in final["rounds"]] == list(range(1, ROUNDS + 1))  # no round lost, none twice
    phases_per_round = TAU + 2  # local_train, tau transfers, evaluate
    for cid, info in state["clients"].items():
        assert info["late"] == 0 and info["answered"] == ROUNDS * phases_per_round, (cid, info)
    assert state["counters"].get("rejected", 0) == 0
    assert health["broker_connected"] is True
    coordinator_log = (dep.workdir / "coordinator" / "coordinator.log").read_text()
    assert coordinator_log.count("connected to mqtt://") >= 2  # it reconnected by itself

    for cid in REAL:  # each task computed once: as many as its accepted answers, re-sends served from the cache
        status = json.loads((dep.agent_path(cid).parent / "agent-status.json").read_text())
        assert status["connects"] >= 2, status
        assert status["counters"]["tasks"] == ROUNDS * phases_per_round, status
        assert status["counters"].get("errors", 0) == 0 and status["counters"].get("rejected", 0) == 0

    assert summary["error"] is None and summary["finished"] == len(emulated)
    assert summary["feedback_applied_twice"] == {} and summary["iterations_applied_twice"] == {}
    assert summary["feedback_applied"] == len(emulated) * ROUNDS * TAU
    for cid, s in summary["per_client"].items():
        assert s["connects"] >= 2, (cid, s)
        assert s["counters"]["tasks"] == ROUNDS * phases_per_round, (cid, s)
