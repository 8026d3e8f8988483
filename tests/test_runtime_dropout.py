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
                     phases={"deadline_s": 2.0, "train_deadline_s": 3.0, "quorum": 0.6, "resend_s": 1.0})
    yield dep
    dep.close()


def test_killed_agent_is_left_out_then_rejoins_from_its_checkpoint(deployment):
    dep = deployment
    dep.start_coordinator()
    for cid in ("c00", "c01", "c02"):
        dep.start_agent(cid)
    dep.wait_for(lambda r: r["completed_rounds"] >= 2 and r["phase"] == "transfer", what="a transfer iteration of round 3")
    victim = dep.agents["c02"]
    victim.send_signal(signal.SIGKILL)  # mid-iteration
    victim.wait()
    killed_at = dep.run()["completed_rounds"]

    # the run goes on without c02: its phases close at their deadlines with the quorum
    state = dep.wait_for(lambda r: r["completed_rounds"] >= killed_at + 2, what="rounds without the killed agent")
    assert state["clients"]["c02"]["late"] > 0
    assert state["clients"]["c02"]["online"] is False  # the broker published its Last Will
    answered_before = state["clients"]["c02"]["answered"]

    ckpt = dep.agent_path("c02").parent / "checkpoint.pt"
    assert ckpt.exists()
    restarted = dep.start_agent("c02")
    state = dep.wait_for(lambda r: r["clients"]["c02"]["answered"] > answered_before + 3, what="the restarted agent answering")
    assert state["clients"]["c02"]["online"] is True
    final = dep.wait_for(lambda r: r["state"] == "finished", timeout_s=240, what="the run to finish")
    assert final["completed_rounds"] == 14
    logs = "".join(p.read_text() for p in dep.agent_path("c02").parent.glob("agent-*.log"))
    assert "resumed from checkpoint" in logs
    results = dep.results()
    assert [r["round"] for r in results["rounds"]] == list(range(1, 15))  # no round lost, none twice
    assert results["final"]["client_acc"][2] is not None  # c02 took part in the last evaluation
    assert restarted.wait(timeout=60) == 0  # agents leave by themselves when the run is finished
