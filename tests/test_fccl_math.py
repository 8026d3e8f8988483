"""FCCL and FCCL+ against their math (docs/algorithms.md, FCCL): the cross-correlation loss and the
instance-similarity loss on hand-built inputs, all regulariser weights 0 as `local` step for step,
the non-forgetting teachers (pretrained model, previous round's model), and refused uploads."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.strategies import get_strategy, optim
from fedal.strategies.fccl import (
    S_KEY,
    SBAR_KEY,
    Z_KEY,
    ZBAR_KEY,
    FCCLClient,
    FCCLPlusClient,
    batch_normalise,
    cross_correlation_loss,
    instance_similarity,
    instance_similarity_loss,
    kd_term,
    non_target_kl,
)
from fedal.strategies.params import StrategyParams
from tests.helpers import TinyNet, in_process, toy_dataset, toy_federation

pytestmark = pytest.mark.usefixtures("one_torch_thread")
K = 4


def params(strategy: str, **kw) -> StrategyParams:
    return StrategyParams(**kw).resolve(get_strategy(strategy).preset)


# -- the cross-correlation loss ---------------------------------------------------------------------

def test_batch_normalise_centres_and_scales_each_column():
    z = torch.tensor([[1.0, 10.0], [3.0, 10.0], [5.0, 10.0], [7.0, 10.0]])
    zn = batch_normalise(z)
    # column 0: mean 4, population variance 5; column 1 is constant and becomes 0
    torch.testing.assert_close(zn[:, 0], (z[:, 0] - 4) / np.sqrt(5 + 1e-8))
    assert zn[:, 1].abs().max().item() == 0.0


def test_cross_correlation_loss_is_zero_for_identical_decorrelated_inputs_and_hand_computed_otherwise():
    # two orthogonal, centred, unit-variance columns: C = I for identical inputs
    z = torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    assert cross_correlation_loss(batch_normalise(z), batch_normalise(z), 0.0051).item() == pytest.approx(0.0, abs=1e-6)
    # the average's columns swapped and one flipped: C = [[0, 1], [-1, 0]] / ... by hand:
    other = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])  # column 0 = z's column 1, column 1 = z's 0
    c = batch_normalise(z).T @ batch_normalise(other) / 4
    torch.testing.assert_close(c, torch.tensor([[0.0, 1.0], [1.0, 0.0]]), atol=1e-6, rtol=0)
    # on-diagonal (0-1)^2 twice = 2, off-diagonal 1^2 twice = 2, weighted by lambda
    assert cross_correlation_loss(batch_normalise(z), batch_normalise(other), 0.5).item() == pytest.approx(2 + 0.5 * 2, 1e-6)
    # identical but correlated columns: only the off-diagonal term remains
    corr = torch.tensor([[1.0, 1.0], [1.0, 1.0], [-1.0, 1.0], [-1.0, -1.0]])
    zc = batch_normalise(corr)
    cc = (zc.T @ zc / 4)[0, 1].item()
    assert cc != 0
    assert cross_correlation_loss(zc, zc, 0.25).item() == pytest.approx(0.25 * 2 * cc**2, abs=1e-6)


# -- the instance-similarity loss (FCCL+) ------------------------------------------------------------

def test_instance_similarity_drops_the_diagonal_and_the_loss_is_kl_of_the_rows():
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    s = instance_similarity(h)
    r = float(1 / np.sqrt(2))
    torch.testing.assert_close(s, torch.tensor([[0.0, r], [0.0, r], [r, r]]), atol=1e-6, rtol=0)
    assert instance_similarity_loss(s, s.clone(), 0.02).item() == pytest.approx(0.0, abs=1e-7)
    target = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, -0.5]])
    t = 0.5
    want = 0.0
    for i in range(3):  # KL(softmax(target/t) || softmax(s/t)) per row, mean over rows
        q = np.exp(target[i].numpy() / t) / np.exp(target[i].numpy() / t).sum()
        p = np.exp(s[i].numpy() / t) / np.exp(s[i].numpy() / t).sum()
        want += float((q * np.log(q / p)).sum()) / 3
    assert instance_similarity_loss(s, target, t).item() == pytest.approx(want, rel=1e-5)


def test_non_target_kl_drops_the_label_column_without_renormalising():
    student = torch.tensor([[2.0, 0.0, -1.0]])
    teacher = torch.tensor([[0.0, 1.0, 1.0]])
    y = torch.tensor([1])
    p = F.softmax(student, dim=1)[0, [0, 2]]
    q = F.softmax(teacher, dim=1)[0, [0, 2]]
    want = float((q * (q.log() - p.log())).sum())
    assert non_target_kl(student, teacher, y, 1.0).item() == pytest.approx(want, rel=1e-6)
    # a teacher that differs only on the label column teaches nothing ... at T, times T^2
    assert non_target_kl(student, student.clone(), y, 3.0).item() == pytest.approx(0.0, abs=1e-7)


# -- weights 0 = local training ---------------------------------------------------------------------

ZERO = {"fccl_col_weight": 0.0, "fccl_inter_weight": 0.0}


@pytest.mark.parametrize("strategy", ["fccl", "fccl-plus"])
def test_zero_weights_are_local_training_step_for_step(strategy):
    extra = {"fccl_intra_weight": 0.0, "fccl_pretrain_epochs": 0} if strategy == "fccl" else {"fccl_isl_weight": 0.0}

    def trained(strategy_name, **kw):
        server, clients, _ = toy_federation(strategy_name, n_clients=2, k=K, tau=3, **kw)
        for r in range(3):
            in_process(server, clients).run_round(r)
        return clients["c0"].model.state_dict()

    local = trained("local")
    zero = trained(strategy, **ZERO, **extra)
    assert all(torch.equal(local[k], zero[k]) for k in local)
    pulled = trained(strategy, **extra)  # ... and with the weights on it differs
    assert not all(torch.equal(local[k], pulled[k]) for k in local)


# -- the non-forgetting teachers --------------------------------------------------------------------

def test_teachers_are_the_pretrained_and_the_previous_rounds_model():
    server, clients, _ = toy_federation("fccl", n_clients=2, k=K, tau=2, fccl_pretrain_epochs=2)
    c = clients["c0"]
    initial = {k: v.clone() for k, v in c.model.state_dict().items()}
    rec = in_process(server, clients).run_round(0)
    assert rec["server"]["pretrain_loss"] > 0
    pretrained = c.intra.state_dict()
    assert not all(torch.equal(initial[k], pretrained[k]) for k in initial)
    after0 = {k: v.clone() for k, v in c.model.state_dict().items()}
    assert all(torch.equal(c.inter.state_dict()[k], after0[k]) for k in after0)  # inter: the model this round left
    in_process(server, clients).run_round(1)
    # intra stays theta*, inter moved on to round 1's result
    assert all(torch.equal(c.intra.state_dict()[k], pretrained[k]) for k in pretrained)
    assert all(torch.equal(c.inter.state_dict()[k], c.model.state_dict()[k]) for k in after0)
    assert not all(torch.equal(c.inter.state_dict()[k], after0[k]) for k in after0)


def test_non_target_kl_stays_finite_where_both_probabilities_underflow():
    """A logit gap of 1000 at T = 3: both softmaxes put exactly 0 on the far class, whose term is
    0 (as kd_term gives), where log(softmax) made it 0 * log 0 = NaN, in the loss and gradient."""
    student = torch.tensor([[1000.0, 0.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[1000.0, 0.0, 0.0]])
    loss = non_target_kl(student, teacher, torch.tensor([1]), 3.0)
    loss.backward()
    assert torch.isfinite(loss) and loss.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(student.grad).all()


def test_local_update_distils_from_the_teachers_it_names():
    """One local step equals a hand-built step on CE + KL(inter) + KL(intra) with the stored teachers."""
    data = toy_dataset(n=20, k=K, seed=4)
    p = params("fccl", tau=1, fccl_pretrain_epochs=1, fccl_temperature=2.0, fccl_inter_weight=0.7,
               fccl_intra_weight=0.3)
    torch.manual_seed(1)
    client = FCCLClient("c0", TinyNet(k=K), data, np.zeros((4, 6), np.float32), p, seed=3)
    client.pretrain()
    with torch.no_grad():  # make the two teachers differ: inter a perturbed copy
        for w in client.inter.module.parameters():
            w.add_(0.5)
    model, gen = TinyNet(k=K), torch.Generator()
    model.load_state_dict(client.model.state_dict())
    gen.set_state(client.generator.get_state())
    opt = optim.Adam(model.parameters(), lr=p.lr)  # the clients' own Adam
    opt.load_state_dict(copy.deepcopy(client.optimizer.state_dict()))  # (a state_dict holds live tensors)
    idx = torch.randperm(len(data.y), generator=gen)[: p.batch_size]
    x, y = torch.from_numpy(data.x)[idx], torch.from_numpy(data.y)[idx]
    out = model(x)
    loss = (F.cross_entropy(out, y) + 0.7 * kd_term(out, client.inter(x), 2.0)
            + 0.3 * kd_term(out, client.intra(x), 2.0))
    opt.zero_grad()
    loss.backward()
    opt.step()
    client.local_update(1)
    assert all(torch.equal(model.state_dict()[k], client.model.state_dict()[k]) for k in model.state_dict())


def test_fccl_plus_has_no_pretraining_and_its_first_inter_teacher_is_the_initial_model():
    server, clients, _ = toy_federation("fccl-plus", n_clients=2, k=K, tau=2)
    c = clients["c1"]
    initial = {k: v.clone() for k, v in c.model.state_dict().items()}
    assert server.begin_round(0).phase == "collaborate"
    assert all(torch.equal(c.inter.state_dict()[k], initial[k]) for k in initial) and c.intra is None
    plus = get_strategy("fccl-plus")  # pretraining is fccl's knob: fccl-plus refuses it
    assert StrategyParams(fccl_pretrain_epochs=5).foreign(plus.params, plus.preset) == ["fccl_pretrain_epochs"]


# -- what travels ------------------------------------------------------------------------------------

def test_uploads_are_normalised_and_the_feedback_is_their_mean():
    server, clients, _ = toy_federation("fccl-plus", n_clients=3, k=K, tau=2)
    phase = server.begin_round(0)
    results = {cid: clients[cid].handle(task) for cid, task in phase.tasks.items()}
    for cid, res in results.items():
        server.validate(phase, cid, res)
        z = res.tensors[Z_KEY]
        np.testing.assert_allclose(z.mean(axis=0), 0, atol=1e-5)
        np.testing.assert_allclose(z.var(axis=0), 1, atol=1e-4)
        assert res.tensors[S_KEY].shape == (z.shape[0], z.shape[0] - 1)
    nxt = server.collect(phase, results)
    for task in nxt.tasks.values():
        np.testing.assert_allclose(task.tensors[ZBAR_KEY], np.mean([r.tensors[Z_KEY] for r in results.values()], axis=0),
                                   atol=1e-6)
        np.testing.assert_allclose(task.tensors[SBAR_KEY], np.mean([r.tensors[S_KEY] for r in results.values()], axis=0),
                                   atol=1e-6)
        assert task.meta["n_avg"] == 3


@pytest.mark.parametrize("strategy", ["fccl", "fccl-plus", "fedal"])
def test_the_server_decodes_each_upload_once(strategy, monkeypatch):
    """validate decodes a result's tensors and collect averages what it decoded; a result collect
    gets that validate did not see (another object) is decoded then, to the same average."""
    import fedal.strategies.fccl as fccl_module
    import fedal.strategies.fedal as fedal_module

    module = fedal_module if strategy == "fedal" else fccl_module
    server, clients, _ = toy_federation(strategy, n_clients=3, k=K, tau=2, lambda_adv=0.0)
    phase = server.begin_round(0)
    uploads_in = "local_train" if strategy == "fedal" else "collaborate"  # the phase whose results carry uploads
    while phase.phase != uploads_in:
        results = {cid: clients[cid].handle(task) for cid, task in phase.tasks.items()}
        phase = server.collect(phase, results)
    results = {cid: clients[cid].handle(task) for cid, task in phase.tasks.items()}
    decoded = []
    real = module.decode_tensor

    def counted(tensors, name, *args, **kwargs):
        decoded.append(name)
        return real(tensors, name, *args, **kwargs)

    monkeypatch.setattr(module, "decode_tensor", counted)
    for cid, res in results.items():
        server.validate(phase, cid, res)
    names = len(decoded)
    assert names == 3 * (2 if strategy == "fccl-plus" else 1)
    first = server.collect(phase, results)
    assert len(decoded) == names  # collect decoded nothing again
    again = {cid: Message(res.meta, dict(res.tensors)) for cid, res in results.items()}  # never validated
    second = server.collect(phase, again)
    assert len(decoded) == 2 * names
    for cid in first.tasks:
        for name, value in first.tasks[cid].tensors.items():
            np.testing.assert_array_equal(value, second.tasks[cid].tensors[name])


@pytest.mark.parametrize("bad", ["raw_logits", "similarity_above_one", "extra_tensor", "wrong_shape"])
def test_bad_uploads_are_refused_counted_and_left_out_of_the_average(bad):
    server, clients, _ = toy_federation("fccl-plus", n_clients=3, k=K, tau=2)

    class Broken:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def handle(self, task):
            res = self.inner.handle(task)
            if task.phase != "collaborate":
                return res
            t = dict(res.tensors)
            if bad == "raw_logits":
                t[Z_KEY] = t[Z_KEY] * 3 + 1
            elif bad == "similarity_above_one":
                t[S_KEY] = t[S_KEY] * 2
            elif bad == "extra_tensor":
                t["logits"] = t[Z_KEY]
            else:
                t[Z_KEY] = t[Z_KEY][:, :-1]
            return Message(res.meta, t)

    clients["c2"] = Broken(clients["c2"])
    seen = []
    original = server._average

    def spy(results):
        seen.append(sorted(results))
        return original(results)

    server._average = spy
    rec = in_process(server, clients).run_round(0)
    assert rec["rejected"] == 2  # both of c2's uploads (tau 2)
    assert seen and all(s == ["c0", "c1"] for s in seen)


def test_a_client_refuses_an_average_for_an_upload_it_did_not_make():
    data = toy_dataset(n=20, k=K, seed=1)
    client = FCCLPlusClient("c0", TinyNet(k=K), data, np.random.default_rng(0).normal(size=(10, 6)).astype(np.float32),
                            params("fccl-plus", tau=2, public_batch_size=4), seed=0)
    task = Message({"phase": "collaborate", "round": 0, "iteration": 1, "n_avg": 1},
                   {ZBAR_KEY: np.zeros((4, K), np.float32), SBAR_KEY: np.zeros((4, 3), np.float32)})
    with pytest.raises(ValueError, match="did not upload"):
        client.handle(task)
    client.handle(Message({"phase": "collaborate", "round": 0, "iteration": 0, "n_avg": 0}))
    before = {k: v.clone() for k, v in client.model.state_dict().items()}
    wrong = Message(task.meta, {ZBAR_KEY: np.zeros((4, K), np.float16), SBAR_KEY: np.zeros((4, 3), np.float32)})
    with pytest.raises(ValueError):
        client.handle(wrong)
    assert client.pending is not None  # a refused form leaves the upload waiting
    assert all(torch.equal(before[k], client.model.state_dict()[k]) for k in before)


@pytest.mark.parametrize("wire_dtype", ["float16", "int8"])
@pytest.mark.parametrize("strategy", ["fccl", "fccl-plus"])
def test_reduced_precision_uploads_pass_the_normalisation_check(strategy, wire_dtype):
    server, clients, _ = toy_federation(strategy, n_clients=3, k=K, tau=2, wire_dtype=wire_dtype,
                                        **({"fccl_pretrain_epochs": 1} if strategy == "fccl" else {}))
    for r in range(2):
        rec = in_process(server, clients).run_round(r)
        assert rec.get("rejected", 0) == 0 and rec["server"]["participation"] == 1.0
        assert rec["server"]["loss_cc"] > 0


def test_a_client_that_missed_local_pretrain_pretrains_before_its_first_local_update():
    server, clients, _ = toy_federation("fccl", n_clients=2, k=K, tau=1, fccl_pretrain_epochs=1)
    phase = server.begin_round(0)
    assert phase.phase == "local_pretrain"
    results = {"c0": clients["c0"].handle(phase.tasks["c0"])}  # c1's answer is lost
    assert clients["c1"].intra is None
    phase = server.collect(phase, results)
    while phase is not None:
        results = {cid: clients[cid].handle(task) for cid, task in phase.tasks.items()}
        phase = server.collect(phase, results)
    assert clients["c1"].intra is not None  # pretrained at local_train, then trained on
    assert not all(torch.equal(clients["c1"].intra.state_dict()[k], clients["c1"].model.state_dict()[k])
                   for k in clients["c1"].model.state_dict())
