"""CFD (Sattler et al., 2020) and MHAT (Hu et al., 2021) against hand-built inputs: the b-bit
quantization's error bound, delta coding's exact round trip, the server's average by hand, full
bit-width without delta coding as plain soft-label exchange, lambda_kd = 0 as Local step for
step, MHAT's server model trained by the distillation and sent down, and the uploads the server
half refuses (and the engine counts)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedal.protocol import Message, decode, encode
from fedal.strategies import InvalidResult, ServerContext, StrategyParams, get_strategy
from fedal.strategies.cfd import (
    CHANGED_KEY,
    LEVELS_KEY,
    NEW_KEY,
    NO_REF,
    TARGET_KEY,
    delta_decode,
    delta_encode,
    dequantize,
    distillation_rows,
    quantize,
    soft_cross_entropy,
)
from tests.helpers import in_process, toy_federation

K = 4


def wire(msg: Message) -> Message:
    return decode(encode(msg))


def random_probs(n: int, k: int, seed: int = 0) -> np.ndarray:
    z = np.random.default_rng(seed).normal(0, 2, (n, k))
    return (np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)).astype(np.float32)


# -- the code -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 9, 12, 16])
def test_quantization_error_is_at_most_half_a_step(bits):
    p = random_probs(500, 10, seed=bits)
    levels = quantize(p, bits)
    top = 2**bits - 1
    assert levels.dtype == (np.uint8 if bits <= 8 else np.uint16) and levels.max() <= top
    err = np.abs(dequantize(levels, bits) - p.astype(np.float64))
    assert err.max() <= 0.5 / top + 1e-7
    assert err.max() > 0.25 / top  # the bound is tight, not vacuous
    grid = np.arange(top + 1, dtype=np.float64)[:, None] / top  # values on the grid come back exactly
    np.testing.assert_array_equal(quantize(grid, bits)[:, 0], np.arange(top + 1))


def test_one_bit_keeps_the_entries_above_one_half_and_rounds_halves_to_even():
    p = np.array([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25], [0.5, 0.5, 0.0]], np.float32)
    assert quantize(p, 1).tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert quantize(np.array([[0.5 / 3, 1.5 / 3, 1.0 / 3]]), 2).tolist() == [[0, 2, 1]]  # rint: 0.5 -> 0, 1.5 -> 2


@pytest.mark.parametrize("bits", [1, 3, 8, 16])
def test_delta_coding_round_trip_is_exact(bits):
    rng = np.random.default_rng(bits)
    top = 2**bits - 1
    ref = rng.integers(0, top + 1, (13, 5)).astype(np.uint8 if bits <= 8 else np.uint16)
    for share in (0.0, 0.1, 1.0):
        new = ref.copy()
        flip = rng.random(ref.shape) < share
        new[flip] = (new[flip].astype(np.int64) + 1 + rng.integers(0, top, flip.sum())) % (top + 1)  # != old
        code = delta_encode(new, ref)
        assert code[CHANGED_KEY].dtype == np.uint8 and code[CHANGED_KEY].shape == ((13 * 5 + 7) // 8,)
        m = int(flip.sum())
        assert (NEW_KEY in code) == (m > 0) and (m == 0 or code[NEW_KEY].shape == (m,))
        back = delta_decode(wire(Message({}, code)).tensors, ref, bits)
        assert back.dtype == ref.dtype and np.array_equal(back, new)


def test_delta_decoding_refuses_what_delta_encode_does_not_write():
    ref = np.zeros((3, 3), np.uint8)
    new = ref.copy()
    new[1, 2] = 1
    code = delta_encode(new, ref)
    assert np.unpackbits(code[CHANGED_KEY]).tolist()[:9] == [0, 0, 0, 0, 0, 1, 0, 0, 0]
    bad = [
        {**code, CHANGED_KEY: np.packbits(np.ones(16, bool))},  # padding bits set (and 9 changes, 1 level)
        {**code, NEW_KEY: np.array([1, 1], np.uint8)},  # more levels than changed entries
        {**code, NEW_KEY: np.array([1], np.uint16)},  # the wrong dtype for 1 bit
        {**code, NEW_KEY: np.array([2], np.uint8)},  # above 2^1 - 1
        {CHANGED_KEY: code[CHANGED_KEY]},  # a change without its level
        {CHANGED_KEY: np.zeros(2, np.uint8), NEW_KEY: np.array([1], np.uint8)},  # a level without a change
        {CHANGED_KEY: code[CHANGED_KEY][:1], NEW_KEY: code[NEW_KEY]},  # a short bitmap
    ]
    for tensors in bad:
        with pytest.raises(ValueError):
            delta_decode(tensors, ref, 1)


# -- the server's average -------------------------------------------------------------------------
def hand_server(name: str, **kw):
    spec = get_strategy(name)
    params = StrategyParams(**{"cfd_public_rows": 2, "tau": 1, **kw}).resolve(spec.preset)
    public_x = np.random.default_rng(0).normal(size=(6, 6)).astype(np.float32)
    return spec.server(params, ["a", "b", "c"], ServerContext(3, 6, seed=0, public_x=public_x)), params


def upload(phase, cid: str, levels) -> Message:
    meta = {"phase": "local_train", "round": phase.round, "iteration": 0, "ref": NO_REF, "loss": 1.0}
    return wire(Message(meta, {LEVELS_KEY: np.asarray(levels, np.uint8)}))


def test_server_average_by_hand_two_bits():
    """b = 2 (levels 0..3, step 1/3), K = 3, D = 2 rows, three clients."""
    server, _ = hand_server("cfd", cfd_bits=2, cfd_delta=False)
    phase = server.begin_round(0)
    levels = {"a": [[3, 0, 0], [1, 1, 1]], "b": [[2, 1, 0], [0, 3, 0]], "c": [[1, 1, 1], [0, 2, 1]]}
    results = {cid: upload(phase, cid, lv) for cid, lv in levels.items()}
    for cid, res in results.items():
        server.validate(phase, cid, res)
    nxt = server.collect(phase, results)
    # row 0: ((3,0,0) + (2,1,0) + (1,1,1)) / 3 / 3 = (6/9, 2/9, 1/9) -> levels round(2, 2/3, 1/3) = (2, 1, 0)
    # row 1: ((1,1,1) + (0,3,0) + (0,2,1)) / 9 = (1/9, 6/9, 2/9) -> levels round(1/3, 2, 2/3) = (0, 2, 1)
    assert nxt.phase == "distill" and set(nxt.tasks) == {"a", "b", "c"}
    for task in nxt.tasks.values():
        assert task.tensors[TARGET_KEY].dtype == np.uint8
        assert task.tensors[TARGET_KEY].tolist() == [[2, 1, 0], [0, 2, 1]]
    assert server.refs["b"][0] == 0 and server.refs["b"][1].tolist() == levels["b"]


def test_a_client_left_out_does_not_enter_the_average_but_gets_the_target():
    server, _ = hand_server("cfd", cfd_bits=2, cfd_delta=False)
    phase = server.begin_round(0)
    results = {"a": upload(phase, "a", [[3, 0, 0], [0, 0, 3]]), "c": upload(phase, "c", [[1, 2, 0], [0, 0, 3]])}
    nxt = server.collect(phase, results)
    # (3 + 1) / 6 = 2/3 -> 2; (0 + 2) / 6 = 1/3 -> 1
    assert nxt.tasks["b"].tensors[TARGET_KEY].tolist() == [[2, 1, 0], [0, 0, 3]]


# -- full bit-width, no delta coding: plain soft-label exchange ------------------------------------
def soft_labels(client) -> torch.Tensor:
    return F.softmax(client.predict(client.public_x[client.rows]), dim=1).double()


def test_sixteen_bits_without_delta_is_plain_soft_label_exchange(one_torch_thread):
    server, clients, params = toy_federation("cfd", k=K, tau=3, cfd_bits=16, cfd_delta=False, cfd_public_rows=20)
    phase = server.begin_round(0)
    results = {cid: wire(clients[cid].handle(wire(t))) for cid, t in phase.tasks.items()}
    plain = torch.stack([soft_labels(c) for c in clients.values()]).mean(dim=0)  # the exact average
    nxt = server.collect(phase, results)
    target = dequantize(nxt.tasks["c0"].tensors[TARGET_KEY], 16)
    # two roundings of at most half a step each (upload, then download)
    assert np.abs(target - plain.numpy()).max() <= 1.0 / (2**16 - 1) + 1e-7
    assert np.abs(target - plain.numpy()).max() > 0  # it is quantized, not passed through

    # the client's distillation steps: as with the exact average, to float precision
    c = clients["c0"]
    twin_state = {k: v.clone() for k, v in c.model.state_dict().items()}
    opt_state = copy.deepcopy(c.optimizer.state_dict())  # live references otherwise
    gen_state = c.generator.get_state()
    c.handle(wire(nxt.tasks["c0"]))
    got = [v.clone() for v in c.model.state_dict().values()]
    c.model.load_state_dict(twin_state)
    c.optimizer.load_state_dict(opt_state)
    c.generator.set_state(gen_state)
    x = c.public_x[c.rows]
    exact = (plain / plain.sum(dim=1, keepdim=True)).float()
    for _ in range(params.tau):
        idx = torch.randperm(len(c.rows), generator=c.generator)[: params.public_batch_size]
        c.model.train()
        loss = soft_cross_entropy(c.model(x[idx]), exact[idx], torch.ones(len(idx), dtype=torch.bool), 1.0)
        c.optimizer.zero_grad()
        loss.backward()
        c.optimizer.step()
    for a, b in zip(got, c.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(got, twin_state.values()))  # the steps did move it


# -- lambda_kd = 0 is Local -----------------------------------------------------------------------
def step_for_step(name: str, lambda_kd: float, rounds: int = 3):
    server, cfd_clients, _ = toy_federation(name, k=K, tau=4, lambda_kd=lambda_kd, cfd_public_rows=30)
    _, local_clients, _ = toy_federation("local", k=K, tau=4)
    local_server = get_strategy("local").server(local_clients["c0"].params, list(local_clients), ServerContext(K, 0, seed=0))
    same = []
    for r in range(rounds):
        in_process(server, cfd_clients).run_round(r)
        in_process(local_server, local_clients).run_round(r)
        same.append(all(torch.equal(a, b) for cid in cfd_clients
                        for a, b in zip(cfd_clients[cid].model.state_dict().values(),
                                        local_clients[cid].model.state_dict().values())))
    return same


@pytest.mark.parametrize("name", ["cfd", "mhat"])
def test_lambda_kd_zero_is_local_training_step_for_step(name, one_torch_thread):
    assert step_for_step(name, 0.0) == [True, True, True]
    # the comparison can fail: with the distillation on, the first round's steps already differ
    assert step_for_step("mhat", 1.0)[0] is False


# -- MHAT's server model --------------------------------------------------------------------------
def test_mhat_server_model_is_trained_by_the_distillation_and_is_what_clients_receive(one_torch_thread):
    server, _ = hand_server("mhat", cfd_public_rows=6, mhat_server_epochs=5, public_batch_size=3)
    assert server.params.cfd_bits == 16 and server.params.cfd_delta is False
    target = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0], [0, 1, 0], [0, 0, 1]], np.float64)
    before = server.outputs()
    losses = [float(np.mean(server.train_server(target))) for _ in range(20)]
    after = server.outputs()
    assert losses[-1] < losses[0] * 0.8
    ce = lambda out: float(-(target * np.log(out + 1e-12)).sum(axis=1).mean())  # noqa: E731
    assert ce(after) < ce(before)

    server, _ = hand_server("mhat", cfd_public_rows=6, mhat_server_epochs=5, public_batch_size=3)
    phase = server.begin_round(0)
    lv = quantize(target, 16)
    results = {cid: wire(Message({"phase": "local_train", "round": 0, "iteration": 0, "ref": NO_REF, "loss": 1.0},
                                 {LEVELS_KEY: lv})) for cid in ("a", "b", "c")}
    before = server.outputs()
    nxt = server.collect(phase, results)
    sent = nxt.tasks["a"].tensors[TARGET_KEY]
    assert np.array_equal(sent, quantize(server.outputs(), 16))  # the trained model's outputs go down
    assert not np.array_equal(sent, quantize(before, 16)) and not np.array_equal(sent, lv)
    assert ce(server.outputs()) < ce(before)
    assert "server_loss" in server.round_metrics()


def test_mhat_needs_the_public_inputs_on_the_server():
    spec = get_strategy("mhat")
    with pytest.raises(ValueError, match="public"):
        spec.server(StrategyParams().resolve(spec.preset), ["a"], ServerContext(3, 6, seed=0))


def test_distillation_rows_are_fixed_for_the_run():
    p = StrategyParams(cfd_public_rows=7, rows_seed=3)
    rows = distillation_rows(p, 50)
    assert len(set(rows.tolist())) == 7 and np.array_equal(rows, distillation_rows(p, 50))
    assert sorted(distillation_rows(StrategyParams(), 9).tolist()) == list(range(9))


# -- delta coding between the halves, refusals ------------------------------------------------------
def test_delta_uploads_follow_the_reference_the_server_holds(one_torch_thread):
    server, clients, _ = toy_federation("cfd", k=K, tau=2, cfd_bits=4)
    in_process(server, clients).run_round(0)
    phase = server.begin_round(1)
    assert {t.meta["ref"] for t in phase.tasks.values()} == {0}
    res = wire(clients["c0"].handle(wire(phase.tasks["c0"])))
    assert res.meta["ref"] == 0 and LEVELS_KEY not in res.tensors and CHANGED_KEY in res.tensors
    server.validate(phase, "c0", res)
    # decoded, it is exactly what the client holds as its own last upload
    assert np.array_equal(server.decoded("c0", res), clients["c0"].ref_levels)
    # a server that lost its reference asks for a full upload, and gets one
    blank, _, _ = toy_federation("cfd", k=K, tau=2, cfd_bits=4)
    task = blank.begin_round(2).tasks["c1"]
    assert task.meta["ref"] == NO_REF
    assert LEVELS_KEY in clients["c1"].handle(wire(task)).tensors


def genuine(name: str = "cfd"):
    server, clients, _ = toy_federation(name, k=K, tau=2, cfd_bits=4)
    in_process(server, clients).run_round(0)
    phase = server.begin_round(1)
    results = {cid: wire(clients[cid].handle(wire(task))) for cid, task in phase.tasks.items()}
    return server, phase, results


def bad_uploads(res: Message, full: Message):
    meta, t = res.meta, res.tensors
    yield "no ref", Message({k: v for k, v in meta.items() if k != "ref"}, t)
    yield "ref as a string", Message({**meta, "ref": "0"}, t)
    yield "a delta against a round the server does not hold", Message({**meta, "ref": 5}, t)
    yield "a delta without its bitmap", Message(meta, {k: v for k, v in t.items() if k != CHANGED_KEY})
    yield "a delta with full levels beside it", Message(meta, {**t, LEVELS_KEY: full.tensors[LEVELS_KEY]})
    yield "a full upload named as a delta", Message(meta, full.tensors)
    yield "a delta named as a full upload", Message({**meta, "ref": NO_REF}, t)
    levels = full.tensors[LEVELS_KEY]
    fmeta = {**full.meta, "ref": NO_REF}
    yield "levels above 2^b - 1", Message(fmeta, {LEVELS_KEY: np.full_like(levels, 16)})
    yield "rows that are no probabilities", Message(fmeta, {LEVELS_KEY: np.full_like(levels, 15)})
    yield "levels as uint16 at 4 bits", Message(fmeta, {LEVELS_KEY: levels.astype(np.uint16)})
    yield "levels as float32", Message(fmeta, {LEVELS_KEY: levels.astype(np.float32)})
    yield "a row short", Message(fmeta, {LEVELS_KEY: levels[:-1]})
    yield "an unknown tensor beside", Message(fmeta, {LEVELS_KEY: levels, "extra": levels})


def test_bad_uploads_are_refused(one_torch_thread):
    server, phase, results = genuine()
    for cid, res in results.items():
        server.validate(phase, cid, res)  # the genuine ones pass
    res = results["c0"]
    assert res.meta["ref"] == 0
    full = wire(Message({**res.meta, "ref": NO_REF}, {LEVELS_KEY: server.decoded("c0", res)}))
    server.validate(phase, "c0", full)  # a full upload is always accepted
    tried = 0
    for what, bad in bad_uploads(res, full):
        tried += 1
        with pytest.raises(InvalidResult):
            server.validate(phase, "c0", wire(bad))
            pytest.fail(f"accepted: {what}")
    assert tried == 13


def test_the_client_refuses_a_malformed_target(one_torch_thread):
    server, clients, _ = toy_federation("cfd", k=K, tau=2, cfd_bits=4, cfd_public_rows=10)
    phase = server.begin_round(0)
    nxt = server.collect(phase, {cid: wire(clients[cid].handle(wire(t))) for cid, t in phase.tasks.items()})
    task = nxt.tasks["c0"]
    target = task.tensors[TARGET_KEY]
    clients["c0"].handle(wire(task))
    for bad in ({}, {TARGET_KEY: target[:-1]}, {TARGET_KEY: target.astype(np.uint16)},
                {TARGET_KEY: np.full_like(target, 15)}, {TARGET_KEY: np.full_like(target, 16)}):
        with pytest.raises(ValueError):
            clients["c0"].handle(Message(task.meta, bad))


def test_refused_uploads_are_counted_and_left_out_of_the_average(one_torch_thread):
    server, clients, _ = toy_federation("cfd", k=K, tau=2, cfd_bits=4, cfd_public_rows=10)

    class Broken:
        def __init__(self, inner, mode):
            self.inner, self.mode = inner, mode

        def __getattr__(self, name):  # the rest of the client half as it is
            return getattr(self.inner, name)

        def handle(self, task):
            res = self.inner.handle(task)
            if task.phase == "local_train" and self.mode == "float":
                res.tensors[LEVELS_KEY] = res.tensors[LEVELS_KEY].astype(np.float32)
            elif task.phase == "local_train":
                res.tensors[LEVELS_KEY][0] = 15
            return res

    clients["c1"] = Broken(clients["c1"], "float")
    clients["c2"] = Broken(clients["c2"], "rows")
    rec = in_process(server, clients).run_round(0)
    assert rec["rejected"] == 2
    assert list(server.refs) == ["c0"]  # only the valid upload is averaged (and held for a delta)
    assert rec["server"]["participation"] == pytest.approx(1 / 3)
