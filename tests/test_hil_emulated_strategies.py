"""Every registered strategy, emulated: the emulated agent's answers pass the real server halves.

In-process, each strategy's server half drives emulated agents (hil/emulated_agent.py) for a few
rounds and validates every result as the coordinator does; the replay guard of the shared client
session (fedal.session) brings an emulated client back to its round-start state when a resumed
coordinator repeats the round under way. Over Mosquitto, a fleet answers a real coordinator
process for strategies the emulation did not speak before.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import subprocess
import sys
import uuid

import numpy as np
import pytest

from fedal.protocol import Message, RunManifest, answering, decode, encode, topics
from fedal.strategies import (
    STRATEGIES,
    STRATEGY_NAMES,
    ServerContext,
    StrategyParams,
    get_strategy,
)
from fedal.strategies.fedhkd import COUNT_KEY, H_KEY, Q_KEY
from fedal.strategies.global_model import global_accuracy
from fedal.strategies.local import LocalClient
from hil.coordinator_setup import (
    get_json,
    start_coordinator,
    stop_process,
    wait_for_run,
    write_coordinator_config,
)
from hil.emulated_agent import EmulatedAgent, PublicSetSource, emulated_strategies
from hil.fleet import Fleet, client_ids
from hil.mosquitto import free_port

RUN = "emu"
K, P, B = 10, 200, 16
PUBLIC_X = np.random.default_rng(0).normal(size=(P, 40)).astype(np.float32)  # for a server-side model (MHAT)


class _Public(PublicSetSource):
    def size(self, expected_hash, url):  # no coordinator here: the size the manifest announces
        return P


def manifest(strategy: str, clients: list[str], params: StrategyParams, instance: str = "i-1") -> bytes:
    return RunManifest(run_id=RUN, strategy=strategy, strategy_params=params.model_dump(mode="json"), num_classes=K,
                       clients=clients, rounds=3, public_hash="h", public_size=P, public_url="http://127.0.0.1:9/x",
                       instance=instance).to_json()


def setup(strategy: str, n: int = 3, **agent_kwargs):
    spec = get_strategy(strategy)
    params = StrategyParams(public_batch_size=B, tau=2).resolve(spec.preset)
    ids = [f"c{i}" for i in range(n)]
    server = spec.server(params, ids, ServerContext(K, P, seed=0, public_x=PUBLIC_X))
    agents = {cid: EmulatedAgent(RUN, cid, index=i, public=_Public(), **agent_kwargs) for i, cid in enumerate(ids)}
    for a in agents.values():
        assert a.on_message(a.manifest_topic, manifest(strategy, ids, params)) == []
        assert a.joined is not None, a.counters
    return spec, params, ids, server, agents


def send(agent: EmulatedAgent, task: Message, key: tuple[int, int]) -> Message:
    meta = {**task.meta, "run": RUN, "client": agent.client_id, "instance": "i-1", "epoch": key[0], "seq": key[1]}
    (pub,) = agent.on_message(agent.task_topic, encode(Message(meta, task.tensors)))
    assert pub.topic == topics.result(RUN, agent.client_id)
    res = decode(pub.payload)
    assert (res.meta["epoch"], res.meta["seq"]) == key
    return answering(res, task)  # as the engine reads it: the task's context restored


def run_round(server, agents, r: int, epoch: int, seq: int, log: list | None = None) -> int:
    """One round of the server half, then `evaluate`; every result must pass the server half's
    validation (InvalidResult otherwise). `log` collects (phase, iteration, client, task, result)."""
    phase = server.begin_round(r)
    while phase is not None:
        seq += 1
        results = {}
        for cid, task in phase.tasks.items():
            res = send(agents[cid], task, (epoch, seq))
            server.validate(phase, cid, res)
            results[cid] = res
            if log is not None:
                log.append((phase.phase, phase.iteration, cid, task, res))
        phase = server.collect(phase, results)
    seq += 1
    for a in agents.values():  # the coordinator's evaluate: acc in [0, 1], answered by the session
        res = send(a, Message({"phase": "evaluate", "round": r, "iteration": 0}), (epoch, seq))
        assert res.meta["phase"] == "evaluate" and 0.0 <= res.meta["acc"] <= 1.0 and res.meta["num_test"] == 100
    return seq


def test_every_registered_strategy_is_emulated():
    assert emulated_strategies() == STRATEGY_NAMES


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_every_strategy_is_accepted_by_its_server_half(strategy):
    spec, _params, _ids, server, agents = setup(strategy)
    log: list = []
    seq = 0
    for r in range(3):
        seq = run_round(server, agents, r, 0, seq, log)
    assert {p for p, *_ in log} == set(spec.phases)  # every phase the strategy declares was answered
    for cid, a in agents.items():
        tasks = sum(1 for *_, c, _t, _r in log if c == cid) + 3  # and three evaluations
        assert a.counters["tasks"] == tasks, (cid, dict(a.counters))
        assert not a.counters["rejected"] and not a.counters["errors"] and not a.counters["setup_failures"]
        s = a.status()
        assert s["feedback_twice"] == [] and s["iterations_twice"] == []
    applied = sum(a.status()["feedback_applied"] for a in agents.values())
    fed_back = sum(1 for _p, _i, _c, task, _r in log if {"fbar", "fd/teacher", "cfd/target"} & set(task.tensors)
                   or {"proto/global", "hbar", "fccl/zbar"} & set(task.tensors) or (spec.homogeneous_models and _p == "train"))
    assert applied == fed_back and (applied > 0) == (strategy != "local")


def test_cfd_uploads_are_delta_coded_after_the_first_round():
    _spec, _params, _ids, server, agents = setup("cfd")
    log: list = []
    seq = run_round(server, agents, 0, 0, 0, log)
    assert server.round_metrics()["cfd_delta"] == 0.0
    run_round(server, agents, 1, 0, seq, log)
    refs = [(r.meta["round"], r.meta["ref"], sorted(r.tensors)) for p, _i, _c, _t, r in log if p == "local_train"]
    assert refs[:3] == [(0, -1, ["cfd/levels"])] * 3
    assert {(rnd, ref) for rnd, ref, _ in refs[3:]} == {(1, 0)} and all("cfd/changed" in t for *_, t in refs[3:])
    assert server.round_metrics()["cfd_delta"] == 1.0


def test_fedhkd_knowledge_goes_both_ways():
    _spec, _params, ids, server, agents = setup("fedhkd")
    log: list = []
    seq = run_round(server, agents, 0, 0, 0, log)
    run_round(server, agents, 1, 0, seq, log)
    trains = [(task, res) for phase, _i, _c, task, res in log if phase == "train"]
    for _task, res in trains:
        h, q, counts = res.tensors[H_KEY], res.tensors[Q_KEY], res.tensors[COUNT_KEY]
        assert h.dtype == np.float32 and h.shape == (K, 32) and q.shape == (K, K) and counts.dtype == np.int64
        assert 0 < res.meta["shared_classes"] == int((counts > 0).sum()) and counts.sum() <= res.meta["num_samples"]
    first, second = trains[:len(ids)], trains[len(ids):]
    assert all(H_KEY not in t.tensors and "hkd_head" not in r.meta for t, r in first)
    # round 1 carries the global knowledge down, and the clients report the knowledge terms
    assert all(H_KEY in t.tensors and {"hkd_head", "hkd_feature", "ce"} <= set(r.meta) for t, r in second)
    assert server.knowledge is not None and server.knowledge.mask.any()


def test_feddf_groups_two_architectures():
    _spec, _params, _ids, server, agents = setup("feddf-al", n=4)
    log: list = []
    seq = run_round(server, agents, 0, 0, 0, log)
    run_round(server, agents, 1, 0, seq, log)
    tags = {cid: res.meta["arch"] for phase, _i, cid, _t, res in log if phase == "init"}
    assert tags["c0"] == tags["c2"] != tags["c1"] == tags["c3"]  # round-robin over two emulated models
    assert len(set(server.group_of.values())) == 2
    averages = [(cid, task, res) for phase, _i, cid, task, res in log if phase == "average"]
    for _cid, task, res in averages:  # each group of two gets its average, loaded before the logits
        assert any(k.startswith("w/") for k in task.tensors) and res.meta["averaged"] is True
        assert res.tensors["logits"].shape == (B, K)


@pytest.mark.parametrize("strategy", [s for s in STRATEGY_NAMES if STRATEGIES[s].global_model])
def test_global_model_of_emulated_weights_can_be_scored(strategy):
    """With the coordinator's model named, the uploads load into it: the coordinator's `global_acc`."""
    _spec, _params, _ids, server, agents = setup(strategy, models=["mlp"], input_shape=(40,))
    seq = run_round(server, agents, 0, 0, 0)
    run_round(server, agents, 1, 0, seq)
    rng = np.random.default_rng(0)
    acc = global_accuracy(server, "mlp", K, rng.standard_normal((50, 40), dtype=np.float32), rng.integers(0, K, 50))
    assert acc is not None and 0.0 <= acc <= 1.0


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_replayed_round_starts_from_the_round_start_state(strategy):
    """A coordinator resumed from its state after round 0 repeats round 1 under epoch 1: each
    client goes back to its state at round 1's start, so every result of the replay equals the
    first attempt's and every feedback is applied once per (instance, round, iteration)."""
    _spec, params, ids, server, agents = setup(strategy)
    seq = run_round(server, agents, 0, 0, 0)
    saved = copy.deepcopy(server.state_dict())  # what the coordinator saved after round 0
    first: list = []
    run_round(server, agents, 1, 0, seq, first)  # ... then it dies before saving round 1

    resumed = get_strategy(strategy).server(params, ids, ServerContext(K, P, seed=0, public_x=PUBLIC_X))
    resumed.load_state_dict(saved)
    again: list = []
    seq = run_round(resumed, agents, 1, 1, 0, again)
    assert [(p, i, c) for p, i, c, _t, _r in again] == [(p, i, c) for p, i, c, _t, _r in first]
    for (_p, _i, cid, _t, r1), (_p2, _i2, _c2, _t2, r2) in zip(first, again):
        assert {k: v for k, v in r1.meta.items() if k not in ("epoch", "seq")} == \
            {k: v for k, v in r2.meta.items() if k not in ("epoch", "seq")}, cid
        assert r1.tensors.keys() == r2.tensors.keys() and all(np.array_equal(r1.tensors[k], r2.tensors[k])
                                                               for k in r1.tensors), cid
    run_round(resumed, agents, 2, 1, seq)  # and the run goes on
    for a in agents.values():
        assert a.counters["round_replays"] == 1 and not a.counters["rejected"] and not a.counters["errors"]
        assert a.status()["iterations_twice"] == [] and a.status()["feedback_twice"] == []
        if strategy != "local":
            assert any(r == 1 for (_inst, r, _i) in a.applied_iterations)  # round 1's feedback, applied once


def test_a_strategy_without_an_emulation_is_refused_at_join(monkeypatch, caplog):
    """Driven by the registry: a client half the emulation does not know, or a phase its
    emulation does not answer, fails the join with the reason logged and counted."""
    class Unknown(LocalClient):
        """A client half no emulation is registered for."""

    local = STRATEGIES["local"]
    monkeypatch.setitem(STRATEGIES, "mystery", dataclasses.replace(local, name="mystery", client=Unknown))
    monkeypatch.setitem(STRATEGIES, "local-plus", dataclasses.replace(local, name="local-plus",
                                                                      phases={**local.phases, "distill": "exchange"}))
    params = StrategyParams().resolve(local.preset)
    for name, why in (("mystery", "client half Unknown has no emulation"), ("local-plus", "['distill']")):
        a = EmulatedAgent(RUN, "c0", public=_Public())
        with caplog.at_level(logging.WARNING, logger="hil.emulated_agent"):
            assert a.on_message(a.manifest_topic, manifest(name, ["c0"], params)) == []
        assert a.joined is None and a.counters["setup_failures"] == 1
        assert any(why in rec.getMessage() and "cannot join" in rec.getMessage() for rec in caplog.records), caplog.text
    assert "mystery" not in emulated_strategies() and "local" in emulated_strategies()


@pytest.mark.parametrize("strategy", ["fedhkd", "feddf-al"])
def test_fleet_answers_a_real_coordinator(mosquitto, tmp_path, strategy):
    """Emulated agents over Mosquitto and a real coordinator process, for a global-model strategy
    (the coordinator scores the emulated weights in its own model) and for FedDF-AL's groups."""
    run_id = f"emu-{strategy}-{uuid.uuid4().hex[:6]}"
    n, rounds = 4, 2
    ids = client_ids(n)
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    config = write_coordinator_config(tmp_path / "coordinator", mosquitto, run_id, ids, api_port=port, strategy=strategy,
                                      rounds=rounds, tau=2, public_size=300,
                                      public_batch_size=B if STRATEGIES[strategy].uses_public_set else 32,
                                      extra={"run": {"models": ["mlp"]}} if STRATEGIES[strategy].global_model else None)
    models = {"models": ["mlp"], "input_shape": (40,)} if STRATEGIES[strategy].global_model else {}
    fleet = Fleet(mosquitto, run_id, ids, seed=0, **models).start()
    coordinator = start_coordinator(config, tmp_path / "coordinator.log")
    try:
        final = wait_for_run(api, run_id, lambda r: r["state"] in ("finished", "failed"), 240, coordinator)
        records = get_json(f"{api}/api/v1/runs/{run_id}/rounds")
        assert fleet.wait_finished(30)
    finally:
        fleet.stop()
        stop_process(coordinator)
    assert final["state"] == "finished", (final.get("error"), (tmp_path / "coordinator.log").read_text()[-3000:])
    assert final["counters"].get("rejected", 0) == 0, final["counters"]
    assert [r["round"] for r in records] == list(range(1, rounds + 1))
    for r in records:
        assert set(r["phases"]) <= set(STRATEGIES[strategy].phases) | {"evaluate"}
        assert all(stats["participation"] == 1.0 for stats in r["phases"].values()), r["phases"]
        assert 0.0 <= r["mean_acc"] <= 1.0
        if STRATEGIES[strategy].global_model:
            assert 0.0 <= r["global_acc"] <= 1.0
    if strategy == "fedhkd":
        assert records[-1]["server"]["hkd_classes"] > 0  # the knowledge was aggregated
    else:
        assert records[-1]["server"]["groups"] == 2  # two emulated architectures, averaged apart
    summary = fleet.summary()
    assert summary["error"] is None and summary["finished"] == n
    assert summary["counters"].get("rejected", 0) == 0 and summary["counters"].get("setup_failures", 0) == 0
    assert summary["feedback_applied"] > 0
    assert summary["feedback_applied_twice"] == {} and summary["iterations_applied_twice"] == {}


@pytest.mark.parametrize("strategy", ["fedakd", "fedhkd"])
def test_fleet_command_drives_a_global_model_strategy(mosquitto, tmp_path, strategy):
    """`fedal hil fleet --start-coordinator` with a strategy whose coordinator scores the averaged
    model: the emulated weights take that model's layout and no knob it does not take is written."""
    run_id = f"glob-{uuid.uuid4().hex[:8]}"
    workdir = tmp_path / "coordinator"
    proc = subprocess.run([sys.executable, "-m", "hil", "fleet", "--clients", "3", "--broker", mosquitto, "--run-id", run_id,
                           "--timeout", "170", "--quiet", "--start-coordinator", "--workdir", str(workdir),
                           "--strategy", strategy, "--rounds", "2", "--tau", "2"],
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert json.loads(proc.stdout)["outcome"] == "finished"
    results = json.loads((workdir / "state" / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert all(r.get("global_acc") is not None for r in results["rounds"])
    assert results["deployment"]["counters"].get("rejected", 0) == 0


def test_a_reduced_precision_run_is_refused_at_join(caplog):
    """Emulated agents speak float32 only: a run with another wire_dtype is refused up front,
    with the reason logged and counted, not answered with logits the coordinator would refuse."""
    agent = EmulatedAgent("wire", "c0", public=PublicSetSource())
    manifest = RunManifest(run_id="wire", strategy="fedal", strategy_params={"wire_dtype": "int8"}, num_classes=10,
                           clients=["c0", "c1"], rounds=1, eval_every=1, public_hash=None, public_size=None,
                           public_url=None, state="running", round=0, instance="i")
    with caplog.at_level(logging.WARNING):
        assert agent.on_message(agent.manifest_topic, manifest.to_json()) == []
    assert agent.joined is None and agent.counters["setup_failures"] == 1
    assert "wire_dtype" in caplog.text
