"""The agent's stop-signal handler takes no lock. It used to call Event.set(), whose lock the
main thread it interrupts may hold (inside Event.wait or a first handler's set): a second
SIGTERM or SIGHUP at that moment hung the agent for ever, its port and workspace lock held (seen
after a demo was SIGKILLed: the kernel's SIGTERM, then a second signal)."""

from __future__ import annotations

import threading
import time

from edge_agent.agent import Agent
from edge_agent.config import AgentConfig


def test_the_handler_finishes_while_the_stop_events_lock_is_held_and_the_agent_then_stops(tmp_path):
    (tmp_path / "train.npz").write_bytes(b"")
    agent = Agent(AgentConfig(client_id="c0", run_id="r", model="mlp", data_file=tmp_path / "train.npz",
                              workspace=tmp_path / "ws", broker={"url": "mqtt://127.0.0.1:1"}))
    handler = threading.Thread(target=agent.request_stop)
    with agent.stop_event._cond:  # noqa: SLF001 - as the interrupted main thread holds it in Event.wait/set
        handler.start()
        handler.join(timeout=5)
        assert not handler.is_alive(), "the signal handler waits for a lock the interrupted thread holds"
    t0 = time.monotonic()
    assert agent.run() == 0  # the stop it asked for is seen by the main loop
    assert time.monotonic() - t0 < 30 and agent.stop_event.is_set()
