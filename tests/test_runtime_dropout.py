"""An agent SIGKILLed mid-run does not stall the run; restarted, it resumes from its checkpoint."""

from __future__ import annotations

import signal

import pytest

from fedal.sim import load_config
from tests.deployment import Deployment


@pytest.fixture()
def deployment(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=14, tau=2, public_size=100, seed=2))
    dep = Deployment(config, tmp_path / "dep", mosquitto,
                     phases={"deadline_s": 2.0, "train_deadline_s": 3.0, "quorum": 0.6, "resend_s": 1.0,
                             # where the test acts, held there however fast or slow the run is
                             "pause_at": [{"round": 3, "phase": "transfer", "iteration": 1}, {"round": 5}]})
    yield dep
    dep.close()


def test_killed_agent_is_left_out_then_rejoins_from_its_checkpoint(deployment):
    dep = deployment
    dep.start_coordinator()
    for cid in ("c00", "c01", "c02"):
        dep.start_agent(cid)
    dep.wait_held(3, "transfer", 1)  # round 3, between its two transfer iterations
    assert dep.control("resume")["state"] == "running"
    victim = dep.agents["c02"]
    victim.send_signal(signal.SIGKILL)  # mid-round: its second transfer's task is on its way
    victim.wait()

    # the run goes on without c02: rounds 3 and 4 close their phases at the deadlines with the quorum
    state = dep.wait_held(5)
    assert state["completed_rounds"] == 4
    # round 4: local_train, the first transfer and evaluate (missing a transfer, it gets no
    # feedback in the next); round 3: at least its evaluation
    assert state["clients"]["c02"]["late"] >= 3 + 1
    assert state["clients"]["c02"]["online"] is False  # the broker published its Last Will
    answered_before = state["clients"]["c02"]["answered"]

    ckpt = dep.agent_path("c02").parent / "checkpoint.pt"
    assert ckpt.exists()
    restarted = dep.start_agent("c02")
    dep.wait_for(lambda r: r["clients"]["c02"]["online"], what="the restarted agent online")
    dep.control("resume")  # from round 5 on with c02 again
    state = dep.wait_for(lambda r: r["clients"]["c02"]["answered"] > answered_before + 3, what="the restarted agent answering")
    assert state["clients"]["c02"]["online"] is True
    final = dep.wait_for(lambda r: r["state"] == "finished", timeout_s=240, what="the run to finish")
    assert final["completed_rounds"] == 14
    logs = "".join(p.read_text() for p in dep.agent_path("c02").parent.glob("agent-*.log"))
    assert "resumed from checkpoint" in logs
    results = dep.results()
    assert [r["round"] for r in results["rounds"]] == list(range(1, 15))  # no round lost, none twice
    # c02 evaluated again after it rejoined (which evaluations: a phase that closes at its 2 s
    # deadline on a busy machine may leave a slow answer out, as it would any client's)
    assert any(r["client_acc"][2] is not None for r in results["rounds"][4:])
    assert restarted.wait(timeout=60) == 0  # agents leave by themselves when the run is finished
