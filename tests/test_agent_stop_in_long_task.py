"""An agent asked to stop (systemd's SIGTERM) in the middle of a long training task stops between
two steps and exits 0 at once. Before, it waited 30 s for the task to end, then the interpreter's
teardown, torch still computing in the worker thread, ended in SIGABRT ("terminate called
without an active exception"): a service stop that looked like a crash, and 30 s of it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from fedal.sim import load_config
from tests.deployment import Deployment
from tests.waiting import wait_until


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_agent_stopped_in_a_long_task_stops_between_steps_and_exits_0(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="local", dataset="digits", clients=2, rounds=1, tau=1_000_000,
                                    public_size=60, seed=3))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    try:
        dep.start_all()
        dep.wait_for(lambda r: r["phase"] == "local_train", timeout_s=120, what="round 0's local training")
        agent = dep.agents["c00"]
        start = cpu_seconds(agent.pid)
        wait_until(lambda: cpu_seconds(agent.pid) > start + 1.5, timeout_s=60, what="the agent to train")
        t0 = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=60)
        took = time.monotonic() - t0
        log = "".join(p.read_text() for p in dep.agent_path("c00").parent.glob("agent-*.log"))
        assert code == 0, f"exit {code} after {took:.1f} s; the log ends:\n{log[-2000:]}"
        assert took < 15, f"{took:.1f} s to stop"
        assert "stopped in the middle of a task" in log
        status = json.loads((dep.agent_path("c00").parent / "agent-status.json").read_text())
        assert status["counters"].get("tasks", 0) == 0  # nothing answered, nothing made durable
    finally:
        dep.close()
