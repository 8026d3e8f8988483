"""Vectorized clients (`vectorize`): clients of one architecture as one stacked model give the
per-client path's numbers, up to float summation order, step for step; whatever cannot be
stacked runs client by client, unchanged."""

from __future__ import annotations

import pytest
import torch

from fedal.sim import build_run, load_config, simulate, simulated_engine
from fedal.strategies.stacked import NotStackable, StackedModels
from tests.helpers import without_timings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(strategy: str, vectorize: bool, **extra):
    base = dict(strategy=strategy, dataset="mnist1d", clients=4, samples_per_client=120, public_size=200,
                models=["mlp", "cnn1d"], rounds=2, seed=3, vectorize=vectorize, mnist1d_samples=2000)
    return load_config(None, {**base, **extra}).resolved()


def _engine(strategy: str, vectorize: bool, **extra):
    config = _config(strategy, vectorize, **extra)
    data, clients, server = build_run(config)
    return simulated_engine(config, data, clients, server), clients, data


def _assert_close_clients(a: dict, b: dict, atol: float) -> None:
    for cid in a:
        for part in ("model", "global_model"):  # FedAKD keeps its copy of the global model as well
            if not hasattr(a[cid], part):
                continue
            for (name, p), q in zip(getattr(a[cid], part).named_parameters(), getattr(b[cid], part).parameters()):
                assert torch.allclose(p, q, atol=atol, rtol=0), (cid, part, name, (p - q).abs().max().item())





@pytest.mark.parametrize("strategy,extra", [
    ("fedal", {"clients": 6, "models": ["mlp", "cnn1d", "cnn1d_wide"]}), ("fedmd", {}), ("fedmd-lf", {}),
    ("feddf-al", {"models": ["mlp", "cnn1d", "mlp"], "strategy_params": {"tau": 3}}),
    ("feddf", {"models": ["mlp", "cnn1d", "mlp"], "strategy_params": {"tau": 3}}),
    ("fedavg", {"models": ["cnn1d"]}),
    ("fedavg", {"models": ["mlp"], "strategy_params": {"local_epochs": 1}}),
    ("local", {}),
    ("fd", {"strategy_params": {"tau": 6}}),
    ("fd", {"strategy_params": {"tau": 6, "fd_beta": 0.0}}),
    ("fedproto", {"models": ["mlp", "cnn1d_wide"], "strategy_params": {"tau": 6}}),
    ("fedakd", {"models": ["cnn1d"], "strategy_params": {"tau": 4}}),
    ("fedhkd", {"models": ["cnn1d_wide"], "strategy_params": {"tau": 4, "local_epochs": 0}}),  # tau steps, not 5 epochs
    ("fedhkd", {"models": ["mlp"], "strategy_params": {"tau": 4, "local_epochs": 0, "hkd_preset": "paper"}}),
    ("cfd", {"strategy_params": {"tau": 4}}),
    ("mhat", {"strategy_params": {"tau": 4}}),
    ("fedproto-public", {"models": ["mlp", "cnn1d_wide"], "strategy_params": {"tau": 3}}),
    ("fccl", {"strategy_params": {"tau": 3, "fccl_pretrain_epochs": 2}}),
], ids=["fedal", "fedmd", "fedmd-lf", "feddf-al", "feddf", "fedavg", "fedavg-epochs", "local", "fd", "fd-no-term",
        "fedproto", "fedakd", "fedhkd-official", "fedhkd-paper", "cfd", "mhat", "fedproto-public", "fccl"])
def test_every_phase_equals_the_per_client_step(strategy, extra):
    """Round after round from the same state: every output within 1e-5, every weight within 1e-4
    (Adam divides each gradient by its own running scale, so where a gradient is of the size of
    float rounding, e.g. a convolution channel behind a dead ReLU, a summation-order difference
    moves that weight by a fraction of the learning rate)."""
    per_engine, per_clients, data = _engine(strategy, False, **extra)
    vec_engine, vec_clients, _ = _engine(strategy, True, **extra)
    for r in range(2):
        per_engine.run_round(r)
        vec_engine.run_round(r)
        _assert_close_clients(per_clients, vec_clients, atol=1e-4)
        x = torch.from_numpy(data.public_x[:64])
        for cid in per_clients:  # outputs on the public set, per client
            assert torch.allclose(per_clients[cid].predict(x), vec_clients[cid].predict(x), atol=1e-5, rtol=0)
            per_state, vec_state = per_clients[cid].optimizer.state_dict(), vec_clients[cid].optimizer.state_dict()
            for k, st in per_state["state"].items():
                assert float(st["step"]) == float(vec_state["state"][k]["step"])
                assert torch.allclose(st["exp_avg_sq"], vec_state["state"][k]["exp_avg_sq"], atol=1e-7, rtol=1e-4)
    assert vec_engine.transport.stacked_tasks > 0 and per_engine.transport.stacked_tasks == 0


def test_a_simulation_gives_the_per_client_results():
    per = simulate(_config("fedal", False, rounds=3))
    vec = simulate(_config("fedal", True, rounds=3))
    assert vec["config"]["vectorize"] is True
    # 4 clients (mlp, cnn1d, mlp, cnn1d): two pairs, every task stacked; 3 rounds of 1 + tau tasks each
    tau = vec["config"]["strategy_params"]["tau"]
    assert vec["vectorized"] == {"stacked_tasks": 4 * 3 * (1 + tau), "per_client_tasks": 0, "per_client_reasons": {}}
    for a, b in zip(per["rounds"], vec["rounds"]):
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]
        for x, y in zip(a["client_acc"], b["client_acc"]):
            # at most a few test rows of 400 flip: float summation order (the CPU's kernels) moves
            # a row sitting on a decision boundary
            assert abs(x - y) <= 3 / 400
    for key in ("disc_loss", "disc_acc"):
        assert per["rounds"][-1]["server"][key] == pytest.approx(vec["rounds"][-1]["server"][key], abs=1e-4)
    # the transfer stage's diagnostics, which a group computes for all its clients and
    # iterations in one call on the round's last iteration
    for a, b in zip(per["rounds"], vec["rounds"]):
        for key in ("loss_kd", "gnorm_kd", "gnorm_lf", "gnorm_adv"):
            assert a["server"][key] == pytest.approx(b["server"][key], rel=1e-4, abs=1e-7), key


def test_a_run_in_which_no_group_can_be_stacked_is_the_per_client_run_exactly():
    """Power-law client sizes, a batch of 100: in each architecture's pair the batch sizes differ,
    so every group is refused and every client steps on its own path: the very same numbers."""
    extra = dict(models=["mlp", "cnn1d_wide"], strategy_params={"batch_size": 100}, partition="pow")
    per = simulate(_config("fedproto", False, **extra))
    vec = simulate(_config("fedproto", True, **extra))
    assert without_timings(per)["rounds"] == without_timings(vec)["rounds"]
    # the results say so, and why: 4 clients x 2 rounds, none stacked
    assert "vectorized" not in per
    assert vec["vectorized"] == {"stacked_tasks": 0, "per_client_tasks": 8, "per_client_reasons": {
        "the clients' batches differ in size (or are empty)": 8}}


def test_every_strategy_has_a_group_step():
    from fedal.strategies import GROUP_STEPS, STRATEGIES

    assert {spec.client for spec in STRATEGIES.values()} <= set(GROUP_STEPS)


def test_a_group_that_cannot_be_stacked_runs_client_by_client():
    """Power-law client sizes with a batch of 100: clients below 100 rows take smaller batches,
    so their group is not stacked; the one mlp pair that shares a batch size still is."""
    extra = dict(partition="pow", samples_per_client=120, strategy_params={"batch_size": 100})
    engine, clients, _ = _engine("fedal", True, **extra)
    per_engine, per_clients, _ = _engine("fedal", False, **extra)
    assert sorted(len(c.y_train) for c in clients.values()) == [57, 76, 116, 231]
    engine.run_round(0)
    per_engine.run_round(0)
    _assert_close_clients(per_clients, clients, atol=1e-5)
    # local training ran client by client (batch sizes differ in both architecture groups); the
    # transfer iterations, on public batches of one size, were stacked
    tau = clients["c00"].params.tau
    assert engine.transport.stacked_tasks == 4 * tau


def test_stacking_refuses_what_it_cannot_do():
    from fedal.models import build_model
    from fedal.strategies import optim

    a, b = build_model("mlp", (40,), 10), build_model("cnn1d", (40,), 10)
    with pytest.raises(NotStackable, match="architecture"):
        StackedModels([a, b], [optim.Adam(a.parameters()), optim.Adam(b.parameters())])
    c = build_model("mlp", (40,), 10)
    with pytest.raises(NotStackable, match="Adam"):
        StackedModels([a, c], [optim.Adam(a.parameters()), optim.SGD(c.parameters(), lr=0.1)])
    with pytest.raises(NotStackable, match="settings"):
        StackedModels([a, c], [optim.Adam(a.parameters(), lr=1e-3), optim.Adam(c.parameters(), lr=1e-2)])


def test_a_deployment_refuses_vectorize(tmp_path):
    from coordinator.config import CoordinatorConfig, RunSpec
    from coordinator.run import Run

    with pytest.raises(ValueError, match="each client is a device"):
        CoordinatorConfig(run_id="r", client_ids=["a", "b"], state_dir=tmp_path,
                          run={"strategy": "fedal", "dataset": "digits", "vectorize": True})
    with pytest.raises(ValueError, match="each client is a device"):
        RunSpec(run_id="r", client_ids=["a", "b"], run={"strategy": "fedal", "vectorize": True})
    with pytest.raises(ValueError, match="each client is a device"):
        RunSpec(run_id="r", client_ids=["a", "b"], run={"strategy": "fedal", "backend": "ray"})
    cfg = CoordinatorConfig(run_id="r", client_ids=["a", "b"], state_dir=tmp_path, run={"strategy": "fedal"})
    cfg.run.vectorize = True
    with pytest.raises(ValueError, match="each client is a device"):
        Run(cfg)


def test_simulate_cli_takes_vectorize(tmp_path):
    from click.testing import CliRunner

    from fedal_cli.main import cli

    out = tmp_path / "r.json"
    result = CliRunner().invoke(cli, ["simulate", "--strategy", "fedmd", "--clients", "4", "--rounds", "1",
                                      "--vectorize", "--mnist1d-samples", "1000", "--public-size", "200", "--out", str(out)])
    assert result.exit_code == 0, result.output
    import json

    assert json.loads(out.read_text())["config"]["vectorize"] is True
    # 4 clients of the default zoo (mlp, cnn1d, cnn1d_wide): the mlp pair stacked, two alone
    import re

    found = re.search(r"vectorized: (\d+) of (\d+) client tasks stacked, (\d+) client by client \(a group of one",
                      result.output)
    assert found, result.output
    stacked, total, alone = map(int, found.groups())
    assert stacked == alone and stacked + alone == total


@pytest.mark.parametrize("name,shape", [("mlp", (40,)), ("cnn1d", (40,)), ("cnn1d_wide", (43,)), ("cnn1d", (1, 21)),
                                        ("lenet5", (1, 28, 28))])
def test_the_stacked_forward_is_each_models_forward(name, shape):
    """Hand-stacked layers (linear, 1-D convolution, pooling with a dropped tail) and the vmap
    fallback (2-D convolutions): outputs and every weight's gradient as the models' own."""
    from fedal.models import build_model
    from fedal.models.stacked import has_fast_path, stacked_function

    torch.manual_seed(0)
    models = [build_model(name, shape, 10) for _ in range(3)]
    assert has_fast_path(models[0]) == (name != "lenet5")
    x = torch.randn(3, 5, *shape)
    params = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]).requires_grad_()
              for n, _ in models[0].named_parameters()}
    out = stacked_function(models[0])(params, x)
    own = torch.stack([m(x[k]) for k, m in enumerate(models)])
    assert torch.allclose(out, own, atol=1e-6, rtol=0)
    weights = torch.randn_like(own)
    (out * weights).sum().backward()
    (own * weights).sum().backward()
    for n, stacked in params.items():
        for k, m in enumerate(models):
            assert torch.allclose(stacked.grad[k], dict(m.named_parameters())[n].grad, atol=1e-5, rtol=0), (n, k)
    # the two halves alone (FedProto's steps): features, and the head on them
    with torch.no_grad():
        # without a gradient to keep (references, evaluation) pooling takes another way: same numbers
        assert torch.equal(stacked_function(models[0])(params, x), out.detach())
        h = stacked_function(models[0], "features")(params, x)
        assert torch.allclose(h, torch.stack([m.features(x[k]) for k, m in enumerate(models)]), atol=1e-6, rtol=0)
        assert torch.allclose(stacked_function(models[0], "head")(params, h), own, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="part"):
        stacked_function(models[0], "backbone")


def test_stacked_references_are_restacked_when_a_reference_changes():
    """A group's stacked references (`frozen`) are reused while their modules are the same and
    untouched; another module, or weights written into one (a snapshot, a checkpoint load), make a
    new stack of the current weights."""
    from fedal.models import build_model
    from fedal.strategies import optim
    from fedal.strategies.frozen import frozen_copy

    torch.manual_seed(0)
    models = [build_model("mlp", (40,), 10) for _ in range(3)]
    stack = StackedModels(models, [optim.Adam(m.parameters(), lr=1e-3) for m in models])
    refs = [frozen_copy(m) for m in models]
    first = stack.frozen("ref", refs)
    assert stack.frozen("ref", refs) is first  # untouched: the same stack
    name = stack.names[0]
    assert torch.equal(first[name][1], dict(refs[1].named_parameters())[name])

    with torch.no_grad():
        models[1].get_parameter(name).add_(1.0)
    frozen_copy(models[1], into=refs[1])  # a new snapshot, copied in place
    second = stack.frozen("ref", refs)
    assert second is not first and torch.equal(second[name][1], models[1].get_parameter(name))

    refs[2].load_state_dict(models[1].state_dict())  # a checkpoint load
    third = stack.frozen("ref", refs)
    assert third is not second and torch.equal(third[name][2], models[1].get_parameter(name))

    other = [refs[0], refs[1], frozen_copy(models[0])]  # another module
    fourth = stack.frozen("ref", other)
    assert fourth is not third and torch.equal(fourth[name][2], models[0].get_parameter(name))
    stack.release_frozen("ref")
    assert stack.frozen("ref", other) is not fourth


def test_a_group_keeps_its_stack_until_a_client_changes_on_its_own():
    engine, clients, _ = _engine("fedal", True)
    engine.run_round(0)
    mlps = [c for c in clients.values() if type(c.model).__name__ == "MLP"]
    stack = mlps[0].group
    assert stack is not None and all(c.group is stack for c in mlps)
    assert stack.current([c.model for c in mlps], [c.optimizer for c in mlps])
    with torch.no_grad():  # a client's weights change outside the group (a checkpoint load, a step of its own)
        next(mlps[0].model.parameters()).add_(1.0)
    assert not stack.current([c.model for c in mlps], [c.optimizer for c in mlps])
    per_engine, per_clients, _ = _engine("fedal", False)
    per_engine.run_round(0)
    with torch.no_grad():
        next(per_clients[mlps[0].client_id].model.parameters()).add_(1.0)
    engine.run_round(1)
    per_engine.run_round(1)
    assert mlps[0].group is not stack  # restacked from the clients' own tensors
    _assert_close_clients(per_clients, clients, atol=1e-5)


def test_a_simulation_stacks_by_default_and_no_vectorize_runs_per_client(tmp_path):
    import json

    from click.testing import CliRunner

    from fedal_cli.main import cli

    default = _config("fedal", None)
    assert default.vectorize is None and default.vectorized
    engine, _, _ = _engine("fedal", None)
    engine.run_round(0)
    assert engine.transport.stacked_tasks > 0
    out = tmp_path / "r.json"
    args = ["simulate", "--strategy", "fedal", "--clients", "3", "--rounds", "1", "--mnist1d-samples", "1000",
            "--public-size", "200", "--out", str(out)]
    assert CliRunner().invoke(cli, args).exit_code == 0
    assert json.loads(out.read_text())["config"]["vectorize"] is True  # the results say which path ran
    result = CliRunner().invoke(cli, [*args, "--no-vectorize"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["config"]["vectorize"] is False


def test_a_layer_out_of_place_takes_the_vmap_path_with_the_same_numbers():
    """A linear layer on a convolution's [B, C, L] output (no Flatten between) is not what the
    channels-last stacked forms compute: such a model runs under vmap, and its numbers are right."""
    from torch import nn

    from fedal.models.base import SplitModel
    from fedal.models.cnn1d import _AsChannels
    from fedal.models.stacked import has_fast_path, stacked_function

    torch.manual_seed(1)
    models = [SplitModel(nn.Sequential(_AsChannels(), nn.Conv1d(1, 4, 3, padding=1), nn.Linear(12, 5), nn.Flatten(1)),
                         nn.Linear(20, 3), feature_dim=20, num_classes=3, input_shape=(12,)) for _ in range(2)]
    assert not has_fast_path(models[0])
    x = torch.randn(2, 4, 12)
    params = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]) for n, _ in models[0].named_parameters()}
    own = torch.stack([m(x[k]) for k, m in enumerate(models)])
    assert torch.allclose(stacked_function(models[0])(params, x), own, atol=1e-6, rtol=0)


def _state(clients):
    return [([p.detach().clone() for p in c.model.parameters()], c.generator.get_state()) for c in clients]


def _assert_same_state(a, b):
    for (pa, ga), (pb, gb) in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(pa, pb)) and torch.equal(ga, gb)


def test_fedavg_and_feddf_groups_refuse_weights_that_do_not_fit_and_change_nothing():
    """A task the client itself would refuse is handed back (NotStackable) before any client
    changed, so each client refuses it on its own path, as without vectorize."""
    from fedal.protocol import Message
    from fedal.strategies.fedavg import model_to_numpy
    from fedal.strategies.feddf import WEIGHTS
    from fedal.strategies.stacked_fedal import handle_feddf_group
    from fedal.strategies.stacked_fedavg import handle_fedavg_group

    engine, clients, _ = _engine("fedavg", True, models=["mlp"])
    engine.run_round(0)
    cs = list(clients.values())
    good = model_to_numpy(cs[0].model)
    missing = dict(good)
    missing.pop(next(iter(missing)))
    meta = {"phase": "train", "round": 1, "iteration": 0, "steps": 2}
    before = _state(cs)
    with pytest.raises(NotStackable, match="do not match"):
        handle_fedavg_group(cs, [Message(meta, good), Message(meta, missing), Message(meta, good), Message(meta, good)])
    _assert_same_state(before, _state(cs))
    assert handle_fedavg_group(cs, [Message(meta, good)] * 4)[0].meta["num_samples"] == 120

    engine, clients, _ = _engine("feddf", True, models=["mlp"], strategy_params={"tau": 2})
    engine.run_round(0)
    cs = list(clients.values())
    weights = {WEIGHTS + k: v for k, v in model_to_numpy(cs[0].model).items()}
    bad = {k: v[:1] if k.endswith("weight") else v for k, v in weights.items()}
    meta = {"phase": "local_train", "round": 1, "iteration": 0, "steps": 2}
    before = _state(cs)
    with pytest.raises(NotStackable, match="shapes"):
        handle_feddf_group(cs, [Message(meta, weights)] * 3 + [Message(meta, bad)])
    _assert_same_state(before, _state(cs))


def test_fedavg_clients_with_different_data_sizes_under_local_epochs_run_client_by_client():
    """With local_epochs a client's step count follows its data size: a group of different sizes
    is not stacked, and the run is the per-client one."""
    extra = dict(models=["mlp"], partition="pow", strategy_params={"local_epochs": 1})
    per = simulate(_config("fedavg", False, **extra))
    vec = simulate(_config("fedavg", True, **extra))
    assert without_timings(per)["rounds"] == without_timings(vec)["rounds"]


@pytest.mark.parametrize("strategy", ["fd", "fedavg", "feddf", "fedproto", "fedakd", "fedhkd", "cfd", "fedproto-public",
                                      "fccl"])
def test_stacked_strategies_report_the_per_client_numbers(strategy):
    """What the results say (losses, accuracies, bytes) and what FD uploads (per-label means,
    counts: the next round's teachers), with and without stacking."""
    extra = {"models": ["mlp"]} if strategy in ("fedavg", "fedakd", "fedhkd") else {"models": ["mlp", "cnn1d_wide"]}
    if strategy == "fccl":
        extra["strategy_params"] = {"fccl_pretrain_epochs": 2}
    if strategy == "fd":
        extra["strategy_params"] = {"tau": 10}  # not its 250 steps a round: float summation orders drift apart
    per = simulate(_config(strategy, False, rounds=3, **extra))
    vec = simulate(_config(strategy, True, rounds=3, **extra))
    for a, b in zip(per["rounds"], vec["rounds"]):
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]
        for x, y in zip(a["client_acc"], b["client_acc"]):
            assert abs(x - y) <= 1 / 400 + 1e-12  # at most one test row of 400 flips
        assert a["server"]["local_loss"] == pytest.approx(b["server"]["local_loss"], abs=1e-4)


def test_stacked_clipping_clips_each_client_as_its_own_model_would():
    """StackedModels.step(clip_norm): each client's gradient clipped over all its parameters, as
    clip_grad_norm_ clips one model's (FedHKD's official preset), then Adam."""
    from fedal.models import build_model
    from fedal.strategies import optim

    torch.manual_seed(0)
    models = [build_model("mlp", (40,), 10) for _ in range(3)]
    twins = [build_model("mlp", (40,), 10) for _ in range(3)]
    for m, t in zip(models, twins):
        t.load_state_dict(m.state_dict())
    x, y = torch.randn(3, 8, 40), torch.randint(0, 10, (3, 8))
    scale = torch.tensor([0.01, 1.0, 100.0])  # one client below the norm, two far above it
    # eps far above the gradients: Adam's step is then proportional to the (clipped) gradient
    stack = StackedModels(models, [optim.Adam(m.parameters(), lr=1e-2, eps=10.0) for m in models])
    out = stack.forward(stack.params, x)
    per = torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(3, 8).mean(1)
    stack.step((per * scale).sum(), clip_norm=0.5)
    stack.write_back()
    for k, t in enumerate(twins):
        opt = optim.Adam(t.parameters(), lr=1e-2, eps=10.0)
        (torch.nn.functional.cross_entropy(t(x[k]), y[k]) * scale[k]).backward()
        norm = torch.nn.utils.clip_grad_norm_(t.parameters(), max_norm=0.5)
        assert (norm > 0.5) == (k > 0)
        opt.step()
        for p, q in zip(models[k].parameters(), t.parameters()):
            assert torch.allclose(p, q, atol=1e-6, rtol=0)


def test_stacked_clipping_takes_broadcast_and_shared_gradients_as_they_are():
    """Autograd hands some gradients out as broadcast (stride-0) views, or one tensor for two
    parameters: clipping scales them out of place, each once. Adam's first step is then
    -lr * g / (|g| + eps) per element, computed here by hand."""
    from fedal.models import build_model
    from fedal.strategies import optim

    torch.manual_seed(0)
    models = [build_model("mlp", (40,), 10) for _ in range(3)]
    stack = StackedModels(models, [optim.Adam(m.parameters(), lr=1e-2, eps=10.0) for m in models])
    b1, b3, head_bias = (stack.params[n] for n in ("backbone.1.bias", "backbone.3.bias", "classifier.bias"))
    before = {n: v.detach().clone() for n, v in stack.params.items()}
    scale = torch.tensor([0.01, 1.0, 100.0])
    # b1 and b3 get one gradient tensor (the add's), the head's bias a broadcast view of ones
    stack.step(((b1 + b3) * scale[:, None]).sum() + head_bias.sum(), clip_norm=0.5)
    g_hidden, g_head = scale[:, None].expand(3, 100), torch.ones(3, 10)
    coef = (0.5 / (torch.cat([g_hidden, g_hidden, g_head], dim=1).norm(dim=1) + 1e-6)).clamp(max=1.0)[:, None]
    for name, g in (("backbone.1.bias", g_hidden), ("backbone.3.bias", g_hidden), ("classifier.bias", g_head)):
        g = g * coef
        torch.testing.assert_close(stack.params[name].detach(), before[name] - 1e-2 * g / (g.abs() + 10.0),
                                   atol=1e-7, rtol=1e-5)
    assert torch.equal(stack.params["backbone.1.weight"], before["backbone.1.weight"])  # no gradient: not stepped


def test_stacked_adam_steps_equal_each_client_adam_and_skip_parameters_without_gradient():
    """StackedModels.step hands autograd's gradients to Adam's fused kernel itself: over several
    steps every client's weights and moments are its own torch Adam's (weight decay and maximize
    included), and a parameter the loss does not reach (here the head) is not stepped and gets no
    state, as torch's Adam leaves it."""
    from fedal.models import build_model
    from fedal.strategies import optim

    torch.manual_seed(1)
    settings = dict(lr=3e-2, betas=(0.8, 0.99), weight_decay=0.1, maximize=True)
    models = [build_model("cnn1d", (40,), 10) for _ in range(3)]
    twins = [build_model("cnn1d", (40,), 10) for _ in range(3)]
    for m, t in zip(models, twins):
        t.load_state_dict(m.state_dict())
    stack = StackedModels(models, [optim.Adam(m.parameters(), **settings) for m in models])
    x = torch.randn(3, 8, 40)
    for _ in range(4):
        stack.step(stack.features(stack.params, x).square().mean(dim=(1, 2)).sum())
    stack.write_back()
    for k, (m, t) in enumerate(zip(models, twins)):
        opt = optim.Adam(t.parameters(), **settings)
        for _ in range(4):
            opt.zero_grad()
            t.features(x[k]).square().mean().backward()
            opt.step()
        mine = stack.optimizers[k]
        for (name, p), q in zip(m.named_parameters(), t.parameters()):
            assert torch.allclose(p, q, atol=1e-6, rtol=0), name
            if name.startswith("classifier"):
                assert torch.equal(p, q) and not mine.state.get(p) and not opt.state.get(q)
            else:
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.allclose(mine.state[p][key], opt.state[q][key], atol=1e-6, rtol=0), (name, key)
                assert float(mine.state[p]["step"]) == float(opt.state[q]["step"]) == 4.0


def test_fccl_plus_steps_equal_the_per_client_steps():
    """FCCL+ task by task (local update, uploads, collaborative steps with the averages, the
    local update after the last one), from an Adam warmed by a local update. A run's own first
    step is a collaborative one, whose loss does not depend on the head's bias (the logits are
    normalised along the batch): that gradient is float rounding on either path, and a fresh
    Adam's first step (the sign of one gradient) turns it into a move of up to the learning rate,
    which is why this compares from a warmed state, not a whole run."""
    import numpy as np

    from fedal.protocol import Message
    from fedal.strategies.fccl import S_KEY, SBAR_KEY, Z_KEY, ZBAR_KEY
    from fedal.strategies.stacked_fccl import handle_fccl_group

    _, per, _ = _engine("fccl-plus", False, models=["mlp"], strategy_params={"tau": 2})
    _, vec, _ = _engine("fccl-plus", True, models=["mlp"], strategy_params={"tau": 2})
    per_c, vec_c = list(per.values()), list(vec.values())

    def both(task: Message) -> list[Message]:
        a = [c.handle(task) for c in per_c]
        b = handle_fccl_group(vec_c, [task] * len(vec_c))
        for x, y in zip(a, b):
            assert set(x.tensors) == set(y.tensors)
            for key in x.tensors:
                assert np.allclose(x.tensors[key], y.tensors[key], atol=1e-5), (task.phase, key)
            for key, value in x.meta.items():
                assert y.meta[key] == pytest.approx(value, abs=1e-5, nan_ok=True), (task.phase, key)
        _assert_close_clients(per, vec, atol=1e-5)
        return a

    def average(results: list[Message]) -> dict:
        return {ZBAR_KEY: np.mean([r.tensors[Z_KEY] for r in results], axis=0).astype(np.float32),
                SBAR_KEY: np.mean([r.tensors[S_KEY] for r in results], axis=0).astype(np.float32)}

    both(Message({"phase": "local_train", "round": 0, "iteration": 0, "steps": 3}))  # warms Adam
    uploads = both(Message({"phase": "collaborate", "round": 1, "iteration": 0}))
    uploads = both(Message({"phase": "collaborate", "round": 1, "iteration": 1}, average(uploads)))
    done = both(Message({"phase": "local_train", "round": 1, "iteration": 0, "steps": 3}, average(uploads)))
    assert all(np.isfinite(r.meta["loss_isl"]) for r in done)  # the collaborative steps were taken


@pytest.mark.parametrize("strategy", ["fedal", "fedproto-public", "fccl-plus"])
def test_groups_past_the_kept_rows_recompute_their_upload_and_hold_no_gradients_between_steps(strategy,
                                                                                               monkeypatch):
    """Past MAX_KEPT_ROWS public rows over all groups, a group does not keep its upload's graph
    until the feedback (at N = 1000 every group's would): the feedback step recomputes that forward
    from the same weights, so the run is the very same. Between steps a group holds no gradients."""
    import fedal.strategies.stacked as stacked

    extra = {"models": ["mlp", "cnn1d_wide"]} if strategy == "fedproto-public" else {}
    taken: list[bool] = []
    take = StackedModels.take_upload

    def spy(self, *args):
        kept = take(self, *args)
        taken.append(kept is not None)
        return kept

    monkeypatch.setattr(StackedModels, "take_upload", spy)
    kept = simulate(_config(strategy, True, **extra))
    assert any(taken)  # small groups: feedback steps go through the kept forward
    taken.clear()
    monkeypatch.setattr(stacked, "MAX_KEPT_ROWS", 0)
    engine, clients, _ = _engine(strategy, True, **extra)
    for r in range(2):
        engine.run_round(r)
        groups = {id(c.group): c.group for c in clients.values() if c.group is not None}
        assert groups and all(t.grad is None for g in groups.values() for t in g.params.values())
    assert taken and not any(taken)  # nothing kept: every feedback step recomputed its forward
    recomputed = simulate(_config(strategy, True, **extra))
    assert without_timings(recomputed)["rounds"] == without_timings(kept)["rounds"]
    assert recomputed["vectorized"] == kept["vectorized"] and kept["vectorized"]["stacked_tasks"] > 0


def test_a_large_architecture_group_steps_in_parts_of_at_most_max_group(monkeypatch):
    """Clients of one architecture stack in parts of at most MAX_GROUP (past the CPU's caches a
    larger stack runs at memory speed), as equal in size as can be: each part steps as the
    per-client path does, and every task is still stacked."""
    import fedal.engine.inprocess as inprocess

    monkeypatch.setattr(inprocess, "MAX_GROUP", 3)
    assert inprocess.group_parts(list(range(7))) == [[0, 1], [2, 3], [4, 5, 6]]
    assert inprocess.group_parts(list(range(3))) == [[0, 1, 2]]
    extra = {"clients": 8, "models": ["mlp", "cnn1d"]}  # two architectures of 4 clients: parts of 2
    per_engine, per_clients, _ = _engine("fedal", False, **extra)
    vec_engine, vec_clients, _ = _engine("fedal", True, **extra)
    sizes: list[int] = []
    of = StackedModels.of

    def spy(clients):
        sizes.append(len(clients))
        return of(clients)

    monkeypatch.setattr(StackedModels, "of", staticmethod(spy))
    for r in range(2):
        per_engine.run_round(r)
        vec_engine.run_round(r)
        _assert_close_clients(per_clients, vec_clients, atol=1e-4)
    assert sizes and set(sizes) == {2}
    stacking = vec_engine.transport.stacking.summary()
    assert stacking["per_client_tasks"] == 0 and stacking["stacked_tasks"] > 0


def test_a_relu_before_max_pooling_runs_after_it_with_the_same_values_and_gradients():
    """The stacked plan pools before the ReLU that precedes a max-pooling (fewer elements): max and
    ReLU commute, values and gradients exactly, ties, zeros and all-negative windows included."""
    import torch.nn.functional as F

    from fedal.models import build_model
    from fedal.models.stacked import _model_plan, _pool, _relu

    model = build_model("cnn1d", (40,), 10)
    layers = {f"backbone.{n}": type(m).__name__ for n, m in model.backbone.named_children()}
    order = [layers.get(key, key) for _, key, _ in _model_plan(model)]
    # the model: conv, ReLU, pool, conv, ReLU, pool; the plan pools before each of those ReLUs
    assert order[1:7] == ["Conv1d", "MaxPool1d", "ReLU", "Conv1d", "MaxPool1d", "ReLU"]
    assert [op is _relu for op, _, _ in _model_plan(model)][1:7] == [False, False, True, False, False, True]
    torch.manual_seed(0)
    h = torch.randn(2, 3, 12, 4).round(decimals=0)  # many ties and zeros
    h[0, 0, :4] = -1.0  # a window of negatives only
    for size in (2, 4):
        a = h.clone().requires_grad_()
        b = h.clone().requires_grad_()
        relu_first = _pool(F.relu(a), size)
        pool_first = F.relu(_pool(b, size))
        assert torch.equal(relu_first, pool_first)
        g = torch.randn_like(relu_first)
        relu_first.backward(g)
        pool_first.backward(g)
        assert torch.equal(a.grad, b.grad)


def test_a_fedal_feedback_for_other_public_rows_than_uploaded_runs_client_by_client():
    """The group's feedback step uses the rows the clients uploaded; where one client's upload
    was of other rows (another rows setting before a restore) the group is refused, unchanged."""
    from fedal.strategies.stacked_fedal import handle_group

    config = _config("fedal", True, models=["mlp"])
    _, clients, server = build_run(config)
    group = list(clients.values())
    phase = server.begin_round(0)
    results = {cid: r for cid, r in zip(phase.tasks, handle_group(group, list(phase.tasks.values())))}
    for cid, res in results.items():
        server.validate(phase, cid, res)
    phase = server.collect(phase, results)
    assert phase.phase == "transfer"
    moved = group[1].pending["indices"]
    group[1].pending["indices"] = moved.flip(0)
    before = [{n: p.detach().clone() for n, p in c.model.named_parameters()} for c in group]
    with pytest.raises(NotStackable, match="other public rows"):
        handle_group(group, list(phase.tasks.values()))
    for c, was in zip(group, before):
        assert all(torch.equal(p, was[n]) for n, p in c.model.named_parameters())
    group[1].pending["indices"] = moved
    assert len(handle_group(group, list(phase.tasks.values()))) == len(group)
