"""FedHKD against its math (ALGORITHMS.md section 4): lambda = gamma = 0 is FedAvg, eq. 9 on
hand-built uploads, the noise's standard deviation, the sharing threshold, and which part of
the model each knowledge term trains."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedal.models import SplitModel, build_model
from fedal.protocol import Message, decode, encode
from fedal.sim import build_run, load_config
from fedal.strategies import InvalidResult, ServerContext, StrategyParams
from fedal.strategies.fedhkd import (
    COUNT_KEY,
    H_KEY,
    MASK_KEY,
    Q_KEY,
    FedHKDClient,
    FedHKDServer,
    Knowledge,
    aggregate_knowledge,
    extract_knowledge,
    knowledge_terms,
    last_writer_knowledge,
)
from tests.helpers import in_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def params(**kw) -> StrategyParams:
    return StrategyParams(**kw).resolve({"tau": 3, "hkd_lambda": 0.05, "hkd_gamma": 0.05})


def run_rounds(strategy: str, rounds: int = 3, **extra):
    config = load_config(None, dict(strategy=strategy, dataset="digits", clients=3, rounds=rounds, tau=4, seed=3,
                                    models=["mlp"], partition="dirichlet-class", alpha=0.5, **extra)).resolved()
    _, clients, server = build_run(config)
    engine = in_process(server, clients)
    for r in range(rounds):
        engine.run_round(r)
    return server, clients


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


@pytest.mark.parametrize("work", [{"local_epochs": 0, "batch_size": 32}, {"local_epochs": 1, "batch_size": 32}],
                         ids=["tau-steps", "one-epoch"])  # the same local work for both (FedHKD's preset: 5 epochs of 64)
def test_zero_lambda_and_gamma_is_fedavg_exactly(work):
    hkd_server, hkd_clients = run_rounds("fedhkd", hkd_lambda=0.0, hkd_gamma=0.0, hkd_nu=0.0, **work)
    avg_server, avg_clients = run_rounds("fedavg", **work)
    assert hkd_server.knowledge is not None and hkd_server.knowledge.mask.all()  # knowledge did travel
    assert same_state(hkd_server.global_weights, avg_server.global_weights)
    for cid in avg_clients:
        assert same_state(hkd_clients[cid].model.state_dict(), avg_clients[cid].model.state_dict())
    # the same run with the knowledge terms on is not FedAvg: the comparison can tell
    on_server, _ = run_rounds("fedhkd", hkd_nu=0.0, **work)
    assert not same_state(on_server.global_weights, avg_server.global_weights)


def hand_uploads():
    """3 clients, K = 4 classes, d = 2; class 3 shared by nobody, class 1 by one client."""
    h = [np.array([[1, 2], [0, 0], [5, 5], [0, 0]], np.float32),
         np.array([[3, 4], [7, -1], [0, 0], [0, 0]], np.float32),
         np.array([[-1, 0], [0, 0], [1, 1], [0, 0]], np.float32)]
    q = [np.array([[.7, .1, .1, .1], [0, 0, 0, 0], [.1, .1, .8, 0], [0, 0, 0, 0]], np.float32),
         np.array([[.5, .5, 0, 0], [.2, .6, .1, .1], [0, 0, 0, 0], [0, 0, 0, 0]], np.float32),
         np.array([[.9, 0, .1, 0], [0, 0, 0, 0], [0, .2, .8, 0], [0, 0, 0, 0]], np.float32)]
    counts = [np.array([10, 0, 30, 0]), np.array([20, 5, 0, 0]), np.array([70, 0, 10, 0])]
    return h, q, counts


def test_aggregation_matches_eq9_on_hand_built_uploads():
    h, q, counts = hand_uploads()
    k = aggregate_knowledge(list(zip(h, q, counts)))
    # eq. 9 written out by hand: p_i = N_i^j / N^j over the clients that shared class j
    assert np.allclose(k.h[0], (10 * h[0][0] + 20 * h[1][0] + 70 * h[2][0]) / 100)
    assert np.allclose(k.h[0], [0.0, 1.0])  # (10 + 60 - 70) / 100, (20 + 80 + 0) / 100
    assert np.allclose(k.q[0], (10 * q[0][0] + 20 * q[1][0] + 70 * q[2][0]) / 100)
    assert np.allclose(k.h[1], h[1][1]) and np.allclose(k.q[1], q[1][1])  # one sharer: its own
    assert np.allclose(k.h[2], (30 * h[0][2] + 10 * h[2][2]) / 40)
    assert np.allclose(k.h[2], [4.0, 4.0])
    assert k.mask.tolist() == [True, True, True, False]  # nobody shared class 3
    assert not k.h[3].any() and not k.q[3].any()


def test_official_aggregation_is_last_writer_wins_and_keeps_old_classes():
    h, q, counts = hand_uploads()
    k = last_writer_knowledge(list(zip(h, q, counts)), previous=None)
    assert np.array_equal(k.h[0], h[2][0]) and np.array_equal(k.h[2], h[2][2]) and np.array_equal(k.h[1], h[1][1])
    assert k.mask.tolist() == [True, True, True, False]
    previous = Knowledge(np.full((4, 2), 9, np.float32), np.full((4, 4), .25, np.float32), np.ones(4, bool))
    k2 = last_writer_knowledge(list(zip(h, q, counts))[::-1], previous)
    assert np.array_equal(k2.h[0], h[0][0]) and np.array_equal(k2.h[3], [9, 9]) and k2.mask.all()


def server_and_phase(num_classes=4, **kw):
    server = FedHKDServer(params(**kw), ["a", "b", "c"], ServerContext(num_classes=num_classes, public_size=0, seed=0))
    server.global_weights = {"w": np.zeros((2, 2), np.float32)}
    return server, server.begin_round(1)


def upload(phase, cid, h, q, counts, w=0.0, n=200) -> Message:
    task = phase.tasks[cid]
    msg = Message({k: task.meta[k] for k in ("phase", "round", "iteration")} | {"num_samples": n, "loss": 1.0},
                  {"w": np.full((2, 2), w, np.float32), H_KEY: h, Q_KEY: q, COUNT_KEY: np.asarray(counts, np.int64)})
    return decode(encode(msg))  # as it arrives from the wire


def test_server_aggregates_weights_like_fedavg_and_knowledge_by_eq9_then_sends_it():
    server, phase = server_and_phase()
    h, q, counts = hand_uploads()
    results = {}
    for i, cid in enumerate(["a", "b", "c"]):
        res = upload(phase, cid, h[i], q[i], counts[i], w=float(i), n=100 * (i + 1))
        server.validate(phase, cid, res)
        results[cid] = res
    assert server.collect(phase, results) is None
    assert np.allclose(server.global_weights["w"], (0 * 100 + 1 * 200 + 2 * 300) / 600)
    expected = aggregate_knowledge(list(zip(h, q, counts)))
    assert np.allclose(server.knowledge.h, expected.h) and server.knowledge.mask.tolist() == [True, True, True, False]
    task = server.begin_round(2).tasks["b"]
    assert np.allclose(task.tensors[H_KEY], expected.h) and task.tensors[MASK_KEY].tolist() == [1, 1, 1, 0]
    assert "hkd/h" not in server.global_weights  # the knowledge never leaks into the averaged weights


def test_server_refuses_malformed_knowledge():
    server, phase = server_and_phase()
    h, q, counts = hand_uploads()
    bad = {
        "feature rows": (h[0][:3], q[0], counts[0]),
        "negative count": (h[0], q[0], [10, -1, 30, 0]),
        "not a distribution": (h[0], q[0] * 2, counts[0]),
        "NaN feature": (np.where(h[0] == 1, np.nan, h[0]).astype(np.float32), q[0], counts[0]),
        "counts above num_samples": (h[0], q[0], [500, 0, 30, 0]),
    }
    for what, (hh, qq, cc) in bad.items():
        with pytest.raises(InvalidResult):
            server.validate(phase, "a", upload(phase, "a", hh, qq, cc))
        print("refused:", what)
    missing = upload(phase, "a", *[x[0] for x in hand_uploads()])
    del missing.tensors[COUNT_KEY]
    with pytest.raises(InvalidResult):
        server.validate(phase, "a", missing)


class Identity(SplitModel):
    """Features = the input itself, so the class means are known exactly."""

    def __init__(self, d: int, k: int):
        super().__init__(nn.Flatten(1), nn.Linear(d, k), feature_dim=d, num_classes=k, input_shape=(d,))


def class_data(counts: list[int], d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.cat([torch.full((c,), j) for j, c in enumerate(counts)])
    x = torch.rand(len(y), d, generator=g) * 4 - 2  # inside [-zeta, zeta] = [-3, 3]: clipping changes nothing
    return x, y


def test_paper_noise_has_std_2_zeta_sigma_over_class_count():
    counts, d, repeats = [400, 200, 100, 300], 50, 100
    x, y = class_data(counts, d)
    model = Identity(d, 4)
    p = params(hkd_nu=0.0)  # share every class; sigma = 7, zeta = 3 (the paper's)
    clean, _, shared = extract_knowledge(model, x, y, 4, params(hkd_nu=0.0, hkd_sigma=0.0), torch.Generator())
    assert shared.tolist() == counts
    assert np.allclose(clean, [x[y == j].mean(0).numpy() for j in range(4)], atol=1e-6)
    g = torch.Generator().manual_seed(123)
    noise = np.stack([extract_knowledge(model, x, y, 4, p, g)[0] - clean for _ in range(repeats)])  # [R, K, d]
    std = 2 * 3.0 * 7.0 / np.asarray(counts, np.float64)  # 2 zeta sigma / N^j
    z = noise / std[None, :, None]
    # n = R * d = 5000 draws per class: a sample std has standard error 1/sqrt(2n) = 0.01 and a
    # sample mean 1/sqrt(n) = 0.014; the bounds are five standard errors (float32 rounding of
    # the means, ~1e-7 relative, is far below them). The seed is fixed: the test is deterministic.
    n = repeats * d
    for j in range(4):
        assert abs(z[:, j].std() - 1.0) < 5 / math.sqrt(2 * n), (j, z[:, j].std())
        assert abs(z[:, j].mean()) < 5 / math.sqrt(n)
    # independent per class and element (eq. 7), unlike the authors' code
    corr = np.corrcoef(z[:, 0].ravel(), z[:, 1].ravel())[0, 1]
    assert abs(corr) < 5 / math.sqrt(n)


def test_official_noise_is_one_vector_of_std_2_for_every_class():
    counts, d = [40, 20, 10, 30], 50
    x, y = class_data(counts, d)
    model = Identity(d, 4)
    clean = np.stack([x[y == j].mean(0).numpy() for j in range(4)])
    g = torch.Generator().manual_seed(5)
    noise = np.stack([extract_knowledge(model, x, y, 4, params(hkd_preset="official"), g)[0] - clean for _ in range(100)])
    assert np.allclose(noise[:, 0], noise[:, 3], atol=1e-5)  # the same vector on every class
    n = noise[:, 0].size  # 5000 draws: five standard errors as above
    assert abs(noise[:, 0].std() / 2.0 - 1.0) < 5 / math.sqrt(2 * n)


def test_paper_clips_features_to_zeta_before_averaging():
    x = torch.tensor([[10.0, -10.0], [0.0, 1.0]])
    y = torch.tensor([0, 0])
    h, _, _ = extract_knowledge(Identity(2, 2), x, y, 2, params(hkd_nu=0.0, hkd_sigma=0.0), torch.Generator())
    assert np.allclose(h[0], [1.5, -1.0])  # mean of clip(x, -3, 3)
    h_off, _, _ = extract_knowledge(Identity(2, 2), x, y, 2, params(hkd_preset="official", hkd_official_noise_std=0.0),
                                    torch.Generator())
    assert np.allclose(h_off[0], [5.0, -4.5])  # the authors' code does not clip


def test_classes_under_the_threshold_are_not_shared_and_masked():
    counts = [600, 250, 149, 1, 0]  # N = 1000, nu = 0.25: only classes 0 and 1 reach 250
    x, y = class_data(counts, 3)
    h, q, shared = extract_knowledge(Identity(3, 5), x, y, 5, params(), torch.Generator().manual_seed(0))
    assert shared.tolist() == [600, 250, 0, 0, 0]
    assert not h[2:].any() and not q[2:].any()
    assert np.allclose(q[:2].sum(1), 1.0, atol=1e-5)
    _, _, off = extract_knowledge(Identity(3, 5), x, y, 5, params(hkd_preset="official"), torch.Generator())
    assert off.tolist() == [600, 250, 149, 1, 0]  # the authors' code has no threshold
    # a class under everyone's threshold is masked out of the global knowledge ...
    k = aggregate_knowledge([(h, q, shared), (h, q, np.array([0, 300, 0, 0, 0]))])
    assert k.mask.tolist() == [True, True, False, False, False]
    # ... and the knowledge terms never look at masked rows
    model = Identity(3, 5)
    hb = torch.randn(6, 3)
    yb = torch.tensor([0, 1, 2, 3, 4, 0])
    base = knowledge_terms(model, hb, yb, k, params())
    keep = k.mask[:, None]
    junk = Knowledge(np.where(keep, k.h, 1e6).astype(np.float32), np.where(keep, k.q, 7).astype(np.float32), k.mask)
    again = knowledge_terms(model, hb, yb, junk, params())
    assert torch.equal(base[0], again[0]) and torch.equal(base[1], again[1])


def grads_after(model: SplitModel, term: torch.Tensor) -> tuple[list[float], list[float]]:
    model.zero_grad(set_to_none=True)
    term.backward()
    norm = lambda ps: [0.0 if p.grad is None else float(p.grad.abs().sum()) for p in ps]  # noqa: E731
    return norm(model.backbone.parameters()), norm(model.classifier.parameters())


@pytest.mark.parametrize("preset", ["paper", "official"])
def test_each_knowledge_term_trains_only_its_part(preset):
    torch.manual_seed(0)
    model = build_model("mlp", (64,), 10)
    k = Knowledge(torch.randn(10, model.feature_dim).abs().numpy(), torch.softmax(torch.randn(10, 10), 1).numpy(),
                  np.array([1, 1, 0, 1, 0, 1, 1, 1, 0, 1], bool))
    x, y = torch.randn(16, 64), torch.arange(16) % 10
    p = params(hkd_preset=preset)
    head, _ = knowledge_terms(model, model.features(x), y, k, p)
    backbone_g, head_g = grads_after(model, head)
    assert all(g == 0.0 for g in backbone_g) and all(g > 0 for g in head_g)
    _, feature = knowledge_terms(model, model.features(x), y, k, p)
    backbone_g, head_g = grads_after(model, feature)
    assert all(g == 0.0 for g in head_g) and all(g > 0 for g in backbone_g)


def test_paper_terms_are_the_euclidean_norms_of_eq11():
    torch.manual_seed(1)
    model = build_model("mlp", (64,), 4)
    k = Knowledge(torch.randn(4, 100).numpy(), torch.softmax(torch.randn(4, 4), 1).numpy(), np.array([1, 0, 1, 1], bool))
    x, y = torch.randn(5, 64), torch.tensor([0, 1, 2, 3, 3])
    h = model.features(x)
    head, feature = knowledge_terms(model, h, y, k, params(hkd_temperature=0.5))
    with torch.no_grad():
        want_head = np.mean([np.linalg.norm(torch.softmax(model.head(torch.from_numpy(k.h[j])) / 0.5, 0).numpy() - k.q[j])
                             for j in (0, 2, 3)])
        want_feature = sum(np.linalg.norm(h[b].numpy() - k.h[int(y[b])]) for b in (0, 2, 3, 4)) / 5  # class 1 absent
    assert head.item() == pytest.approx(want_head, rel=1e-5)
    assert feature.item() == pytest.approx(want_feature, rel=1e-5)


def grad_norms_of_steps(preset: str, knowledge: Knowledge | None, steps: int = 3) -> list[float]:
    config = load_config(None, dict(strategy="fedhkd", dataset="digits", clients=2, rounds=1, tau=1, seed=0,
                                    models=["mlp"], hkd_preset=preset)).resolved()
    _, clients, _ = build_run(config)
    client: FedHKDClient = clients["c00"]
    with torch.no_grad():
        client.model.classifier.weight.mul_(100)  # large cross-entropy gradients too
    seen = []
    step = client.optimizer.step

    def spy():
        seen.append(float(torch.cat([p.grad.flatten() for p in client.model.parameters()]).norm()))
        step()

    client.optimizer.step = spy
    client.train(steps, knowledge)
    return seen


def test_official_preset_clips_the_gradient_norm_while_knowledge_is_present():
    k = Knowledge(np.full((10, 100), 50.0, np.float32), np.full((10, 10), .1, np.float32), np.ones(10, bool))
    assert max(grad_norms_of_steps("official", k)) <= 1.1 + 1e-4
    assert min(grad_norms_of_steps("paper", k)) > 1.1  # the paper does not clip
    assert min(grad_norms_of_steps("official", None)) > 1.1  # nor does the authors' code in round 1


def test_client_and_server_state_round_trip():
    server, clients = run_rounds("fedhkd", rounds=2)
    restored = FedHKDServer(server.params, server.client_ids, server.context)
    restored.load_state_dict(server.state_dict())
    assert same_state(restored.knowledge.tensors(), server.knowledge.tensors())
    c = clients["c01"]
    twin = FedHKDClient("c01", build_model("mlp", (64,), 10), c.train_data, None, c.params, seed=0)
    twin.load_state_dict(c.state_dict())
    assert torch.equal(twin.noise_generator.get_state(), c.noise_generator.get_state())


def test_fedhkd_preset_is_the_papers(tmp_path):
    """ALGORITHMS.md section 4: lambda = gamma = 0.05, T = 0.5, sigma = 7, nu = 0.25, zeta = 3,
    5 local epochs, Adam 1e-3, batch 64. The batch is the preset's unless given (its own default
    is 32 for every other strategy), and a saved FedHKD run switched to another strategy gets
    that one's batch back."""
    from fedal.strategies import get_strategy

    p = StrategyParams().resolve(get_strategy("fedhkd").preset)
    assert (p.hkd_lambda, p.hkd_gamma, p.hkd_temperature, p.hkd_sigma, p.hkd_nu, p.hkd_zeta) == (0.05, 0.05, 0.5, 7.0,
                                                                                                 0.25, 3.0)
    assert (p.local_epochs, p.batch_size, p.optimizer, p.lr) == (5, 64, "adam", 1e-3)
    assert StrategyParams(batch_size=32).resolve(get_strategy("fedhkd").preset).batch_size == 32  # given: kept
    assert p.resolve(get_strategy("fedhkd").preset) == p  # resolving again changes nothing
    assert StrategyParams().resolve(get_strategy("fedavg").preset).batch_size == 32
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"config": load_config(None, {"strategy": "fedhkd"}).resolved().model_dump(mode="json")}))
    assert load_config(saved).resolved().strategy_params.batch_size == 64
    other = load_config(saved, {"strategy": "fedavg"}).resolved().strategy_params
    assert (other.batch_size, other.local_epochs) == (32, 0)
