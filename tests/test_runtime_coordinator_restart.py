"""A coordinator killed with SIGKILL mid-run and started again with the same config resumes from
the last completed round; the agents resynchronise by themselves."""

from __future__ import annotations

import json
import signal

from coordinator.store import RunStore, default_store_url
from fedal.sim import load_config, simulate
from tests.deployment import Deployment
from tests.helpers import per_client


def test_sigkilled_coordinator_resumes_the_run(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=8, tau=2, public_size=100, seed=11))
    # mid-round by construction: the run holds before round 4's second transfer, however fast it is
    dep = Deployment(config, tmp_path / "dep", mosquitto,
                     phases={"resend_s": 2.0, "pause_at": [{"round": 4, "phase": "transfer", "iteration": 1}]})
    try:
        dep.start_coordinator()
        for cid in ("c00", "c01", "c02"):
            dep.start_agent(cid)
        dep.wait_held(4, "transfer", 1)
        dep.coordinator.send_signal(signal.SIGKILL)  # mid-round: the agents trained and transferred in round 4
        dep.coordinator.wait()
        saved = RunStore(default_store_url(dep.workdir / "coordinator" / "state")).load("demo")
        assert saved.completed_rounds == 3 and len(saved.records) == 3

        dep.start_coordinator()  # same config, same state dir
        # replaying round 4 it reaches the same point again, and holds there again
        assert dep.wait_held(4, "transfer", 1)["completed_rounds"] == 3
        dep.control("resume")
        final = dep.wait_for(lambda r: r["state"] == "finished", timeout_s=240, what="the resumed run to finish")
        results = dep.results()
        log = (dep.workdir / "coordinator" / "coordinator.log").read_text()  # the restarted process's
        assert f"resuming run demo after round {saved.completed_rounds} " in log  # not from scratch, not a round late
        for cid in ("c00", "c01", "c02"):
            assert dep.agents[cid].wait(timeout=60) == 0  # no operator action needed
        replays = {cid: json.loads((dep.agent_path(cid).parent / "agent-status.json").read_text())["counters"]
                   .get("round_replays", 0) for cid in ("c00", "c01", "c02")}
    finally:
        dep.close()
    assert final["completed_rounds"] == 8
    assert [r["round"] for r in results["rounds"]] == list(range(1, 9))  # every round recorded once
    uninterrupted = simulate(per_client(config))["final"]["mean_acc"]
    # the agents went back to their state at the interrupted round's start: the resumed run is
    # the uninterrupted one exactly, not only within a point
    assert results["final"]["mean_acc"] == uninterrupted
    assert replays == {"c00": 1, "c01": 1, "c02": 1}
