"""A strategy with a global model (FedAvg, FedHKD, FedAKD) takes its first client's upload for
that model. One device whose upload is no model of the run (another `model` in its config, or
garbage) failed the whole run at the round's evaluation, with nothing counted as rejected: the
coordinator now holds that first upload to the run's model, and an evaluation that still cannot
load the global model is said and counted, not fatal."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.config import load_coordinator_config
from coordinator.run import Run
from fedal.models import build_model
from fedal.protocol import Message
from fedal.strategies import ServerContext, StrategyParams, get_strategy
from fedal.strategies.base import InvalidResult, PhaseTasks
from fedal.strategies.fedavg import model_to_numpy


def run_of(tmp_path, strategy: str, model: str = "mlp") -> Run:
    cfg = load_coordinator_config(None, run_id="g", client_ids=["a", "b"], num_classes=10, state_dir=tmp_path / "state",
                                  run={"strategy": strategy, "dataset": "digits", "rounds": 1, "models": [model]})
    return Run(cfg)


@pytest.mark.parametrize("strategy", ["fedavg", "fedhkd", "fedakd"])
def test_the_coordinator_knows_the_global_models_layout(tmp_path, strategy):
    run = run_of(tmp_path, strategy)
    expected = model_to_numpy(build_model("mlp", (64,), 10))
    assert run.server.context.weight_layout == {k: (v.shape, v.dtype.name) for k, v in expected.items()}


def test_a_strategy_without_a_global_model_loads_no_test_set_for_it(tmp_path):
    run = run_of(tmp_path, "fedmd")
    assert run.server.context.weight_layout is None and "global_test" not in run.__dict__


def init_phase(server) -> PhaseTasks:
    phase = server.begin_round(0)
    assert phase.phase == "init"
    return phase


def test_a_first_upload_of_another_model_is_refused_and_one_of_the_runs_model_taken(tmp_path):
    run = run_of(tmp_path, "fedavg")
    server = run.server
    phase = init_phase(server)
    (first,) = phase.tasks
    other = model_to_numpy(build_model("cnn1d", (64,), 10))  # a device whose config names another model
    with pytest.raises(InvalidResult, match="do not match the run's model's tensors"):
        server.validate(phase, first, Message(dict(phase.tasks[first].meta), other))
    wrong_shape = model_to_numpy(build_model("mlp", (64,), 10))
    key = next(iter(wrong_shape))
    wrong_shape[key] = np.zeros((3, 3), np.float32)
    with pytest.raises(InvalidResult, match=rf"tensor '{key}' is float32\[3, 3\], expected float32"):
        server.validate(phase, first, Message(dict(phase.tasks[first].meta), wrong_shape))
    good = model_to_numpy(build_model("mlp", (64,), 10))
    server.validate(phase, first, Message(dict(phase.tasks[first].meta), good))


def test_without_a_layout_the_first_upload_is_held_to_the_models_dtypes_only():
    """A server half built without the run's model (a test, a simulation): as before."""
    spec = get_strategy("fedavg")
    server = spec.server(StrategyParams().resolve(spec.preset), ["a", "b"], ServerContext(10, 0, 0))
    phase = init_phase(server)
    server.validate(phase, "a", Message(dict(phase.tasks["a"].meta), {"w": np.zeros(2, np.float32)}))
    with pytest.raises(InvalidResult, match="dtype float64"):
        server.validate(phase, "a", Message(dict(phase.tasks["a"].meta), {"w": np.zeros(2)}))


def test_a_global_model_that_does_not_load_is_counted_not_fatal(tmp_path, caplog):
    """A global model kept from before this check (a restarted run's stored state)."""
    run = run_of(tmp_path, "fedavg")
    run.server.global_weights = {"w": np.zeros(2, np.float32)}
    assert "global_acc" not in run._global_model_metrics({})
    assert run.counters["global_eval_failed"] == 1
    assert "the global model does not load into mlp" in caplog.text
    run.server.global_weights = model_to_numpy(build_model("mlp", (64,), 10))
    assert 0.0 <= run._global_model_metrics({})["global_acc"] <= 1.0
