"""A task's `steps` is a count within a run's bounds for tau (1..MAX_STEPS), refused otherwise
before the client half takes the task (a negative count was answered as a task of no steps, with
loss 0; a huge one trained for days), for every registered strategy."""

from __future__ import annotations

import pytest
import torch

from fedal.protocol import Message
from fedal.session import ClientSession, TaskRefused
from fedal.strategies import STRATEGIES
from fedal.strategies.params import MAX_STEPS
from tests.helpers import toy_federation
from tests.test_strategy_contract import knobs


def first_task_with_steps(name: str):
    """(client id, client half, the task) of the first task of the first two rounds that says
    how many steps to take; the rounds before it run with every client answering directly."""
    server, clients, _ = toy_federation(name, **knobs(name))
    for r in range(2):
        phase = server.begin_round(r)
        while phase is not None:
            for cid, task in phase.tasks.items():
                if "steps" in task.meta:
                    return cid, clients[cid], task
            phase = server.collect(phase, {cid: clients[cid].handle(t) for cid, t in phase.tasks.items()})
    raise AssertionError(f"{name}: no task with steps in two rounds")


def state(client) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in client.model.state_dict().items()}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_steps_outside_a_runs_bounds_are_refused_before_the_client_takes_the_task(name, one_torch_thread):
    cid, client, task = first_task_with_steps(name)
    session = ClientSession("r", cid, client, "inst", evaluate=lambda t: t)
    seq = iter(range(1, 100))

    def send(steps) -> Message:
        meta = {**task.meta, "instance": "inst", "epoch": 0, "seq": next(seq), "steps": steps}
        return session.on_task(Message(meta, task.tensors)).received()

    before = state(client)
    for bad in (-3, 0, MAX_STEPS + 1, 2.0, True):
        with pytest.raises(TaskRefused, match="steps must be"):
            send(bad)
        after = state(client)
        assert all(torch.equal(before[k], after[k]) for k in before), f"steps={bad!r} changed the client"
    assert session.counters["tasks"] == 0
    result = send(task.meta["steps"])  # the genuine count is taken
    assert result.meta.get("declined") is None and session.counters["tasks"] == 1
