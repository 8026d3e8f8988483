"""Run configs that used to pass validation and then crash or hang: a `strategy_params` or
`privacy` that is not a table under a flag that writes into it, counts and rates far past any
useful value. Each is now the config's one error (exit 2), before anything runs. And the demo
keeps the results file it reads its config from, and records the per-client path it ran."""

from __future__ import annotations

import json

import pytest

from fedal.sim import ConfigError, load_config

SMALL = {"clients": 2, "rounds": 1, "mnist1d_samples": 600, "public_size": 60}


@pytest.mark.parametrize("toml, flags, needle", [
    ('strategy_params = "x"\n', {"tau": 3}, "strategy_params must be a table"),
    ("strategy_params = [1]\n", {"dp_noise_multiplier": 1.0}, "strategy_params must be a table"),
    ("privacy = 3\n", {"dp_noise_multiplier": 1.0}, "privacy ([privacy]) must be a table"),
    ("[strategy_params]\nprivacy = 3\n", {"dp_noise_multiplier": 1.0}, "privacy ([privacy]) must be a table"),
])
def test_a_table_that_is_not_one_is_refused_under_flags_too(tmp_path, toml, flags, needle):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        load_config(path, {**SMALL, **flags})


@pytest.mark.parametrize("params, field", [
    ({"tau": 10**20}, "tau"),
    ({"tau": 2**64 - 1}, "tau"),
    ({"lr": 1e300}, "lr"),
    ({"disc_lr": 1e300}, "disc_lr"),
    ({"batch_size": 10**12}, "batch_size"),
    ({"privacy": {"noise_multiplier": 1e300}}, "noise_multiplier"),
])
def test_values_far_past_any_use_are_refused_when_read(params, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, {**SMALL, "strategy_params": params})


@pytest.mark.parametrize("strategy, params, field", [
    ("fedavg", {"local_epochs": 10**20}, "local_epochs"),
    ("mhat", {"mhat_server_epochs": 10**20}, "mhat_server_epochs"),
    ("fccl", {"fccl_pretrain_epochs": 10**20}, "fccl_pretrain_epochs"),
])
def test_epoch_counts_of_other_strategies_are_bounded_too(strategy, params, field):
    with pytest.raises(ConfigError, match=f"{field}.*less than or equal"):
        load_config(None, {**SMALL, "strategy": strategy, "strategy_params": params})


def test_a_dirichlet_concentration_past_any_use_is_refused():
    """Near 1e308 numpy's Dirichlet draw overflows to zeros, and the partition's errors then told
    the user to raise it."""
    with pytest.raises(ConfigError, match="alpha.*less than or equal"):
        load_config(None, {**SMALL, "alpha": 1e308})
    assert load_config(None, {**SMALL, "alpha": 1e9}).alpha == 1e9


def test_a_data_dir_for_mnist1d_is_said_to_hold_its_cache(tmp_path):
    notes = load_config(None, {**SMALL, "data_dir": str(tmp_path / "d")}).notes()
    assert any("keeps the generated MNIST-1D cache" in n for n in notes), notes


def test_the_demo_records_that_its_clients_ran_one_by_one():
    """Its results said `vectorize: null`: rerun with `fedal simulate --config`, they ran
    vectorized and differed from the demo's in the 8th digit."""
    from fedal_cli.demo import deployable

    assert deployable(load_config(None, SMALL)).vectorize is False


def test_the_demo_keeps_the_results_file_it_reads_its_config_from(tmp_path):
    """`fedal demo --config runs/demo/results.json` removed that very file as an earlier run's
    output when it started: a rerun that then failed or was stopped left no record at all."""
    from fedal import workspace
    from fedal_cli.demo import prepare_workspace

    ws = workspace.claim(tmp_path / "ws", "fedal demo")
    earlier = {"config": dict(SMALL), "rounds": [], "final": {}}
    (ws / "results.json").write_text(json.dumps(earlier))
    config = load_config(ws / "results.json", {}).resolved()
    prepare_workspace(config, ws, "mqtt://127.0.0.1:1", 1, keep=[ws / "results.json"])
    assert json.loads((ws / "results.json").read_text()) == earlier
    prepare_workspace(config, ws, "mqtt://127.0.0.1:1", 1)  # another config: the earlier run's output goes
    assert not (ws / "results.json").exists()


def test_an_empty_models_list_is_refused_as_the_flag_is(tmp_path):
    """`models = []` silently meant the dataset's defaults, where `--models ","` is refused."""
    path = tmp_path / "run.toml"
    path.write_text("models = []\n")
    with pytest.raises(ConfigError, match="models: List should have at least 1 item"):
        load_config(path, SMALL)


def test_a_results_json_through_a_pipe_is_read_once_and_taken_as_json(tmp_path):
    """`--config <(cat results.json) --seed 3`: the file was read a second time to tell JSON from
    TOML, the pipe was empty by then, and the saved run's seed-derived values (its public rows'
    key, rows_seed) were kept instead of derived from the new seed."""
    import json
    import os
    import threading

    from fedal.sim import load_config

    saved = {"config": load_config(None, {"strategy": "fedal", "seed": 0}).resolved().model_dump(mode="json")}
    assert saved["config"]["strategy_params"]["rows_seed"] == 0
    read_end, write_end = os.pipe()

    def feed() -> None:
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(json.dumps(saved).encode())

    threading.Thread(target=feed, daemon=True).start()
    try:
        config = load_config(f"/dev/fd/{read_end}", {"seed": 3}).resolved()
    finally:
        os.close(read_end)
    assert config.seed == 3 and config.strategy_params.rows_seed == 3
