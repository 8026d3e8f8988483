"""Reduced-precision exchange (`wire_dtype`): the codec's error bounds, strict refusal of any
other form on both ends (counted), `fedal simulate` running with it, fewer bytes on the wire,
and simulation == deployment over a real Mosquitto with float16 and int8."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from fedal.protocol import Message, decode, encode
from fedal.protocol.wire_dtype import WireDtypeError, decode_tensor, encode_tensor, wire_round
from fedal.session import ClientSession, TaskRefused
from fedal.sim import load_config
from fedal.strategies import InvalidResult, StrategyParams
from tests.deployment import Deployment
from tests.helpers import in_process, simulated_run, toy_federation


def rows(seed: int = 0) -> np.ndarray:
    """Rows of very different magnitudes, one all zero, one with a single non-zero value."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(9, 10)) * np.array([1e-3, 0.1, 1, 10, 300, 1e4, 1, 0, 1])[:, None]
    x[8] = 0.0
    x[8, 3] = -2.5
    return x.astype(np.float32)


# -- the codec -------------------------------------------------------------------------------

def test_int8_per_row_round_trip_is_within_half_a_step():
    x = rows()
    wire = encode_tensor("logits", x, "int8")
    q, scale = wire["logits"], wire["logits.scale"]
    assert set(wire) == {"logits", "logits.scale"} and q.dtype == np.int8 and q.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == (len(x),)
    np.testing.assert_array_equal(scale, (np.abs(x.astype(np.float64)).max(axis=1) / 127).astype(np.float32))
    assert np.abs(q).max() <= 127 and scale[7] == 0 and not q[7].any()
    # on the grid of the scale that is sent: |x - q * scale| <= scale / 2, exactly
    grid_err = np.abs(x.astype(np.float64) - q.astype(np.float64) * scale.astype(np.float64)[:, None])
    assert np.all(grid_err <= scale.astype(np.float64)[:, None] / 2)
    deq = decode_tensor(wire, "logits", "int8")
    assert deq.dtype == np.float32
    # and in float32 as received, up to float32's own rounding of the product
    tol = scale[:, None] / 2 + np.abs(x) * np.finfo(np.float32).eps
    assert np.all(np.abs(x - deq) <= tol)
    assert deq[8, 3] == x[8, 3]  # a row's peak is on the grid
    np.testing.assert_array_equal(wire_round(x, "int8"), deq)


def test_int8_per_tensor_scale():
    x = rows(1)
    wire = encode_tensor("fbar", x, "int8", "tensor")
    scale = wire["fbar.scale"]
    assert scale.shape == (1,) and scale[0] == np.float32(np.abs(x).max() / 127)
    deq = decode_tensor(wire, "fbar", "int8", "tensor")
    assert np.all(np.abs(x - deq) <= scale[0] / 2 + np.abs(x) * np.finfo(np.float32).eps)
    with pytest.raises(WireDtypeError, match="shape"):  # a per-tensor scale where the run says per row
        decode_tensor(wire, "fbar", "int8", "row")


def test_float16_round_trip_equals_numpys_cast_and_float32_is_untouched():
    x = rows(2)
    wire = encode_tensor("grad", x, "float16")
    assert set(wire) == {"grad"} and wire["grad"].dtype == np.float16
    np.testing.assert_array_equal(wire["grad"], x.astype(np.float16))
    np.testing.assert_array_equal(decode_tensor(wire, "grad", "float16"), x.astype(np.float16).astype(np.float32))
    assert encode_tensor("grad", x, "float32")["grad"] is x  # a float32 run sends exactly what it did before
    assert wire_round(x, "float32") is x


def bad_forms(x: np.ndarray):
    """(run's wire_dtype, tensors, reason kind) that a receiver must refuse."""
    int8 = encode_tensor("t", x, "int8")
    yield "int8", {"t": x}, "wire_dtype"  # float32 where the run says int8
    yield "int8", {"t": int8["t"]}, "wire_dtype"  # int8 without its scale
    yield "int8", {**int8, "t.scale": int8["t.scale"].astype(np.float64)}, "wire_dtype"
    yield "int8", {**int8, "t.scale": int8["t.scale"][:-1]}, "wire_dtype"
    yield "int8", {**int8, "t.scale": np.full_like(int8["t.scale"], np.nan)}, "non_finite"
    yield "int8", {**int8, "t.scale": -int8["t.scale"]}, "wire_dtype"
    yield "int8", {**int8, "t.scale": np.full_like(int8["t.scale"], 1e3)}, "magnitude"  # 127e3 > 1e4 decoded
    yield "int8", {**int8, "t": np.full_like(int8["t"], -128)}, "wire_dtype"
    yield "int8", {**int8, "t": int8["t"].astype(np.int16)}, "wire_dtype"
    yield "float16", {"t": x}, "wire_dtype"
    yield "float16", {"t": x.astype(np.float16), "t.scale": np.ones(len(x), np.float32)}, "wire_dtype"
    yield "float16", {"t": np.full(x.shape, np.inf, np.float16)}, "non_finite"
    yield "float32", {"t": x.astype(np.float16)}, "wire_dtype"
    yield "float32", {**int8}, "wire_dtype"
    yield "float32", {"t": x, "t.scale": np.ones(len(x), np.float32)}, "wire_dtype"
    yield "float32", {}, "wire_dtype"


def test_decode_refuses_every_form_the_run_did_not_declare():
    x = rows(3)
    cases = list(bad_forms(x))
    for wire_dtype, tensors, kind in cases:
        with pytest.raises(WireDtypeError) as err:
            decode_tensor(tensors, "t", wire_dtype, max_abs_value=1e4)
        assert err.value.kind == kind, (wire_dtype, sorted(tensors), str(err.value))
    for wire_dtype in ("float32", "float16", "int8"):  # the genuine form, of the wrong shape
        with pytest.raises(WireDtypeError, match="shape"):
            decode_tensor(encode_tensor("t", x, wire_dtype), "t", wire_dtype, shape=(len(x) + 1, x.shape[1]))


def test_the_setting_is_validated_and_belongs_to_the_distillation_strategies():
    with pytest.raises(ValueError):
        StrategyParams(wire_dtype="bfloat16")
    with pytest.raises(ValueError, match="65504"):
        StrategyParams(wire_dtype="float16", max_abs_value=1e5)
    for name in ("fedal", "fedmd", "fedmd-lf", "feddf", "feddf-al"):
        load_config(None, dict(strategy=name, dataset="digits", clients=3, wire_dtype="int8", wire_int8_scale="tensor"))
    with pytest.raises(ValueError, match="wire_dtype"):
        load_config(None, dict(strategy="fedavg", dataset="digits", clients=3, wire_dtype="int8"))


# -- both halves refuse another form, and it is counted ----------------------------------------

@pytest.mark.parametrize(("run", "sent"), [("int8", "float32"), ("float16", "int8"), ("float32", "float16")])
def test_the_server_half_refuses_logits_in_another_dtype_and_the_engine_counts_it(run, sent, one_torch_thread):
    server, clients, params = toy_federation("fedal", n_clients=3, tau=2, wire_dtype=run)
    phase = server.begin_round(0)
    honest = clients["c0"].handle(phase.tasks["c0"])
    server.validate(phase, "c0", decode(encode(honest)))  # the run's own form passes
    other = params.model_copy(update={"wire_dtype": sent})
    f = decode_tensor(honest.tensors, "logits", run)
    with pytest.raises(InvalidResult) as err:
        server.validate(phase, "c0", Message(honest.meta, encode_tensor("logits", f, sent)))
    assert err.value.kind == "wire_dtype"

    server, clients, params = toy_federation("fedal", n_clients=3, tau=2, wire_dtype=run)
    clients["c1"].params = other  # a device that sends its logits in another form than the run's
    engine = in_process(server, clients)
    record = engine.run_round(0)
    assert engine.reject_reasons["wire_dtype"] >= 1 and record["rejected"] >= 1
    assert engine.clients["c1"].rejected >= 1 and engine.clients["c0"].rejected == 0
    assert all(r.startswith("c1:") and "logits" in r for r in engine.round_rejects)


def agent_for(client, tmp_path) -> tuple[Agent, list[bytes]]:
    cfg = AgentConfig(client_id="c0", run_id="r", model="mlp", data_file=tmp_path / "unused.npz", workspace=tmp_path / "ws")
    agent = Agent(cfg)
    (tmp_path / "ws").mkdir()
    agent.test = agent.local_test = None
    agent._attach(client, "inst")
    sent: list[bytes] = []
    agent.link.publish_result = lambda wire: sent.append(wire) or len(wire)
    return agent, sent


def deliver(agent: Agent, task: Message, seq: int) -> None:
    meta = {**task.meta, "run": "r", "client": "c0", "instance": "inst", "epoch": 0, "seq": seq}
    agent._on_task(encode(Message(meta, task.tensors)))


@pytest.mark.parametrize("tamper", ["float32 fbar", "int8 fbar without scale", "float16 grad"])
def test_the_agent_refuses_feedback_in_another_dtype_and_counts_it(tamper, tmp_path, one_torch_thread):
    server, clients, _ = toy_federation("fedal", n_clients=2, wire_dtype="int8")
    agent, sent = agent_for(clients["c0"], tmp_path)
    phase = server.begin_round(0)
    deliver(agent, phase.tasks["c0"], 1)  # local_train: answered, with int8 logits
    assert len(sent) == 1 and agent.counters["tasks"] == 1
    up = decode(sent[0])
    assert up.tensors["logits"].dtype == np.int8 and "logits.scale" in up.tensors
    results = {"c0": up, "c1": clients["c1"].handle(phase.tasks["c1"])}
    task = server.collect(phase, results).tasks["c0"]
    assert task.tensors["fbar"].dtype == np.int8 and task.tensors["grad"].dtype == np.int8
    tensors = dict(task.tensors)
    if tamper == "float32 fbar":
        tensors["fbar"] = decode_tensor(tensors, "fbar", "int8")
        del tensors["fbar.scale"]
    elif tamper == "int8 fbar without scale":
        del tensors["fbar.scale"]
    else:
        tensors["grad"] = decode_tensor(tensors, "grad", "int8").astype(np.float16)
        del tensors["grad.scale"]
    before = {k: v.clone() for k, v in agent.client.model.state_dict().items()}
    deliver(agent, Message(task.meta, tensors), 2)
    assert len(sent) == 1 and agent.counters["rejected"] == 1 and agent.rejects["wire_dtype"] == 1
    assert agent.counters["tasks"] == 1
    assert all(torch.equal(before[k], v) for k, v in agent.client.model.state_dict().items())  # never trained on
    deliver(agent, task, 2)  # the genuine task of the same step is still applied, not taken for a replay
    assert len(sent) == 2 and agent.counters["tasks"] == 2 and not agent.counters["round_replays"]


def test_the_session_refuses_a_task_the_client_half_cannot_read():
    """The in-process transport's session is the agent's: the same refusal reaches it."""
    server, clients, _ = toy_federation("fedmd", n_clients=2, wire_dtype="float16")
    session = ClientSession("r", "c0", clients["c0"], "inst", evaluate=lambda t: t)
    phase = server.begin_round(0)
    ident = {"run": "r", "client": "c0", "instance": "inst", "epoch": 0}
    up = session.on_task(Message({**phase.tasks["c0"].meta, **ident, "seq": 1}, phase.tasks["c0"].tensors)).received()
    assert up.tensors["logits"].dtype == np.float16
    task = server.collect(phase, {"c0": up, "c1": clients["c1"].handle(phase.tasks["c1"])}).tasks["c0"]
    assert task.tensors["fbar"].dtype == np.float16
    bad = {**task.tensors, "fbar": task.tensors["fbar"].astype(np.float32)}
    with pytest.raises(TaskRefused, match="float16"):
        session.on_task(Message({**task.meta, **ident, "seq": 2}, bad))
    assert session.counters["tasks"] == 1


# -- simulation: runs, and sends fewer bytes ------------------------------------------------------

def small_config(name: str, wire_dtype: str, **extra):
    return load_config(None, dict(strategy=name, dataset="digits", clients=3, rounds=2, public_size=60, seed=3,
                                  models=["mlp", "lenet5"], tau=2, eval_every=1, wire_dtype=wire_dtype,
                                  vectorize=False, **extra))  # the per-client reference


def test_fedal_simulate_runs_with_float16_and_int8(tmp_path):
    for name in ("fedal", "fedmd"):
        for wire_dtype in ("float16", "int8"):
            path = tmp_path / f"{name}-{wire_dtype}.toml"
            path.write_text(f'strategy = "{name}"\ndataset = "digits"\nclients = 3\nrounds = 2\npublic_size = 60\n'
                            f'seed = 3\n\n[strategy_params]\ntau = 2\nwire_dtype = "{wire_dtype}"\n')
            out = tmp_path / f"{name}-{wire_dtype}.json"
            proc = subprocess.run([sys.executable, "-m", "fedal_cli.main", "simulate", "--config", str(path), "--quiet",
                                   "--out", str(out)], capture_output=True, text=True, env={**os.environ}, timeout=300)
            assert proc.returncode == 0, proc.stderr
            res = json.loads(out.read_text())
            assert res["config"]["strategy_params"]["wire_dtype"] == wire_dtype
            assert [r["round"] for r in res["rounds"]] == [1, 2]
            assert all(r["rejected"] == 0 and r["bytes_up"] > 0 for r in res["rounds"]), res["rounds"]
            assert len(res["final"]["client_acc"]) == 3


def per_row_payload(monkeypatch, config) -> tuple[list[dict], int, int]:
    """The run's round records and the bytes of the per-row tensors (logits up; fbar, grad and
    their scales down) inside every envelope of it."""
    sizes = {"up": 0, "down": 0}
    original = ClientSession.on_task

    def counted(self, task):
        sizes["down"] += sum(a.nbytes for k, a in task.tensors.items() if k.split(".")[0] in ("fbar", "grad"))
        wire = original(self, task)
        if wire is not None:
            sizes["up"] += sum(a.nbytes for k, a in wire.received().tensors.items() if k.split(".")[0] == "logits")
        return wire

    monkeypatch.setattr(ClientSession, "on_task", counted)
    records: list[dict] = []
    simulated_run(config, records)
    monkeypatch.undo()
    return records, sizes["up"], sizes["down"]


@pytest.mark.parametrize("name", ["fedal", "fedmd"])
def test_int8_sends_well_under_half_the_bytes_of_float32(name, monkeypatch, one_torch_thread):
    full, up32, down32 = per_row_payload(monkeypatch, small_config(name, "float32"))
    half, up16, down16 = per_row_payload(monkeypatch, small_config(name, "float16"))
    int8, up8, down8 = per_row_payload(monkeypatch, small_config(name, "int8"))
    assert up32 > 0 and down32 > 0
    # float16: exactly half; int8: a quarter plus one float32 scale per row of 10 classes
    assert (up16, down16) == (up32 / 2, down32 / 2)
    assert up8 / up32 == pytest.approx(0.25 + 1 / 10) and down8 / down32 == pytest.approx(0.25 + 1 / 10)
    assert up8 / up32 < 0.5 and down8 / down32 < 0.5
    # the round records count whole envelopes: their headers (a few hundred bytes each, the
    # same in every form) do not shrink, yet int8 still stays well under float32
    for r32, r16, r8 in zip(full, half, int8):
        assert r8["bytes_up"] < r16["bytes_up"] < r32["bytes_up"]
        assert r8["bytes_down"] < r16["bytes_down"] < r32["bytes_down"]
        assert r8["bytes_up"] / r32["bytes_up"] < 0.65 and r8["bytes_down"] / r32["bytes_down"] < 0.65
        assert r8["rejected"] == 0


# -- simulation == deployment ---------------------------------------------------------------------

@pytest.mark.parametrize(("name", "wire_dtype"), [("fedal", "int8"), ("fedmd", "int8"), ("fedal", "float16"),
                                                  ("fedmd", "float16")])
def test_deployment_over_mosquitto_matches_simulation(name, wire_dtype, mosquitto, tmp_path, one_torch_thread):
    config = small_config(name, wire_dtype)
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    try:
        dep.start_all()
        results = dep.finish()
        for cid, agent in dep.agents.items():
            assert agent.wait(timeout=120) == 0, f"agent {cid} exited with {agent.returncode}"
    finally:
        dep.close()
    records: list[dict] = []
    data, clients, _ = simulated_run(config, records)
    assert results["config"]["strategy_params"]["wire_dtype"] == wire_dtype
    got = results["rounds"]
    assert [r["round"] for r in got] == [r["round"] for r in records] == [1, 2]
    for dep_round, sim_round in zip(got, records):
        acc = {k: v for k, v in sim_round.items() if k.endswith("_acc")}
        assert {k: v for k, v in dep_round.items() if k.endswith("_acc")} == acc, f"round {sim_round['round']}"
        assert dep_round["server"] == pytest.approx(sim_round["server"], rel=1e-9, abs=1e-12)
        assert dep_round["bytes_up"] > 0 and dep_round["bytes_down"] > 0
    # the rounding is felt: a float32 run's server diagnostics differ from this one's
    full: list[dict] = []
    simulated_run(small_config(name, "float32"), full)
    assert [r["server"] for r in full] != [r["server"] for r in records]
    for cid, client in clients.items():  # the model each device kept
        remote = np.load(tmp_path / "dep" / "agents" / cid / "final" / "test_logits.npy")
        assert np.max(np.abs(remote - client.predict(data.test.x).numpy())) <= 1e-6, cid
    assert results["deployment"]["counters"].get("rejected", 0) == 0
