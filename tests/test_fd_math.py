"""FD (Jeong et al., 2018) against hand-built inputs: the per-label averages each end computes,
labels a client lacks, the distillation term, beta = 0 as Local step for step, and the uploads
the server half refuses (and the engine counts)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedal.data import ArrayDataset
from fedal.protocol import Message, decode, encode
from fedal.strategies import InvalidResult, ServerContext, StrategyParams, get_strategy
from fedal.strategies.fd import (
    AVG_KEY,
    COUNT_KEY,
    MASK_KEY,
    TEACHER_KEY,
    Teacher,
    distillation_term,
    read_teacher,
    teacher_for,
)
from fedal.strategies.local import local_batches
from tests.helpers import TinyNet, in_process, toy_dataset, toy_federation

K = 3


def wire(msg: Message) -> Message:
    return decode(encode(msg))


def f32(rows) -> np.ndarray:
    return np.asarray(rows, np.float32)


# three clients; c1 never saw label 2
UPLOADS = {
    "c0": (f32([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8]]), np.array([10, 20, 30], np.int64)),
    "c1": (f32([[0.8, 0.1, 0.1], [0.3, 0.5, 0.2], [0.0, 0.0, 0.0]]), np.array([30, 10, 0], np.int64)),
    "c2": (f32([[0.4, 0.4, 0.2], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]), np.array([20, 10, 10], np.int64)),
}


def test_teacher_excludes_the_own_upload_as_in_algorithm_1():
    """Every client saw every label: teacher_i = (sum_j F_j - F_i) / (M - 1), line 15."""
    full = {c: (avg, np.array([5, 5, 5], np.int64)) for c, (avg, _) in UPLOADS.items() if c != "c1"}
    full["c1"] = (f32([[0.8, 0.1, 0.1], [0.3, 0.5, 0.2], [0.3, 0.3, 0.4]]), np.array([5, 5, 5], np.int64))
    total = sum(avg.astype(np.float64) for avg, _ in full.values())
    for cid, (own, _) in full.items():
        t = teacher_for(cid, full, exclude_own=True, weighting="clients", num_classes=K)
        assert t.mask.all()
        np.testing.assert_allclose(t.probs, (total - own) / (len(full) - 1), rtol=0, atol=1e-7)


def test_per_label_average_by_hand_with_a_label_one_client_lacks():
    # label 2: c1 has no mean (count 0): it is left out, not averaged in as a row of zeros
    t = teacher_for("c0", UPLOADS, exclude_own=True, weighting="clients", num_classes=K)
    np.testing.assert_allclose(t.probs, [[0.6, 0.25, 0.15], [0.2, 0.65, 0.15], [0.2, 0.2, 0.6]], atol=1e-7)
    assert t.mask.tolist() == [True, True, True]
    # c2's teacher for label 2 would be c0's alone; with c0 gone too, no one is left
    t = teacher_for("c2", {c: UPLOADS[c] for c in ("c1", "c2")}, exclude_own=True, weighting="clients", num_classes=K)
    assert t.mask.tolist() == [True, True, False]
    np.testing.assert_array_equal(t.probs[2], [0, 0, 0])
    np.testing.assert_allclose(t.probs[:2], UPLOADS["c1"][0][:2], atol=0)
    # weighted by counts: label 0 for c2 = (10 * c0 + 30 * c1) / 40; label 2 = c0's (c1 has count 0)
    t = teacher_for("c2", UPLOADS, exclude_own=True, weighting="counts", num_classes=K)
    np.testing.assert_allclose(t.probs, [[0.75, 0.15, 0.1], [(20 * 0.2 + 10 * 0.3) / 30, (20 * 0.7 + 10 * 0.5) / 30,
                                                              (20 * 0.1 + 10 * 0.2) / 30], [0.1, 0.1, 0.8]], atol=1e-7)
    # every client, own included, weighted by counts: label 1 = (20 * c0 + 10 * c1 + 10 * c2) / 40
    t = teacher_for("c2", UPLOADS, exclude_own=False, weighting="counts", num_classes=K)
    np.testing.assert_allclose(t.probs[1], [(4 + 3 + 1) / 40, (14 + 5 + 8) / 40, (2 + 2 + 1) / 40], atol=1e-7)
    np.testing.assert_allclose(t.probs[2], [(3 + 2) / 40, (3 + 2) / 40, (24 + 6) / 40], atol=1e-7)
    assert all(np.isclose(t.probs.sum(axis=1), 1.0))


def make_client(strategy: str, labels: list[int] | None = None, seed: int = 0, **params):
    spec = get_strategy(strategy)
    p = StrategyParams(**params).resolve(spec.preset)
    data = toy_dataset(n=40, k=K, seed=seed)
    if labels is not None:
        keep = np.isin(data.y, labels)
        data = ArrayDataset(data.x[keep], data.y[keep], K, "part")
    torch.manual_seed(100 + seed)
    return spec.client(f"c{seed}", TinyNet(k=K), data, None, p, seed=7 + seed)


def test_upload_is_the_per_label_mean_of_the_training_outputs():
    """Algorithm 1, lines 6 and 8: the softmax outputs of every step's forward pass, summed per
    ground-truth label and divided by how many rows of that label the batches held."""
    client = make_client("fd", labels=[0, 1], tau=6, batch_size=8)
    outputs: list[torch.Tensor] = []
    client.model.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))
    replay = torch.Generator()
    replay.set_state(client.generator.get_state())
    batches = list(local_batches(len(client.y_train), client.params, 6, replay))
    res = wire(client.handle(Message({"phase": "local_train", "round": 0, "iteration": 0, "steps": 6})))
    assert len(outputs) == len(batches) == 6
    sums, counts = np.zeros((K, K)), np.zeros(K, np.int64)
    for idx, out in zip(batches, outputs):
        for label, row in zip(client.y_train[idx].tolist(), F.softmax(out, dim=1).double().numpy()):
            sums[label] += row
            counts[label] += 1
    assert res.tensors[COUNT_KEY].tolist() == counts.tolist() and counts[2] == 0 and counts.sum() == 48
    np.testing.assert_allclose(res.tensors[AVG_KEY][:2], sums[:2] / counts[:2, None], rtol=1e-6)
    np.testing.assert_array_equal(res.tensors[AVG_KEY][2], [0, 0, 0])  # the label this client lacks
    assert res.meta["num_samples"] == len(client.y_train) and set(res.meta) >= {"loss", "ce"}
    assert "fd_loss" not in res.meta  # no teacher yet


def test_distillation_term_by_hand_and_labels_without_teacher():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 1.0, 3.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    teacher = Teacher(f32([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.0, 0.0, 0.0]]), np.array([True, True, False]))
    term = distillation_term(logits, y, teacher)

    def log_softmax(z):
        m = max(z)
        return [v - m - math.log(sum(math.exp(u - m) for u in z)) for v in z]

    rows = logits.detach().tolist()
    by_hand = (-sum(q * ls for q, ls in zip([0.7, 0.2, 0.1], log_softmax(rows[0])))
               - sum(q * ls for q, ls in zip([0.1, 0.8, 0.1], log_softmax(rows[1])))) / 3  # row 3: no teacher
    assert term.item() == pytest.approx(by_hand, rel=1e-6)
    term.backward()
    assert torch.equal(logits.grad[2], torch.zeros(3))  # the label without a teacher gets no pull
    assert logits.grad[:2].abs().sum() > 0


def step_for_step(fd_beta: float, rounds: int = 3):
    """FD's clients (under FD's server, which sends teachers from round 1 on) and Local's clients,
    from the same models, data and seeds: per round, whether every weight is torch.equal."""
    server, fd_clients, _ = toy_federation("fd", k=K, tau=4, fd_beta=fd_beta)
    _, local_clients, _ = toy_federation("local", k=K, tau=4)
    same = []
    for r in range(rounds):
        in_process(server, fd_clients).run_round(r)
        in_process(get_strategy("local").server(local_clients["c0"].params, list(local_clients),
                                                ServerContext(K, 0, seed=0)), local_clients).run_round(r)
        same.append(all(torch.equal(a, b) for cid in fd_clients
                        for a, b in zip(fd_clients[cid].model.state_dict().values(),
                                        local_clients[cid].model.state_dict().values())))
    return same, server


def test_beta_zero_is_local_training_step_for_step(one_torch_thread):
    same, server = step_for_step(0.0)
    assert same == [True, True, True]
    assert server.uploads and server.begin_round(3).tasks["c0"].tensors  # the teachers were there all along
    # the comparison can fail: with beta > 0 the teacher changes the steps from round 1 on
    assert step_for_step(1.0)[0] == [True, False, False]


def test_beta_zero_takes_no_teacher_term_and_reports_none():
    server, clients, _ = toy_federation("fd", k=K, tau=2, fd_beta=0.0)
    in_process(server, clients).run_round(0)
    task = server.begin_round(1).tasks["c1"]
    assert TEACHER_KEY in task.tensors
    res = clients["c1"].handle(wire(task))
    assert "fd_loss" not in res.meta and res.meta["loss"] == res.meta["ce"]


def test_a_label_nobody_else_has_gets_no_teacher_on_the_wire():
    spec = get_strategy("fd")
    params = StrategyParams(tau=3).resolve(spec.preset)
    clients = {"a": make_client("fd", labels=[0, 1], seed=0, tau=3), "b": make_client("fd", seed=1, tau=3)}
    server = spec.server(params, ["a", "b"], ServerContext(K, 0, seed=0))
    in_process(server, clients).run_round(0)
    tasks = server.begin_round(1).tasks
    # b alone saw label 2: b's teacher (a's outputs) has none for it; a's (b's) has all three
    assert tasks["b"].tensors[MASK_KEY].tolist() == [1, 1, 0] and tasks["a"].tensors[MASK_KEY].tolist() == [1, 1, 1]
    np.testing.assert_array_equal(tasks["b"].tensors[TEACHER_KEY][2], [0, 0, 0])
    np.testing.assert_array_equal(tasks["b"].tensors[TEACHER_KEY][:2], server.uploads["a"][0][:2])
    res = clients["b"].handle(wire(tasks["b"]))
    assert res.meta["fd_loss"] >= 0


def test_the_client_refuses_a_malformed_teacher():
    ok = {TEACHER_KEY: f32([[0.5, 0.5, 0.0]] * K), MASK_KEY: np.array([1, 1, 0], np.uint8)}
    assert read_teacher(ok, K) is not None
    assert read_teacher({}, K) is None
    assert read_teacher({**ok, MASK_KEY: np.zeros(K, np.uint8)}, K) is None  # nothing to distil
    bad = [
        {TEACHER_KEY: ok[TEACHER_KEY]},
        {**ok, TEACHER_KEY: ok[TEACHER_KEY][:2]},
        {**ok, TEACHER_KEY: ok[TEACHER_KEY].astype(np.float64)},
        {**ok, MASK_KEY: np.array([1, 2, 0], np.uint8)},
        {**ok, TEACHER_KEY: f32([[0.5, 0.6, 0.0]] * K)},
    ]
    for tensors in bad:
        with pytest.raises(ValueError):
            read_teacher(tensors, K)


def genuine(tau: int = 2):
    server, clients, _ = toy_federation("fd", k=K, tau=tau)
    phase = server.begin_round(0)
    results = {cid: wire(clients[cid].handle(wire(task))) for cid, task in phase.tasks.items()}
    return server, phase, results


def tampered(res: Message, **changes) -> Message:
    meta = {**res.meta, **changes.pop("meta", {})}
    tensors = {**res.tensors, **changes}
    return Message({k: v for k, v in meta.items() if v is not None}, {k: v for k, v in tensors.items() if v is not None})


def bad_uploads(res: Message):
    avg, counts = res.tensors[AVG_KEY], res.tensors[COUNT_KEY]
    nan = avg.copy()
    nan[0, 0] = np.nan
    negative = counts.copy()
    negative[0], negative[1] = -1, negative[1] + 1
    zero_row = counts.copy()
    zero_row[0] = 0
    yield "avg of shape [K, K+1]", tampered(res, **{AVG_KEY: np.zeros((K, K + 1), np.float32)})
    yield "counts of shape [K+1]", tampered(res, **{COUNT_KEY: np.append(counts, 0)})
    yield "avg holding NaN", tampered(res, **{AVG_KEY: nan})
    yield "a negative count", tampered(res, **{COUNT_KEY: negative})
    yield "counts as float64", tampered(res, **{COUNT_KEY: counts.astype(np.float64)})
    yield "counts as float32 halves", tampered(res, **{COUNT_KEY: counts.astype(np.float32) + 0.5})
    yield "counts as int32", tampered(res, **{COUNT_KEY: counts.astype(np.int32)})
    yield "no counts", tampered(res, **{COUNT_KEY: None})
    yield "a tensor more", tampered(res, **{"fd/extra": counts.copy()})
    yield "more rows than a round trains", tampered(res, **{COUNT_KEY: counts * 100})
    yield "a row that is no probability vector", tampered(res, **{AVG_KEY: avg * 2})
    yield "a non-zero row with count 0", tampered(res, **{COUNT_KEY: zero_row})
    yield "num_samples missing", tampered(res, meta={"num_samples": None})
    yield "num_samples a float", tampered(res, meta={"num_samples": float(res.meta["num_samples"])})
    yield "num_samples a boolean", tampered(res, meta={"num_samples": True})


def test_bad_uploads_are_refused():
    server, phase, results = genuine()
    for cid, res in results.items():
        server.validate(phase, cid, res)  # the genuine ones pass
    res = results["c0"]
    tried = 0
    for what, bad in bad_uploads(res):
        tried += 1
        with pytest.raises(InvalidResult):
            server.validate(phase, "c0", wire(bad))
            pytest.fail(f"accepted: {what}")
    assert tried == 15


def test_refused_uploads_are_counted_and_left_out_of_the_teacher(one_torch_thread):
    server, clients, _ = toy_federation("fd", k=K, tau=2)

    class Broken:
        def __init__(self, inner, mode):
            self.inner, self.mode = inner, mode

        def __getattr__(self, name):  # the rest of the client half (params, state) as it is
            return getattr(self.inner, name)

        def handle(self, task):
            res = self.inner.handle(task)
            counts = res.tensors[COUNT_KEY]
            if self.mode == "negative":
                counts[0] = -1
            else:
                res.tensors[COUNT_KEY] = counts.astype(np.float32)
            return res

    clients["c1"] = Broken(clients["c1"], "negative")
    clients["c2"] = Broken(clients["c2"], "float")
    rec = in_process(server, clients).run_round(0)
    assert rec["rejected"] == 2
    assert list(server.uploads) == ["c0"]  # only the valid upload teaches
    tasks = server.begin_round(1).tasks
    assert TEACHER_KEY not in tasks["c0"].tensors  # c0's own upload is not its teacher
    np.testing.assert_array_equal(tasks["c1"].tensors[TEACHER_KEY], server.uploads["c0"][0])
