"""What a researcher's config and flags can get wrong, each a usage error (exit 2) with one line
before any work, or made harmless (values of the wrong type: tests/test_config_values.py): a
delta so large that the accountant's epsilon went negative (every result rejected, exit 0 at
chance accuracy), --plot onto --out, a plot format that needs LaTeX, a results file not named
.json given back as --config, seeds whose client seeds overflowed torch's, an MHAT server model
that does not exist, missing data files."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from click.testing import CliRunner

from fedal.sim import load_config, simulate
from fedal.sim.build import client_seed
from fedal_cli.main import cli
from tests.helpers import fedal_command

QUICK = ["--dataset", "digits", "--clients", "2", "--rounds", "1", "--public-size", "60", "--quiet"]


def test_numbers_and_booleans_as_their_strings_still_load(tmp_path):
    """(environment overrides are strings)"""
    config = load_config(None, {"alpha": "0.5", "strategy_params": {"lr": "0.01", "tau": "3"}})
    assert (config.alpha, config.strategy_params.lr, config.strategy_params.tau) == (0.5, 0.01, 3)
    fd = load_config(None, {"strategy": "fd", "strategy_params": {"fd_exclude_own": "false"}})
    assert fd.strategy_params.fd_exclude_own is False


def test_a_large_delta_gives_epsilon_zero_not_a_rejected_run():
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=3, rounds=2, public_size=60, seed=1,
                                    dp_noise_multiplier=1.0, dp_delta=0.5))
    results = simulate(config)
    assert all(r["rejected"] == 0 for r in results["rounds"])
    assert results["privacy"] is not None and all(e == 0.0 for e in results["privacy"]["final_epsilon"].values())


def run(tmp_path: Path, *args: str):
    return CliRunner().invoke(cli, ["simulate", *QUICK, *args], catch_exceptions=False)


def test_the_plot_onto_the_results_and_a_plot_format_needing_latex_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    same = run(tmp_path, "--out", "same.png", "--plot", "same.png")
    assert same.exit_code == 2 and "the plot would replace the results" in same.output
    pgf = run(tmp_path, "--out", "r.json", "--plot", "p.pgf")
    assert pgf.exit_code == 2 and "not .pgf" in pgf.output and ".png" in pgf.output
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_results_file_of_any_name_repeats_its_run(tmp_path):
    cmd = fedal_command()
    first = subprocess.run([*cmd, "simulate", *QUICK, "--seed", "4", "--out", "run1"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([*cmd, "simulate", "--quiet", "--config", "run1", "--out", "run2.json"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    a, b = (json.loads((tmp_path / name).read_text()) for name in ("run1", "run2.json"))
    assert a["config"] == b["config"] and a["final"] == b["final"]


def test_client_seeds_stay_within_torchs_64_bits_and_unchanged_below():
    assert client_seed(5, 2) == 5 * 100_003 + 3  # every seed used so far keeps its clients' seeds
    assert all(0 <= client_seed(2**63 - 1, i) < 2**64 for i in range(20))
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=60,
                                    seed=200_000_000_000_000))
    assert simulate(config)["final"]["mean_acc"] >= 0


def test_an_mhat_server_model_that_cannot_be_built_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for model, needle in (("foo", "unknown model 'foo'"), ("cnn1d", "mhat_server_model")):
        config = tmp_path / f"{model}.toml"
        config.write_text(f'strategy = "mhat"\n[strategy_params]\nmhat_server_model = "{model}"\n')
        r = run(tmp_path, "--strategy", "mhat", "--config", str(config), "--out", "r.json")
        assert r.exit_code == 2 and needle in r.output, r.output
    assert not (tmp_path / "r.json").exists()


def test_an_mhat_server_model_that_is_no_zoo_model_is_refused_when_the_config_is_read():
    """It was refused only once a simulation had built its data (and a coordinator's config
    loaded with it)."""
    import pytest

    from fedal.sim.config import ConfigError

    with pytest.raises(ConfigError, match="mhat_server_model: unknown model 'nope'"):
        load_config(None, dict(strategy="mhat", strategy_params={"mhat_server_model": "nope"}))


def test_missing_dataset_files_are_a_usage_error_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["simulate", "--dataset", "mnist", "--data-dir", str(tmp_path / "nowhere"), "--clients",
                                 "2", "--rounds", "1", "--quiet", "--out", "r.json"], catch_exceptions=False)
    assert r.exit_code == 2 and "--data-dir" in r.output, r.output


def test_an_unwritable_mnist1d_cache_only_costs_the_cache(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    from fedal.data.embedded import load_mnist1d

    train, test = load_mnist1d(200, cache_dir=blocker / "cache")
    assert len(train) + len(test) == 200
    assert "cannot cache the generated data" in caplog.text


def test_cfd_public_rows_beyond_the_public_set_are_refused_not_clamped(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfd.toml"
    config.write_text('strategy = "cfd"\n[strategy_params]\ncfd_public_rows = 5000\n')
    r = run(tmp_path, "--strategy", "cfd", "--config", str(config), "--out", "r.json")
    assert r.exit_code == 2 and "cfd_public_rows 5000 is more than the public set's 60 rows" in r.output, r.output
    # the config alone does not decide it: a deployment's public set may be a file of another size
    assert load_config(None, {"strategy": "cfd", "public_size": 1000,
                              "strategy_params": {"cfd_public_rows": 5000}}).strategy_params.cfd_public_rows == 5000


def test_a_privacy_flag_alone_is_told_which_flags_set_the_missing_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run(tmp_path, "--dp-delta", "0.01")
    assert r.exit_code == 2 and "privacy needs noise_multiplier or target_epsilon" in r.output
    assert "--dp-noise-multiplier sets noise_multiplier" in r.output and "--dp-target-epsilon sets target_epsilon" in r.output
    assert not list(tmp_path.iterdir())
    (tmp_path / "run.toml").write_text("[strategy_params.privacy]\ndelta = 0.01\n")
    from_file = run(tmp_path, "--config", "run.toml")  # no flag given: the config's own names alone
    assert from_file.exit_code == 2 and "privacy needs noise_multiplier" in from_file.output
    assert "--dp-" not in from_file.output
