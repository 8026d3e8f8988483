"""POST /api/v1/runs: in-process validation and auth, then a coordinator started with no run of
its own is given one over the API, runs it with real agents, and picks it up again after a
SIGKILL and restart."""

from __future__ import annotations

import io
import signal
import tomllib

import httpx
import numpy as np
import pytest
import tomli_w

from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager
from fedal.data import content_hash, public_set
from fedal.sim import load_config, simulate
from tests.deployment import Deployment
from tests.helpers import per_client
from tests.local_api import local_client
from tests.waiting import wait_for_port, wait_until

SPEC = {"run_id": "api-run", "client_ids": ["pi-1", "pi-2"],
        "run": {"strategy": "fedmd", "dataset": "digits", "rounds": 3, "public_size": 50, "seed": 2}}


@pytest.fixture()
def client(tmp_path):
    cfg = load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": "tok"})
    runs = RunManager(cfg)
    yield local_client(runs), runs, tmp_path
    runs.store.close()


def test_create_run_in_process(client):
    api, runs, tmp_path = client
    auth = {"Authorization": "Bearer tok"}
    assert api.get("/api/v1/runs").json() == []  # a coordinator without a run of its own
    assert api.post("/api/v1/runs", json=SPEC).status_code == 401
    assert api.post("/api/v1/runs", json=SPEC, headers={"Authorization": "Bearer no"}).status_code == 403

    created = api.post("/api/v1/runs", json=SPEC, headers=auth)
    assert created.status_code == 201
    body = created.json()
    assert body["run_id"] == "api-run" and body["strategy"] == "fedmd" and body["rounds"] == 3 and body["state"] == "pending"
    assert [r["run_id"] for r in api.get("/api/v1/runs").json()] == ["api-run"]
    assert {c["id"] for c in api.get("/api/v1/clients").json()} == {"pi-1", "pi-2"}
    assert api.get("/api/v1/clients/pi-2").json()["run_id"] == "api-run"
    # the public set is derived from the dataset: the rows `fedal simulate` holds out
    public = api.get("/api/v1/runs/api-run/public")
    with np.load(io.BytesIO(public.content)) as z:
        assert content_hash(z["x"]) == content_hash(public_set("digits", 50, 2)) == public.headers["x-content-hash"]
    # the store keeps the spec, so a restarted coordinator can start the run again
    assert runs.store.run_ids(origin="api") == ["api-run"]

    assert api.post("/api/v1/runs", json=SPEC, headers=auth).status_code == 409
    bad = [
        ({**SPEC, "run_id": "x y"}, "run_id"),
        ({**SPEC, "run_id": "b", "client_ids": ["one"]}, "client_ids"),
        # every open read of a run lists each client: a bound, as a simulation has
        ({**SPEC, "run_id": "b2", "client_ids": [f"c{i}" for i in range(10_001)]}, "more than the 10000"),
        ({**SPEC, "run_id": "c", "run": {"strategy": "nope"}}, "strategy"),
        ({**SPEC, "run_id": "d", "surprise": 1}, "surprise"),
        ({**SPEC, "run_id": "e", "public_file": "/etc/passwd"}, "state_dir"),
        # a data_dir elsewhere: its rows were served without a token as the public set
        ({**SPEC, "run_id": "e2", "run": {**SPEC["run"], "dataset": "mnist", "data_dir": str(tmp_path / "private")}},
         "run.data_dir must lie inside the coordinator's state_dir"),
        ({**SPEC, "run_id": "e3", "run": {**SPEC["run"], "dataset": "mnist1d", "data_dir": "/tmp/../root/made"}},
         "run.data_dir must lie inside"),
        # a NUL byte in a path: 422 (was a 500, uncounted)
        ({**SPEC, "run_id": "e4", "public_file": str(tmp_path / "state" / "x\u0000y.npz")}, "public_file must lie"),
        ({**SPEC, "run_id": "e5", "run": {**SPEC["run"], "dataset": "mnist", "data_dir": "da\u0000ta"}},
         "run.data_dir must lie inside"),
        ({**SPEC, "run_id": "f", "phases": {"pause_at": [{"round": 99}]}}, "round 99 is past the run's"),
        ({**SPEC, "run_id": "g", "phases": {"pause_at": [{"round": 1, "phase": "Transfer!"}]}}, "pause_at"),
    ]
    for spec, needle in bad:
        resp = api.post("/api/v1/runs", json=spec, headers=auth)
        assert resp.status_code == 422 and needle in resp.text, (spec, resp.text)
    # a file of the operator's where the run's results would go: never written over
    mine = tmp_path / "state" / "runs" / "exp1" / "results.json"
    mine.parent.mkdir(parents=True)
    mine.write_text("the operator's notes\n")
    taken = api.post("/api/v1/runs", json={**SPEC, "run_id": "exp1"}, headers=auth)
    assert taken.status_code == 422 and "results" in taken.text and mine.read_text() == "the operator's notes\n"
    assert api.post("/api/v1/runs", content=b"{not json", headers={**auth, "content-type": "application/json"}).status_code == 422
    assert [r["run_id"] for r in api.get("/api/v1/runs").json()] == ["api-run"]  # nothing half-created
    assert not (tmp_path / "private").exists()
    inside = {**SPEC, "run_id": "in-state", "run": {**SPEC["run"], "dataset": "mnist1d", "mnist1d_samples": 1000,
                                                    "data_dir": str(tmp_path / "state" / "datasets")}}
    assert api.post("/api/v1/runs", json=inside, headers=auth).status_code == 201  # where the operator puts datasets


def test_a_run_created_over_the_api_runs_and_survives_a_restart(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=3, rounds=6, tau=1, public_size=100, seed=5))
    dep = Deployment(config, tmp_path / "dep", mosquitto, phases={"resend_s": 2.0})
    coord = tomllib.loads(dep.coord_path.read_text())
    spec = {"run_id": "demo", "client_ids": coord.pop("client_ids"), "run": coord.pop("run"),
            "num_classes": coord.pop("num_classes"),
            # killed mid-run by construction: the run holds before round 3 however fast it is
            "phases": {**coord["phases"], "pause_at": [{"round": 3}]}}
    coord.pop("public_file")
    coord.pop("run_id")
    coord["api"]["token"] = "tok"
    dep.coord_path.write_text(tomli_w.dumps(coord))
    auth = {"Authorization": "Bearer tok"}
    try:
        dep.start_coordinator()
        wait_until(lambda: wait_for_port(dep.port, timeout_s=1), timeout_s=60, what="the coordinator's API")
        assert httpx.get(f"{dep.api}/api/v1/runs").json() == []
        assert httpx.post(f"{dep.api}/api/v1/runs", json=spec, headers=auth).status_code == 201
        for cid in spec["client_ids"]:
            dep.start_agent(cid)
        assert dep.wait_held(3)["completed_rounds"] == 2
        dep.coordinator.send_signal(signal.SIGKILL)
        dep.coordinator.wait()

        dep.start_coordinator()  # no run in its config: the API-created one comes back from the store
        assert dep.wait_held(3)["completed_rounds"] == 2  # with its spec (pause_at too) and its two rounds
        httpx.post(f"{dep.api}/api/v1/runs/demo/resume", headers=auth).raise_for_status()
        dep.wait_for(lambda r: r["state"] == "finished", timeout_s=240, what="the restored run to finish")
        results = dep.results()
    finally:
        dep.close()
    assert [r["round"] for r in results["rounds"]] == list(range(1, 7))  # every round recorded once
    assert abs(results["final"]["mean_acc"] - simulate(per_client(config))["final"]["mean_acc"]) <= 0.01
