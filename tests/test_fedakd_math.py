"""FedAKD's math: the FedAvg reduction, the two distillation losses, the selection, the
data-size weighting, the persistent personal model, and collaborative fairness."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedal.protocol import Message
from fedal.sim.fairness import collaborative_fairness, fairness_summary
from fedal.strategies import InvalidResult, ServerContext, StrategyParams, get_strategy
from fedal.strategies.fedakd import FedAKDServer, distill, select
from fedal.strategies.local import local_batches
from tests.helpers import in_process, toy_dataset

K = 4


class TinyBNNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear: BatchNorm buffers must be averaged like weights."""

    def __init__(self, d_in: int = 6, k: int = K):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, k))

    def forward(self, x):
        return self.net(x)


def federation(strategy: str, sizes=(30, 55, 17), **overrides):
    spec = get_strategy(strategy)
    params = StrategyParams(**overrides).resolve(spec.preset)
    ids = [f"c{i}" for i in range(len(sizes))]
    clients = {}
    for i, (cid, n) in enumerate(zip(ids, sizes)):
        torch.manual_seed(100 + i)
        clients[cid] = spec.client(cid, TinyBNNet(), toy_dataset(n=n, k=K, seed=i), None, params, seed=7 + i)
    server = spec.server(params, ids, ServerContext(num_classes=K, public_size=0, seed=0))
    return server, clients


def numpy_state(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("local_epochs, tau", [(1, 5), (2, 5), (0, 6)])
def test_beta_zero_and_selection_all_is_exactly_one_fedavg_round(local_epochs, tau, one_torch_thread):
    # alpha stays 1: step 1 trains the personal model, but with beta = 0 and I_k = D_k nothing of
    # it may reach the upload
    fedavg, avg_clients = federation("fedavg", local_epochs=local_epochs, tau=tau)
    fedakd, akd_clients = federation("fedakd", local_epochs=local_epochs, tau=tau, akd_beta=0.0, akd_selection="all")
    in_process(fedavg, avg_clients).run_round(0)
    in_process(fedakd, akd_clients).run_round(0)
    assert set(fedavg.global_weights) == set(fedakd.global_weights)
    assert any("running_mean" in k for k in fedakd.global_weights)  # BatchNorm buffers travel and are averaged
    for k, v in fedavg.global_weights.items():
        np.testing.assert_array_equal(fedakd.global_weights[k], v)
    for cid in avg_clients:  # each client's upload is FedAvg's local model, output for output
        x = avg_clients[cid].x_train
        with torch.no_grad():
            want = avg_clients[cid].model.eval()(x)
            got = akd_clients[cid].global_model.eval()(x)
        assert torch.max(torch.abs(want - got)) <= 1e-7
    # ...while the personal models did train (step 1 ran) and are not what was uploaded
    personal = numpy_state(akd_clients["c0"].model)
    assert any(not np.array_equal(personal[k], fedakd.global_weights[k]) for k in personal if "weight" in k)


def test_default_fedakd_is_not_fedavg(one_torch_thread):
    fedavg, avg_clients = federation("fedavg", local_epochs=1)
    fedakd, akd_clients = federation("fedakd")
    in_process(fedavg, avg_clients).run_round(0)
    in_process(fedakd, akd_clients).run_round(0)
    diff = max(float(np.max(np.abs(fedavg.global_weights[k] - fedakd.global_weights[k])))
               for k in fedavg.global_weights if "weight" in k)
    assert diff > 1e-4


def test_fedakd_preset_is_the_papers():
    p = StrategyParams().resolve(get_strategy("fedakd").preset)
    assert (p.akd_alpha, p.akd_beta, p.akd_temperature, p.local_epochs, p.batch_size) == (1.0, 1.0, 1.0, 1, 32)
    assert p.akd_selection == "correct" and p.akd_confidence == 0.0 and p.optimizer == "adam"
    assert StrategyParams().resolve(get_strategy("fedavg").preset).local_epochs == 0  # others keep tau steps


def test_selection_keeps_exactly_the_correctly_classified():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.1, 0.0, 0.0], [0.0, 0.0, 1.0]])
    y = torch.tensor([0, 2, 0, 2])
    assert select(logits, y, "correct").tolist() == [True, False, True, True]
    assert select(logits, y, "all").tolist() == [True] * 4
    # the optional confidence threshold drops the barely-right third row (p = 0.36)
    assert select(logits, y, "correct", confidence=0.5).tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="unknown selection"):
        select(logits, y, "confident")


def test_client_selects_what_its_personal_model_gets_right(one_torch_thread):
    server, clients = federation("fedakd")
    engine = in_process(server, clients)
    engine.run_round(0)
    for r in (1, 2):
        w_g = {k: v.copy() for k, v in server.global_weights.items()}
        for c in clients.values():
            reply = c.handle(Message({"phase": "train", "round": r, "iteration": 0, "steps": 5}, w_g))
            # after the call the personal model is the one step 2 used (step 3 leaves it alone)
            correct = int((c.predict(c.x_train).argmax(dim=1) == c.y_train).sum())
            assert reply.meta["selected"] == correct and reply.meta["num_samples"] == len(c.y_train)


def test_empty_selection_uploads_the_global_model_unchanged(one_torch_thread):
    # nothing reaches a 0.99 confidence after one tiny-step epoch: I_k is empty
    server, clients = federation("fedakd", akd_confidence=0.99, lr=1e-6)
    in_process(server, clients).run_round(0)
    before = {k: v.copy() for k, v in server.global_weights.items()}
    c = clients["c1"]
    reply = c.handle(Message({"phase": "train", "round": 1, "iteration": 0}, before))
    assert reply.meta["selected"] == 0 and reply.meta["global_loss"] is None  # NaN travels as null
    for k, v in before.items():
        np.testing.assert_array_equal(reply.tensors[k], v)


def test_distillation_loss_is_ce_plus_weighted_t2_kl():
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    teacher = torch.randn(8, 3)
    weight, temp, lr = 0.7, 2.5, 0.1
    distill(model, torch.optim.SGD(model.parameters(), lr=lr), x, y, teacher, weight, temp, [torch.arange(8)])
    # by hand: CE + weight * T^2 * sum_j p_t log(p_t / p_s) / B with p = softmax(./T), target first
    out = ref(x)
    p_t = F.softmax(teacher / temp, dim=1)
    log_p_s = F.log_softmax(out / temp, dim=1)
    kl = (p_t * (p_t.log() - log_p_s)).sum(dim=1).mean()
    (F.cross_entropy(out, y) + weight * temp**2 * kl).backward()
    with torch.no_grad():
        for p_model, p_ref in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p_model, p_ref - lr * p_ref.grad, rtol=0, atol=1e-6)


def test_epoch_batches_cover_every_row_once_per_pass():
    params = StrategyParams(local_epochs=2, batch_size=4)
    batches = list(local_batches(10, params, steps=99, generator=torch.Generator().manual_seed(0)))
    # 10 rows: 4, 4, 2 per pass; a pass is a permutation
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    assert sorted(torch.cat(batches[:3]).tolist()) == list(range(10))
    assert sorted(torch.cat(batches[3:]).tolist()) == list(range(10))
    # a last batch of one row joins the one before (BatchNorm cannot train on a single row)
    odd = list(local_batches(9, params, steps=1, generator=torch.Generator().manual_seed(0)))
    assert [len(b) for b in odd] == [4, 5, 4, 5]
    steps = list(local_batches(10, StrategyParams(local_epochs=0, batch_size=4), steps=3,
                               generator=torch.Generator().manual_seed(0)))
    assert [len(b) for b in steps] == [4, 4, 4]


def test_aggregation_weights_uploads_by_local_data_size():
    params = StrategyParams().resolve(get_strategy("fedakd").preset)
    server = FedAKDServer(params, ["a", "b", "c"], ServerContext(num_classes=K, public_size=0, seed=0))
    init = server.begin_round(0)
    start = {"w": np.zeros(2, np.float32), "bn.running_var": np.ones(2, np.float32),
             "bn.num_batches_tracked": np.array(0, np.int64)}
    train = server.collect(init, {"a": Message({"phase": "init", "round": 0, "iteration": 0}, start)})
    assert train.phase == "train" and set(train.tasks) == {"a", "b", "c"}

    def upload(w, var, count, n, selected):
        return Message({"phase": "train", "round": 0, "iteration": 0, "num_samples": n, "selected": selected,
                        "loss": 1.0, "global_loss": 0.5},
                       {"w": np.array(w, np.float32), "bn.running_var": np.array(var, np.float32),
                        "bn.num_batches_tracked": np.array(count, np.int64)})

    results = {"a": upload([1, 2], [2, 2], 10, 100, 50), "b": upload([4, 8], [5, 1], 20, 300, 300),
               "c": upload([0, 0], [1, 1], 3, 600, 0)}
    for cid, res in results.items():
        server.validate(train, cid, res)
    for bad in (-1, 101, 2.5, None, True):  # |I_k| must be a count within |D_k|: refused, never averaged
        with pytest.raises(InvalidResult, match="selected"):
            server.validate(train, "a", upload([1, 2], [2, 2], 10, 100, bad))
    assert server.collect(train, results) is None
    np.testing.assert_allclose(server.global_weights["w"], [(100 * 1 + 300 * 4) / 1000, (100 * 2 + 300 * 8) / 1000])
    np.testing.assert_allclose(server.global_weights["bn.running_var"], [(200 + 1500 + 600) / 1000, (200 + 300 + 600) / 1000])
    assert int(server.global_weights["bn.num_batches_tracked"]) == 8  # floor(1 + 6 + 1.8)
    # |I_k| does not weigh: a client that selected nothing still counts with its |D_k|
    metrics = server.round_metrics()
    assert metrics["selected_frac"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert metrics["participation"] == 1.0


def test_personal_model_persists_and_survives_a_checkpoint(one_torch_thread):
    server, clients = federation("fedakd")
    engine = in_process(server, clients)
    engine.run_round(0)
    engine.run_round(1)
    c = clients["c2"]
    # the personal model is not reset to the global model at a round's start
    assert any(not np.array_equal(v, server.global_weights[k]) for k, v in numpy_state(c.model).items() if "weight" in k)
    # a client restored from the state a device checkpoints answers the next round identically
    torch.manual_seed(999)
    twin = get_strategy("fedakd").client("c2", TinyBNNet(), c.train_data, None, c.params, seed=12345)
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)  # as the agent checkpoints: only tensors and plain data
    buf.seek(0)
    twin.load_state_dict(torch.load(buf, weights_only=True))
    task = Message({"phase": "train", "round": 2, "iteration": 0}, server.global_weights)
    a, b = c.handle(task), twin.handle(task)
    assert a.meta == b.meta
    for k in a.tensors:
        np.testing.assert_array_equal(a.tensors[k], b.tensors[k])
    for k, v in numpy_state(c.model).items():
        np.testing.assert_array_equal(numpy_state(twin.model)[k], v)


def test_first_round_starts_the_personal_model_from_the_global_model(one_torch_thread):
    server, clients = federation("fedakd", akd_alpha=0.0, lr=1e-12)  # step 1 leaves w_k (almost) where it starts
    in_process(server, clients).run_round(0)
    init = numpy_state(clients["c0"].model)  # c0 uploaded the initial weights; c1 must start from them
    for k, v in numpy_state(clients["c1"].model).items():
        if "weight" in k or "bias" in k:
            np.testing.assert_allclose(v, init[k], atol=1e-9)


def test_collaborative_fairness_on_hand_built_numbers():
    assert collaborative_fairness([0.5, 0.6, 0.7], [0.6, 0.7, 0.8]) == pytest.approx(100.0)
    assert collaborative_fairness([0.5, 0.6, 0.7], [0.8, 0.7, 0.6]) == pytest.approx(-100.0)
    # Pearson([1, 2, 3, 4], [1, 3, 2, 4]) = 0.8
    assert collaborative_fairness([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(80.0)
    # clients without a number on either side are left out
    assert collaborative_fairness([1, 2, None, 3, 4], [1, 3, 0.5, 2, 4]) == pytest.approx(80.0)
    assert collaborative_fairness([0.5, 0.5, 0.5], [0.1, 0.2, 0.3]) is None  # undefined, not 0 or NaN
    # a mean that is not exactly representable: np.std of these is 1e-17, and CF came out 2e-14
    assert collaborative_fairness([0.1] * 7, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]) is None
    assert collaborative_fairness([0.1, 0.2, 0.3], [0.7] * 3) is None
    assert collaborative_fairness([0.5], [0.1]) is None


def test_fairness_summary_prefers_the_local_test_accuracies():
    fed = {"client_acc": [0.1, 0.2, 0.3], "client_local_acc": [0.4, 0.2, 0.9]}
    alone = {"client_acc": [0.3, 0.2, 0.1], "client_local_acc": [0.5, 0.1, 0.6]}
    out = fairness_summary(fed, alone)
    assert out["cf_on"] == "local_test" and out["standalone_acc"] == [0.3, 0.2, 0.1]
    assert out["standalone_local_acc"] == [0.5, 0.1, 0.6]
    assert out["cf"] == pytest.approx(100 * np.corrcoef([0.5, 0.1, 0.6], [0.4, 0.2, 0.9])[0, 1])
    out = fairness_summary({"client_acc": [0.1, 0.2, 0.3]}, {"client_acc": [0.3, 0.2, 0.1]})
    assert out["cf_on"] == "test" and out["cf"] == pytest.approx(-100.0)
