"""What the agent does under its systemd service (Restart=always, RestartPreventExitStatus=2):
restarted after it finished a run, it leaves that run's final model alone and waits for the next
run (it used to finish it again and exit, every 5 s, rewriting the model each time); a config it
cannot use exits 2 with one line before torch is loaded (the unit then waits for a fixed config)."""

from __future__ import annotations

import subprocess
import sys
import time

import tomli_w

from fedal.sim import load_config
from tests.deployment import Deployment
from tests.waiting import wait_until


def test_an_agent_restarted_after_its_run_finished_waits_for_the_next_run(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=2, tau=1, public_size=60,
                                    seed=3))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    try:
        dep.start_all()
        dep.finish()
        assert dep.agents["c00"].wait(timeout=60) == 0  # exit_on_finish: done
        final = dep.agent_path("c00").parent / "final"
        written = {p.name: p.stat().st_mtime_ns for p in final.iterdir()}
        assert (final / "instance").read_text().strip()  # the run instance its final model is of
        again = dep.start_agent("c00")  # what the service does 5 s later
        logs = lambda: "".join(p.read_text() for p in dep.agent_path("c00").parent.glob("agent-*.log"))  # noqa: E731
        wait_until(lambda: "finished here already" in logs(), timeout_s=60, what="the agent to see its finished run")
        time.sleep(2)
        assert again.poll() is None, logs()[-2000:]  # it waits for the next run
        assert {p.name: p.stat().st_mtime_ns for p in final.iterdir()} == written  # nothing rewritten
    finally:
        dep.close()


def test_a_config_the_agent_cannot_use_exits_2_before_loading_torch(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "x.npz").write_bytes(b"")  # (a missing one is a usage error of its own)
    cases = {
        "typo.toml": {"run_id": "r", "client_id": "c", "broker": {"url": "mqtt://127.0.0.1:1"}, "data_file": "x.npz",
                      "modell": "mlp"},
        "workspace.toml": {"run_id": "r", "client_id": "c", "broker": {"url": "mqtt://127.0.0.1:1"},
                           "data_file": str(tmp_path / "x.npz"), "model": "mlp", "workspace": str(blocker / "ws")},
    }
    probe = ("import atexit, runpy, sys; atexit.register(lambda: print('torch loaded:', 'torch' in sys.modules, "
             "file=sys.stderr)); sys.argv = ['edge_agent', '--config', sys.argv[1]]; "
             "runpy.run_module('edge_agent', run_name='__main__')")
    for name, cfg in cases.items():
        path = tmp_path / name
        path.write_text(tomli_w.dumps(cfg))
        r = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (name, r.stderr)
        assert "Traceback" not in r.stderr and "torch loaded: False" in r.stderr, (name, r.stderr)
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, r.stderr
    assert "workspace" in errors[0] and "Not a directory" in errors[0]


def test_an_agent_that_stays_does_not_write_its_final_model_again_for_the_same_run(mosquitto, tmp_path):
    """exit_on_finish = false: the run's `finished` manifest comes again (a restarted coordinator
    publishes it anew, a reconnect delivers the retained one); the final model is not rewritten."""
    import signal

    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, tau=1, public_size=60,
                                    seed=5))
    dep = Deployment(config, tmp_path / "dep", mosquitto, agent={"exit_on_finish": False})
    try:
        dep.start_all()
        dep.finish()
        final = dep.agent_path("c00").parent / "final"
        wait_until(lambda: (final / "instance").exists(), timeout_s=60, what="the final model")
        written = {p.name: p.stat().st_mtime_ns for p in final.iterdir()}
        dep.coordinator.send_signal(signal.SIGTERM)
        assert dep.coordinator.wait(timeout=60) == 0
        dep.start_coordinator()  # finds the run finished and publishes its manifest again
        dep.wait_for(lambda r: r["state"] == "finished", what="the restarted coordinator")
        time.sleep(3)
        assert dep.agents["c00"].poll() is None  # it stays, as configured
        assert {p.name: p.stat().st_mtime_ns for p in final.iterdir()} == written
    finally:
        dep.close()
