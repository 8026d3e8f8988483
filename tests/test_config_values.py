"""Run-config values no run can use are refused when the config is read (exit 2 on the command
line), not deep inside a run: infinite concentrations or shifts, seeds torch cannot take, absurd
thread counts, and TOML values of the wrong type that a lenient parser would coerce
(`rounds = true` ran one round, `vectorize = "yes"` stacked)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fedal.sim.config import ConfigError, load_config
from fedal_cli.main import cli


@pytest.mark.parametrize("values, needle", [
    ({"alpha": float("inf")}, "alpha: Input should be a finite number"),
    ({"shift_c": float("inf"), "partition": "covariate-shift"}, "shift_c: Input should be a finite number"),
    ({"seed": 2**64}, "seed: Input should be less than"),
    ({"threads": 100_000}, "threads: Input should be less than or equal to 1024"),
    # widths within 1..65536 each, but a discriminator of 4e9 parameters: the simulation was OOM-killed
    ({"disc_hidden": [65536, 65536]}, "would hold 4,296,409,098 parameters, more than 16,777,216"),
])
def test_values_no_run_can_use_are_refused(values, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, values)


@pytest.mark.parametrize("toml, needle", [
    ("rounds = true\n", "rounds: Input should be a valid integer"),
    ("clients = 3.0\n", "clients: Input should be a valid integer"),
    ("seed = 1.5\n", "seed: Input should be a valid integer"),
    ('vectorize = "yes"\n', "vectorize: Input should be a valid boolean"),
    # float, strategy and privacy settings, list items (`stragglers = true` made every client a straggler)
    ("stragglers = true\n", "stragglers: Input should be a valid number, not a boolean"),
    ("alpha = true\n", "alpha: Input should be a valid number, not a boolean"),
    ("[strategy_params]\ntau = true\n", "strategy_params.tau: Input should be a valid integer, not a boolean"),
    ("[strategy_params]\nlambda_kd = true\n", "strategy_params.lambda_kd: Input should be a valid number"),
    ("[strategy_params]\nbatch_size = 16.0\n", "strategy_params.batch_size: Input should be a valid integer, not a float"),
    ('strategy = "fd"\n[strategy_params]\nfd_exclude_own = "no"\n', "fd_exclude_own: Input should be a valid boolean"),
    ('strategy = "fd"\n[strategy_params]\nfd_exclude_own = 0\n', "fd_exclude_own: Input should be a valid boolean"),
    ("[privacy]\nnoise_multiplier = true\n", "strategy_params.privacy.noise_multiplier: Input should be a valid number"),
    ("[strategy_params]\ndisc_hidden = [true, 64]\n", "strategy_params.disc_hidden: Input should be a valid integer"),
    ("[strategy_params]\ndisc_hidden = [32.0, 64]\n", "strategy_params.disc_hidden: Input should be a valid integer"),
])
def test_toml_values_of_the_wrong_type_are_not_coerced(tmp_path, toml, needle):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=needle):
        load_config(path)
    r = CliRunner().invoke(cli, ["simulate", "--config", str(path), "--quiet", "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and needle in r.output
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("hidden, needle", [
    ([0, 3], "greater than or equal to 1"),
    ([10**6], "less than or equal to 65536"),
    ([3] * 20, "at most 16 items"),
])
def test_a_discriminator_of_no_or_absurd_width_is_refused(hidden, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, {"disc_hidden": hidden})


def test_environment_overrides_still_give_numbers_and_booleans_as_text(tmp_path, monkeypatch):
    """FEDAL_COORD_RUN__ROUNDS=5 (a systemd Environment= line) is text: it stays accepted."""
    from coordinator.config import load_coordinator_config

    path = tmp_path / "coordinator.toml"
    path.write_text('run_id = "lab"\nclient_ids = ["c00", "c01"]\nstate_dir = "%s"\n\n[run]\nstrategy = "fedmd"\n'
                    'dataset = "digits"\nclients = 2\n\n[broker]\nurl = "mqtt://127.0.0.1:1883"\n' % (tmp_path / "state"))
    monkeypatch.setenv("FEDAL_COORD_RUN__ROUNDS", "5")
    monkeypatch.setenv("FEDAL_COORD_RUN__SEED", "7")
    config = load_coordinator_config(str(path))
    assert (config.run.rounds, config.run.seed) == (5, 7)
    assert load_config(None, {"vectorize": "false"}).vectorize is False


@pytest.mark.parametrize("flags, needle", [
    (["--ray-actors", "4"], "ray_actors (--ray-actors) apply to the ray backend only"),
    (["--ray-address", "auto", "--client-resources", "num_cpus=1"],
     "ray_address (--ray-address), client_resources (--client-resources) apply to the ray backend only"),
])
def test_ray_options_without_the_ray_backend_are_refused_not_ignored(tmp_path, flags, needle):
    r = CliRunner().invoke(cli, ["simulate", *flags, "--quiet", "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 2 and needle in r.output, r.output
    assert "--backend ray" in r.output
    assert not (tmp_path / "r.json").exists()
    load_config(None, {"backend": "ray", "ray_actors": 4, "client_resources": "num_cpus=1"})  # with it, taken


@pytest.mark.parametrize("argv, needle", [
    (["demo", "--linger", "nan"], "'nan' is not a finite number"),
    (["demo", "--linger", "inf"], "--linger"),  # it was a traceback from time.sleep after the run
    (["demo", "--linger", "1e10"], "--linger"),
    (["simulate", "--dropout", "nan"], "'nan' is not a finite number"),
    (["hil", "fleet", "--clients", "2", "--run-id", "r", "--timeout", "nan"], "'nan' is not a finite number"),
    (["hil", "fleet", "--clients", "2", "--run-id", "r", "--resend-s", "nan"], "'nan' is not a finite number"),
])
def test_non_finite_numbers_are_refused_by_every_ranged_option(tmp_path, argv, needle):
    r = CliRunner().invoke(cli, [*argv, "--quiet"] if argv[0] != "hil" else argv)
    assert r.exit_code == 2 and needle in r.output, r.output


@pytest.mark.parametrize("argv, needle", [
    (["export", "--model", "mlp", "--out", "{tmp}/m.onnx", "--input-shape", "1000000,1000000", "--num-classes", "10"],
     "values per sample, more than 16,777,216"),
    (["hil", "fleet", "--clients", "2", "--run-id", "r", "--start-coordinator", "--public-size", "10000000000"],
     "--public-size"),
])
def test_sizes_no_machine_can_allocate_are_usage_errors_not_tracebacks(tmp_path, argv, needle):
    r = CliRunner().invoke(cli, [a.format(tmp=tmp_path) for a in argv])
    assert r.exit_code == 2 and needle in r.output, r.output


@pytest.mark.parametrize("argv, needle", [
    (["export", "--model", "mlp", "--out", "{tmp}/m.onnx", "--input-shape", "4", "--num-classes", "10",
      "--quantize-mode", "dynamic"], "--quantize-mode applies to --quantize int8 only"),
    (["export", "--model", "mlp", "--out", "{tmp}/m.onnx", "--input-shape", "4", "--num-classes", "1"],
     "--num-classes must be 2 to 10000, got 1"),
    (["export", "--model", "mlp", "--out", "{tmp}/m.onnx", "--input-shape", "4", "--num-classes", "100000000"],
     "--num-classes must be 2 to 10000, got 100000000"),  # an allocator's message before
    (["fleet", "wheelhouse", "--out", "{tmp}/wh", "--no-index"], "--no-index needs --find-links"),
    (["fleet", "init", "--devices", "2", "--broker", "mqtt://h:1883", "--out", "{tmp}/f", "--broker-dir", "rel/broker"],
     "must be an absolute path"),  # Mosquitto reads its config's paths from its own directory
    (["fleet", "init", "--devices", "2", "--broker", "mqtt://h:1883", "--out", "{tmp}/f", "--broker-dir",
      "/etc/m\nlistener 1 0.0.0.0"], "must be an absolute path without spaces, control characters"),
    (["fleet", "wheelhouse", "--out", "{tmp}/wh", "--no-index", "--find-links", "{tmp}", "--index-url", "http://x/"],
     "contradict"),
    (["hil", "fleet", "--clients", "2", "--run-id", "r", "--ids", "a,a"], "lists a client more than once: ['a']"),
    (["fleet", "init", "--devices", "1000000000", "--broker", "mqtt://h", "--out", "{tmp}/wh"], "--devices"),
    (["demo", "--dataset", "mnist", "--data-dir", "{tmp}", "--workdir", "{tmp}/w", "--quiet"], "(--data-dir)"),
    (["simulate", "--strategy", "fccl", "--public-size", "1", "--out", "{tmp}/r.json"],
     "needs at least 2 public rows per transfer iteration"),  # exit 1 from the server half, after the data was built
])
def test_options_that_were_silently_ignored_or_contradictory_are_refused(tmp_path, argv, needle):
    r = CliRunner().invoke(cli, [a.format(tmp=tmp_path) for a in argv])
    assert r.exit_code == 2 and needle in r.output, r.output
    assert not (tmp_path / "m.onnx").exists() and not (tmp_path / "wh").exists() and not (tmp_path / "r.json").exists()


def test_rows_seed_is_a_64_bit_seed_like_seed():
    with pytest.raises(ConfigError, match="rows_seed"):
        load_config(None, {"rows_seed": 2**63})


def test_a_data_dir_given_for_digits_is_said_to_be_unused_not_refused(tmp_path):
    """Older configs with data_dir set for the embedded digits keep working; the user is told."""
    config = load_config(None, {"dataset": "digits", "data_dir": str(tmp_path)})
    assert any("is not read: dataset 'digits' comes with scikit-learn" in n for n in config.notes())
    assert not [n for n in load_config(None, {"dataset": "digits"}).notes() if "data_dir" in n]
    import click.testing

    from fedal_cli.options import config_from_flags

    with click.testing.CliRunner().isolation() as (_out, err, *_):
        config_from_flags(None, {"dataset": "digits", "data_dir": str(tmp_path)})
        assert b"is not read" in err.getvalue()


def test_the_privacy_table_is_spelled_the_same_in_a_deployment():
    """`[privacy]` worked in a simulate TOML only: a coordinator's [run.privacy] and an API spec's
    run.privacy were refused as unknown keys."""
    from coordinator.config import RunSpec, load_coordinator_config

    table = {"noise_multiplier": 1.1, "max_grad_norm": 2.0}
    config = load_coordinator_config(None, run={"strategy": "fedal", "dataset": "digits", "privacy": table})
    assert (config.run.strategy_params.privacy.noise_multiplier, config.run.strategy_params.privacy.max_grad_norm) == (1.1, 2.0)
    spec = RunSpec.model_validate({"run_id": "r", "client_ids": ["a", "b"],
                                   "run": {"strategy": "fedal", "dataset": "digits", "privacy": table}})
    assert spec.run.strategy_params.privacy == config.run.strategy_params.privacy
    from fedal.sim.config import RunConfig

    with pytest.raises(ValueError, match="privacy is given twice"):
        RunConfig.model_validate({"privacy": table, "strategy_params": {"privacy": table}})
    from fedal.strategies import StrategyParams

    built = RunConfig(strategy_params=StrategyParams(lr=0.01), privacy=table)  # a StrategyParams made in code
    assert built.strategy_params.lr == 0.01 and built.strategy_params.privacy.noise_multiplier == 1.1
