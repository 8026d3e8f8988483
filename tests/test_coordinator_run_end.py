"""How a run's end looks to whoever watches the coordinator: a run that fails says so on the event
stream, in the store and with its end time; a run found finished at a restart keeps when it
finished and the results it wrote; the metrics name a paused run's state and keep the last
evaluated accuracy between evaluations."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from coordinator.config import load_coordinator_config
from coordinator.run import Run
from coordinator.runs import RunManager
from fedal.engine import RoundEngine
from fedal.sim import load_config, simulate
from tests.local_api import local_client
from tests.test_coordinator_api import engine, metric_values  # noqa: F401 (engine: its Run fixture)


def drain(q) -> list[dict]:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def wait(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_failed_run_says_so_on_the_event_stream_in_the_store_and_with_its_end(mosquitto, tmp_path, monkeypatch):
    """Before: the API said `failed`, but no `run` event went out, `finished_at` stayed null and
    the store kept `pending`."""
    def broken(self, r):
        raise RuntimeError(f"a server-side error in round {r}")

    monkeypatch.setattr(RoundEngine, "run_round", broken)
    cfg = load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": "tok"},
                                  broker={"url": mosquitto}, phases={"start_timeout_s": 0})
    runs = RunManager(cfg)
    events = runs.events.subscribe()
    runs.start()
    try:
        api = local_client(runs)
        created = api.post("/api/v1/runs", headers={"Authorization": "Bearer tok"},
                           json={"run_id": "f1", "client_ids": ["a", "b"],
                                 "run": {"strategy": "fedmd", "dataset": "digits", "rounds": 2, "public_size": 50}})
        assert created.status_code == 201, created.text
        wait(lambda: api.get("/api/v1/runs/f1").json()["state"] == "failed", 60, "the run to fail")
        snap = api.get("/api/v1/runs/f1").json()
        assert snap["error"] == "RuntimeError: a server-side error in round 0"
        assert snap["finished_at"] is not None and snap["finished_at"] >= snap["started_at"]
        states = [e["state"] for e in drain(events) if e["type"] == "run" and e["run_id"] == "f1"]
        assert states == ["running", "failed"]
        assert runs.store.load("f1").state == "failed" and runs.store.load("f1").finished_at == snap["finished_at"]
    finally:
        runs.stop()
        runs.store.close()


def run_to_its_end(run: Run) -> None:
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    assert run.finished_event.wait(60)
    thread.join(10)


def run_with_its_round_stored(broker: str, tmp_path, run_id: str, state: str):
    """(config, run) of a one-round run registered as a fresh start would be, its round (as the
    simulation computes it) stored with `state`."""
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 64), np.float32))
    spec = dict(strategy="fedmd", dataset="digits", rounds=1, public_size=50, seed=0, clients=2)
    cfg = load_coordinator_config(None, run_id=run_id, client_ids=["c00", "c01"], num_classes=10,
                                  state_dir=tmp_path / "state", broker={"url": broker},
                                  run={k: v for k, v in spec.items() if k != "clients"})
    first = Run(cfg)
    first._resume()
    records = simulate(load_config(None, {**spec, "vectorize": False}))["rounds"]
    first.store.save(run_id, {"completed_rounds": 1, "state": state, "started_at": 1000.0}, records, {},
                     first.server.state_dict())
    return cfg, first


def test_a_run_found_finished_at_a_restart_keeps_its_end_and_its_results(mosquitto, tmp_path):
    """Before: a restarted coordinator finished the run again: `finished_at` became the restart's
    time, and results.json was rewritten with a wall time that counted the downtime."""
    cfg, first = run_with_its_round_stored(mosquitto, tmp_path, "done", "finished")
    first.store.set_state("done", "finished", 1040.0)
    results = cfg.state_dir / "results.json"
    results.write_text('{"written": "when it finished"}\n')
    first.store.close()

    again = Run(load_coordinator_config(None, **json.loads(cfg.model_dump_json())))
    events = again.events.subscribe()
    run_to_its_end(again)
    try:
        snap = again.snapshot()
        assert snap["state"] == "finished" and (snap["started_at"], snap["finished_at"]) == (1000.0, 1040.0)
        assert again.results()["timings"]["wall_seconds"] == 40.0
        assert results.read_text() == '{"written": "when it finished"}\n'
        assert [e["state"] for e in drain(events) if e["type"] == "run"] == ["finished"]  # never `running` again
        assert again.store.load("done").finished_at == 1040.0
    finally:
        again.transport.stop()
        again.store.close()


def test_metrics_name_a_paused_run_and_keep_the_last_evaluated_accuracy(engine):
    """Before: a paused run was 0 in every `fedal_run_state` series, and with eval_every > 1 the
    accuracy gauges vanished after every round that did not evaluate."""
    engine.records = [{"round": 1, "mean_acc": 0.5, "min_acc": 0.25, "local_mean_acc": 0.75},
                      {"round": 2, "mean_acc": None, "min_acc": None, "local_mean_acc": None}]
    engine.state = "paused"
    values = metric_values(local_client(engine).get("/metrics").text)
    states = {dict(labels)["state"]: v for (name, labels), v in values.items() if name == "fedal_run_state"}
    assert states == {"pending": 0, "running": 0, "paused": 1, "finished": 0, "stopped": 0, "failed": 0}
    run = (("run", "unit"),)
    assert (values[("fedal_mean_accuracy", run)], values[("fedal_min_accuracy", run)],
            values[("fedal_local_mean_accuracy", run)]) == (0.5, 0.25, 0.75)


def test_a_run_paused_before_it_starts_holds_before_its_first_phase(mosquitto, engine_on_broker):
    """Before: pausing a pending run answered 200 and was dropped: the run went straight to
    `running` when the broker came."""
    run = engine_on_broker
    api = local_client(run)
    assert run.state == "pending"
    token = {"Authorization": "Bearer tok"}
    paused = api.post("/api/v1/runs/unit/pause", headers=token)
    assert paused.status_code == 200 and paused.json()["state"] == "paused"
    events = run.events.subscribe()
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        wait(lambda: run.snapshot()["held_before"] is not None, 60, "the run to hold before its first phase")
        snap = run.snapshot()
        assert snap["state"] == "paused" and snap["completed_rounds"] == 0
        assert snap["held_before"] == {"round": 1, "phase": "local_train", "iteration": 0}
        assert api.post("/api/v1/runs/unit/resume", headers=token).json()["state"] == "running"
        wait(lambda: run.snapshot()["held_before"] is None, 30, "the run to go on")
        assert [e["state"] for e in drain(events) if e["type"] == "run"] == ["running"]  # paused all along, then resumed
    finally:
        run.stop()
        thread.join(30)
        run.transport.stop()


@pytest.fixture()
def engine_on_broker(mosquitto, tmp_path):
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 64), np.float32))
    cfg = load_coordinator_config(None, run_id="unit", client_ids=["a", "b"], num_classes=10,
                                  public_file=tmp_path / "public.npz", state_dir=tmp_path / "state",
                                  broker={"url": mosquitto}, phases={"start_timeout_s": 0}, api={"token": "tok"},
                                  run={"strategy": "fedmd", "dataset": "digits", "rounds": 2})
    return Run(cfg)


def publish_status(url: str, run_id: str, cid: str, state: str, retain: bool) -> None:
    import paho.mqtt.client as mqtt

    from fedal.protocol import parse_broker_url, topics

    addr = parse_broker_url(url)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-status-{cid}")
    client.connect(addr.host, addr.port)
    client.loop_start()
    try:
        client.publish(topics.status(run_id, cid), json.dumps({"state": state, "ts": time.time() - 3600}),
                       qos=1, retain=retain).wait_for_publish(10)
    finally:
        client.loop_stop()
        client.disconnect()


def test_a_retained_status_sets_online_but_not_last_seen(mosquitto, engine_on_broker):
    """Before: the broker's retained copy of a status, delivered when the coordinator subscribes
    (at every restart), set `last_seen` to that moment: a device gone for an hour was shown seen
    just now. A live status still sets it."""
    run = engine_on_broker
    publish_status(mosquitto, "unit", "a", "online", retain=True)  # what a device left behind
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        wait(lambda: run.snapshot()["clients"]["a"]["online"], 30, "the retained status applied")
        assert run.snapshot()["clients"]["a"]["last_seen"] is None
        publish_status(mosquitto, "unit", "b", "online", retain=False)  # live
        wait(lambda: run.snapshot()["clients"]["b"]["online"], 30, "the live status applied")
        assert run.snapshot()["clients"]["b"]["last_seen"] >= time.time() - 60
    finally:
        run.stop()
        thread.join(30)
        run.transport.stop()  # (the `mosquitto` fixture clears retained messages for the next test)


def test_a_run_stopped_before_its_first_round_shows_round_0(mosquitto, tmp_path):
    """Stopped while it waited for its clients: it showed round 1, a round it never entered."""
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 64), np.float32))
    run = Run(load_coordinator_config(None, run_id="unit", client_ids=["a", "b"], num_classes=10,
                                      public_file=tmp_path / "public.npz", state_dir=tmp_path / "state",
                                      broker={"url": mosquitto}, phases={"start_timeout_s": 600}, api={"token": "tok"},
                                      run={"strategy": "fedmd", "dataset": "digits", "rounds": 2}))
    api = local_client(run)
    assert run.snapshot()["round"] == 0
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        wait(lambda: run.snapshot()["state"] == "running", 60, "the run to wait for its clients")
        assert api.post("/api/v1/runs/unit/stop", headers={"Authorization": "Bearer tok"}).status_code == 200
        wait(lambda: run.snapshot()["state"] == "stopped", 30, "the run to stop")
        snap = run.snapshot()
        assert (snap["round"], snap["completed_rounds"]) == (0, 0)
    finally:
        run.stop()
        thread.join(30)
        run.transport.stop()


@pytest.mark.parametrize("end", ["stop", "close"])
def test_a_paused_run_that_is_stopped_sends_nothing(mosquitto, engine_on_broker, end):
    """stop() releases the hold too: the held phase's tasks went out to every device (which began
    to train for a stopped run) before the loop saw the stop. `close` is a coordinator's SIGTERM."""
    run = engine_on_broker
    sent: list[str] = []
    real_send = run.engine._send
    run.engine._send = lambda cid, packet: (sent.append(cid), real_send(cid, packet))[1]
    run.pause()
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        wait(lambda: run.snapshot()["held_before"] is not None, 60, "the run to hold before its first phase")
        getattr(run, end)()
        thread.join(30)
        assert not thread.is_alive() and run.state == "stopped"
        assert sent == []
    finally:
        run.stop()
        thread.join(30)
        run.transport.stop()


def test_a_run_found_finished_while_the_broker_is_away_says_so_and_refuses_a_pause(tmp_path):
    """Before: it showed `pending` until the broker came, and a pause (200) stored `paused`
    without its end time: after the next restart the run finished again, with a new end."""
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 64), np.float32))
    cfg = load_coordinator_config(None, run_id="done", client_ids=["c00", "c01"], num_classes=10,
                                  state_dir=tmp_path / "state", broker={"url": "mqtt://127.0.0.1:1"},
                                  api={"token": "tok"}, run={"strategy": "fedmd", "dataset": "digits", "rounds": 1,
                                                             "public_size": 50})
    first = Run(cfg)
    first._resume()
    first.store.save("done", {"completed_rounds": 1, "state": "finished", "started_at": 1000.0}, [{"round": 1}], {},
                     first.server.state_dict())
    first.store.set_state("done", "finished", 1040.0)
    first.store.close()
    again = Run(load_coordinator_config(None, **json.loads(cfg.model_dump_json())))
    thread = threading.Thread(target=again.run, daemon=True)
    thread.start()
    try:
        wait(lambda: again.snapshot()["state"] == "finished", 30, "the run to say it is finished")
        assert again.snapshot()["finished_at"] == 1040.0
        api = local_client(again)
        token = {"Authorization": "Bearer tok"}
        for action in ("pause", "resume"):
            answer = api.post(f"/api/v1/runs/done/{action}", headers=token)
            assert answer.status_code == 409 and "finished" in answer.json()["detail"], answer.text
        stored = again.store.load("done")
        assert (stored.state, stored.finished_at) == ("finished", 1040.0)
    finally:
        again.stop()
        thread.join(30)
        again.store.close()
    assert not thread.is_alive()


def test_a_run_paused_while_pending_is_pending_again_when_resumed(unstarted_run):
    """Before: the resume made it `running` (round 1, in the store too) while it had not even
    reached its broker."""
    run = unstarted_run  # its broker, 127.0.0.1:1, never answers
    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    try:
        run.pause()
        assert run.state == "paused" and run.store.load("race").state == "paused"
        run.resume()
        assert run.state == "pending" and run.store.load("race").state == "pending"
    finally:
        run.stop()
        thread.join(30)
    assert run.state == "stopped"


def test_a_store_that_fails_as_a_run_stops_still_ends_it(unstarted_run, monkeypatch):
    """Before: the error killed the run's thread; a stop waited its full 10 s, an exit_on_finish
    coordinator never exited, and the API said nothing of it."""
    from sqlalchemy.exc import OperationalError

    run = unstarted_run

    def full(*_args, **_kwargs):
        raise OperationalError("UPDATE runs", {}, Exception("database or disk is full"))

    thread = threading.Thread(target=run.run, daemon=True)
    thread.start()
    monkeypatch.setattr(run.store, "set_state", full)
    run.stop()
    assert run.finished_event.wait(30)
    thread.join(30)
    snap = run.snapshot()
    assert snap["state"] == "stopped" and snap["finished_at"] is not None
    assert "database or disk is full" in snap["error"]


def test_a_run_whose_end_the_store_cannot_record_still_finishes(mosquitto, tmp_path, monkeypatch):
    """Every round done and stored, then the store refuses the end (a locked or full database).
    Before: the run was reported `failed`, wrote no results and never announced `finished`."""
    from sqlalchemy.exc import OperationalError

    # its last round stored, and then the coordinator stopped before the end was recorded
    cfg, first = run_with_its_round_stored(mosquitto, tmp_path, "end", "running")
    first.store.close()

    again = Run(load_coordinator_config(None, **json.loads(cfg.model_dump_json())))

    def locked(*_args, **_kwargs):
        raise OperationalError("UPDATE runs", {}, Exception("database is locked"))

    monkeypatch.setattr(again.store, "set_state", locked)
    run_to_its_end(again)
    try:
        snap = again.snapshot()
        assert snap["state"] == "finished" and snap["completed_rounds"] == 1
        assert "its end (finished) not recorded" in snap["error"] and "database is locked" in snap["error"]
        assert json.loads((cfg.state_dir / "results.json").read_text())["final"] is not None
        assert again.manifest().state == "finished"
    finally:
        again.transport.stop()
        again.store.close()


def test_a_run_restarted_before_its_first_round_keeps_its_start_time(mosquitto, tmp_path):
    """Before: `started_at` reached the store with the first completed round, so a coordinator
    restarted while the run waited for its clients gave it a new start time at every restart."""
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 64), np.float32))
    cfg = load_coordinator_config(None, run_id="wait", client_ids=["c00", "c01"], num_classes=10,
                                  state_dir=tmp_path / "state", broker={"url": mosquitto},
                                  run={"strategy": "fedmd", "dataset": "digits", "rounds": 1, "public_size": 50},
                                  phases={"start_timeout_s": 600})
    starts = []
    for _ in range(2):
        run = Run(load_coordinator_config(None, **json.loads(cfg.model_dump_json())))
        thread = threading.Thread(target=run.run, daemon=True)
        thread.start()
        try:
            wait(lambda: run.snapshot()["state"] == "running", 60, "the run to reach the broker")  # noqa: B023
            starts.append(run.snapshot()["started_at"])
        finally:
            run.stop()
            thread.join(30)
            run.transport.stop()
            run.store.close()
        assert not thread.is_alive()
        time.sleep(0.05)  # a new start time would differ
    assert starts[0] is not None and starts[1] == starts[0]


def test_a_file_put_where_the_results_go_during_the_run_is_never_written_over(mosquitto, tmp_path):
    """A run writes its results at its end: a file the toolkit did not write put there meanwhile
    is left as it is, and the run's error says so (its rounds are in the store)."""
    cfg, first = run_with_its_round_stored(mosquitto, tmp_path, "end2", "running")
    first.store.close()
    mine = cfg.state_dir / "results.json"
    mine.write_text("the operator's notes\n")

    again = Run(load_coordinator_config(None, **json.loads(cfg.model_dump_json())))
    run_to_its_end(again)
    try:
        snap = again.snapshot()
        assert snap["state"] == "finished" and "results not written" in snap["error"]
        assert mine.read_text() == "the operator's notes\n"
    finally:
        again.transport.stop()
        again.store.close()
