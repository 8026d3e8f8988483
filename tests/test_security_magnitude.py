"""Finite but absurd values: logits of magnitude 3.4e38 pass a NaN/inf check, so received float
tensors are bounded by the run's max_abs_value (default 1e4): a server half rejects such a result
(reason `magnitude`), the agent refuses such a task and never trains on it, and honest values
pass untouched. The attack over a real broker and coordinator: tests/test_security_device_attack.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from fedal.protocol import Message, decode, encode, tensor_problem
from fedal.strategies import InvalidResult
from tests.helpers import toy_federation

BIG = np.float32(3.4e38)


def test_tensor_problem_bounds_magnitude_and_finiteness():
    ok = {"logits": np.array([[1e4, -1e4]], np.float32), "indices": np.array([2**31 - 1], np.int32)}
    assert tensor_problem(ok, 1e4) is None  # integers are not bounded; the limit itself is allowed
    assert tensor_problem({"logits": np.array([BIG], np.float32)}, 1e4)[0] == "magnitude"
    assert tensor_problem({"logits": np.array([-1e4 - 1], np.float64)}, 1e4)[0] == "magnitude"
    assert tensor_problem({"logits": np.array([np.nan], np.float16)}, 1e4)[0] == "non_finite"
    assert tensor_problem({"empty": np.zeros((0, 3), np.float32)}, 1e4) is None


@pytest.mark.parametrize("strategy", ["fedal", "fedmd", "fedavg"])
def test_a_server_half_rejects_absurd_values(strategy):
    server, clients, params = toy_federation(strategy, n_clients=2)
    assert params.max_abs_value == 1e4
    phase = server.begin_round(0)
    while "c0" not in phase.tasks:  # FedAvg's init phase goes to c0 only; anything else to both
        phase = server.collect(phase, {})
    honest = clients["c0"].handle(phase.tasks["c0"])
    server.validate(phase, "c0", honest)  # accepted
    name = next(k for k, v in honest.tensors.items() if np.issubdtype(v.dtype, np.floating))
    bad = dict(honest.tensors)
    bad[name] = np.full_like(bad[name], BIG)
    with pytest.raises(InvalidResult, match="max_abs_value") as err:
        server.validate(phase, "c0", Message(honest.meta, bad))
    assert err.value.kind == "magnitude"
    nan = dict(honest.tensors)
    nan[name] = np.full_like(nan[name], np.nan)
    with pytest.raises(InvalidResult) as err:
        server.validate(phase, "c0", Message(honest.meta, nan))
    assert err.value.kind == "non_finite"


def test_the_limit_is_a_run_setting():
    server, clients, _ = toy_federation("fedmd", n_clients=2, max_abs_value=0.5)
    phase = server.begin_round(0)
    honest = clients["c0"].handle(phase.tasks["c0"])
    if np.abs(honest.tensors["logits"]).max() > 0.5:
        with pytest.raises(InvalidResult, match="max_abs_value 0.5"):
            server.validate(phase, "c0", honest)
    server, clients, _ = toy_federation("fedmd", n_clients=2, max_abs_value=1e30)
    phase = server.begin_round(0)
    honest = clients["c0"].handle(phase.tasks["c0"])
    server.validate(phase, "c0", Message(honest.meta, {"logits": np.full_like(honest.tensors["logits"], 1e29)}))


def test_the_agent_refuses_a_task_with_absurd_feedback(tmp_path):
    server, clients, _ = toy_federation("fedal", n_clients=2)
    cfg = AgentConfig(client_id="c0", run_id="r", model="mlp", data_file=tmp_path / "unused.npz", workspace=tmp_path / "ws")
    agent = Agent(cfg)
    (tmp_path / "ws").mkdir()
    agent.test = agent.local_test = None
    agent._attach(clients["c0"], "inst")
    sent: list[bytes] = []
    agent.link.publish_result = lambda wire: sent.append(wire) or len(wire)

    def deliver(task: Message, seq: int) -> None:
        meta = {**task.meta, "run": "r", "client": "c0", "instance": "inst", "epoch": 0, "seq": seq}
        agent._on_task(encode(Message(meta, task.tensors)))

    phase = server.begin_round(0)
    deliver(phase.tasks["c0"], 1)  # local_train: answered
    assert len(sent) == 1 and agent.counters["tasks"] == 1
    results = {cid: c.handle(phase.tasks[cid]) for cid, c in clients.items() if cid != "c0"}
    results["c0"] = decode(sent[0])
    transfer = server.collect(phase, results)
    task = transfer.tasks["c0"]
    assert "fbar" in task.tensors
    before = {k: v.clone() for k, v in agent.client.model.state_dict().items()}
    poisoned = Message(task.meta, {**task.tensors, "fbar": np.full_like(task.tensors["fbar"], BIG)})
    deliver(poisoned, 2)
    assert len(sent) == 1 and agent.counters["rejected"] == 1 and agent.rejects["magnitude"] == 1
    assert all(np.array_equal(before[k], v) for k, v in agent.client.model.state_dict().items())  # never trained on
    deliver(task, 2)  # the honest feedback for the same step is still applied
    assert len(sent) == 2 and agent.counters["tasks"] == 2
