"""Differentially private training (fedal/privacy/): the DP-SGD step against per-sample clipping
by hand, the accountant against an independent one, the budget, seeded noise, checkpoints, the
settings, and what reaches the results."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedal.privacy import (
    PrivacyAccountant,
    PrivacyBudgetExhausted,
    PrivacyParams,
    PrivacyUnavailable,
    PrivateTraining,
    dp_compatible,
)
from fedal.protocol import Message
from fedal.sim import load_config, simulate
from fedal.sim.config import ConfigError
from fedal.strategies.training import minibatch_steps
from tests.helpers import TinyNet, per_client, toy_dataset, toy_federation

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _by_hand(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, clip: float,
             expected_batch: float) -> list[torch.Tensor]:
    """Sum over the batch of each sample's gradient, clipped to `clip` in L2 over all parameters,
    over the expected batch size: DP-SGD's gradient without noise, one sample at a time."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for i in idx.tolist():
        grads = torch.autograd.grad(F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]), params)
        norm = torch.sqrt(sum((g**2).sum() for g in grads))
        scale = min(1.0, clip / (float(norm) + 1e-6))
        total = [t + scale * g for t, g in zip(total, grads)]
    return [t / expected_batch for t in total]


@pytest.mark.parametrize("clip", [0.05, 1.0, 100.0])  # every sample clipped, some, none
def test_a_dp_step_without_noise_is_per_sample_clipping_by_hand(clip):
    data = toy_dataset(n=60, seed=3)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    torch.manual_seed(0)
    model = TinyNet()
    reference = copy.deepcopy(model)
    private = PrivateTraining(PrivacyParams(noise_multiplier=0.0, max_grad_norm=clip), n=60, batch_size=12, seed=5)
    idx = PrivateTraining(private.params, n=60, batch_size=12, seed=5).batches(1)[0]  # the batch it will draw
    assert 0 < len(idx) < 60
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    minibatch_steps(model, optimizer, private.batches(1), lambda i: (F.cross_entropy(model(x[i]), y[i]), {}),
                    private=private)
    want = _by_hand(reference, x, y, idx, clip, private.expected_batch)
    for before, after, g in zip(reference.parameters(), model.parameters(), want):
        torch.testing.assert_close(before.detach() - after.detach(), g, atol=1e-6, rtol=1e-5)
    assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in model.parameters())
    assert all(len(m._forward_hooks) == 0 and len(m._backward_hooks) == 0 for m in model.modules())  # left as it was


def test_noise_is_the_documented_gaussian_and_seeded():
    """With a zero loss the step is noise alone: std sigma * C / (q n), the same for the same seed."""
    params = PrivacyParams(noise_multiplier=2.0, max_grad_norm=0.5)

    def noise_step(seed: int) -> torch.Tensor:
        model = torch.nn.Linear(400, 50, bias=False)
        torch.nn.init.zeros_(model.weight)
        private = PrivateTraining(params, n=100, batch_size=10, seed=seed)
        x = torch.zeros(100, 400)
        minibatch_steps(model, torch.optim.SGD(model.parameters(), lr=1.0), private.batches(1),
                        lambda i: ((model(x[i]) ** 2).mean() * 0, {}), private=private)
        return -model.weight.detach()

    a, b, c = noise_step(1), noise_step(1), noise_step(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(float(a.std()) - 2.0 * 0.5 / 10.0) < 0.003  # 20 000 draws
    assert abs(float(a.mean())) < 0.003


@pytest.mark.parametrize("q, sigma, steps, delta", [(0.05, 1.1, 100, 1e-5), (0.01, 0.8, 1000, 1e-5),
                                                    (0.2, 2.0, 30, 1e-6), (1.0, 4.0, 10, 1e-5)])
def test_the_accountant_agrees_with_an_independent_one(q, sigma, steps, delta):
    """Google's dp_accounting, at the same RDP orders: equal up to its own numerics."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant
    from opacus.accountants import RDPAccountant

    ours = PrivacyAccountant("rdp")
    ours.step(sigma, q, steps)
    reference = rdp_privacy_accountant.RdpAccountant(orders=RDPAccountant.DEFAULT_ALPHAS)
    reference.compose(dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps))
    assert ours.steps == steps
    assert ours.epsilon(delta) == pytest.approx(reference.get_epsilon(delta), rel=1e-3)


def test_the_accountant_of_the_plain_gaussian_mechanism_is_the_closed_form():
    """q = 1: T steps of noise sigma have RDP T a / (2 sigma^2); Opacus converts with
    eps = min_a rdp(a) + log((a-1)/a) - (log delta + log a) / (a - 1) (Balle et al. 2020)."""
    from opacus.accountants import RDPAccountant

    sigma, steps, delta = 3.0, 20, 1e-5
    accountant = PrivacyAccountant()
    accountant.step(sigma, 1.0, steps)
    closed = min(steps * a / (2 * sigma**2) + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1)
                 for a in RDPAccountant.DEFAULT_ALPHAS)
    assert accountant.epsilon(delta) == pytest.approx(closed, rel=1e-9)

def test_the_remembered_rdp_gives_opacus_epsilon_to_the_bit():
    """The per-step RDP is computed once per (sample rate, noise) and scaled by the steps: every
    ledger's epsilon is still exactly what Opacus's own accountant says for that history, asked
    again or asked first (mixed entries, q = 1 releases, repeated entries)."""
    from opacus.accountants import RDPAccountant

    rng = np.random.default_rng(7)
    for _ in range(40):
        ours = PrivacyAccountant("rdp")
        for _ in range(int(rng.integers(1, 4))):
            sigma = float(rng.choice([0.7, 1.1, float(rng.uniform(0.4, 5.0))]))
            q = float(rng.choice([1.0, 0.02, float(rng.uniform(0.001, 0.5))]))
            ours.step(sigma, q, int(rng.integers(1, 3000)))
        opacus = RDPAccountant()
        opacus.history = list(ours._accountant.history)
        delta = float(rng.choice([1e-5, 1e-6]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus: the optimal order is an end of its range
            assert ours.epsilon(delta) == float(opacus.get_epsilon(delta=delta))
            assert ours.epsilon(delta) == float(opacus.get_epsilon(delta=delta))  # asked again: remembered



def test_the_budget_refuses_steps_before_taking_any():
    private = PrivateTraining(PrivacyParams(noise_multiplier=1.0, epsilon_budget=4.0), n=300, batch_size=32, seed=0)
    model = TinyNet(d_in=6)
    x, y = torch.zeros(300, 6), torch.zeros(300, dtype=torch.long)
    taken = 0
    with pytest.raises(PrivacyBudgetExhausted, match="epsilon_budget 4"):
        while True:
            private.check_budget(5)
            minibatch_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), private.batches(5),
                            lambda i: (F.cross_entropy(model(x[i]), y[i]), {}), private=private)
            taken += 5
    assert taken > 0 and private.accountant.steps == taken and private.refused_steps == 5
    assert private.epsilon() <= 4.0 < private.accountant.epsilon_after(1.0, private.sample_rate, 5, 1e-5)


def test_fedal_trains_privately_only_on_its_private_data_and_reports_epsilon_not_loss():
    privacy = {"noise_multiplier": 1.0, "max_grad_norm": 1.0}
    server, clients, params = toy_federation("fedal", tau=3, privacy=privacy)
    client = clients["c0"]
    assert client.private is not None and client.private.sample_rate == pytest.approx(32 / 40)
    phase = server.begin_round(0)
    result = client.handle(Message({**phase.tasks["c0"].meta}))
    assert client.private.accountant.steps == 3  # stage 1: tau DP-SGD steps
    assert "loss" not in result.meta and result.meta["dp_exhausted"] is False
    assert result.meta["epsilon"] == pytest.approx(client.private.epsilon()) and result.meta["epsilon"] > 0
    results = {cid: c.handle(Message({**phase.tasks[cid].meta})) for cid, c in clients.items() if cid != "c0"}
    transfer = server.collect(phase, {"c0": result, **results})
    client.handle(transfer.tasks["c0"])
    assert client.private.accountant.steps == 3  # stage 2 is on the public set: post-processing, no cost


def test_the_privacy_state_is_checkpointed_with_the_client():
    _, clients, _ = toy_federation("fedal", tau=2, privacy={"noise_multiplier": 0.7})
    a = clients["c0"]
    a.local_steps(4)
    state = copy.deepcopy(a.state_dict())
    _, again, _ = toy_federation("fedal", tau=2, privacy={"noise_multiplier": 0.7})
    b = again["c0"]
    b.load_state_dict(state)
    assert b.private.accountant.steps == 4 and b.private.epsilon() == a.private.epsilon()
    a.local_steps(2)
    b.local_steps(2)  # the same sampling and noise from here on
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    _, plain, _ = toy_federation("fedal", tau=2)
    with pytest.raises(ValueError, match="without differential privacy"):
        b.load_state_dict(plain["c0"].state_dict())


def test_batchnorm_models_get_a_groupnorm_variant_with_a_message(caplog):
    from fedal.models import build_model

    model = build_model("wrn10_1", (3, 32, 32), 10)
    assert any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    with caplog.at_level(logging.WARNING, logger="fedal.privacy"):
        fixed = dp_compatible(model, "c3's model")
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in fixed.modules())
    assert any(isinstance(m, torch.nn.GroupNorm) for m in fixed.modules())
    assert "c3's model" in caplog.text and "GroupNorm" in caplog.text
    assert fixed(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    mlp = build_model("mlp", (40,), 10)
    assert dp_compatible(mlp) is mlp


@contextlib.contextmanager
def monkeypatch_item(mapping, key, value):
    old = mapping[key]
    mapping[key] = value
    try:
        yield
    finally:
        mapping[key] = old


def _dp_config(**extra):
    base = dict(strategy="fedal", dataset="mnist1d", clients=3, samples_per_client=120, public_size=100, rounds=3,
                tau=2, seed=2, mnist1d_samples=1000, models=["mlp"])
    return load_config(None, {**base, **extra})


def test_a_client_over_its_budget_stops_training_privately_and_the_run_finishes():
    results = simulate(_dp_config(dp_noise_multiplier=1.0, dp_epsilon_budget=5.0))
    privacy = results["privacy"]
    assert privacy["rounds"] == [1, 2, 3] and len(results["rounds"]) == 3 and "mean_acc" in results["final"]
    assert sorted(privacy["exhausted"]) == ["c00", "c01", "c02"]  # each stops before going past 5
    for eps in privacy["epsilon"].values():
        assert eps[0] > 0 and all(e <= 5.0 for e in eps) and eps == sorted(eps)
        assert eps[-1] == eps[-2]  # nothing spent once stopped
    assert privacy["max_epsilon"] == max(privacy["final_epsilon"].values()) <= 5.0
    # the others' phases still close with every client: it goes on sharing its (private) model's logits
    assert all(p["participation"] == 1.0 for r in results["rounds"] for p in r["phases"].values())


def test_the_same_seed_gives_the_same_private_run_and_noise_changes_it():
    a = simulate(_dp_config(dp_noise_multiplier=0.8, rounds=2))
    b = simulate(_dp_config(dp_noise_multiplier=0.8, rounds=2))
    c = simulate(_dp_config(dp_noise_multiplier=0.8, rounds=2, seed=3))
    assert a["final"] == b["final"] and a["privacy"] == b["privacy"]
    assert a["final"]["client_acc"] != c["final"]["client_acc"]
    assert a["config"]["strategy_params"]["privacy"]["noise_multiplier"] == 0.8  # saved with the results


def test_privacy_settings_from_the_config_file_and_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "fedmd"\n[privacy]\nnoise_multiplier = 1.3\ndelta = 1e-6\n')
    config = load_config(path, {"dp_max_grad_norm": 0.5, "dp_epsilon_budget": 8.0})
    privacy = config.strategy_params.privacy
    assert (privacy.noise_multiplier, privacy.delta, privacy.max_grad_norm, privacy.epsilon_budget) == (1.3, 1e-6, 0.5, 8.0)
    with pytest.raises(ConfigError, match="noise_multiplier or target_epsilon"):
        load_config(None, {"dp_delta": 1e-6})
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, {"dp_noise_multiplier": 1.0, "dp_target_epsilon": 3.0})
    planned = load_config(None, {"dp_target_epsilon": 3.0, "rounds": 7, "tau": 4}).resolved()
    assert planned.strategy_params.privacy.planned_rounds == 7
    import dataclasses

    from fedal.strategies import STRATEGIES

    spec = STRATEGIES["local"]  # as a strategy whose spec does not take privacy
    with monkeypatch_item(STRATEGIES, "local", dataclasses.replace(spec, params=("local_epochs",))):
        with pytest.raises(ConfigError, match="has no differentially private training yet.*fedal, fedmd, fedmd-lf.*fd"):
            load_config(None, {"strategy": "local", "dp_noise_multiplier": 1.0})


def test_a_client_half_without_private_steps_refuses_privacy():
    """A half that has not named its private steps (a new strategy's, say) never trains without
    the privacy the manifest promises."""
    from fedal.strategies import ClientHalf, StrategyParams

    class Unnamed(ClientHalf):
        def handle(self, task):
            return self.reply(task)

    params = StrategyParams(privacy={"noise_multiplier": 1.0})
    with pytest.raises(ValueError, match="no differentially private training"):
        Unnamed("c0", TinyNet(), toy_dataset(), None, params, seed=0)


def test_without_opacus_a_device_refuses_the_run(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_opacus(name, *args, **kwargs):
        if name == "opacus" or name.startswith("opacus."):
            raise ModuleNotFoundError("No module named 'opacus'", name="opacus")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_opacus)
    with pytest.raises(PrivacyUnavailable, match="privacy. extra"):
        toy_federation("fedal", privacy={"noise_multiplier": 1.0})


def test_the_engine_refuses_a_malformed_epsilon_and_counts_it():
    from tests.helpers import in_process

    server, clients, _ = toy_federation("fedal", tau=1, privacy={"noise_multiplier": 1.0})
    bad = clients["c1"]
    handle = bad.handle

    def lying(task):
        result = handle(task)
        return result.with_meta(epsilon=-1.0) if task.phase == "local_train" else result

    bad.handle = lying
    engine = in_process(server, clients)
    record = engine.run_round(0)
    assert engine.reject_reasons["privacy"] >= 1 and record["rejected"] >= 1
    assert record["privacy"]["epsilon"][1] is None and all(e > 0 for i, e in enumerate(record["privacy"]["epsilon"]) if i != 1)
    assert np.isfinite(record["privacy"]["epsilon"][0])


@pytest.mark.parametrize("sigma", [0.0, -1.0, True, "1.0"])  # (non-finite: not encodable)
def test_the_engine_refuses_a_malformed_noise_multiplier_and_counts_it(sigma):
    from tests.helpers import in_process

    server, clients, _ = toy_federation("fedal", tau=1, privacy={"noise_multiplier": 1.0})
    handle = clients["c1"].handle

    def lying(task):
        result = handle(task)
        return result.with_meta(noise_multiplier=sigma) if task.phase == "local_train" else result

    clients["c1"].handle = lying
    engine = in_process(server, clients)
    record = engine.run_round(0)
    assert engine.reject_reasons["privacy"] >= 1 and record["rejected"] >= 1
    assert record["privacy"]["noise_multiplier"][1] is None and record["privacy"]["noise_multiplier"][0] == 1.0


@pytest.mark.parametrize("strategy, privacy", [("fedal", {"dp_noise_multiplier": 1.1, "dp_max_grad_norm": 0.8}),
                                               ("fedmd", {"dp_target_epsilon": 6.0})])
def test_a_private_deployment_over_mqtt_gives_the_simulations_numbers(strategy, privacy, embedded_broker, tmp_path):
    """Seeded sampling and noise: `fedal demo` (coordinator and agents as processes, over a broker)
    gives the simulation's accuracies and every client's epsilon after every round."""
    from fedal_cli.demo import run_demo

    config = load_config(None, dict(strategy=strategy, dataset="digits", clients=3, rounds=2, tau=2, public_size=100,
                                    seed=1, **privacy))
    deployed = run_demo(config, tmp_path / "demo", broker=embedded_broker, quiet=True, timeout_s=300)
    simulated = simulate(per_client(config))
    assert deployed["final"]["client_acc"] == simulated["final"]["client_acc"]
    assert deployed["privacy"] == simulated["privacy"] and deployed["privacy"]["max_epsilon"] > 0
    for cid in (c["id"] for c in deployed["clients"]):
        assert deployed["deployment"]["clients"][cid]["epsilon"] == simulated["privacy"]["final_epsilon"][cid]


def test_a_target_epsilon_calibrates_each_clients_noise_to_reach_it_at_the_end():
    """Clients of different sizes sample at different rates: each gets its own noise, and every
    one ends the run at the target (within Opacus's calibration tolerance), never above it."""
    results = simulate(_dp_config(dp_target_epsilon=4.0, partition="pow",
                                  samples_per_client=None, mnist1d_samples=900))
    assert results["config"]["strategy_params"]["privacy"]["planned_rounds"] == 3
    sizes = results["data"]["client_sizes"]
    assert len(set(sizes)) > 1
    for eps in results["privacy"]["final_epsilon"].values():
        assert 3.95 <= eps <= 4.0
    # the noise each client calibrated is in the results: a larger client samples at a lower
    # rate and needs less noise for the same target
    sigma = results["privacy"]["client_noise_multiplier"]
    assert results["privacy"]["noise_multiplier"] is None and len(sigma) == len(sizes)
    by_size = sorted(zip(sizes, sigma.values()))
    assert all(a[1] >= b[1] for a, b in zip(by_size, by_size[1:])) and by_size[0][1] > by_size[-1][1]
    params = results["config"]["strategy_params"]
    tau, batch = params["tau"], params["batch_size"]
    privacy = PrivacyParams(**params["privacy"])
    for n, got in zip(sizes, sigma.values()):  # what the client's own calibration gives for its size
        assert got == privacy.sigma_for(min(1.0, batch / n), tau)


def test_a_private_client_does_not_report_its_own_test_splits_accuracy():
    results = simulate(_dp_config(dp_noise_multiplier=1.0, rounds=1, local_test_fraction=0.2))
    assert "client_local_acc" not in results["final"] and "mean_acc" in results["final"]
    plain = simulate(_dp_config(rounds=1, local_test_fraction=0.2))
    assert "client_local_acc" in plain["final"]


# -- private statistics: the Gaussian mechanism over a clipped norm ------------------------------

def test_a_private_statistics_sensitivity_is_bounded_by_its_clipping_on_worst_case_inputs():
    """Neighbouring datasets (one sample added), the added sample as extreme as it gets: the
    release before noise moves by at most sqrt(2) C, and by exactly that for a huge sample."""
    from fedal.privacy.statistics import clipped_class_sums, sensitivity

    rng = np.random.default_rng(0)
    clip, k = 0.7, 5
    values = torch.from_numpy(rng.normal(scale=3.0, size=(50, 8)))
    labels = torch.from_numpy(rng.integers(0, k, 50))
    base = clipped_class_sums(values, labels, k, clip)
    worst = 0.0
    for extreme in (torch.full((1, 8), 1e30), torch.full((1, 8), -1e30), torch.zeros(1, 8), values[:1] * 1e6,
                    torch.from_numpy(rng.normal(size=(1, 8)))):
        for label in range(k):
            grown = clipped_class_sums(torch.cat([values, extreme]), torch.cat([labels, torch.tensor([label])]), k, clip)
            moved = float((grown - base).norm())
            assert moved <= sensitivity(clip) + 1e-9
            worst = max(worst, moved)
    assert worst == pytest.approx(sensitivity(clip))  # the bound is reached: it is the sensitivity
    shrunk = clipped_class_sums(values[1:], labels[1:], k, clip)  # one sample removed
    assert float((shrunk - base).norm()) <= sensitivity(clip) + 1e-9


def test_private_class_means_without_noise_are_the_clipped_means_and_with_noise_are_accounted():
    from fedal.privacy.statistics import private_class_means

    values = torch.tensor([[0.3, 0.4], [0.0, 0.5], [3.0, 4.0], [0.1, 0.1]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 3])
    means, counts = private_class_means(values, labels, 4, clip=1.0, sigma=0.0, generator=torch.Generator())
    np.testing.assert_allclose(means, [[0.15, 0.45], [0.6, 0.8], [0, 0], [0.1, 0.1]], atol=1e-7)  # [3, 4] clipped to norm 1
    assert counts.tolist() == [2, 1, 0, 1] and counts.dtype == np.int64 and means.dtype == np.float32
    private = PrivateTraining(PrivacyParams(noise_multiplier=2.0), n=40, batch_size=8, seed=1)
    private.release_class_means(values, labels, 4)
    reference = PrivacyAccountant()
    reference.step(2.0, 1.0)
    assert private.epsilon() == reference.epsilon(1e-5) > 0


def test_fd_trains_privately_and_sends_its_per_label_means_through_the_gaussian_mechanism():
    server, clients, params = toy_federation("fd", tau=4, privacy={"noise_multiplier": 1.0})
    phase = server.begin_round(0)
    results = {cid: c.handle(phase.tasks[cid]) for cid, c in clients.items()}
    for cid, client in clients.items():
        assert client.private.accountant.steps == 4 + 1  # four DP-SGD steps and one release at rate 1
        result = results[cid]
        assert "loss" not in result.meta and "ce" not in result.meta and result.meta["epsilon"] > 0
        server.validate(phase, cid, result)  # noisy means, made probability rows again, pass the server's checks
    nxt = server.begin_round(1) if server.collect(phase, results) is None else None
    assert nxt is not None and any("fd/teacher" in t.tensors for t in nxt.tasks.values())
    spent = clients["c0"].private.epsilon()
    reference = PrivacyAccountant()
    reference.step(1.0, clients["c0"].private.sample_rate, 4)
    reference.step(1.0, 1.0)
    assert spent == pytest.approx(reference.epsilon(1e-5))


def test_a_private_fd_run_finishes_and_reports_epsilon():
    results = simulate(_dp_config(strategy="fd", tau=3, dp_noise_multiplier=1.5, rounds=2))
    assert results["privacy"]["max_epsilon"] > 0 and len(results["rounds"]) == 2
    assert all(r["rejected"] == 0 for r in results["rounds"])


def test_fedproto_trains_privately_and_sends_noisy_clipped_prototypes():
    from fedal.strategies.local import local_step_count

    privacy = {"noise_multiplier": 1.0, "statistic_clip": 2.0}
    server, clients, params = toy_federation("fedproto", privacy=privacy)
    phase = server.begin_round(0)
    results = {cid: c.handle(phase.tasks[cid]) for cid, c in clients.items()}
    for cid, client in clients.items():
        steps = local_step_count(params, int(params.tau), len(client.y_train))  # local_epochs passes
        assert client.private.accountant.steps == steps + 1 and steps > 1
        assert "loss" not in results[cid].meta and results[cid].meta["epsilon"] > 0
        server.validate(phase, cid, results[cid])
    assert server.collect(phase, results) is None and server.mask is not None


@pytest.mark.parametrize("strategy", ["fd", "fedproto"])
def test_target_epsilon_counts_the_private_statistics_too(strategy):
    """Calibrated for its steps and its one release a round: every client ends at the target."""
    models = ["mlp"] if strategy == "fd" else ["mlp", "cnn1d_wide"]
    results = simulate(_dp_config(strategy=strategy, tau=3, dp_target_epsilon=3.0, rounds=2, models=models))
    for eps in results["privacy"]["final_epsilon"].values():
        assert 2.95 <= eps <= 3.0



@pytest.mark.parametrize("strategy", ["fedavg", "local"])
def test_weight_sharing_and_local_only_runs_train_privately(strategy):
    """FedAvg sends weights after DP-SGD (the init weights saw no data); Local only reports its epsilon."""
    results = simulate(_dp_config(strategy=strategy, tau=3, dp_noise_multiplier=1.2, rounds=2))
    eps = results["privacy"]["epsilon"]
    assert all(e[0] > 0 and e[1] > e[0] for e in eps.values()) and len(results["rounds"]) == 2
    assert all("local_loss" not in r["server"] for r in results["rounds"])  # no private loss reached the server
    if strategy == "fedavg":
        assert results["final"]["global_acc"] is not None
    plain = simulate(_dp_config(strategy=strategy, tau=3, rounds=2))
    assert "privacy" not in plain and any("local_loss" in r["server"] for r in plain["rounds"])


def test_vectorized_clients_train_privately_one_by_one():
    """Per-sample clipping runs per client: --vectorize with privacy gives the per-client run."""
    a = simulate(_dp_config(dp_noise_multiplier=1.0, rounds=2, models=["mlp", "cnn1d"], vectorize=False))
    b = simulate(_dp_config(dp_noise_multiplier=1.0, rounds=2, models=["mlp", "cnn1d"], vectorize=True))
    assert a["final"] == b["final"] and a["privacy"] == b["privacy"]
    assert b["vectorized"]["stacked_tasks"] == 0 and list(b["vectorized"]["per_client_reasons"]) == [
        "no group step (differential privacy: per-sample clipping runs per client)"]


def test_the_manifest_carries_privacy_only_for_a_private_run():
    plain = load_config(None, {}).resolved().strategy_params.manifest_dict()
    private = load_config(None, {"dp_noise_multiplier": 1.0}).resolved().strategy_params.manifest_dict()
    assert "privacy" not in plain and private["privacy"]["noise_multiplier"] == 1.0
    from fedal.strategies import StrategyParams

    assert StrategyParams(**private).privacy.noise_multiplier == 1.0  # what the agent builds from it


def test_fedhkd_adds_its_head_term_as_a_public_term_unclipped_and_unnoised():
    """The head term reads only the server's knowledge: with the private part clipped to nothing
    and no noise, a step moves the head by exactly lambda * its gradient (SGD, lr 1)."""
    from fedal.strategies.fedhkd import Knowledge, head_term

    privacy = {"noise_multiplier": 0.0, "max_grad_norm": 1e-12}
    _, clients, params = toy_federation("fedhkd", privacy=privacy, hkd_lambda=0.7, hkd_gamma=0.0, optimizer="sgd",
                                        lr=1.0, local_epochs=0)
    client = clients["c0"]
    rng = np.random.default_rng(0)
    knowledge = Knowledge(rng.normal(size=(4, 8)).astype(np.float32),
                          np.full((4, 4), 0.25, np.float32), np.array([True, True, False, True]))
    reference = copy.deepcopy(client.model)
    want = torch.autograd.grad(0.7 * head_term(reference, knowledge, params), list(reference.net[2].parameters()))
    features_before = [p.detach().clone() for p in client.model.net[0].parameters()]
    client._private_steps(client.private.batches(1), knowledge, 0.7, 0.0)
    for before, after, g in zip(reference.net[2].parameters(), client.model.net[2].parameters(), want):
        torch.testing.assert_close(before.detach() - after.detach(), g, atol=1e-6, rtol=1e-5)
    for before, after in zip(features_before, client.model.net[0].parameters()):
        torch.testing.assert_close(before, after.detach(), atol=1e-9, rtol=0)  # the private part: clipped to ~0


def test_fedhkd_trains_privately_and_releases_its_knowledge_through_the_gaussian_mechanism():
    from fedal.strategies.local import local_step_count

    results = simulate(_dp_config(strategy="fedhkd", tau=3, dp_noise_multiplier=1.5, rounds=2, models=["mlp"]))
    assert results["privacy"]["max_epsilon"] > 0 and all(r["rejected"] == 0 for r in results["rounds"])
    server, clients, params = toy_federation("fedhkd", tau=3, privacy={"noise_multiplier": 1.5}, local_epochs=0)
    phase = server.begin_round(0)
    while phase.phase != "train":  # FedAvg's init: the first client's initial weights
        phase = server.collect(phase, {cid: clients[cid].handle(t) for cid, t in phase.tasks.items()})
    results = {cid: c.handle(phase.tasks[cid]) for cid, c in clients.items()}
    for cid, client in clients.items():
        assert client.private.accountant.steps == local_step_count(params, 3, len(client.y_train)) + 2
        server.validate(phase, cid, results[cid])
        assert "loss" not in results[cid].meta and results[cid].meta["epsilon"] > 0


@pytest.mark.parametrize("strategy", ["cfd", "mhat"])
def test_cfd_and_mhat_train_privately_and_share_only_public_row_outputs(strategy):
    results = simulate(_dp_config(strategy=strategy, tau=3, dp_noise_multiplier=1.2, rounds=2))
    eps = results["privacy"]["epsilon"]
    assert all(e[0] > 0 and e[1] > e[0] for e in eps.values()) and all(r["rejected"] == 0 for r in results["rounds"])
    server, clients, params = toy_federation(strategy, tau=2, privacy={"noise_multiplier": 1.2})
    phase = server.begin_round(0)
    result = clients["c0"].handle(phase.tasks["c0"])
    assert "loss" not in result.meta and result.meta["epsilon"] > 0
    assert clients["c0"].private.accountant.steps == 2  # the soft labels on public rows cost nothing


@pytest.mark.parametrize("strategy", ["feddf", "feddf-al"])
def test_feddf_trains_privately_and_shares_weights_after_dp_sgd(strategy):
    results = simulate(_dp_config(strategy=strategy, tau=2, dp_noise_multiplier=1.2, rounds=2, models=["mlp", "cnn1d"]))
    eps = results["privacy"]["epsilon"]
    assert all(e[0] > 0 and e[1] > e[0] for e in eps.values()) and all(r["rejected"] == 0 for r in results["rounds"])
    assert all("local_loss" not in r["server"] for r in results["rounds"])


def test_fedproto_public_trains_privately_and_shares_public_row_features():
    results = simulate(_dp_config(strategy="fedproto-public", tau=2, dp_noise_multiplier=1.2, rounds=2,
                                  models=["mlp", "cnn1d_wide"]))
    eps = results["privacy"]["epsilon"]
    assert all(e[0] > 0 and e[1] > e[0] for e in eps.values()) and all(r["rejected"] == 0 for r in results["rounds"])
    server, clients, _ = toy_federation("fedproto-public", tau=2, privacy={"noise_multiplier": 1.2})
    phase = server.begin_round(0)
    result = clients["c0"].handle(phase.tasks["c0"])
    assert "loss" not in result.meta and clients["c0"].private.accountant.steps == 2


@pytest.mark.parametrize("strategy", ["fccl", "fccl-plus"])
def test_fccl_pretrains_and_updates_privately_and_a_target_counts_the_pretraining(strategy):
    from fedal.strategies.local import local_step_count

    server, clients, params = toy_federation(strategy, tau=2, privacy={"noise_multiplier": 1.2},
                                             fccl_pretrain_epochs=2 if strategy == "fccl" else None)
    client = clients["c0"]
    phase = server.begin_round(0)
    if phase.phase == "local_pretrain":
        result = client.handle(phase.tasks["c0"])
        assert "loss" not in result.meta and result.meta["epsilon"] > 0
        assert client.private.accountant.steps == client.private_one_off(params, len(client.y_train)) > 1
    assert (client.private_one_off(params, len(client.y_train)) == 0) == (strategy == "fccl-plus")
    before = client.private.accountant.steps
    result = client.handle(Message({**phase.tasks["c0"].meta, "phase": "local_train", "steps": 2}))
    assert "loss" not in result.meta
    assert client.private.accountant.steps == before + local_step_count(params, 2, len(client.y_train))
    pretrain = {"fccl_pretrain_epochs": 2} if strategy == "fccl" else {}
    results = simulate(_dp_config(strategy=strategy, tau=2, dp_target_epsilon=5.0, rounds=2, models=["mlp"], **pretrain))
    for eps in results["privacy"]["final_epsilon"].values():
        assert 4.95 <= eps <= 5.0  # the one-off pretraining is in the plan the noise is calibrated for


def test_fedakd_distils_both_ways_privately_and_releases_a_noisy_selection_count():
    from fedal.strategies.local import local_step_count
    from fedal.strategies.losses import kl_per_row, kl_to_student

    target, student = torch.randn(7, 4), torch.randn(7, 4)
    torch.testing.assert_close(kl_per_row(target, student, 2.0).mean(), kl_to_student(target, student, 2.0))
    server, clients, params = toy_federation("fedakd", tau=2, privacy={"noise_multiplier": 1.2})
    phase = server.begin_round(0)
    while phase.phase != "train":
        phase = server.collect(phase, {cid: clients[cid].handle(t) for cid, t in phase.tasks.items()})
    for cid, client in clients.items():
        result = client.handle(phase.tasks[cid])
        server.validate(phase, cid, result)
        assert "loss" not in result.meta and "global_loss" not in result.meta and result.meta["epsilon"] > 0
        assert 0 <= result.meta["selected"] <= len(client.y_train)
        count = local_step_count(params, 2, len(client.y_train))
        assert client.private.accountant.steps == 2 * count + 1  # both distillations and the count
    results = simulate(_dp_config(strategy="fedakd", tau=2, dp_target_epsilon=4.0, rounds=2))
    for eps in results["privacy"]["final_epsilon"].values():
        assert 3.95 <= eps <= 4.0
    assert results["final"]["global_acc"] is not None


def test_a_stragglers_epsilon_counts_though_its_results_come_too_late():
    """A straggler trains and answers after the deadline: its work was done and its privacy
    spent, so its epsilon is reported (it was null all run, or a round behind)."""
    plain = simulate(_dp_config(dp_noise_multiplier=1.0))["privacy"]
    late = simulate(_dp_config(dp_noise_multiplier=1.0, stragglers=0.5, straggle_every=1))
    stragglers = late["deployment"]["faults"]["stragglers"]
    assert stragglers and late["deployment"]["faults"]["late_results"] > 0
    for cid in stragglers:  # the same data, steps and noise as without the fault: the same epsilon
        assert late["privacy"]["final_epsilon"][cid] == pytest.approx(plain["final_epsilon"][cid], rel=1e-12)
    assert late["privacy"]["max_epsilon"] == pytest.approx(plain["max_epsilon"], rel=1e-12)


def test_privacy_settings_no_run_can_use_are_refused():
    for privacy, needle in (({"noise_multiplier": 0.0}, "adds no noise"),
                            ({"noise_multiplier": float("inf")}, "finite"),
                            ({"target_epsilon": float("inf")}, "finite")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, {"strategy": "fedal", "dataset": "digits", "privacy": privacy})


def test_a_flag_choosing_how_the_noise_is_set_replaces_the_configs_choice(tmp_path):
    (tmp_path / "run.toml").write_text('strategy = "fedal"\ndataset = "digits"\n[privacy]\nnoise_multiplier = 1.0\n')
    config = load_config(tmp_path / "run.toml", {"dp_target_epsilon": 3.0}).resolved()
    privacy = config.strategy_params.privacy
    assert (privacy.noise_multiplier, privacy.target_epsilon, privacy.planned_rounds) == (None, 3.0, config.rounds)
    config = load_config(tmp_path / "run.toml", {"dp_noise_multiplier": 0.5})
    assert config.strategy_params.privacy.noise_multiplier == 0.5


def test_the_results_state_every_privacy_setting():
    results = simulate(_dp_config(dp_target_epsilon=3.0, rounds=1))
    privacy = results["privacy"]
    assert (privacy["target_epsilon"], privacy["planned_rounds"], privacy["accountant"]) == (3.0, 1, "rdp")
    assert privacy["noise_multiplier"] is None and privacy["statistic_clip"] == 1.0
    assert set(privacy["client_noise_multiplier"]) == set(privacy["final_epsilon"])
    assert all(s > 0 for s in privacy["client_noise_multiplier"].values())
    fixed = simulate(_dp_config(dp_noise_multiplier=0.7, rounds=1))["privacy"]
    assert fixed["noise_multiplier"] == 0.7 and set(fixed["client_noise_multiplier"].values()) == {0.7}


def test_an_unreachable_target_epsilon_is_a_usage_error():
    from click.testing import CliRunner

    from fedal_cli.main import cli

    r = CliRunner().invoke(cli, ["simulate", "--strategy", "fedal", "--dataset", "digits", "--clients", "2", "--rounds",
                                 "1", "--public-size", "60", "--dp-target-epsilon", "1e-9", "--quiet", "--out",
                                 "unused.json"])
    assert r.exit_code == 2, r.output  # was 1
    assert "no noise multiplier reaches target_epsilon 1e-09 in 1 rounds" in r.stderr
