"""An operator's pause outlives the coordinator: paused over the API, then the coordinator
stopped (SIGTERM) and started again, the run is still paused and takes no step until resumed
(it used to resume training by itself). And `stop` on a run that has not started answers once
it is stopped (it answered `pending`)."""

from __future__ import annotations

import signal
import time

from fedal.sim import load_config
from tests.deployment import Deployment, poll_run
from tests.waiting import wait_until


def test_a_paused_run_stays_paused_across_a_coordinator_restart(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=40, tau=1, public_size=60,
                                    seed=3))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    try:
        dep.start_all()
        dep.wait_for(lambda r: r["completed_rounds"] >= 2, timeout_s=180, what="two rounds")
        assert dep.control("pause")["state"] == "paused"
        held = dep.wait_for(lambda r: r["held_before"] is not None, what="the run to hold")
        dep.coordinator.send_signal(signal.SIGTERM)
        assert dep.coordinator.wait(timeout=60) == 0

        dep.start_coordinator()  # same config, same state dir
        state = dep.wait_for(lambda r: r["state"] == "paused" and r["held_before"] is not None, timeout_s=120,
                             what="the restarted run to hold")
        assert state["completed_rounds"] == held["completed_rounds"]
        time.sleep(3)  # the agents are online: a run that went on would complete rounds meanwhile
        assert dep.run()["completed_rounds"] == held["completed_rounds"] and dep.run()["state"] == "paused"
        log = (dep.workdir / "coordinator" / "coordinator.log").read_text()
        assert "was paused when the coordinator stopped: it stays paused" in log
        assert dep.control("resume")["state"] == "running"
        dep.finish()
    finally:
        dep.close()


def test_stop_on_a_run_that_has_not_started_answers_stopped(tmp_path):
    config = load_config(None, dict(strategy="local", dataset="digits", clients=2, rounds=1, seed=0))
    from fedal.ports import free_port

    dep = Deployment(config, tmp_path / "dep", f"mqtt://127.0.0.1:{free_port()}")  # no broker: it never starts
    states: list[str] = []
    try:
        dep.start_coordinator()
        wait_until(lambda: (poll_run(dep.api) or {}).get("state") == "pending", timeout_s=60, what="the API")
        assert dep.control("stop")["state"] == "stopped"
        states = [r["state"] for r in [dep.run()]]
    finally:
        dep.close()
    assert states == ["stopped"]
