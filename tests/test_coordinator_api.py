"""The coordinator's REST API and Prometheus metrics: in-process with TestClient, and against a
live coordinator after a real run."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.app import create_app
from coordinator.config import load_coordinator_config
from coordinator.run import Run
from fedal.sim import load_config, simulate
from tests.deployment import Deployment, get
from tests.helpers import per_client
from tests.local_api import local_client


@pytest.fixture()
def engine(tmp_path):
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 40), np.float32))
    cfg = load_coordinator_config(None, run_id="unit", client_ids=["a", "b"], num_classes=10,
                                  public_file=tmp_path / "public.npz", state_dir=tmp_path / "state")
    return Run(cfg)


def metric_values(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_endpoints_before_the_run_starts(engine):
    client = local_client(engine)
    assert client.get("/healthz").json() == {"status": "ok", "broker_connected": False, "runs": {"unit": "pending"}}
    head = client.head("/healthz")  # what uptime checkers send: 200, no body
    assert head.status_code == 200 and head.content == b""
    runs = client.get("/api/v1/runs").json()
    assert [r["run_id"] for r in runs] == ["unit"] and runs[0]["state"] == "pending"
    counters = client.get("/api/v1/runs/unit").json()["counters"]  # the documented keys, 0 until counted
    assert {k: counters[k] for k in ("rejected", "stale", "duplicates", "quorum_missed")} == dict.fromkeys(
        ("rejected", "stale", "duplicates", "quorum_missed"), 0)
    assert client.get("/api/v1/runs/unit/rounds").json() == []
    assert [c["id"] for c in client.get("/api/v1/clients").json()] == ["a", "b"]
    assert client.get("/api/v1/clients/a").json()["online"] is False
    assert client.get("/api/v1/clients/zz").status_code == 404
    assert client.get("/api/v1/runs/other").status_code == 404
    public = client.get("/api/v1/runs/unit/public")
    assert public.status_code == 200 and public.headers["x-content-hash"] == engine.public_hash
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    values = metric_values(metrics.text)
    assert values[("fedal_clients_enrolled", (("run", "unit"),))] == 2
    assert values[("fedal_run_state", (("run", "unit"), ("state", "pending")))] == 1
    assert all(name.startswith("fedal_") for name, _ in values)
    assert client.get("/openapi.json").json()["info"]["title"].startswith("FedAL Edge")
    for path in ("/metrics", "/api/v1/runs/unit/public"):  # HEAD answers where GET does
        assert client.head(path).status_code == 200


def test_the_openapi_schema_has_one_operation_id_per_operation(engine):
    """Routes answering GET and HEAD gave both operations one operationId (FastAPI warned; OpenAPI
    tools generating clients refuse such a schema)."""
    import warnings

    from hil.control import build_app
    from hil.faults import FaultEngine, Profile
    from hil.proxy import Proxy

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = create_app(engine).openapi()
        build_app(Proxy(FaultEngine(Profile()), ("127.0.0.1", 1))).openapi()
    ids = [op["operationId"] for item in schema["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids)) and "head" not in schema["paths"]["/healthz"]


def test_api_after_a_real_run(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=2, tau=2, public_size=100, seed=9))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    try:
        dep.start_coordinator()
        for cid in ("c00", "c01", "c02"):
            dep.start_agent(cid)
        dep.wait_for(lambda r: r["state"] == "finished", timeout_s=180, what="the run to finish")
        rounds = get(f"{dep.api}/api/v1/runs/demo/rounds")
        clients = {c["id"]: c for c in get(f"{dep.api}/api/v1/clients")}
        one = get(f"{dep.api}/api/v1/clients/c01")
        with urllib.request.urlopen(f"{dep.api}/metrics", timeout=5) as resp:
            metrics = metric_values(resp.read().decode())
        # the agents leave when the run is finished (a retained `offline`): the coordinator still
        # follows its clients (before: `online` forever once the run had ended)
        for agent in dep.agents.values():
            assert agent.wait(timeout=60) == 0
        dep.wait_for(lambda r: not any(c["online"] for c in r["clients"].values()), 30, "the clients shown offline")
        with urllib.request.urlopen(f"{dep.api}/metrics", timeout=5) as resp:
            assert metric_values(resp.read().decode())[("fedal_clients_online", (("run", "demo"),))] == 0
    finally:
        dep.close()
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert set(r["phases"]) == {"local_train", "transfer", "evaluate"}
        for stats in r["phases"].values():
            assert stats["participation"] == 1.0 and 0 <= stats["p50_s"] <= stats["p95_s"]
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
        assert 0 < r["server"]["disc_loss"] and 0 <= r["server"]["disc_acc"] <= 1 and r["server"]["discrepancy"] >= 0
        assert len(r["client_acc"]) == 3 and all(0 <= a <= 1 for a in r["client_acc"])
    assert set(clients) == {"c00", "c01", "c02"}
    assert all(c["answered"] == 2 * (1 + 2 + 1) for c in clients.values())  # 2 rounds x (train, 2 transfers, eval)
    assert one["id"] == "c01" and one["rejected"] == 0 and one["bytes_up"] > 0 and one["last_seen"] is not None
    assert metrics[("fedal_rounds_completed", (("run", "demo"),))] == 2
    assert metrics[("fedal_run_state", (("run", "demo"), ("state", "finished")))] == 1
    assert metrics[("fedal_client_answered_total", (("client", "c02"), ("run", "demo")))] == 8
    assert ("fedal_phase_latency_seconds", (("phase", "transfer"), ("quantile", "0.95"), ("run", "demo"))) in metrics


@pytest.fixture()
def guarded(tmp_path):
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 40), np.float32))
    cfg = load_coordinator_config(None, run_id="unit", client_ids=["a", "b"], num_classes=10, public_file=tmp_path / "public.npz",
                                  state_dir=tmp_path / "state", api={"token": "s3cret", "read_requires_token": True})
    return Run(cfg)


def test_write_endpoints_need_the_token(guarded, engine):
    client = local_client(guarded)
    assert client.post("/api/v1/runs/unit/pause").status_code == 401
    assert client.post("/api/v1/runs/unit/pause", headers={"Authorization": "Bearer nope"}).status_code == 403
    ok = client.post("/api/v1/runs/unit/stop", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["action"] == "stop"
    assert client.post("/api/v1/runs/unit/explode", headers={"Authorization": "Bearer s3cret"}).status_code == 404
    # reads can be made to need it too; health and the agents' public set stay open
    assert client.get("/api/v1/runs").status_code == 401
    assert client.get("/api/v1/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/metrics").status_code == 401
    assert client.get("/healthz").status_code == 200 and client.get("/api/v1/runs/unit/public").status_code == 200
    # without a configured token, writes are off altogether
    open_client = local_client(engine)
    assert open_client.post("/api/v1/runs/unit/stop", headers={"Authorization": "Bearer anything"}).status_code == 403
    # and so without credentials: a 403, not a 401 whose challenge asks for a token that cannot exist
    bare = open_client.post("/api/v1/runs/unit/stop")
    assert bare.status_code == 403 and "www-authenticate" not in bare.headers and "writes are off" in bare.text
    assert open_client.get("/api/v1/runs").status_code == 200


def test_pause_resume_and_live_events_during_a_real_run(mosquitto, tmp_path):
    import json
    import threading

    import httpx

    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=3, rounds=12, tau=1, public_size=100, seed=2))
    dep = Deployment(config, tmp_path / "dep", mosquitto, coordinator={"api": {"token": "tok"}})
    auth = {"Authorization": "Bearer tok"}
    events: list[dict] = []
    subscribed = threading.Event()

    def listen() -> None:
        with httpx.stream("GET", f"{dep.api}/api/v1/events", timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    subscribed.set()  # the first event is "hello": from here on nothing is missed
                    if events[-1].get("state") == "finished":
                        return

    try:
        dep.start_coordinator()
        dep.wait_for(lambda r: r["state"] in ("pending", "running"), what="the API")
        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        assert subscribed.wait(60), "the event stream did not open"
        for cid in ("c00", "c01", "c02"):
            dep.start_agent(cid)
        dep.wait_for(lambda r: r["completed_rounds"] >= 2, what="two rounds")
        assert httpx.post(f"{dep.api}/api/v1/runs/demo/pause", headers=auth).json()["state"] == "paused"
        held = dep.wait_for(lambda r: r["state"] == "paused", what="the pause")["completed_rounds"]
        time.sleep(3)
        assert dep.run()["completed_rounds"] <= held + 1  # at most the round in flight completes
        assert httpx.post(f"{dep.api}/api/v1/runs/demo/resume", headers=auth).json()["state"] == "running"
        dep.wait_for(lambda r: r["state"] == "finished", timeout_s=180, what="the run to finish")
        listener.join(timeout=30)
        assert httpx.post(f"{dep.api}/api/v1/runs/demo/pause", headers=auth).status_code == 409
    finally:
        dep.close()
    kinds = {e["type"] for e in events}
    assert {"hello", "client", "phase", "round", "run"} <= kinds
    assert [e["round"] for e in events if e["type"] == "round"] == list(range(1, 13))
    states = [e["state"] for e in events if e["type"] == "run"]
    assert "paused" in states and states[-1] == "finished"


def test_pause_at_holds_the_run_before_the_named_phases(mosquitto, tmp_path):
    """phases.pause_at: the run holds by itself before round 2's second transfer and before round 3,
    sends nothing while held, and finishes as the run that never paused."""
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=3, tau=2, public_size=100, seed=6))
    dep = Deployment(config, tmp_path / "dep", mosquitto,
                     phases={"pause_at": [{"round": 2, "phase": "transfer", "iteration": 1}, {"round": 3}]})
    try:
        dep.start_all()
        held = dep.wait_held(2, "transfer", 1)
        assert held["held_before"] == {"round": 2, "phase": "transfer", "iteration": 1}
        assert held["round"] == 2 and held["completed_rounds"] == 1
        assert held["pause_at"] == [{"round": 3, "phase": None, "iteration": None}]
        # round 1 (local_train, 2 transfers, evaluate), then round 2's local_train and first transfer
        assert {c: i["answered"] for c, i in held["clients"].items()} == {c: 6 for c in ("c00", "c01", "c02")}
        time.sleep(2)
        still = dep.run()
        assert still["state"] == "paused" and {c: i["answered"] for c, i in still["clients"].items()} == {
            c: 6 for c in ("c00", "c01", "c02")}
        assert dep.control("resume")["state"] == "running"

        held = dep.wait_held(3)
        assert held["held_before"] == {"round": 3, "phase": "local_train", "iteration": 0}
        assert held["completed_rounds"] == 2 and held["pause_at"] == []
        dep.control("resume")
        final = dep.finish(timeout_s=180)
        state = dep.run()
    finally:
        dep.close()
    assert state["held_before"] is None and state["round"] == 3
    assert [r["round"] for r in final["rounds"]] == [1, 2, 3]
    assert final["final"]["client_acc"] == simulate(per_client(config))["final"]["client_acc"]
    log = (dep.workdir / "coordinator" / "coordinator.log").read_text()
    assert "pausing before round 2 transfer iteration 1" in log and "pausing before round 3 local_train" in log


def test_stop_answers_with_the_state_the_run_reaches(mosquitto, tmp_path):
    """POST .../stop answered "running" (the engine stops between two steps, in its own thread);
    it now answers once the run has stopped."""
    import httpx

    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=3, rounds=500, tau=1, public_size=100, seed=4))
    dep = Deployment(config, tmp_path / "dep", mosquitto, coordinator={"api": {"token": "tok"}})
    try:
        dep.start_coordinator()
        for cid in ("c00", "c01", "c02"):
            dep.start_agent(cid)
        dep.wait_for(lambda r: r["completed_rounds"] >= 1, what="a round")
        answer = httpx.post(f"{dep.api}/api/v1/runs/demo/stop", headers={"Authorization": "Bearer tok"}, timeout=30)
        assert answer.status_code == 200 and answer.json() == {"run_id": "demo", "action": "stop", "state": "stopped"}
        assert get(f"{dep.api}/api/v1/runs/demo")["state"] == "stopped"
    finally:
        dep.close()
