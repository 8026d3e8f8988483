"""A task that repeats a step of the round under way makes the session go back to the round's
start (a resumed coordinator replays the round). If the client half then refuses the task, the
going back is undone: a refused task changes nothing, and the genuine next task is applied to
the state the client had."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fedal.protocol import Message
from fedal.session import ClientSession, TaskRefused
from tests.helpers import toy_federation


class MemoryStore:
    """The agent's SessionStore, kept in memory."""

    def __init__(self):
        self.start = None
        self.saves: list = []  # the round of each save_round_start
        self.answered = 0  # after_task: called with each answer, before it is sent

    def save_round_start(self, round_no, client_state):
        self.saves.append(round_no)
        self.start = (round_no, copy.deepcopy(client_state))

    def load_round_start(self):
        return self.start

    def after_task(self, session):
        self.answered += 1


def weights(client) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in client.model.state_dict().items()}


def two_steps_into_a_round():
    """FedAL, two clients; c0 through its session (with a MemoryStore), c1 directly, through
    local training and the first transfer iteration. Returns the clients, the session, its store,
    send(task) (a new key each call), the first transfer's task to c0 and the next phase."""
    server, clients, _ = toy_federation("fedal", n_clients=2, tau=2)
    store = MemoryStore()
    session = ClientSession("r", "c0", clients["c0"], "inst", evaluate=lambda t: t, store=store)
    ident = {"instance": "inst", "epoch": 0}
    seq = iter(range(1, 100))

    def send(task: Message) -> Message:
        return session.on_task(Message({**task.meta, **ident, "seq": next(seq)}, task.tensors)).received()

    phase = server.begin_round(0)
    results = {"c0": send(phase.tasks["c0"]), "c1": clients["c1"].handle(phase.tasks["c1"])}
    phase = server.collect(phase, results)  # transfer, iteration 0
    first_transfer = phase.tasks["c0"]
    results = {"c0": send(first_transfer), "c1": clients["c1"].handle(phase.tasks["c1"])}
    phase = server.collect(phase, results)  # transfer, iteration 1
    return clients, session, store, send, first_transfer, phase


def test_a_refused_task_that_repeats_a_step_leaves_the_client_as_it_was():
    clients, session, store, send, _, phase = two_steps_into_a_round()
    before, steps = weights(clients["c0"]), set(session.round_steps)

    # a new key for a step already taken (transfer iteration 0), with feedback no client can apply
    bogus = phase.tasks["c0"].meta | {"iteration": 0}
    with pytest.raises(TaskRefused):
        send(Message(bogus, {"fbar": np.zeros((5, 10), np.float32)}))
    after = weights(clients["c0"])
    assert all(torch.equal(before[k], after[k]) for k in before)  # not the round's start: as before the task
    assert session.round_steps == steps and not session.counters["round_replays"]
    assert store.answered == 2  # nothing of the refused task was made durable

    # the genuine task of the next step is applied to that state, not taken for a replay
    send(phase.tasks["c0"])
    assert session.counters["tasks"] == 3 == store.answered and not session.counters["round_replays"]
    assert not all(torch.equal(before[k], v) for k, v in weights(clients["c0"]).items())  # it trained


def test_a_refused_task_that_opens_a_new_round_leaves_the_round_under_way():
    """The replay guard's other branch: a task of another round is that round's first, so the
    session saves its start and opens it before the client half looks at the task. Refused, the
    round under way stays open with its steps: its next task is no round's first (its start, as
    saved, would be that round's middle), and a replay of one of its steps is found as a replay
    (refused here, the saved start being the refused round's) instead of being computed afresh on
    the round's middle."""
    clients, session, store, send, first_transfer, phase = two_steps_into_a_round()
    saves = store.saves
    round_no, steps = session.round_no, set(session.round_steps)
    assert saves == [round_no]

    with pytest.raises(TaskRefused):  # another round's task, with feedback no client can apply
        send(Message(phase.tasks["c0"].meta | {"round": round_no + 7}, {"fbar": np.zeros((5, 10), np.float32)}))
    assert session.round_no == round_no and session.round_steps == steps

    send(phase.tasks["c0"])  # the round's next step: no round's first, so no start is saved
    assert saves == [round_no, round_no + 7] and session.counters["tasks"] == 3
    with pytest.raises(TaskRefused, match="start state is missing"):  # a replay, found as one
        send(first_transfer)


def test_a_refused_replay_is_undone_on_the_vectorized_path_too():
    """compute_tasks (a vectorized simulation, a Ray actor's group) admits and prepares every
    task before computing any: a task refused there leaves its session as on_task does."""
    from fedal.engine.inprocess import compute_tasks

    clients, session, store, _, _, phase = two_steps_into_a_round()
    before, steps = weights(clients["c0"]), set(session.round_steps)
    bogus = Message(phase.tasks["c0"].meta | {"iteration": 0, "instance": "inst", "epoch": 0, "seq": 50},
                    {"fbar": np.zeros((5, 10), np.float32)})
    results, refusals, _ = compute_tasks({"c0": session}, [("c0", bogus)], vectorize=True)
    assert results == [None] and isinstance(refusals[0], TaskRefused)  # a group of one: client by client
    after = weights(clients["c0"])
    assert all(torch.equal(before[k], after[k]) for k in before)  # not the round's start
    assert session.round_steps == steps and not session.counters["round_replays"]
    assert store.answered == 2


def test_a_simulation_refuses_bad_tasks_and_stops_on_a_clients_own_failure(monkeypatch):
    """answer_tasks (both simulation backends): a task the client's checks refuse (ValueError)
    costs only itself and says why; the client failing at a task it took (a bug, out of memory:
    RuntimeError) stops the run with that error, as it must not look like a refused task."""
    from fedal.engine.inprocess import answer_tasks

    server, clients, _ = toy_federation("fedal", n_clients=2, tau=2)
    sessions = {cid: ClientSession("r", cid, c, "inst", evaluate=lambda t: t) for cid, c in clients.items()}
    phase = server.begin_round(0)
    items = [(cid, Message({**t.meta, "instance": "inst", "epoch": 0, "seq": 1}, t.tensors))
             for cid, t in phase.tasks.items()]
    handle = type(clients["c1"]).handle

    def failing(self, task):
        if self.client_id == "c1":
            raise failure
        return handle(self, task)

    monkeypatch.setattr(type(clients["c1"]), "handle", failing)
    failure: Exception = ValueError("steps must be between 1 and 5")
    out, _ = answer_tasks(sessions, items)  # client by client: the patched handle is what runs
    assert out[0][0] is not None and out[0][1] is None  # c0 answered
    assert out[1][0] is None and "steps must be" in out[1][1]
    failure = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    items = [(cid, Message({**task.meta, "seq": 2}, task.tensors)) for cid, task in items]
    with pytest.raises(TaskRefused) as stopped:
        answer_tasks(sessions, items)
    assert isinstance(stopped.value.__cause__, RuntimeError)


def test_a_refused_task_leaves_the_rest_of_a_vectorized_flush_stacked():
    """One client's task refused (feedback that is not finite) costs that task only: the other
    clients of its architecture still step as one stacked group, and the refusing client is left
    as it was. The whole flush used to be computed again client by client."""
    from fedal.engine.inprocess import answer_tasks

    server, clients, _ = toy_federation("fedal", n_clients=4, tau=2)
    sessions = {cid: ClientSession("r", cid, c, "inst", evaluate=lambda t: t) for cid, c in clients.items()}
    seq = iter(range(1, 100))

    def items(phase, poison=None):
        out = []
        for cid, t in phase.tasks.items():
            tensors = dict(t.tensors)
            if cid == poison:
                tensors["fbar"] = np.full_like(tensors["fbar"], np.nan)
            out.append((cid, Message({**t.meta, "instance": "inst", "epoch": 0, "seq": next(seq)}, tensors)))
        return out

    phase = server.begin_round(0)
    answers, stacking = answer_tasks(sessions, items(phase), vectorize=True)
    assert stacking.stacked == 4 and all(r is not None for r, _ in answers)
    phase = server.collect(phase, {cid: r.received() for (cid, _), (r, _) in zip(items(phase), answers)})
    before = weights(clients["c0"])
    answers, stacking = answer_tasks(sessions, items(phase, poison="c0"), vectorize=True)
    assert answers[0][0] is None and "NaN or infinity" in answers[0][1]
    assert all(r is not None and why is None for r, why in answers[1:])
    assert stacking.stacked == 3 and not stacking.per_client  # the other three stepped stacked
    assert all(torch.equal(v, weights(clients["c0"])[k]) for k, v in before.items())
    assert sessions["c0"].counters["tasks"] == 1 and sessions["c1"].counters["tasks"] == 2
    assert not any(s.counters["duplicates"] for s in sessions.values())


class StepsClient:
    """A client half whose state is the list of steps applied to it, each with its epoch."""

    params = SimpleNamespace(max_abs_value=1e4, tau=2)
    private = None

    def __init__(self):
        self.applied: list[tuple] = []

    def state_dict(self):
        return {"applied": list(self.applied)}

    def load_state_dict(self, state):
        self.applied = list(state["applied"])

    def handle(self, task: Message) -> Message:
        self.applied.append((task.phase, task.meta["iteration"], task.meta["epoch"]))
        return Message({"took": len(self.applied)})


def test_a_replay_whose_first_step_this_client_missed_goes_back_to_the_rounds_start():
    """Offline at round 3's local training, the client took its two transfers; the coordinator
    restarts (epoch 1) and runs round 3 again from local training. That task repeats no step
    the client took, yet it is the replay's first: it is computed on the round's start, not on
    top of the transfers (which the replay's own transfers would then wipe)."""
    client, store = StepsClient(), MemoryStore()
    session = ClientSession("r", "pi-1", client, "I", evaluate=lambda t: t, store=store)

    def task(phase, iteration, epoch, seq):
        return Message({"phase": phase, "round": 3, "iteration": iteration, "instance": "I", "epoch": epoch,
                        "seq": seq})

    session.on_task(task("transfer", 0, 0, 2))
    session.on_task(task("transfer", 1, 0, 3))
    assert client.applied == [("transfer", 0, 0), ("transfer", 1, 0)] and store.saves == [3]

    first = session.on_task(task("local_train", 0, 1, 1)).received()
    assert first.meta["took"] == 1 and client.applied == [("local_train", 0, 1)]
    assert session.counters["round_replays"] == 1
    session.on_task(task("transfer", 0, 1, 2))
    session.on_task(task("transfer", 1, 1, 3))  # the replay's own steps: no second going back
    assert client.applied == [("local_train", 0, 1), ("transfer", 0, 1), ("transfer", 1, 1)]
    assert session.counters["round_replays"] == 1 and store.saves == [3]

    session.on_task(Message({**task("local_train", 0, 1, 4).meta, "round": 4}))  # the next round, same epoch
    assert client.applied[-1] == ("local_train", 0, 1) and len(client.applied) == 4
    assert session.counters["round_replays"] == 1 and store.saves == [3, 4]
