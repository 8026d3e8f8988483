"""Tasks that reach an agent before it has joined its run: held within a bound (the oldest
dropped and counted beyond it), and handled one by one once it joins, a failing one counted
without ending the agent's worker or losing the others."""

from __future__ import annotations

from pathlib import Path

from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from fedal.session import MAX_HELD as MAX_DEFERRED


def make_agent(workspace: Path, max_message_bytes: int = 1_000_000) -> Agent:
    workspace.mkdir(parents=True, exist_ok=True)
    return Agent(AgentConfig(client_id="c0", run_id="run", model="mlp", data_file=workspace / "unused.npz",
                             workspace=workspace, broker={"url": "mqtt://127.0.0.1:1", "max_message_bytes": max_message_bytes}))


def test_tasks_held_before_joining_are_bounded_and_the_dropped_ones_counted(tmp_path):
    agent = make_agent(tmp_path / "a")
    for i in range(MAX_DEFERRED + 40):
        agent._dispatch(agent.link.task_topic, i.to_bytes(4, "big") * 10)
    assert len(agent.deferred) == MAX_DEFERRED
    assert agent.deferred[0] == (40).to_bytes(4, "big") * 10  # the newest kept
    assert agent.rejects["deferred"] == 40 and agent.counters["rejected"] == 40
    # by bytes: at most twice the largest message the agent accepts (one task always kept)
    small = make_agent(tmp_path / "b", max_message_bytes=10_000)
    for _ in range(10):
        small._dispatch(small.link.task_topic, b"x" * 6_000)
    assert len(small.deferred) == 3 and small.rejects["deferred"] == 7
    small._dispatch(small.link.task_topic, b"y" * 50_000)
    assert small.deferred == [b"y" * 50_000]


def test_held_tasks_are_handled_one_by_one_when_the_run_is_joined(tmp_path, monkeypatch):
    agent = make_agent(tmp_path / "a")
    handled = []

    def on_task(payload: bytes) -> None:
        if payload == b"bad":
            raise ValueError("a task no check saw coming")
        handled.append(payload)

    monkeypatch.setattr(agent, "_setup", lambda manifest: None)
    monkeypatch.setattr(agent, "_on_task", on_task)
    for payload in (b"first", b"bad", b"last"):
        agent._dispatch(agent.link.task_topic, payload)
    assert agent._join(manifest=None) is True  # type: ignore[arg-type]
    assert handled == [b"first", b"last"] and agent.deferred == []
    assert agent.counters["errors"] == 1


def test_a_failing_retried_join_does_not_end_the_worker(tmp_path, monkeypatch):
    """The worker retries a failed join from its idle loop: an error there is counted, and the
    worker goes on handling messages."""
    agent = make_agent(tmp_path / "a")

    class Manifest:
        state = "running"
        run_id = "run"

    agent.manifest = Manifest()  # type: ignore[assignment]
    calls = []

    def join(manifest) -> bool:
        calls.append(manifest)
        if len(calls) == 1:
            raise RuntimeError("a held task broke the join")
        agent.stop()
        return False

    monkeypatch.setattr(agent, "_join", join)
    agent.worker.start()
    agent.worker.join(timeout=30)
    assert not agent.worker.is_alive() and len(calls) == 2
    assert agent.counters["errors"] == 1


def test_a_join_that_fails_on_any_bad_file_backs_off(tmp_path, monkeypatch):
    """A truncated .npz (BadZipFile) or one without y (KeyError) fails the join like an
    unreadable file: counted, retried later with backoff, never at every idle tick."""
    import time
    import zipfile

    agent = make_agent(tmp_path / "a")
    for error in (zipfile.BadZipFile("File is not a zip file"), KeyError("y is not a file in the archive")):
        def broken(manifest, error=error):
            raise error

        monkeypatch.setattr(agent, "_setup", broken)

        class Manifest:
            run_id = "run"

        before = time.monotonic()
        assert agent._join(Manifest()) is False  # type: ignore[arg-type]
        assert agent.retry_at > before
    assert agent.counters["setup_failures"] == 2 and not agent.counters["errors"]
