"""Real agent processes SIGKILLed at an exact step (the FEDAL_AGENT_CRASH_AT test hook) over a
real Mosquitto with a real coordinator, then started again: with durability "journal" the run
ends exactly (equal, not close) as the uninterrupted run does, for FedAL and FedAvg; with
"round" the agent sits out the round under way and takes part again from the next one."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest
import torch

from fedal.procs import spawn_python
from fedal.sim import load_config, simulate
from tests.deployment import Deployment
from tests.helpers import per_client, simulated_run
from tests.test_coordinator_api import metric_values
from tests.waiting import wait_until

VICTIM = "c01"
# tasks an agent gets per round: fedal local_train, 2 transfers (tau 2), evaluate; fedavg
# train and evaluate (and, in round 1, init for one of the clients). Snapshots: one at join,
# then one at each round's first task.
CRASHES = {
    "fedal": {"after_journal": 6, "after_publish": 5, "next_task": 7, "mid_snapshot": 3},
    "fedavg": {"after_journal": 3, "after_publish": 4, "next_task": 4, "mid_snapshot": 3},
}


def start_victim(dep: Deployment, crash_at: str | None):
    path = dep.agent_path(VICTIM)
    env = {"FEDAL_AGENT_CRASH_AT": crash_at} if crash_at else {}
    dep.agents[VICTIM] = spawn_python("edge_agent", "--config", str(path),
                                      log_path=path.parent / f"agent-{time.monotonic_ns()}.log", env=env)
    return dep.agents[VICTIM]


def agent_logs(dep: Deployment) -> str:
    return "".join(p.read_text() for p in sorted(dep.agent_path(VICTIM).parent.glob("agent-*.log")))


def run_config(strategy: str):
    return load_config(None, dict(strategy=strategy, dataset="digits", clients=2, rounds=3, tau=2, public_size=100,
                                  seed=5))


@pytest.mark.parametrize("point", ["after_journal", "after_publish", "next_task", "mid_snapshot"])
@pytest.mark.parametrize("strategy", ["fedal", "fedavg"])
def test_a_crashed_agent_resumes_to_exactly_the_uninterrupted_run(strategy, point, mosquitto, tmp_path):
    config = run_config(strategy)
    # the coordinator waits for every client however long the restart takes
    dep = Deployment(config, tmp_path / "dep", mosquitto,
                     phases={"deadline_s": 600.0, "train_deadline_s": 600.0, "quorum": 1.0, "resend_s": 1.0})
    try:
        dep.start_coordinator()
        dep.start_agent("c00")
        victim = start_victim(dep, f"{point}:{CRASHES[strategy][point]}")
        assert victim.wait(timeout=240) == -signal.SIGKILL
        assert f"SIGKILL at {point} #{CRASHES[strategy][point]}" in agent_logs(dep)
        restarted = start_victim(dep, None)
        results = dep.finish()
        assert restarted.wait(timeout=60) == 0
        for cid in ("c00", VICTIM):
            assert dep.agents[cid].wait(timeout=60) == 0
    finally:
        dep.close()

    workspace = dep.agent_path(VICTIM).parent
    status = json.loads((workspace / "agent-status.json").read_text())
    assert status["durability"] == "journal" and status["counters"].get("replay_diverged", 0) == 0
    logs = agent_logs(dep)
    assert "resumed from checkpoint" in logs
    if point != "mid_snapshot":  # past a round's first task: the state came back through the journal
        assert "0 journal records replayed" not in logs
    if point == "after_journal":  # never published: the re-sent task is answered from the replayed cache
        assert status["counters"].get("duplicates", 0) >= 1
    assert not list(workspace.glob(".*.tmp"))  # the torn write is cleaned up

    uninterrupted = simulate(per_client(config))
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    for got, want in zip(results["rounds"], uninterrupted["rounds"], strict=True):
        assert got["client_acc"] == want["client_acc"]
        assert got["server"] == want["server"]  # the clients' reported losses included: equal, not close
    assert results["final"]["client_acc"] == uninterrupted["final"]["client_acc"]
    _, clients, _ = simulated_run(config)
    final = torch.load(workspace / "final" / "model.pt", weights_only=True)
    want = clients[VICTIM].model.state_dict()
    assert final.keys() == want.keys() and all(torch.equal(final[k], want[k]) for k in want)


def test_round_durability_loses_at_most_the_round_under_way(mosquitto, tmp_path):
    config = run_config("fedal")
    dep = Deployment(config, tmp_path / "dep", mosquitto, agent={"durability": "round"},
                     # the victim declines round 2's transfers and evaluation, so they close as soon as
                     # the other client answers: a deadline longer than the test may take proves it.
                     # (Its round-2 local_train result reached the broker before it died.)
                     phases={"deadline_s": 600.0, "train_deadline_s": 30.0, "quorum": 0.5, "resend_s": 1.0,
                             "pause_at": [{"round": 2, "phase": "transfer", "iteration": 0}]})
    try:
        dep.start_coordinator()
        dep.start_agent("c00")
        victim = start_victim(dep, "after_publish:5")  # round 2's local_train delivered, then gone
        assert victim.wait(timeout=240) == -signal.SIGKILL
        dep.wait_held(2, "transfer", 0)
        restarted = start_victim(dep, None)
        dep.wait_for(lambda r: r["clients"][VICTIM]["online"], what="the restarted agent online")
        dep.control("resume")
        results = dep.finish()
        run = dep.run()
        with urllib.request.urlopen(f"{dep.api}/metrics", timeout=5) as resp:
            metrics = metric_values(resp.read().decode())
        assert restarted.wait(timeout=60) == 0
    finally:
        dep.close()
    workspace = dep.agent_path(VICTIM).parent
    status = json.loads((workspace / "agent-status.json").read_text())
    assert status["durability"] == "round" and not (workspace / "journal.bin").exists()
    # round 2's first transfer and its evaluation (without its logits of iteration 1 the victim
    # gets no task in the last transfer iteration)
    assert status["counters"]["sat_out"] >= 2
    assert "sitting out the rest of round 1" in agent_logs(dep)  # round 2 as the API counts
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    r2, r3 = results["rounds"][1], results["rounds"][2]
    assert r2["phases"]["transfer"]["participation"] < 1.0  # round 2: lost
    # each declined, not waited for: the run took far less than one deadline
    assert r2["phases"]["transfer"]["declined"] == 1 and r2["phases"]["evaluate"]["declined"] == 1
    assert run["counters"]["declined"] == 2 and run["clients"][VICTIM]["declined"] == 2
    assert run["counters"]["quorum_missed"] == 0 and run["clients"][VICTIM]["late"] == 0
    assert metrics[("fedal_client_declined_total", (("client", VICTIM), ("run", "demo")))] == 2
    assert metrics[("fedal_messages_total", (("outcome", "declined"), ("run", "demo")))] == 2
    assert all(p["participation"] == 1.0 for p in r3["phases"].values())  # round 3: every phase again
    assert all(acc is not None for acc in results["final"]["client_acc"])


def test_an_unreadable_checkpoint_is_kept_aside_and_said(mosquitto, tmp_path):
    """A damaged card: the checkpoint of a killed agent cut in half. The restarted agent keeps the
    damaged file (it wrote over it before), says so as an error, counts it, and takes part again:
    the round's transfers, which build on logits it no longer has, it declines (so they close
    without waiting out their deadline); a later start takes the kept file as the agent's own."""
    # held before round 2's first transfer: the restarted agent is online when its task comes
    dep = Deployment(run_config("fedal"), tmp_path / "dep", mosquitto,
                     phases={"quorum": 0.5, "deadline_s": 20.0,
                             "pause_at": [{"round": 2, "phase": "transfer", "iteration": 0}]})
    try:
        dep.start_coordinator()
        dep.start_agent("c00")
        victim = start_victim(dep, "after_publish:5")  # round 2's local_train delivered, then gone
        assert victim.wait(timeout=240) == -signal.SIGKILL
        ckpt = dep.agent_path(VICTIM).parent / "checkpoint.pt"
        damaged = ckpt.read_bytes()[: ckpt.stat().st_size // 2]
        ckpt.write_bytes(damaged)
        dep.wait_held(2, "transfer", 0)
        restarted = start_victim(dep, None)
        dep.wait_for(lambda r: r["clients"][VICTIM]["online"], what="the restarted agent online")
        dep.control("resume")
        results = dep.finish()
        run = dep.run()
        assert restarted.wait(timeout=60) == 0
        kept = list(ckpt.parent.glob("checkpoint.pt.unreadable-*"))
        assert len(kept) == 1 and kept[0].read_bytes() == damaged
        assert "the checkpoint is unreadable" in agent_logs(dep) and f"kept as {kept[0]}" in agent_logs(dep)
        status = json.loads((ckpt.parent / "agent-status.json").read_text())
        assert status["counters"]["checkpoint_unreadable"] == 1
        # round 2's transfer: its logits of round 2 went with the state (declined, not refused and waited for)
        assert status["counters"]["missed_step"] >= 1 and status["counters"].get("rejected", 0) == 0
        assert run["clients"][VICTIM]["declined"] >= 1 and run["counters"]["quorum_missed"] == 0
        assert "declining transfer" in agent_logs(dep)
        assert results["rounds"][1]["phases"]["transfer"]["declined"] >= 1
        assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
        again = start_victim(dep, None)  # its workspace, kept file included, is its own: it waits for the next run
        wait_until(lambda: "finished here already" in agent_logs(dep) or again.poll() is not None, timeout_s=120,
                   what="the agent started again to see the finished run")
        assert again.poll() is None, agent_logs(dep)[-2000:]
    finally:
        dep.close()
