"""A results file as a config (`fedal simulate --config results.json`): unchanged it repeats its
run exactly; a flag that changes the strategy, seed, dataset or rounds derives what those decide
(a strategy's preset parameters, the public rows' seed, the dataset's default models and size)
as a fresh run would, while the values the saved run chose itself stay."""

from __future__ import annotations

import json

import pytest

from fedal.sim.config import load_config
from fedal.strategies import STRATEGIES

FIELDS = dict(dataset="mnist1d", clients=3, rounds=2, samples_per_client=100, public_size=200, seed=0)


def saved(tmp_path, **config) -> str:
    """What a run writes as its results' `config`: the fully resolved config."""
    path = tmp_path / "results.json"
    resolved = load_config(None, config).resolved().model_dump(mode="json")
    path.write_text(json.dumps({"config": resolved, "final": {}}))
    return str(path)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_an_unchanged_results_file_repeats_its_run(tmp_path, strategy):
    path = saved(tmp_path, strategy=strategy, **FIELDS)
    again = load_config(path).resolved().model_dump(mode="json")
    assert again == json.loads(open(path).read())["config"]


def test_a_private_run_repeats_with_its_planned_rounds(tmp_path):
    path = saved(tmp_path, strategy="fedal", dp_target_epsilon=5.0, **FIELDS)
    assert load_config(path).resolved().model_dump(mode="json") == json.loads(open(path).read())["config"]
    longer = load_config(path, {"rounds": 4}).resolved()
    assert longer.strategy_params.privacy.planned_rounds == 4  # derived from the new rounds


@pytest.mark.parametrize("strategy", ["fedmd", "fedavg", "fd", "fedhkd"])
def test_another_strategy_gets_its_own_settings_not_the_saved_ones(tmp_path, strategy):
    path = saved(tmp_path, strategy="fedal", **FIELDS)
    switched = load_config(path, {"strategy": strategy}).resolved()
    fresh = load_config(None, {"strategy": strategy, **FIELDS}).resolved()
    assert switched.model_dump() == fresh.model_dump()


def test_another_seed_or_dataset_derives_what_they_decide(tmp_path):
    path = saved(tmp_path, strategy="fedal", **FIELDS)
    reseeded = load_config(path, {"seed": 1}).resolved()
    assert reseeded.strategy_params.rows_seed == 1
    assert reseeded.model_dump() == load_config(None, {"strategy": "fedal", **{**FIELDS, "seed": 1}}).resolved().model_dump()
    digits = load_config(path, {"dataset": "digits"}).resolved()  # the saved mnist1d size no longer applies
    assert digits.mnist1d_samples is None and digits.models == load_config(
        None, {"strategy": "fedal", **{**FIELDS, "dataset": "digits"}}).resolved().models


def test_a_chosen_option_of_the_saved_dataset_does_not_follow_another_dataset(tmp_path):
    """A results file of a run with a chosen --mnist1d-samples could not be run on digits: the
    option applies to mnist1d only, and no flag clears it."""
    path = saved(tmp_path, strategy="fedal", mnist1d_samples=600, **FIELDS)
    assert load_config(path).resolved().mnist1d_samples == 600  # unchanged: the run as saved
    digits = load_config(path, {"dataset": "digits"}).resolved()
    assert digits.mnist1d_samples is None
    assert load_config(path, {"dataset": "mnist1d", "seed": 1}).resolved().mnist1d_samples == 600  # its own dataset: kept


def test_values_the_saved_run_chose_stay(tmp_path):
    path = saved(tmp_path, strategy="fedal", models=["mlp"], tau=3, **FIELDS)
    switched = load_config(path, {"strategy": "fedmd"}).resolved()
    assert switched.strategy_params.tau == 3 and switched.models == ["mlp"]
    assert switched.strategy_params.lambda_adv == 0.0  # fedmd's own


def test_a_toml_spelling_out_a_preset_switched_by_a_flag_gets_the_new_strategys(tmp_path):
    """examples/demo.toml writes FedAL's preset values out; `--strategy fedmd` over it ran FedAL's
    adversarial, less-forgetting settings labelled "fedmd" (a results file already derived them anew)."""
    from pathlib import Path

    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.toml"
    switched = load_config(demo, {"strategy": "fedmd"}).resolved()
    p = switched.strategy_params
    assert (p.tau, p.lambda_adv, p.lambda_lf_loc, p.lambda_lf_glo) == (1, 0.0, 0.0, 0.0)  # FedMD's preset
    chosen = tmp_path / "run.toml"
    chosen.write_text('strategy = "fedal"\n[strategy_params]\ntau = 3\nlambda_kd = 0.5\n')
    kept = load_config(chosen, {"strategy": "fedmd"}).resolved().strategy_params
    assert (kept.tau, kept.lambda_kd, kept.lambda_adv) == (3, 0.5, 0.0)  # chosen values stay
    assert load_config(demo).resolved().strategy_params.lambda_adv == 1.0  # unswitched: as written


def test_a_tomls_pinned_values_stay_when_only_the_seed_changes(tmp_path):
    """A TOML's rows_seed = 0 beside seed = 0 is the user's: --seed 7 keeps it (only a new strategy
    takes its own preset over a TOML's values)."""
    pinned = tmp_path / "run.toml"
    pinned.write_text('seed = 0\n[strategy_params]\nrows_seed = 0\ntau = 5\n')
    assert load_config(pinned, {"seed": 7}).resolved().strategy_params.rows_seed == 0


def test_a_ray_runs_results_rerun_in_process_with_a_flag(tmp_path):
    """Its saved ray_actors and client_resources were refused without the ray backend."""
    path = saved(tmp_path, strategy="fedmd", backend="ray", ray_actors=2, client_resources="num_cpus=1", **FIELDS)
    rerun = load_config(path, {"backend": "inprocess"})
    assert (rerun.backend, rerun.ray_actors, rerun.client_resources) == ("inprocess", None, None)
    with pytest.raises(Exception, match="apply to the ray backend only"):
        load_config(path, {"backend": "inprocess", "ray_actors": 3})  # asked for now: still refused
