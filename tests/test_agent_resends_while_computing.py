"""Copies of a task that the coordinator re-sent (every resend_s) while the agent computed it
are answered by the one answer that goes out after them: each was answered with the full cached
result again (eight uploads of a model for a long task on a Pi's link). A copy that comes after
the answer went out (it may have been lost) is answered again, as before."""

from __future__ import annotations

import threading
import time

from fedal.protocol import Message, encode
from tests.helpers import toy_federation
from tests.test_agent_journal import HOSTED, make_agent


def test_copies_queued_while_a_task_was_computed_are_not_answered_again(tmp_path, one_torch_thread):
    server, clients, _ = toy_federation("fedal", tau=2)
    agent = make_agent(tmp_path / "ws")
    agent.host(clients[HOSTED], "sim")
    published: list[bytes] = []
    agent.link.publish_result = published.append
    task = server.begin_round(0).tasks[HOSTED]
    payload = encode(Message({**task.meta, "instance": "sim", "epoch": 0, "seq": 1}, task.tensors))
    topic = agent.link.task_topic
    for _ in range(3):  # the task and two re-sends, all there before the worker takes the first
        agent.inbox.put((topic, payload))
    worker = threading.Thread(target=agent._work_until_stopped, daemon=True)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while agent.counters["resends_while_computing"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(published) == 1 and agent.counters["resends_while_computing"] == 2
        agent.inbox.put((topic, payload))  # a re-send after the answer went out: answered again
        deadline = time.monotonic() + 30
        while len(published) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert published == [published[0]] * 2 and agent.counters["resends_while_computing"] == 2
    finally:
        agent.stop_event.set()
        worker.join(timeout=10)


def test_copies_of_a_task_held_until_the_run_was_joined_are_answered_once(tmp_path, one_torch_thread):
    """An agent back online gets the broker's queued re-sends before the retained manifest: it
    holds them until it has joined, then answered every copy with the full result."""
    server, clients, _ = toy_federation("fedal", tau=2)
    agent = make_agent(tmp_path / "ws")
    published: list[bytes] = []
    agent.link.publish_result = published.append
    task = server.begin_round(0).tasks[HOSTED]
    payload = encode(Message({**task.meta, "instance": "sim", "epoch": 0, "seq": 1}, task.tensors))
    agent._setup = lambda _manifest: agent.host(clients[HOSTED], "sim")  # (its data and model: the toy's)
    agent.deferred = [payload] * 3
    assert agent._join(None)
    assert len(published) == 1 and agent.counters["resends_while_computing"] == 2
