"""A deployment on loopback for tests: workspace from `fedal demo`'s preparation, then the
coordinator and agents as real processes that the test can kill and restart."""

from __future__ import annotations

import json
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

import tomli_w

from fedal_cli.demo import RUN_ID, prepare_workspace, spawn, terminate
from tests.waiting import free_port

TOKEN = "deployment-token"  # the API token of a Deployment's coordinator unless the test names one


class Deployment:
    def __init__(self, config, workdir: Path, broker: str, phases: dict | None = None, coordinator: dict | None = None,
                 agent: dict | None = None):
        self.config = config.resolved()
        self.workdir = workdir
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.coord_path, self.agent_paths, self.data_info = prepare_workspace(self.config, workdir, broker, self.port)
        coord = tomllib.loads(self.coord_path.read_text())
        coord["phases"] = {**coord.get("phases", {}), **(phases or {})}
        merge(coord, coordinator or {})
        coord.setdefault("api", {}).setdefault("token", TOKEN)
        self.coord_path.write_text(tomli_w.dumps(coord))
        self.coord_path.chmod(0o600)  # it holds the API token
        self.coord_config = coord
        for path in self.agent_paths:
            cfg = tomllib.loads(path.read_text())
            merge(cfg, agent or {})
            path.write_text(tomli_w.dumps(cfg))
        self.agents: dict[str, subprocess.Popen] = {}
        self.coordinator: subprocess.Popen | None = None

    def agent_path(self, cid: str) -> Path:
        return next(p for p in self.agent_paths if p.parent.name == cid)

    @property
    def coordinator_log(self) -> Path:
        return self.workdir / "coordinator" / "coordinator.log"

    def start_coordinator(self) -> None:
        self.coordinator = spawn("coordinator", self.coord_path, self.coordinator_log)

    def start_agent(self, cid: str) -> subprocess.Popen:
        path = self.agent_path(cid)
        self.agents[cid] = spawn("edge_agent", path, path.parent / f"agent-{time.monotonic_ns()}.log")
        return self.agents[cid]

    def run(self) -> dict:
        return get(f"{self.api}/api/v1/runs/{RUN_ID}")

    def wait_for(self, predicate, timeout_s: float = 120, what: str = "condition") -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.coordinator is not None and self.coordinator.poll() is not None:
                tail = self.coordinator_log.read_text(errors="replace").splitlines()[-15:]
                raise AssertionError(f"coordinator exited with {self.coordinator.returncode}; its log ends:\n"
                                     + "\n".join(tail))
            state = poll_run(self.api)  # None while the API is down: never judge a state seen before
            if state is not None:
                last = state
                if predicate(state):
                    return state
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last state: {json.dumps(last)[:2000] if last else None}")

    def control(self, action: str) -> dict:
        """POST pause, resume or stop to the run, with the coordinator's token."""
        req = urllib.request.Request(f"{self.api}/api/v1/runs/{RUN_ID}/{action}", method="POST",
                                     headers={"Authorization": f"Bearer {self.coord_config['api']['token']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def wait_held(self, round: int, phase: str | None = None, iteration: int | None = None,
                  timeout_s: float = 180) -> dict:
        """The run's state once it is paused and holds before that phase (a `phases.pause_at` point):
        the test acts at a known point of the run however fast or slow the run is."""
        want = {"round": round, "phase": phase, "iteration": iteration}

        def held(r: dict) -> bool:
            if r["state"] in ("finished", "stopped", "failed"):
                raise AssertionError(f"the run ended ({r['state']}) without holding before {want}")
            at = r.get("held_before")
            return r["state"] == "paused" and at is not None and all(v is None or at[k] == v for k, v in want.items())

        return self.wait_for(held, timeout_s=timeout_s, what=f"the run to hold before {want}")

    def start_all(self) -> None:
        self.start_coordinator()
        for path in self.agent_paths:
            self.start_agent(path.parent.name)

    def finish(self, timeout_s: float = 240) -> dict:
        """Wait for the run to finish; its results JSON."""
        self.wait_for(lambda r: r["state"] == "finished", timeout_s=timeout_s, what="the run to finish")
        return self.results()

    def results(self) -> dict:
        return get(f"{self.api}/api/v1/runs/{RUN_ID}/results")

    def close(self) -> None:
        terminate([p for p in [*self.agents.values(), self.coordinator] if p is not None])


def merge(base: dict, overrides: dict) -> None:
    """Override keys of a config table; nested tables are merged, not replaced."""
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value


def poll_run(api: str, run_id: str = RUN_ID) -> dict | None:
    """The run's state, or None while the API is not (or no longer) reachable."""
    try:
        return get(f"{api}/api/v1/runs/{run_id}")
    except OSError:
        return None


def get(url: str) -> dict:
    # generous: right after a burst (10,000 fuzzed messages) the API shares the GIL with an engine
    # still working through it
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())
