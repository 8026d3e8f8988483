"""`fedal simulate` end to end: real processes, real files, the results contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from fedal.sim import RunConfig, load_config, simulate
from fedal_cli.main import cli
from tests.helpers import without_timings

SMALL = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--tau", "2", "--public-size", "100", "--quiet"]


def fedal(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fedal_cli.main", *args], capture_output=True, text=True, cwd=cwd, env={**os.environ}, timeout=300
    )


def fedal_here(*args):
    """The `fedal` command's parsing and checks in this process (what a process would print and
    its exit status), without a process's start: one case of each list below still runs the
    real command."""
    result = CliRunner().invoke(cli, list(args))
    return SimpleNamespace(returncode=result.exit_code, stderr=result.stderr)


def test_cli_run_writes_results_contract_and_is_deterministic(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        proc = fedal("simulate", "--strategy", "fedal", *SMALL, "--seed", "3", "--out", str(out),
                     "--plot", str(tmp_path / "p.png"))
        assert proc.returncode == 0, proc.stderr
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert without_timings(ra) == without_timings(rb)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    cfg = ra["config"]
    assert cfg["strategy"] == "fedal" and cfg["seed"] == 3 and cfg["strategy_params"]["tau"] == 2
    assert cfg["strategy_params"]["lambda_adv"] == 1.0  # preset made explicit
    assert [r["round"] for r in ra["rounds"]] == [1, 2]
    for r in ra["rounds"]:
        assert {"round", "mean_acc", "min_acc", "max_acc", "client_acc", "bytes_up", "bytes_down"} <= set(r)
        assert len(r["client_acc"]) == 3 and r["min_acc"] <= r["mean_acc"] <= r["max_acc"]
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
    assert set(ra["final"]) == {"mean_acc", "min_acc", "max_acc", "client_acc"}
    assert ra["data"]["public_size"] == 100 and len(ra["data"]["public_hash"]) == 64


def test_other_seed_changes_the_run():
    outs = [simulate(load_config(None, dict(strategy="fedmd", dataset="digits", clients=3, rounds=2, tau=2,
                                            public_size=100, seed=seed))) for seed in (1, 2)]
    assert outs[0]["rounds"] != outs[1]["rounds"]


def test_saved_config_reruns_identically(tmp_path):
    cfg = load_config(None, dict(strategy="fedmd-lf", dataset="digits", clients=3, rounds=2, tau=2, public_size=100, seed=5))
    first = simulate(cfg)
    out = tmp_path / "first.json"
    out.write_text(json.dumps(first))
    again = simulate(load_config(out))  # a results JSON is a valid --config
    assert without_timings(again) == without_timings(first)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--strategy", "nope"], "fedal"),
        (["--dataset", "imagenet"], "mnist1d"),
        (["--clients", "1"], "clients"),
        (["--alpha", "-1"], "alpha"),
        (["--rounds", "0"], "rounds"),
        (["--clients", "three"], "three"),
        (["--models", "mlp,transformer"], "cnn1d"),
        (["--strategy", "fedavg", "--models", "mlp,lenet5"], "one model"),
        (["--dataset", "cifar10"], "data_dir"),
        (["--config", "/nonexistent/run.toml"], "not found"),
        (["--dataset", "digits", "--mnist1d-samples", "2000"], "'mnist1d' only"),
        (["--mnist1d-samples", "5"], "mnist1d-samples"),
    ],
)
def test_cli_errors_exit_2_with_a_clear_message(args, needle, tmp_path):
    run = fedal if args == ["--strategy", "nope"] else fedal_here
    proc = run("simulate", *args, "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert not (tmp_path / "x.json").exists()


def test_bad_config_files_exit_2(tmp_path):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("strategy = \n")
    unknown_key = tmp_path / "unknown.toml"
    unknown_key.write_text('strategy = "fedal"\nlearning_rate = 3\n')
    bad_param = tmp_path / "param.toml"
    bad_param.write_text('[strategy_params]\nkd_target = "median"\n')
    for path, needle in ((bad_toml, "not valid TOML"), (unknown_key, "learning_rate"), (bad_param, "kd_target")):
        run = fedal if path == bad_toml else fedal_here
        proc = run("simulate", "--config", str(path), "--out", str(tmp_path / "x.json"))
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_config_file_with_flag_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "fedmd"\ndataset = "digits"\nclients = 4\nrounds = 9\n[strategy_params]\nlambda_kd = 0.5\n')
    cfg = load_config(path, {"rounds": 2, "tau": 3}).resolved()
    assert (cfg.strategy, cfg.clients, cfg.rounds) == ("fedmd", 4, 2)
    assert cfg.strategy_params.tau == 3 and cfg.strategy_params.lambda_kd == 0.5
    assert cfg.strategy_params.lambda_adv == 0.0  # FedMD preset


def test_wire_bytes_follow_the_strategy():
    base = dict(dataset="digits", clients=3, rounds=1, public_size=100, seed=0, strategy_params={"tau": 2})
    res = {s: simulate(RunConfig(strategy=s, **base))["rounds"][0] for s in ("fedal", "fedmd-lf", "local")}
    k, b, n, tau = 10, 32, 3, 2
    # FedAL sends the discriminator gradient down as well: 2*K*B floats instead of K*B
    extra_down = res["fedal"]["bytes_down"] - res["fedmd-lf"]["bytes_down"]
    assert extra_down >= n * tau * k * b * 4
    assert abs(res["fedal"]["bytes_up"] - res["fedmd-lf"]["bytes_up"]) < n * tau * 200  # metadata only
    assert res["fedmd-lf"]["bytes_up"] > n * tau * k * b * 4
    assert res["local"]["bytes_up"] < 1000  # no tensors, only envelopes


def test_collaboration_beats_local_only_on_digits():
    base = dict(dataset="digits", clients=4, alpha=0.3, rounds=30, public_size=300, seed=1, models=["mlp"],
                strategy_params={"tau": 5})
    local = simulate(RunConfig(strategy="local", **base))["final"]["mean_acc"]
    fedmd_lf = simulate(RunConfig(strategy="fedmd-lf", **base))["final"]["mean_acc"]
    assert fedmd_lf > local + 0.05


@pytest.mark.parametrize(
    "args, needle",
    [(["--broker", "http://127.0.0.1:1883"], "mqtt://"), (["--strategy", "nope"], "fedal"), (["--api-port", "-3"], "api-port")],
)
def test_demo_cli_errors_exit_2(args, needle, tmp_path):
    run = fedal if args[0] == "--broker" else fedal_here
    proc = run("demo", *args, "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr
    assert not (tmp_path / "w").exists()


def test_local_test_fraction_reports_each_clients_own_accuracy():
    res = simulate(load_config(None, dict(strategy="fedmd", dataset="digits", clients=3, rounds=2, tau=2,
                                          public_size=100, local_test_fraction=0.2, eval_every=1)))
    assert sum(res["data"]["local_test_sizes"]) > 0
    for entry in (*res["rounds"], res["final"]):
        local = entry["client_local_acc"]
        assert len(local) == 3 and all(0.0 <= a <= 1.0 for a in local)
        assert entry["local_min_acc"] <= entry["local_mean_acc"] <= entry["local_max_acc"]
    assert load_config(None, {}).local_test_fraction == 0.0
    with pytest.raises(Exception, match="local_test_fraction"):
        load_config(None, dict(local_test_fraction=1.5))


def test_mnist1d_size_is_a_parameter_written_with_the_results(tmp_path):
    """MNIST-1D's generated size is a run setting: the default (12000) is written in the saved
    config, another size changes the data the clients get, and the CLI flag sets it."""
    base = dict(strategy="local", dataset="mnist1d", clients=2, rounds=1, public_size=100, seed=0)
    default = simulate(load_config(None, base))
    assert default["config"]["mnist1d_samples"] == 12000
    small = simulate(load_config(None, {**base, "mnist1d_samples": 2000}))
    assert small["config"]["mnist1d_samples"] == 2000
    assert small["data"]["test_size"] < default["data"]["test_size"]
    assert sum(small["data"]["client_sizes"]) < sum(default["data"]["client_sizes"])
    proc = fedal("simulate", "--strategy", "local", "--clients", "2", "--rounds", "1", "--public-size", "100",
                 "--mnist1d-samples", "2000", "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["config"]["mnist1d_samples"] == 2000 and saved["data"] == small["data"]


def test_simulate_tells_when_its_long_parts_begin():
    """The progress bar starts with the rounds (the data's preparation was counted in round 1),
    and CF's standalone baseline, which ran after the bar had reached 100 %, reports its rounds."""
    from fedal.sim import load_config, simulate

    def seen(strategy: str) -> tuple[list[str], list[tuple[str, int]]]:
        stages: list[str] = []
        rounds: list[tuple[str, int]] = []
        config = load_config(None, dict(strategy=strategy, dataset="digits", clients=2, rounds=2, public_size=60,
                                        local_test_fraction=0.2 if strategy == "fedakd" else 0.0))
        simulate(config, lambda r, _entry: rounds.append((stages[-1], r)), stage=stages.append)
        return stages, rounds

    for strategy, expected in (("fedmd", ["build", "rounds"]), ("fedakd", ["build", "rounds", "standalone"])):
        stages, rounds = seen(strategy)
        assert stages == expected
        assert rounds == [(stage, r) for stage in expected[1:] for r in (1, 2)]


def test_the_summary_says_what_went_wrong_without_stopping_the_run(monkeypatch, tmp_path):
    """Tasks a client refused (their warnings scroll past the progress bar) are counted again in
    the summary's last lines; a run where nothing went wrong says nothing of the kind."""
    import numpy as np

    from fedal.engine.results import mishaps_line
    from fedal.strategies.fedal import FedALServer

    feedback = FedALServer._feedback

    def poisoned(self, results):
        out = feedback(self, results)
        if "c01" in out:
            out["c01"]["fbar"] = np.full_like(out["c01"]["fbar"], np.nan)
        return out

    clean = CliRunner().invoke(cli, ["simulate", "--strategy", "fedal", *SMALL, "--rounds", "1", "--out",
                                     str(tmp_path / "clean.json")])
    assert clean.exit_code == 0 and "refused" not in clean.output, clean.output
    monkeypatch.setattr(FedALServer, "_feedback", poisoned)
    result = CliRunner().invoke(cli, ["simulate", "--strategy", "fedal", *SMALL, "--rounds", "1", "--out",
                                      str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    refused = json.loads((tmp_path / "r.json").read_text())["refused_tasks"]
    assert refused >= 2 and f"{refused} client task(s) refused" in result.output  # every transfer of c01
    assert mishaps_line({"backend": {"name": "ray", "actor_failures": 1, "lost_tasks": 3, "refused_tasks": 0,
                                     "restored_clients": 2}}) == \
        "1 Ray actor failure(s): 3 task(s) lost, 2 client(s) restored from their round-start snapshots"
