"""A real coordinator for a fleet of emulated agents: its config, a synthetic public set, its process.

Emulated agents only need the public set's size and hash (their logits are synthetic), so the
public set here is seeded noise of the right number of rows; everything else is the coordinator
of a deployment, started as its own process (`python -m coordinator`).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from fedal import procs, workspace


def write_coordinator_config(workdir: Path, broker_url: str, run_id: str, ids: list[str], *, api_port: int,
                             strategy: str = "fedal", rounds: int = 3, seed: int = 0, num_classes: int = 10,
                             public_size: int = 1000, public_batch_size: int = 32, tau: int | None = None,
                             eval_every: int = 1, phases: dict[str, float] | None = None,
                             extra: dict[str, Any] | None = None) -> Path:
    """coordinator.toml (and public.npz) in `workdir`; returns the config's path.

    workdir: new, empty, or a workspace made here before (its state/ is kept: a restarted
    coordinator resumes); any other directory raises workspace.WorkspaceError untouched.
    """
    import tomli_w

    workdir = workspace.claim(workdir, "fedal hil fleet --start-coordinator")
    public_file = workdir / "public.npz"
    rng = np.random.default_rng(seed)
    np.savez(public_file, x=rng.standard_normal((public_size, 8), dtype=np.float32))
    from fedal.strategies import get_strategy

    # a knob a strategy does not take is refused by the coordinator: the public batch only where it has a public set
    params: dict[str, Any] = {"public_batch_size": public_batch_size} if get_strategy(strategy).uses_public_set else {}
    if tau is not None:
        params["tau"] = tau
    config: dict[str, Any] = {
        "run_id": run_id, "client_ids": list(ids), "num_classes": num_classes, "public_file": str(public_file),
        "state_dir": str(workdir / "state"), "broker": {"url": broker_url},
        "api": {"host": "127.0.0.1", "port": api_port},
        "phases": {"start_timeout_s": 120.0, **(phases or {})},
        "run": {"strategy": strategy, "rounds": rounds, "seed": seed, "eval_every": eval_every,
                "public_size": public_size, "strategy_params": params},
    }
    for key, value in (extra or {}).items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    path = workdir / "coordinator.toml"
    path.touch(mode=0o600)
    path.chmod(0o600)  # before anything goes in: it may hold the broker password and the API token
    path.write_text(tomli_w.dumps(config))
    return path


def start_coordinator(config_path: Path, log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m coordinator --config config_path`, its output in log_path; env adds variables.
    The coordinator dies with this process (fedal.procs)."""
    return procs.spawn_python("coordinator", "--config", str(config_path), log_path=log_path, env=env)


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> int:
    """SIGTERM (a clean stop: the coordinator publishes `stopped` and saves), SIGKILL after grace_s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def get_json(url: str, timeout: float = 5.0, token: str | None = None) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def poll_run(api: str, run_id: str) -> dict[str, Any] | None:
    """The run's state, or None while the API is not (or no longer) reachable."""
    try:
        return get_json(f"{api}/api/v1/runs/{run_id}")
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_for_run(api: str, run_id: str, predicate, timeout_s: float, process: subprocess.Popen | None = None,
                 every_s: float = 0.25) -> dict[str, Any]:
    """Poll the coordinator's API until predicate(run) holds; raises TimeoutError with the last state."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the coordinator exited with status {process.returncode}")
        last = poll_run(api, run_id) or last
        if last is not None and predicate(last):
            return last
        time.sleep(every_s)
    brief = {k: last.get(k) for k in ("state", "round", "completed_rounds", "phase", "counters", "error")} if last else None
    raise TimeoutError(f"the run did not get there within {timeout_s:.0f} s; last state: {brief}")
