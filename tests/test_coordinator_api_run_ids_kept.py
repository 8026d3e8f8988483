"""A run id names one run for good: a stored run a restart cannot bring back stays visible as
failed and keeps its id and history (a POST with its id used to answer 201 and wipe it); a
run being created holds its id and does not stall the API while its public set is derived; ids
made only of dots (which name a directory or its parent) are refused; a body's NaN or
out-of-range number is a 422, never a 500."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager
from fedal.sim.config import load_config
from tests.local_api import local_client

TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def manager(state_dir) -> RunManager:
    return RunManager(load_coordinator_config(None, state_dir=state_dir, api={"token": TOKEN}))


def spec(run_id: str, **fields) -> dict:
    return {"run_id": run_id, "client_ids": ["pi-1", "pi-2"],
            "run": {"strategy": "fedmd", "dataset": "digits", "rounds": 5, "public_size": 50}, **fields}


def manager_with_run(state, run_id: str) -> RunManager:
    """A manager on `state` whose API created `run_id` on a public file of its own there."""
    state.mkdir()
    np.savez(state / "public.npz", x=np.random.default_rng(0).random((40, 64), dtype=np.float32))
    runs = manager(state)
    api = local_client(runs, raise_server_exceptions=False)
    assert api.post("/api/v1/runs", json=spec(run_id, public_file=str(state / "public.npz")), headers=AUTH).status_code == 201
    return runs


def held_builds(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every run build waits (as one deriving a large public set would) until `release` is set;
    `building` is set once one has started."""
    building, release = threading.Event(), threading.Event()
    real = RunManager._new_run

    def slow_new_run(self, spec, origin):
        building.set()
        assert release.wait(30)
        return real(self, spec, origin)

    monkeypatch.setattr(RunManager, "_new_run", slow_new_run)
    return building, release


def create_in_background(api: TestClient, run_id: str) -> tuple[threading.Thread, list]:
    """POST /api/v1/runs on a thread of its own; its answer lands in the list."""
    answers: list = []
    creator = threading.Thread(target=lambda: answers.append(api.post("/api/v1/runs", json=spec(run_id), headers=AUTH)))
    creator.start()
    return creator, answers


def test_a_stored_run_a_restart_cannot_bring_back_stays_failed_and_keeps_its_id_and_history(tmp_path):
    state = tmp_path / "state"
    runs = manager_with_run(state, "r2")
    records = [{"round": r, "mean_acc": 0.5} for r in (1, 2, 3)]
    runs.store.save("r2", {"completed_rounds": 3, "state": "stopped"}, records,
                    {"c00": {"answered": 7, "online": True}, "c01": {"answered": 6, "online": False}},
                    counters={"counters": {"stale": 2}, "rejects": {"shape": 1}, "transport": {"expired": 1}})
    runs.store.close()
    (state / "public.npz").rename(tmp_path / "moved.npz")  # the operator moved the file

    runs = manager(state)
    runs.restore()
    api = local_client(runs, raise_server_exceptions=False)
    try:
        run = api.get("/api/v1/runs/r2").json()
        assert run["state"] == "failed" and "public.npz" in run["error"] and run["completed_rounds"] == 3
        assert [r["run_id"] for r in api.get("/api/v1/runs").json()] == ["r2"]
        assert api.get("/healthz").json()["runs"] == {"r2": "failed"}
        # what the store kept, in a live run's shape: the dashboard and scripts read it alike
        assert set(run) >= {"counters", "rejects", "clients", "config", "last_round", "held_before", "pause_at"}
        assert run["counters"] == {"rejected": 0, "stale": 2, "duplicates": 0, "quorum_missed": 0, "expired": 1}
        assert run["rejects"] == {"shape": 1} and run["config"]["strategy"] == "fedmd" and run["last_round"] == records[-1]
        assert {cid: (c["answered"], c["online"]) for cid, c in run["clients"].items()} == {"c00": (7, False),
                                                                                           "c01": (6, False)}
        assert api.get("/api/v1/runs/r2/rounds").json() == records
        assert [(c["id"], c["run_id"]) for c in api.get("/api/v1/clients", params={"run_id": "r2"}).json()] == \
            [("c00", "r2"), ("c01", "r2")]
        failed = [line for line in api.get("/metrics").text.splitlines() if line.startswith('fedal_run_state{run="r2"')]
        assert 'fedal_run_state{run="r2",state="failed"} 1.0' in failed and len(failed) == 6
        box: dict = {}
        listener = threading.Thread(target=lambda: box.setdefault("resp", api.get("/api/v1/events")), daemon=True)
        listener.start()
        deadline = time.monotonic() + 30
        while not runs.events._subscribers and time.monotonic() < deadline:
            time.sleep(0.02)
        runs.events.close()  # the stream ends: its hello is read
        listener.join(15)
        assert '"runs": {"r2": "failed"}' in box["resp"].text.split("\n\n")[0]
        again = api.post("/api/v1/runs", json=spec("r2"), headers=AUTH)
        assert again.status_code == 409 and "could not bring it back" in again.text, again.text
        control = api.post("/api/v1/runs/r2/resume", headers=AUTH)
        assert control.status_code == 409 and "public.npz" in control.text
        assert [r["round"] for r in runs.store.load("r2").records] == [1, 2, 3]  # its history, untouched
    finally:
        runs.store.close()


def test_a_run_being_created_holds_its_id_and_reads_go_on_meanwhile(tmp_path, monkeypatch):
    runs = manager(tmp_path / "state")
    api = local_client(runs, raise_server_exceptions=False)
    building, release = held_builds(monkeypatch)
    creator, answers = create_in_background(api, "big")
    try:
        assert building.wait(30)
        started = time.monotonic()
        assert api.get("/api/v1/runs").json() == [] and api.get("/healthz").status_code == 200
        assert time.monotonic() - started < 5  # (they waited for the whole creation before)
        twin = api.post("/api/v1/runs", json=spec("big"), headers=AUTH)
        assert twin.status_code == 409 and "exists already" in twin.text
    finally:
        release.set()
        creator.join(60)
    assert answers[0].status_code == 201
    assert [r["run_id"] for r in api.get("/api/v1/runs").json()] == ["big"]
    runs.store.close()


@pytest.mark.parametrize("body", [spec(".."), spec("."), {**spec("ok"), "client_ids": ["pi-1", ".."]}])
def test_ids_made_only_of_dots_are_refused(tmp_path, body):
    runs = manager(tmp_path / "state")
    api = local_client(runs, raise_server_exceptions=False)
    resp = api.post("/api/v1/runs", json=body, headers=AUTH)
    assert resp.status_code == 422 and "not only dots" in resp.text, resp.text
    assert runs.store.run_ids() == []
    runs.store.close()


@pytest.mark.parametrize("text, where", [
    ('"alpha": NaN', "alpha"),
    ('"alpha": 1e400', "alpha"),
    ('"strategy_params": {"lr": 1e999}', "lr"),
    ('"strategy_params": {"lr": Infinity}', "lr"),
])
def test_non_finite_numbers_in_a_body_are_a_422(tmp_path, text, where):
    runs = manager(tmp_path / "state")
    api = local_client(runs, raise_server_exceptions=False)
    body = '{"run_id": "x1", "client_ids": ["a", "b"], "run": {"strategy": "fedmd", "dataset": "digits", ' + text + "}}"
    resp = api.post("/api/v1/runs", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert resp.status_code == 422, (resp.status_code, resp.text)
    assert where in resp.text and "finite" in resp.text, resp.text
    assert resp.json()["detail"]  # strict JSON: the quoted value is text
    assert runs.store.run_ids() == []
    runs.store.close()


def test_a_run_created_while_the_coordinator_stops_is_never_started(tmp_path, monkeypatch):
    runs = manager(tmp_path / "state")
    runs.start()
    api = local_client(runs, raise_server_exceptions=False)
    building, release = held_builds(monkeypatch)
    creator, answers = create_in_background(api, "late")
    assert building.wait(30)
    runs.stop(timeout_s=5)  # SIGTERM while the run is still being built
    release.set()
    creator.join(60)
    assert answers[0].status_code == 503 and "shutting down" in answers[0].text
    assert runs.get("late") is None and "late" not in runs.threads and runs.store.run_ids() == []
    runs.store.close()


def test_runs_are_built_one_at_a_time(tmp_path, monkeypatch):
    """Building a run's server seeds torch's global generator: two builds at once could mix them."""
    runs = manager(tmp_path / "state")
    api = local_client(runs, raise_server_exceptions=False)
    real = RunManager._new_run
    order: list[str] = []

    def recorded_new_run(self, spec, origin):
        order.append(f"start {spec.run_id}")
        time.sleep(0.3)
        try:
            return real(self, spec, origin)
        finally:
            order.append(f"end {spec.run_id}")

    monkeypatch.setattr(RunManager, "_new_run", recorded_new_run)
    threads = [threading.Thread(target=api.post, args=("/api/v1/runs",), kwargs={"json": spec(f"r{i}"), "headers": AUTH})
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(order) == 4 and all(order[i].split()[1] == order[i + 1].split()[1] for i in (0, 2)), order
    runs.store.close()


def test_a_stored_spec_of_any_shape_never_breaks_the_run_list(tmp_path):
    state = tmp_path / "state"
    runs = manager(state)
    runs.store.register("odd", {"run_id": "odd", "run": "not a table", "client_ids": ["a", "b"]}, "api")
    runs.store.close()
    runs = manager(state)
    runs.restore()
    api = local_client(runs, raise_server_exceptions=False)
    listing = api.get("/api/v1/runs")
    assert listing.status_code == 200 and [(r["run_id"], r["state"]) for r in listing.json()] == [("odd", "failed")]
    runs.store.close()


def test_a_stored_run_whose_data_dir_the_rules_now_refuse_is_not_restored(tmp_path):
    """A spec an older coordinator stored (before run.data_dir had to lie in state_dir) would keep
    serving any directory's dataset as the public set after a restart; it is shown failed instead."""
    state = tmp_path / "state"
    runs = manager(state)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    stored = spec("old")
    stored["run"] = {**stored["run"], "dataset": "mnist1d", "data_dir": str(outside)}
    runs.store.register("old", stored, "api")
    runs.store.close()

    runs = manager(state)
    runs.restore()
    try:
        api = local_client(runs, raise_server_exceptions=False)
        run = api.get("/api/v1/runs/old").json()
        assert run["state"] == "failed" and "run.data_dir must lie inside" in run["error"]
        assert "old" not in runs.by_id
    finally:
        runs.store.close()


def test_a_run_stored_with_an_empty_models_list_is_restored_as_it_ran(tmp_path):
    """`run.models = []` was accepted (the dataset's defaults) until an empty list was refused: a
    run stored with it must still come back after an upgrade, not stay failed for good."""
    state = tmp_path / "state"
    runs = manager_with_run(state, "old")
    stored = runs.store.load("old").spec
    runs.store.register("old", {**stored, "run": {**stored["run"], "models": []}}, "api")  # as an older version stored it
    runs.store.close()

    runs = manager(state)
    runs.restore()
    try:
        assert runs.unrestored == {} and runs.get("old") is not None
        defaults = load_config(None, {**spec("old")["run"], "clients": 2}).resolved().models
        assert runs.get("old").run_config.models == defaults  # what [] meant
        new = {**spec("new"), "run": {**spec("new")["run"], "models": []}}
        refused = local_client(runs, raise_server_exceptions=False).post("/api/v1/runs", json=new, headers=AUTH)
        assert refused.status_code == 422 and "models" in refused.text  # new input: refused
    finally:
        runs.store.close()


@pytest.mark.parametrize("damage, unread", [
    ("UPDATE runs SET spec = '{not json' WHERE run_id = 'bad'", "spec is not valid JSON"),
    ("UPDATE runs SET spec = '[1, 2]' WHERE run_id = 'bad'", "spec is not a table"),
    ("INSERT INTO rounds (run_id, round, record) VALUES ('bad', 0, '{\"round\": 0')", "round record is not valid JSON"),
    ("INSERT INTO clients (run_id, client_id, info) VALUES ('bad', 'pi-1', 'nan nan')", "client pi-1 is not valid JSON"),
    ("INSERT INTO run_counters (run_id, counters) VALUES ('bad', '\"text\"')", "counters is not a table"),
    # a table whose parts are of other shapes: read back (its thread then fails it, saying why)
    ("INSERT INTO run_counters (run_id, counters) VALUES ('bad', '{\"counters\": [1], \"rejects\": 7}')", None),
])
def test_one_damaged_row_in_the_store_fails_that_run_alone(tmp_path, damage, unread):
    """A row that is not a JSON table (damage on disk, a hand edit) made the coordinator exit with
    a traceback at start, every run offline; now that run is shown failed, saying which row."""
    from sqlalchemy import text

    state = tmp_path / "state"
    runs = manager_with_run(state, "good")
    api = local_client(runs, raise_server_exceptions=False)
    assert api.post("/api/v1/runs", json=spec("bad", public_file=str(state / "public.npz")), headers=AUTH).status_code == 201
    with runs.store.engine.begin() as conn:
        conn.execute(text(damage))
    runs.store.close()

    runs = manager(state)
    runs.restore()
    try:
        api = local_client(runs, raise_server_exceptions=False)
        listing = api.get("/api/v1/runs")
        assert listing.status_code == 200
        states = {r["run_id"]: r["state"] for r in listing.json()}
        assert states["good"] != "failed" and "good" in runs.by_id
        bad = api.get("/api/v1/runs/bad")
        assert bad.status_code == 200
        if unread is not None:
            assert bad.json()["state"] == "failed" and f"run bad: its stored {unread}" in bad.json()["error"]
        else:
            assert "bad" in runs.by_id
        assert api.get("/api/v1/clients").status_code == 200
    finally:
        runs.store.close()
