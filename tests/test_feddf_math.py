"""FedDF-AL and FedDF: per-architecture, data-size-weighted parameter averaging, then FedAL's
transfer stage (ALGORITHMS.md section 1, variants)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from fedal.protocol import Message, decode, encode
from fedal.sim.config import RunConfig
from fedal.strategies import InvalidResult, ServerContext, StrategyParams, get_strategy
from fedal.strategies.feddf import FEDDF_AL_PRESET, FEDDF_PRESET, WEIGHTS, architecture_tag
from tests.helpers import TinyNet, in_process, toy_dataset

K, D_IN, PUBLIC = 4, 6, 50
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class NarrowNet(nn.Module):
    """Another architecture: other parameter shapes."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, 5), nn.Tanh(), nn.Linear(5, K))

    def forward(self, x):
        return self.net(x)


class ReluNet(TinyNet):
    """TinyNet's parameter names and shapes, but another model: must never be averaged with it."""

    def __init__(self):
        super().__init__(D_IN, K)
        self.net[1] = nn.ReLU()


def federation(strategy: str, archs: list, sizes: list[int], **overrides):
    spec = get_strategy(strategy)
    params = StrategyParams(**overrides).resolve(spec.preset)
    public_x = np.random.default_rng(0).normal(size=(PUBLIC, D_IN)).astype(np.float32)
    ids = [f"c{i}" for i in range(len(archs))]
    clients = {}
    for i, (make, n) in enumerate(zip(archs, sizes)):
        torch.manual_seed(100 + i)
        clients[ids[i]] = spec.client(ids[i], make(), toy_dataset(n=n, k=K, seed=i), public_x, params, seed=7 + i)
    server = spec.server(params, ids, ServerContext(num_classes=K, public_size=PUBLIC, seed=0))
    return server, clients


def wire(msg: Message) -> Message:
    return decode(encode(msg))


def answer(server, clients, phase, skip=()):
    results = {cid: wire(clients[cid].handle(wire(t))) for cid, t in phase.tasks.items() if cid not in skip}
    for cid, res in results.items():
        server.validate(phase, cid, res)
    return results


def local_train(server, clients, round_idx=0, skip=()):
    """The round's local_train phase and its results (after the init phase, if the round has one)."""
    phase = server.begin_round(round_idx)
    if phase.phase == "init":
        phase = server.collect(phase, answer(server, clients, phase))
    return phase, answer(server, clients, phase, skip)


def weights_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}


def sent_average(task: Message) -> dict[str, np.ndarray]:
    return {k[len(WEIGHTS):]: v for k, v in task.tensors.items() if k.startswith(WEIGHTS)}


def test_group_average_is_weighted_by_local_data_size():
    sizes = [10, 30, 80]
    server, clients = federation("feddf-al", [TinyNet] * 3, sizes, tau=3)
    phase, results = local_train(server, clients)
    assert [results[c].meta["num_samples"] for c in clients] == sizes
    trained = [weights_of(c.model) for c in clients.values()]  # the weights each client uploaded
    avg = server.collect(phase, results)
    assert avg.phase == "average"
    for key in trained[0]:
        expected = sum(n * w[key] for n, w in zip(sizes, trained)) / sum(sizes)
        unweighted = sum(w[key] for w in trained) / len(trained)
        for cid in clients:
            got = sent_average(avg.tasks[cid])[key]
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        if key.endswith("weight"):
            assert np.max(np.abs(expected - unweighted)) > 1e-4  # the sizes really made a difference


def test_groups_never_mix_architectures():
    archs = [TinyNet, NarrowNet, TinyNet, NarrowNet, ReluNet]
    sizes = [20, 40, 60, 30, 50]
    server, clients = federation("feddf", archs, sizes, tau=2)
    assert architecture_tag(clients["c0"].model) != architecture_tag(clients["c4"].model)  # same shapes, other class
    phase, results = local_train(server, clients)
    trained = {cid: weights_of(c.model) for cid, c in clients.items()}
    avg = server.collect(phase, results)
    for group in (["c0", "c2"], ["c1", "c3"]):
        n = [sizes[int(c[1:])] for c in group]
        for cid in group:
            sent = sent_average(avg.tasks[cid])
            assert set(sent) == set(trained[cid])
            for key, got in sent.items():
                expected = sum(w * trained[c][key] for w, c in zip(n, group)) / sum(n)
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
            assert avg.tasks[cid].meta["group_size"] == 2
    # the only ReluNet is its own group: it keeps its model and receives no weights
    assert sent_average(avg.tasks["c4"]) == {} and avg.tasks["c4"].meta["group_size"] == 1
    assert server.round_metrics()["groups"] == 3

    for cid, task in avg.tasks.items():
        res = wire(clients[cid].handle(wire(task)))
        server.validate(avg, cid, res)
        assert res.meta["averaged"] is (cid != "c4")
    for a, b in (("c0", "c2"), ("c1", "c3")):
        for p, q in zip(clients[a].model.parameters(), clients[b].model.parameters()):
            assert torch.equal(p, q)  # group members start the transfer stage from one model
    for key, value in clients["c4"].model.state_dict().items():
        assert np.array_equal(value.numpy(), trained["c4"][key].astype(np.float32))


def test_a_false_architecture_tag_does_not_mix_shapes():
    server, clients = federation("feddf", [TinyNet, NarrowNet, TinyNet], [20, 40, 60], tau=1)
    phase, results = local_train(server, clients)
    liar = results["c1"]
    results["c1"] = Message({**liar.meta, "arch": results["c0"].meta["arch"]}, liar.tensors)
    with pytest.raises(InvalidResult, match="uploaded before"):  # held to what it declared at init
        server.validate(phase, "c1", results["c1"])
    avg = server.collect(phase, results)  # and even unvalidated, groups never mix shapes
    assert avg.tasks["c1"].meta["group_size"] == 1 and sent_average(avg.tasks["c1"]) == {}
    assert avg.tasks["c0"].meta["group_size"] == 2
    assert {k: v.shape for k, v in sent_average(avg.tasks["c0"]).items()} == {
        k: tuple(v.shape) for k, v in clients["c0"].model.state_dict().items()}


def test_feddf_al_without_the_adversarial_term_is_feddf_step_for_step():
    # the presets differ only in lambda_adv and tau (paper: 15 and 10)
    assert StrategyParams(lambda_adv=0.0, tau=10).resolve(FEDDF_AL_PRESET) == StrategyParams().resolve(FEDDF_PRESET)
    archs, sizes = [TinyNet, NarrowNet, TinyNet, NarrowNet], [20, 40, 60, 30]
    s_df, c_df = federation("feddf", archs, sizes, tau=2)
    s_al, c_al = federation("feddf-al", archs, sizes, tau=2, lambda_adv=0.0)
    e_df, e_al = in_process(s_df, c_df), in_process(s_al, c_al)
    for r in range(3):
        seq_df, seq_al = e_df.seq, e_al.seq
        e_df.run_round(r), e_al.run_round(r)
        # [init in round 0], local_train, average, tau transfer iterations
        assert e_df.seq - seq_df == e_al.seq - seq_al == (1 if r == 0 else 0) + 2 + 2
        for cid in c_df:
            for a, b in zip(c_df[cid].model.parameters(), c_al[cid].model.parameters()):
                assert torch.equal(a, b), f"diverged at round {r} for {cid}"
    # and the adversarial term really acts when switched on (its gradient goes down too)
    s_on, c_on = federation("feddf-al", archs, sizes, tau=2)
    rec_on = in_process(s_on, c_on).run_round(0)
    s_off, c_off = federation("feddf", archs, sizes, tau=2)
    rec_off = in_process(s_off, c_off).run_round(0)
    assert rec_on["server"]["disc_loss"] > 0 and "disc_loss" not in rec_off["server"]
    assert rec_on["bytes_down"] > rec_off["bytes_down"]
    assert any(not torch.equal(a, b) for a, b in zip(c_on["c0"].model.parameters(), c_off["c0"].model.parameters()))


def test_group_members_start_from_one_initialisation_once():
    archs = [TinyNet, NarrowNet, TinyNet, ReluNet, NarrowNet, TinyNet]
    server, clients = federation("feddf", archs, [20] * 6, tau=1)
    initial = {cid: weights_of(c.model) for cid, c in clients.items()}
    init = server.begin_round(0)
    assert init.phase == "init" and set(init.tasks) == set(clients) and all(not t.tensors for t in init.tasks.values())
    uploads = answer(server, clients, init)  # weights and tag, no sample count needed yet
    assert "num_samples" not in uploads["c0"].meta
    with pytest.raises(InvalidResult, match="architecture"):
        server.validate(init, "c0", Message({k: v for k, v in uploads["c0"].meta.items() if k != "arch"}, uploads["c0"].tensors))
    train = server.collect(init, uploads)
    assert train.phase == "local_train"
    starts = {cid: sent_average(t) for cid, t in train.tasks.items()}
    for cid, first in (("c2", "c0"), ("c5", "c0"), ("c4", "c1")):  # later members get the first member's weights
        assert set(starts[cid]) == set(initial[first])
        assert all(np.array_equal(starts[cid][k], initial[first][k].astype(np.float32)) for k in starts[cid])
    assert starts["c0"] == starts["c1"] == starts["c3"] == {}  # first members and a group of one keep theirs
    answer(server, clients, train)
    for cid in ("c2", "c5"):
        for key, value in clients[cid].ref_loc.state_dict().items():  # local training started from c0's weights
            np.testing.assert_array_equal(value.numpy(), initial["c0"][key].astype(np.float32))
    assert server.begin_round(1).phase == "local_train"  # once the groups are known, never again


@pytest.mark.parametrize("ref_glo", ["local_train", "average"])
def test_less_forgetting_references_round_start_and_after_local_training_or_the_average(ref_glo):
    """theta_ref_loc is the round's start. theta_ref_glo (feddf_ref_glo): by default, as
    ALGORITHMS.md says, the client's model right after local training (what it uploaded), so the
    transfer stage's LF term pulls toward the client's own locally trained model and is not zero
    at the stage's start; `average`: the group average the client then loads."""
    server, clients = federation("feddf-al", [TinyNet, TinyNet], [20, 60], tau=3, feddf_ref_glo=ref_glo)
    c = clients["c0"]
    start = weights_of(c.model)
    phase, results = local_train(server, clients)
    for key, value in c.ref_loc.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), start[key].astype(np.float32))  # theta_ref_loc: round start
    uploaded = {k[len(WEIGHTS):]: v for k, v in results["c0"].tensors.items() if k.startswith(WEIGHTS)}
    avg = server.collect(phase, results)
    c.handle(avg.tasks["c0"])
    expected = sent_average(avg.tasks["c0"])
    for key, value in c.model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), expected[key])  # the transfer stage starts from the average
    want = uploaded if ref_glo == "local_train" else expected
    for key, value in c.ref_glo.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), want[key])
    assert not all(np.array_equal(uploaded[k], expected[k]) for k in expected)  # the two readings differ here


@pytest.mark.parametrize("change, needle", [
    (lambda m: Message({**m.meta, "arch": ""}, m.tensors), "architecture"),
    (lambda m: Message({k: v for k, v in m.meta.items() if k != "arch"}, m.tensors), "architecture"),
    (lambda m: Message({**m.meta, "num_samples": 0}, m.tensors), "num_samples"),
    (lambda m: Message({**m.meta, "num_samples": True}, m.tensors), "num_samples"),
    (lambda m: Message(dict(m.meta), {}), "weights"),
    (lambda m: Message(dict(m.meta), {**m.tensors, "logits": np.zeros((2, K), np.float32)}), "weights"),
    (lambda m: Message(dict(m.meta), {**m.tensors, WEIGHTS + "x": np.array([True])}), "dtype"),
    (lambda m: Message(dict(m.meta), {**m.tensors, WEIGHTS + "x": np.array([np.nan], np.float32)}), "NaN"),
])
def test_malformed_weight_uploads_are_refused(change, needle):
    server, clients = federation("feddf", [TinyNet, TinyNet], [20, 30], tau=1)
    phase, results = local_train(server, clients)
    with pytest.raises(InvalidResult, match=needle):
        server.validate(phase, "c0", change(results["c0"]))


def test_average_phase_needs_logits_and_a_client_refuses_foreign_shapes():
    server, clients = federation("feddf", [TinyNet, NarrowNet, TinyNet], [20, 30, 40], tau=1)
    phase, results = local_train(server, clients)
    avg = server.collect(phase, results)
    res = clients["c0"].handle(avg.tasks["c0"])
    with pytest.raises(InvalidResult, match="logits"):
        server.validate(avg, "c0", Message(dict(res.meta), {}))
    wrong = Message(dict(avg.tasks["c1"].meta), {**avg.tasks["c0"].tensors})  # a TinyNet average for a NarrowNet
    with pytest.raises(ValueError, match="shapes"):
        clients["c1"].handle(wrong)


def test_a_client_that_missed_the_upload_gets_its_group_average_also_after_a_restart():
    archs, sizes = [TinyNet, NarrowNet, TinyNet], [20, 30, 40]
    server, clients = federation("feddf-al", archs, sizes, tau=1)
    in_process(server, clients).run_round(0)  # the server learns every client's group
    buf = io.BytesIO()
    torch.save(server.state_dict(), buf)  # as the coordinator persists it
    buf.seek(0)
    restarted, _ = federation("feddf-al", archs, sizes, tau=1)
    restarted.load_state_dict(torch.load(buf, weights_only=True))
    assert restarted.group_of == server.group_of
    for s in (server, restarted):
        phase, results = local_train(s, clients, round_idx=1, skip=("c2",))
        avg = s.collect(phase, results)
        sent = sent_average(avg.tasks["c2"])
        assert sent and all(np.array_equal(sent[k], results["c0"].tensors[WEIGHTS + k]) for k in sent)
        assert sent_average(avg.tasks["c0"]) == {}  # c0 was its group's only contributor this round
    for key in ("disc", "disc_opt"):
        assert key in restarted.state_dict()


def test_run_config_accepts_heterogeneous_models_for_both():
    for name, tau in (("feddf-al", 15), ("feddf", 10)):
        cfg = RunConfig(strategy=name, dataset="mnist1d").resolved()
        assert cfg.models == ["mlp", "cnn1d", "cnn1d_wide"] and cfg.strategy_params.tau == tau
