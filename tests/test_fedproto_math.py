"""FedProto against its math (docs/algorithms.md, FedProto): eq. 6's count-weighted prototype average
on hand-built uploads (a client without a class adds nothing to it), eq. 5's local prototypes,
the authors' MSE term, proto_lambda = 0 as `local` step for step, the public variant's row-wise
average and its leave-one-out step, and the refusal of another feature width at both ends."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedal.protocol import Message, decode, encode
from fedal.strategies import InvalidResult, ServerContext, StrategyParams, get_strategy
from fedal.strategies.fedproto import (
    AVERAGE_KEY,
    COUNT_KEY,
    FEATURES_KEY,
    GLOBAL_KEY,
    MASK_KEY,
    PROTO_KEY,
    FedProtoClient,
    FedProtoPublicClient,
    FedProtoPublicServer,
    FedProtoServer,
    aggregate_prototypes,
    local_prototypes,
    proto_distance,
)
from fedal.strategies.local import LocalClient
from tests.helpers import TinyNet, in_process, toy_dataset

pytestmark = pytest.mark.usefixtures("one_torch_thread")
K = 4


class WideNet(TinyNet):
    """TinyNet with another feature width (a different architecture for FedProto's purposes)."""

    def __init__(self, hidden: int, d_in: int = 6, k: int = K):
        nn.Module.__init__(self)
        self.num_classes = k
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, k))


def params(strategy: str = "fedproto", **kw) -> StrategyParams:
    return StrategyParams(**kw).resolve(get_strategy(strategy).preset)


def wire(msg: Message) -> Message:
    return decode(encode(msg))


def upload(protos, counts, n=None) -> Message:
    counts = np.asarray(counts, np.int64)
    return Message({"phase": "local_train", "round": 0, "iteration": 0, "num_samples": int(n or counts.sum())},
                   {PROTO_KEY: np.asarray(protos, np.float32), COUNT_KEY: counts})


# -- eq. 6: the server's average ------------------------------------------------------------------

def test_global_prototype_is_the_count_weighted_mean_and_absent_classes_add_nothing():
    a = np.array([[1, 2], [3, 4], [0, 0], [7, 7]], np.float32)
    b = np.array([[5, 6], [9, 9], [2, 2], [99, -99]], np.float32)  # its class 3 row is junk: count 0
    counts_a, counts_b = np.array([3, 1, 0, 2]), np.array([1, 3, 4, 0])
    protos, mask = aggregate_prototypes([(a, counts_a), (b, counts_b)])
    want = np.array([(3 * a[0] + 1 * b[0]) / 4, (1 * a[1] + 3 * b[1]) / 4, b[2], a[3]], np.float32)
    np.testing.assert_allclose(protos, want, rtol=0, atol=1e-6)
    assert mask.tolist() == [True, True, True, True]
    # the authors' code: the plain mean over the clients that have the class
    plain, _ = aggregate_prototypes([(a, counts_a), (b, counts_b)], "client")
    np.testing.assert_allclose(plain, [(a[0] + b[0]) / 2, (a[1] + b[1]) / 2, b[2], a[3]], rtol=0, atol=1e-6)
    # a class nobody has is masked out, its row 0
    protos, mask = aggregate_prototypes([(a, [3, 1, 0, 0]), (b, [1, 3, 0, 0])])
    assert mask.tolist() == [True, True, False, False] and not protos[2:].any()


def test_server_collect_averages_the_accepted_uploads_and_sends_them_down():
    server = FedProtoServer(params(), ["c0", "c1", "c2"], ServerContext(num_classes=K, public_size=0, seed=0))
    phase = server.begin_round(0)
    assert all(GLOBAL_KEY not in t.tensors for t in phase.tasks.values())  # nothing to send yet
    rng = np.random.default_rng(0)
    ups = {c: (rng.normal(size=(K, 5)).astype(np.float32), rng.integers(0, 5, K)) for c in ("c0", "c1", "c2")}
    ups["c1"][1][2] = 0
    results = {c: wire(upload(p, n)) for c, (p, n) in ups.items()}
    for c, res in results.items():
        server.validate(phase, c, res)
    assert server.collect(phase, results) is None
    want = sum(n[:, None].astype(np.float64) * p for p, n in ups.values()) / sum(n for _, n in ups.values())[:, None]
    np.testing.assert_allclose(server.prototypes, want, rtol=1e-6, atol=1e-6)
    nxt = server.begin_round(1)
    for task in nxt.tasks.values():
        task = wire(task)
        np.testing.assert_array_equal(task.tensors[GLOBAL_KEY], server.prototypes)
        assert task.tensors[MASK_KEY].dtype == np.uint8 and task.tensors[MASK_KEY].tolist() == [1, 1, 1, 1]


# -- eq. 5 and the local loss ---------------------------------------------------------------------

def test_local_prototypes_are_per_class_mean_features():
    torch.manual_seed(0)
    model = TinyNet(k=K)
    data = toy_dataset(n=30, k=K, seed=1)
    y = data.y.copy()
    y[y == 3] = 0  # class 3 absent
    x = torch.from_numpy(data.x)
    protos, counts = local_prototypes(model, x, torch.from_numpy(y), K)
    with torch.no_grad():
        h = model.features(x).numpy()
    assert counts.tolist() == [int((y == j).sum()) for j in range(K)] and counts[3] == 0
    for j in range(3):
        np.testing.assert_allclose(protos[j], h[y == j].mean(axis=0), rtol=1e-5, atol=1e-6)
    assert not protos[3].any() and protos.dtype == np.float32


def test_proto_distance_is_the_authors_mse_with_absent_classes_adding_zero():
    h = torch.tensor([[1.0, 2.0], [3.0, 5.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 2])
    glob = torch.tensor([[0.0, 0.0], [3.0, 3.0], [9.0, 9.0]])
    mask = torch.tensor([True, True, False])
    # rows 0 and 1 against their prototypes, row 2 (no global prototype) adds 0; mean over B * d = 6
    assert proto_distance(h, y, glob, mask).item() == pytest.approx((1 + 4 + 0 + 4) / 6)


def test_zero_lambda_is_local_training_step_for_step():
    data = toy_dataset(n=40, k=K, seed=2)
    glob = {GLOBAL_KEY: np.random.default_rng(1).normal(size=(K, 8)).astype(np.float32),
            MASK_KEY: np.ones(K, np.uint8)}

    def trained(cls, strategy, lam=None):
        torch.manual_seed(5)
        p = params(strategy, **({} if lam is None else {"proto_lambda": lam}), local_epochs=0, tau=4)
        client = cls("c0", TinyNet(k=K), data, None, p, seed=11)
        for r in range(3):
            client.handle(Message({"phase": "local_train", "round": r, "iteration": 0, "steps": 4}, glob))
        return client.model.state_dict()

    local = trained(LocalClient, "local")
    proto = trained(FedProtoClient, "fedproto", 0.0)
    assert local.keys() == proto.keys() and all(torch.equal(local[k], proto[k]) for k in local)
    # ... and the comparison can fail: with lambda 1 the same global prototypes move the weights
    pulled = trained(FedProtoClient, "fedproto", 1.0)
    assert not all(torch.equal(local[k], pulled[k]) for k in local)


def test_a_step_with_prototypes_minimises_ce_plus_lambda_times_the_distance():
    data = toy_dataset(n=16, k=K, seed=3)
    glob = np.random.default_rng(2).normal(size=(K, 8)).astype(np.float32)
    mask = np.array([1, 1, 0, 1], np.uint8)
    torch.manual_seed(1)
    p = params(proto_lambda=0.7, local_epochs=0, optimizer="sgd", lr=0.1, batch_size=16)
    client = FedProtoClient("c0", TinyNet(k=K), data, None, p, seed=4)
    ref = copy.deepcopy(client.model)
    res = client.handle(Message({"phase": "local_train", "round": 1, "iteration": 0, "steps": 1},
                                {GLOBAL_KEY: glob, MASK_KEY: mask}))
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)  # batch_size = n: the batch is every row
    h = ref.features(x)
    dist = proto_distance(h, y, torch.from_numpy(glob), torch.from_numpy(mask.astype(bool)))
    loss = F.cross_entropy(ref.head(h), y) + 0.7 * dist
    loss.backward()
    for (name, got), want in zip(client.model.named_parameters(), ref.parameters()):
        assert torch.allclose(got, want - 0.1 * want.grad, atol=1e-6), name
    assert res.meta["proto_loss"] == pytest.approx(dist.item(), rel=1e-5)
    assert res.meta["loss"] == pytest.approx(loss.item(), rel=1e-5)


# -- fedproto-public --------------------------------------------------------------------------------

def test_public_variant_averages_row_by_row_and_steps_towards_the_others_mean():
    tau, n, b = 2, 3, 6
    p = params("fedproto-public", tau=tau, public_batch_size=b, optimizer="sgd", lr=0.5, proto_lambda=2.0)
    public = np.random.default_rng(0).normal(size=(20, 6)).astype(np.float32)
    ids = [f"c{i}" for i in range(n)]
    clients = {}
    for i, cid in enumerate(ids):
        torch.manual_seed(i)
        clients[cid] = FedProtoPublicClient(cid, TinyNet(k=K), toy_dataset(k=K, seed=i), public, p, seed=i)
    server = FedProtoPublicServer(p, ids, ServerContext(num_classes=K, public_size=20, seed=0))
    phase = server.begin_round(0)
    results = {c: wire(clients[c].handle(wire(t))) for c, t in phase.tasks.items()}
    for c, res in results.items():
        server.validate(phase, c, res)
    feats = {c: r.tensors[FEATURES_KEY] for c, r in results.items()}
    before = {c: copy.deepcopy(clients[c].model) for c in ids}
    nxt = server.collect(phase, results)
    assert nxt.phase == "transfer" and nxt.iteration == 0
    mean = np.mean([feats[c].astype(np.float64) for c in ids], axis=0)
    for task in nxt.tasks.values():
        np.testing.assert_allclose(task.tensors[AVERAGE_KEY], mean, rtol=1e-6, atol=1e-6)
        assert task.meta["n_avg"] == n
    c0 = "c0"
    clients[c0].handle(wire(nxt.tasks[c0]))
    # by hand: one SGD step on lambda * MSE(h, (n * mean - h_own) / (n - 1)) through the uploaded forward
    ref = before[c0]
    ref.train()
    from fedal.strategies.public_rows import public_rows
    rows = torch.from_numpy(public_rows(p.rows_seed or 0, 0, 0, 20, b))
    h = ref.features(torch.from_numpy(public)[rows])
    target = (n * torch.from_numpy(mean.astype(np.float32)) - h.detach()) / (n - 1)
    (2.0 * F.mse_loss(h, target)).backward()
    for (name, got), want in zip(clients[c0].model.named_parameters(), ref.parameters()):
        if name.startswith("net.2"):  # the head: the feature term does not reach it
            assert want.grad is None and torch.equal(got, want), name
        else:
            assert torch.allclose(got, want - 0.5 * want.grad, atol=1e-6), name


# -- one feature width ------------------------------------------------------------------------------

def test_server_refuses_an_upload_of_another_feature_width():
    server = FedProtoServer(params(), ["c0", "c1"], ServerContext(num_classes=K, public_size=0, seed=0))
    phase = server.begin_round(0)
    server.validate(phase, "c0", upload(np.zeros((K, 8)), [1, 1, 1, 1]))
    with pytest.raises(InvalidResult, match="feature width 5, this run's is 8") as exc:
        server.validate(phase, "c1", upload(np.zeros((K, 5)), [1, 1, 1, 1]))
    assert exc.value.kind == "feature_dim"
    pub = FedProtoPublicServer(params("fedproto-public", public_batch_size=4), ["c0", "c1"],
                               ServerContext(num_classes=K, public_size=10, seed=0))
    phase = pub.begin_round(0)
    meta = {"phase": "local_train", "round": 0, "iteration": 0, "loss": 1.0}
    pub.validate(phase, "c0", Message(meta, {FEATURES_KEY: np.zeros((4, 8), np.float32)}))
    with pytest.raises(InvalidResult, match="feature width 6") as exc:
        pub.validate(phase, "c1", Message(meta, {FEATURES_KEY: np.zeros((4, 6), np.float32)}))
    assert exc.value.kind == "feature_dim"


def test_client_refuses_global_prototypes_of_another_width():
    client = FedProtoClient("c0", TinyNet(k=K), toy_dataset(k=K), None, params(), seed=0)
    task = Message({"phase": "local_train", "round": 1, "iteration": 0, "steps": 1},
                   {GLOBAL_KEY: np.zeros((K, 5), np.float32), MASK_KEY: np.ones(K, np.uint8)})
    with pytest.raises(ValueError, match="feature width"):
        client.handle(task)


@pytest.mark.parametrize("strategy", ["fedproto", "fedproto-public"])
def test_a_run_with_mixed_widths_rejects_the_other_width_and_goes_on(strategy):
    """The first accepted upload fixes d (c0: 8); c1 (width 5) is rejected, counted under
    feature_dim, every round; c2 (width 8) takes part."""
    p = params(strategy, tau=2, public_batch_size=5)
    public = np.random.default_rng(0).normal(size=(20, 6)).astype(np.float32)
    ids = ["c0", "c1", "c2"]
    spec = get_strategy(strategy)
    clients = {}
    for i, (cid, hidden) in enumerate(zip(ids, (8, 5, 8))):
        torch.manual_seed(i)
        clients[cid] = spec.client(cid, WideNet(hidden), toy_dataset(k=K, seed=i), public, p, seed=i)
    server = spec.server(p, ids, ServerContext(num_classes=K, public_size=20, seed=0))
    engine = in_process(server, clients)
    for r in range(2):
        record = engine.run_round(r)
        assert record["rejected"] >= 1
    assert engine.reject_reasons["feature_dim"] >= 2 and server.feature_dim == 8
    if strategy == "fedproto":
        assert server.prototypes.shape == (K, 8) and server.mask.any()


def test_simulate_takes_models_of_one_width_and_refuses_mixed_widths():
    from fedal.sim import build_run, load_config
    from fedal.sim.config import ConfigError

    config = load_config(None, dict(strategy="fedproto", dataset="mnist1d", clients=2, rounds=1)).resolved()
    assert config.models == ["mlp", "cnn1d_wide"]
    _, clients, _ = build_run(config)
    assert {c.feature_dim for c in clients.values()} == {100}
    mixed = load_config(None, dict(strategy="fedproto-public", dataset="mnist1d", clients=2, rounds=1,
                                   models=["mlp", "cnn1d"])).resolved()
    with pytest.raises(ConfigError, match="one feature width on every client.*'cnn1d': 240"):
        build_run(mixed)
