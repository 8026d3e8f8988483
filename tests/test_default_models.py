"""Strategies that average parameters (one model for all clients) run with no models chosen: the
dataset's single default model, named on stderr and recorded in the results' config; a mixed list
given explicitly is still refused. CLI runs are real processes; the demo runs over Mosquitto."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager
from fedal.sim.config import DEFAULT_MODELS, ConfigError, load_config
from fedal.strategies import STRATEGIES
from tests.helpers import without_timings
from tests.local_api import local_client

AVERAGING = ("fedavg", "fedakd", "fedhkd")
TINY = ["--dataset", "digits", "--clients", "2", "--rounds", "1", "--tau", "1", "--public-size", "50", "--quiet"]


def fedal(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fedal_cli.main", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ}, timeout=300)


def test_the_averaging_strategies_are_the_ones_declaring_identical_models():
    assert {n for n, s in STRATEGIES.items() if s.homogeneous_models} == set(AVERAGING)


@pytest.mark.parametrize("strategy", AVERAGING)
def test_simulate_without_models_uses_the_dataset_default(strategy, tmp_path):
    out = tmp_path / "results.json"
    proc = fedal("simulate", "--strategy", strategy, *TINY, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"{strategy} needs one model for all clients: using mlp" in proc.stderr
    results = json.loads(out.read_text())
    assert results["config"]["models"] == ["mlp"]
    assert [c["model"] for c in results["clients"]] == ["mlp", "mlp"]
    assert 0.0 <= results["final"]["mean_acc"] <= 1.0

    if strategy == "fedavg":  # the saved config names the model: it reruns identically, without the note
        again = tmp_path / "again.json"
        proc = fedal("simulate", "--config", str(out), "--quiet", "--out", str(again))
        assert proc.returncode == 0, proc.stderr
        assert "needs one model" not in proc.stderr
        assert without_timings(json.loads(again.read_text())) == without_timings(results)


@pytest.mark.parametrize("strategy", AVERAGING)
def test_an_explicit_mixed_list_is_still_refused(strategy, tmp_path):
    proc = fedal("simulate", "--strategy", strategy, *TINY, "--models", "mlp,lenet5", "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 2
    assert f"strategy {strategy!r} averages parameters and needs one model for all clients, got ['mlp', 'lenet5']" in proc.stderr
    assert not (tmp_path / "r.json").exists()


def test_config_files_get_the_same_default(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('strategy = "fedakd"\ndataset = "mnist1d"\n')
    config = load_config(toml)
    assert config.models is None and config.resolved().models == ["mlp"] == [DEFAULT_MODELS["mnist1d"][0]]
    assert "using mlp" in config.default_model_note()
    # strategies that take mixed models keep the dataset's mixed default, with no note
    mixed = load_config(toml, {"strategy": "fedal"})
    assert mixed.resolved().models == DEFAULT_MODELS["mnist1d"] and mixed.default_model_note() is None
    assert load_config(toml, {"models": ["cnn1d"]}).default_model_note() is None
    toml.write_text('strategy = "fedhkd"\nmodels = ["mlp", "cnn1d"]\n')
    with pytest.raises(ConfigError, match="needs one model for all clients"):
        load_config(toml)


def test_post_runs_gets_the_same_default(tmp_path):
    cfg = load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": "tok"})
    runs = RunManager(cfg)
    try:
        api = local_client(runs)
        auth = {"Authorization": "Bearer tok"}
        spec = {"run_id": "avg", "client_ids": ["pi-1", "pi-2"], "run": {"strategy": "fedavg", "dataset": "digits", "rounds": 1}}
        created = api.post("/api/v1/runs", json=spec, headers=auth)
        assert created.status_code == 201, created.text
        assert api.get("/api/v1/runs/avg").json()["config"]["models"] == ["mlp"]
        assert api.get("/api/v1/runs/avg/results").json()["config"]["models"] == ["mlp"]
        mixed = {**spec, "run_id": "mixed", "run": {**spec["run"], "models": ["mlp", "lenet5"]}}
        refused = api.post("/api/v1/runs", json=mixed, headers=auth)
        assert refused.status_code == 422 and "needs one model for all clients" in refused.text
    finally:
        runs.store.close()


def test_demo_without_models_over_mosquitto(mosquitto, tmp_path):
    out = tmp_path / "results.json"
    proc = fedal("demo", "--strategy", "fedavg", *TINY, "--broker", mosquitto, "--workdir", str(tmp_path / "demo"),
                 "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fedavg needs one model for all clients: using mlp" in proc.stderr
    results = json.loads(out.read_text())
    assert results["config"]["models"] == ["mlp"]
    assert [c["model"] for c in results["clients"]] == ["mlp", "mlp"]
    assert [r["round"] for r in results["rounds"]] == [1]


@pytest.mark.parametrize("strategy", ["fedproto", "fedproto-public"])
def test_prototype_strategies_name_the_models_of_one_feature_width_they_take(strategy, tmp_path):
    mnist1d = ["--dataset", "mnist1d", *TINY[2:]]
    proc = fedal("simulate", "--strategy", strategy, *mnist1d, "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert f"{strategy} needs one feature width for all clients: using mlp, cnn1d_wide" in proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["config"]["models"] == ["mlp", "cnn1d_wide"]
    assert load_config(None, {"strategy": strategy, "models": ["mlp"]}).default_model_note() is None
    # on digits every default model has its own width: the dataset's single default, said as such
    assert "using mlp" in load_config(None, {"strategy": strategy, "dataset": "digits"}).default_model_note()
