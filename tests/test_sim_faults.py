"""Faults in simulation: the in-process transport drops and delays answers on a simulated
clock, so the engine's deadline and quorum logic runs exactly as in a deployment, in seconds
and reproducibly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedal.engine import StrategyError
from fedal.sim import load_config, simulate
from tests.helpers import in_process, toy_federation, without_timings

BASE = dict(strategy="fedal", dataset="digits", clients=6, rounds=3, tau=2, public_size=100, seed=3,
            models=["mlp", "lenet5"])


def participation(results: dict, phase: str) -> list[float]:
    return [r["phases"][phase]["participation"] for r in results["rounds"] if phase in r["phases"]]


def test_dropout_lowers_participation_and_repeats_exactly():
    a = simulate(load_config(None, {**BASE, "dropout": 0.3}))
    b = simulate(load_config(None, {**BASE, "dropout": 0.3}))
    assert json.dumps(without_timings(a)) == json.dumps(without_timings(b))
    assert min(participation(a, "local_train")) < 1.0
    assert a["deployment"]["faults"]["dropped_tasks"] > 0
    assert participation(a, "evaluate") == [1.0, 1.0, 1.0]  # measurement is never faulted
    c = simulate(load_config(None, {**BASE, "dropout": 0.3, "seed": 4}))
    assert c["deployment"]["faults"] != a["deployment"]["faults"] or participation(c, "transfer") != participation(a, "transfer")


def test_no_faults_means_full_participation_and_no_fault_report():
    clean = simulate(load_config(None, BASE))
    assert "deployment" not in clean
    assert all(p == 1.0 for r in clean["rounds"] for p in (v["participation"] for v in r["phases"].values()))
    assert all(r["rejected"] == 0 for r in clean["rounds"])


def test_stragglers_answer_after_the_deadline_and_are_counted_stale():
    res = simulate(load_config(None, {**BASE, "stragglers": 0.5, "straggle_every": 1}))
    faults = res["deployment"]["faults"]
    assert len(faults["stragglers"]) == 3 and faults["dropped_tasks"] == 0
    assert faults["late_results"] > 0
    # with half the clients late the quorum (0.5) is met: each phase closes at its deadline without
    # them, and a late answer that still arrives during the run is counted stale, never used
    assert participation(res, "local_train") == [0.5, 0.5, 0.5]
    assert 0 < res["deployment"]["counters"]["stale"] <= faults["late_results"]
    assert all(r["rejected"] == 0 for r in res["rounds"])


def test_fault_flags_on_the_command_line(tmp_path):
    out = tmp_path / "r.json"
    ok = subprocess.run([sys.executable, "-m", "fedal_cli.main", "simulate", "--strategy", "fedmd", "--dataset", "digits",
                         "--clients", "4", "--rounds", "2", "--tau", "1", "--public-size", "60", "--dropout", "0.25",
                         "--quiet", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    saved = json.loads(out.read_text())
    assert saved["config"]["dropout"] == 0.25  # the saved config repeats the faulted run
    bad = subprocess.run([sys.executable, "-m", "fedal_cli.main", "simulate", "--dropout", "1.5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--dropout" in bad.stderr


def test_a_validator_bug_stops_the_run_instead_of_counting_a_client():
    server, clients, _ = toy_federation("fedal", n_clients=3, tau=1)

    def broken(phase, cid, result):
        raise KeyError("a bug in the validator")

    server.validate = broken
    with pytest.raises(StrategyError, match="a bug in the validator"):
        in_process(server, clients).run_round(0)


def test_a_deployment_refuses_simulated_faults(tmp_path):
    from coordinator.config import CoordinatorConfig, RunSpec
    from coordinator.run import Run

    with pytest.raises(ValueError, match="faults of the simulation"):  # a config file
        CoordinatorConfig(run_id="r", client_ids=["a", "b"], state_dir=tmp_path,
                          run={"strategy": "local", "dataset": "digits", "dropout": 0.2})
    with pytest.raises(ValueError, match="faults of the simulation"):  # POST /api/v1/runs
        RunSpec(run_id="r", client_ids=["a", "b"], run={"strategy": "local", "stragglers": 0.5})
    cfg = CoordinatorConfig(run_id="r", client_ids=["a", "b"], state_dir=tmp_path, run={"strategy": "local"})
    cfg.run.dropout = 0.1  # past validation, the run itself still refuses
    with pytest.raises(ValueError, match="faults of the simulation"):
        Run(cfg)


def test_a_late_answer_to_a_closed_phase_is_stale_even_before_the_next_phase():
    """Once a phase closed at its deadline, an answer to it that comes while the run waits
    (paused, or between phases) is stale: not taken, not counted as answered."""
    from fedal.engine.inprocess import Faults

    server, clients, _ = toy_federation("fedal", n_clients=4, tau=1)
    engine = in_process(server, clients, faults=Faults(stragglers=0.5, straggle_every=1, seed=1))
    late = engine.transport.stragglers
    phase = server.begin_round(0)
    state = engine.run_phase(phase)
    assert set(state.pending) == late and engine.current is None
    answered = {cid: engine.clients[cid].answered for cid in late}
    while not engine.transport.exhausted():  # the run held: messages are still handled
        engine.pump()
    assert engine.counters["stale"] == len(late)
    assert {cid: engine.clients[cid].answered for cid in late} == answered
