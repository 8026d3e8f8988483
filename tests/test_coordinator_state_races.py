"""Pause, resume and a round's save from different threads (the API's workers and the run's
thread) on one run, their windows widened by a slow store write or a slow engine release, and
events from two publishers: the store, the engine and the event stream end as the last
operation left them."""

from __future__ import annotations

import threading
import time

from coordinator import events as events_module
from coordinator import store as store_module
from coordinator.events import EventHub
from coordinator.runs import RunManager
from fedal.engine import rounds as rounds_module


def slowed(monkeypatch, owner, name: str, seconds: float = 0.1) -> None:
    original = getattr(owner, name)

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, slow)


def test_a_pause_during_a_rounds_save_is_what_the_store_keeps(unstarted_run, monkeypatch):
    unstarted_run.state = "running"
    slowed(monkeypatch, store_module.RunStore, "save")  # the round's save: server state and a transaction
    saving = threading.Thread(target=unstarted_run._save, kwargs={"completed": 1})
    saving.start()
    time.sleep(0.02)
    unstarted_run.pause()  # the operator, over the API, while the round is saved
    saving.join()
    assert unstarted_run.state == "paused" and unstarted_run.operator_paused
    assert unstarted_run.store.load("race").state == "paused"  # a restart keeps the run held


def test_a_resume_during_a_rounds_save_is_what_the_store_keeps(unstarted_run, monkeypatch):
    unstarted_run.state, unstarted_run.connected_once = "running", True  # a run past its broker connection
    unstarted_run.pause()
    slowed(monkeypatch, store_module.RunStore, "save")
    saving = threading.Thread(target=unstarted_run._save, kwargs={"completed": 1})
    saving.start()
    time.sleep(0.02)
    unstarted_run.resume()
    saving.join()
    assert unstarted_run.state == "running" and unstarted_run.store.load("race").state == "running"


def test_a_pause_right_after_a_resume_holds_the_run(unstarted_run, monkeypatch):
    unstarted_run.pause()
    slowed(monkeypatch, rounds_module.RoundEngine, "resume")  # the engine's release, late
    resuming = threading.Thread(target=unstarted_run.resume)
    resuming.start()
    time.sleep(0.02)
    unstarted_run.pause()
    resuming.join()
    assert unstarted_run.state == "paused"
    assert not unstarted_run.engine.resume_event.is_set()  # the engine holds, as the API says
    assert unstarted_run.store.load("race").state == "paused"


def test_events_reach_subscribers_in_the_order_of_their_ids(monkeypatch):
    hub = EventHub()
    q = hub.subscribe()
    first_call = threading.Event()
    real_time = time.time

    def clock() -> float:  # the first publisher is slow between taking its id and queueing
        if not first_call.is_set():
            first_call.set()
            time.sleep(0.1)
        return real_time()

    monkeypatch.setattr(events_module.time, "time", clock)
    slow = threading.Thread(target=hub.publish, args=("run",), kwargs={"state": "paused"})
    slow.start()
    first_call.wait(5)
    hub.publish("run", state="running")
    slow.join()
    got = [q.get_nowait(), q.get_nowait()]
    assert [e["id"] for e in got] == sorted(e["id"] for e in got)


def test_runs_are_not_started_once_the_coordinator_is_stopping(unstarted_run):
    """A stop signal right as the API comes up: the thread that starts the runs may come second."""
    manager = RunManager.of(unstarted_run)
    manager.stop(timeout_s=1)
    manager.start()
    assert manager.threads == {} and unstarted_run.state == "pending"


def test_a_pause_while_a_restarted_run_loads_its_state_is_what_the_store_keeps(unstarted_run):
    """The resume's first save keeps the stored state for a run still pending, but an operator's
    pause that landed meanwhile is the run's state, not the stored one."""
    from coordinator.run import Run

    unstarted_run._resume()
    unstarted_run.state = "running"
    unstarted_run._save(completed=1)  # a crash mid-run: stored `running`
    again = Run(unstarted_run.cfg)
    load = again.store.load_server_state

    def pausing_load(run_id):
        again.pause()  # the API's pause, while the restarted run loads its server state
        return load(run_id)

    again.store.load_server_state = pausing_load
    again._resume()
    assert again.state == "paused" and again.store.load("race").state == "paused"
    again.store.close()


def test_stops_waiting_for_their_run_leave_the_reads_served(unstarted_run):
    """A stop answers once the run has stopped, or after STOP_WAIT_S: it held a server worker
    thread for that wait, so some forty stops at once left none for the reads (the dashboard,
    /healthz). The wait is on the event loop now."""
    import concurrent.futures

    import httpx

    from coordinator.app import STOP_WAIT_S
    from tests.local_api import served

    unstarted_run.cfg.api.token = "s3cret-token-for-the-test"
    manager = RunManager.of(unstarted_run)
    manager.threads["race"] = threading.Thread()  # a run thread that never reaches `stopped`
    with served(manager) as port:
        base = f"http://127.0.0.1:{port}"
        stop = {"Authorization": f"Bearer {unstarted_run.cfg.api.token}"}
        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            stops = [pool.submit(httpx.post, f"{base}/api/v1/runs/race/stop", headers=stop, timeout=60) for _ in range(50)]
            time.sleep(1.0)  # every stop is waiting now
            started = time.monotonic()
            health = httpx.get(f"{base}/healthz", timeout=60)
            waited = time.monotonic() - started
            assert health.status_code == 200
            assert waited < STOP_WAIT_S / 3, waited  # served, not queued behind the stops' waits
            assert all(f.result().status_code == 200 for f in stops)


def restarted(run):
    """The run as a restarted coordinator builds it again, its thread not started yet (the API
    is up before the threads start: RunManager.start)."""
    from coordinator.run import Run

    run.store.close()
    return Run(run.cfg)


def test_a_pause_right_after_a_restart_leaves_a_finished_run_finished(unstarted_run):
    """Before: the restarted run was `pending` until its thread read the store; a pause then
    answered 200 and wrote `paused` over the stored `finished`, erasing when it finished."""
    from tests.local_api import local_client

    unstarted_run.cfg.api.token = "s3cret-token-for-the-test"
    unstarted_run._resume()
    unstarted_run._save(completed=5)
    unstarted_run.store.set_state("race", "finished", finished_at=1234.5)
    again = restarted(unstarted_run)
    try:
        assert again.state == "finished" and again.finished_at == 1234.5
        answer = local_client(again).post("/api/v1/runs/race/pause",
                                          headers={"Authorization": "Bearer s3cret-token-for-the-test"})
        assert answer.status_code == 409 and "finished" in answer.text
        stored = again.store.load("race")
        assert (stored.state, stored.finished_at) == ("finished", 1234.5)
    finally:
        again.store.close()


def test_a_resume_right_after_a_restart_is_not_undone_by_the_runs_thread(unstarted_run):
    """Before: a run an operator paused before the restart was `pending` until its thread read
    the store: a resume answered 200 and did nothing, and the thread then held the run again."""
    unstarted_run._resume()
    unstarted_run._save(completed=1)
    unstarted_run.pause()  # the operator's pause, kept in the store
    again = restarted(unstarted_run)
    try:
        assert again.state == "paused"  # as the store says, before the thread has read anything
        again.resume()  # POST .../resume, before the thread started
        assert again.state == "pending" and again.store.load("race").state == "pending"
        seen = []

        def start(_stop_event):  # the thread reached its broker: what did it make of the store?
            seen.append((again.state, again.store.load("race").state))
            return False  # (and stops there)

        again.transport.start = start
        thread = threading.Thread(target=again.run, daemon=True)
        thread.start()
        thread.join(60)
        assert seen == [("pending", "pending")]
    finally:
        again.store.close()


def test_what_a_restarted_or_held_run_shows_of_its_rounds(unstarted_run):
    """Before: a run paused while pending showed round 1 (never entered); a restarted run's
    pause points in rounds already done stayed listed as still ahead; a run found finished
    announced round = rounds (one past its last), where a run that just finished says its last."""
    from coordinator.config import CoordinatorConfig
    from coordinator.run import Run

    unstarted_run.pause()
    assert unstarted_run.snapshot()["round"] == 0  # paused before it entered any round
    unstarted_run.resume()

    cfg = CoordinatorConfig(**{**unstarted_run.cfg.model_dump(), "run_id": "points",
                               "phases": {"pause_at": [{"round": 1}, {"round": 3, "phase": "transfer"}, {"round": 4}]}})
    first = Run(cfg, store=unstarted_run.store)
    first._resume()
    first.state = "running"
    first._save(completed=2)  # a crash in round 3
    again = Run(cfg, store=unstarted_run.store)
    again._resume()
    assert [p["round"] for p in again.snapshot()["pause_at"]] == [3, 4]  # round 3 is run again, and holds again

    first._save(completed=5)
    unstarted_run.store.set_state("points", "finished", finished_at=99.0)
    done = Run(cfg, store=unstarted_run.store)
    done.transport.start = lambda _stop_event: False  # no broker here: the thread ends after reading the store
    thread = threading.Thread(target=done.run, daemon=True)
    thread.start()
    thread.join(60)
    assert done.state == "finished" and done.finished_at == 99.0
    assert done.manifest().round == 4 and done.snapshot()["pause_at"] == []


def test_a_resume_while_the_restarted_run_reads_the_store_is_what_the_store_keeps(unstarted_run):
    """The run's thread read the stored `paused` and saved it back after a resume that came in
    between: `pending` in memory, `paused` in the store (a restart then held the run again)."""
    unstarted_run._resume()
    unstarted_run._save(completed=1)
    unstarted_run.pause()
    again = restarted(unstarted_run)
    try:
        register = again.store.register

        def resumed_meanwhile(*args, **kwargs):  # the API's resume, between the thread's read and its save
            again.resume()
            return register(*args, **kwargs)

        again.store.register = resumed_meanwhile
        again._resume()
        assert again.state == "pending" and again.store.load("race").state == "pending"
    finally:
        again.store.close()


def failing_once(monkeypatch, owner, name: str) -> None:
    """`owner.name` raises the first time it is called (a store locked past its timeout), then works."""
    original, calls = getattr(owner, name), []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("database is locked")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)


def test_a_pause_or_resume_whose_store_write_fails_changes_nothing_and_a_second_one_works(unstarted_run, monkeypatch):
    """A pause whose store write failed had paused the run in memory only: no event, the store
    `running`, and a second pause did nothing (the run not held after a restart). A resume whose
    write failed said `running` while the engine stayed held, and a second resume did nothing."""
    import pytest

    run = unstarted_run
    run._resume()
    run.state, run.connected_once = "running", True
    seen = run.events.subscribe()
    failing_once(monkeypatch, store_module.RunStore, "set_state")
    with pytest.raises(OSError):
        run.pause()
    assert run.state == "running" and run.engine.resume_event.is_set()
    assert run.store.load("race").state != "paused"
    run.pause()  # the operator tries again
    assert run.state == "paused" and run.store.load("race").state == "paused"

    failing_once(monkeypatch, store_module.RunStore, "set_state")
    with pytest.raises(OSError):
        run.resume()
    assert run.state == "paused" and not run.engine.resume_event.is_set()  # still held, and says so
    run.resume()
    assert run.state == "running" and run.engine.resume_event.is_set() and run.store.load("race").state == "running"
    kinds = []
    while not seen.empty():
        event = seen.get_nowait()
        kinds.append(event.get("state"))
    assert kinds == ["paused", "running"]  # one event per change that happened


def test_a_run_killed_between_its_last_save_and_its_end_is_found_finished(unstarted_run):
    """The last round's save landed, the end did not (kill -9): the store said `running` with
    every round done. The restarted run showed `pending` (a pause accepted and written), and
    without a broker it ended `stopped`, its results never written."""
    run = unstarted_run
    run._resume()
    run._save(completed=run.run_config.rounds)
    again = restarted(run)
    try:
        assert again.state == "finished"
        again.pause()
        assert again.state == "finished" and again.store.load("race").state != "paused"
        thread = threading.Thread(target=again.run, daemon=True)  # its broker never answers
        thread.start()
        time.sleep(0.5)
        again.close()  # the coordinator shuts down before it reached the broker
        thread.join(30)
        assert again.state == "finished" and again.store.load("race").state == "finished"
        assert (again.cfg.state_dir / "results.json").exists()  # written now: its end never was
    finally:
        again.transport.stop()
        again.store.close()


class SlowSecondAcquire:
    """A run manager's lock whose owner thread, once `armed`, waits before its second acquisition
    from then on: the window between two of its lock blocks, widened."""

    def __init__(self, lock):
        self.lock, self.armed, self.count = lock, None, 0

    def __enter__(self):
        if self.armed is threading.current_thread():
            self.count += 1
            if self.count == 2:
                time.sleep(0.5)
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_two_creations_of_one_run_id_at_once_start_one_run(tmp_path, monkeypatch):
    """Between the end of a run's build and its addition the id was claimed nowhere: a second
    request for the same id passed its checks, both were answered 201, and one run was shown
    (never started) while the other ran unreachable."""
    import numpy as np

    from coordinator.config import load_coordinator_config
    from coordinator.runs import RunConflict, RunManager

    state = tmp_path / "state"
    state.mkdir()
    np.savez(state / "public.npz", x=np.zeros((4, 3), np.float32))
    runs = RunManager(load_coordinator_config(None, state_dir=state, broker={"url": "mqtt://127.0.0.1:1"}))
    body = {"run_id": "dup", "client_ids": ["a", "b"], "public_file": str(state / "public.npz"),
            "run": {"strategy": "fedmd", "dataset": "digits"}}
    lock = runs.lock = SlowSecondAcquire(runs.lock)
    built = threading.Event()
    original = RunManager._new_run

    def built_then_armed(self, spec, origin):
        run = original(self, spec, origin)
        lock.armed = threading.current_thread()  # from here on its second lock block waits
        built.set()
        return run

    monkeypatch.setattr(RunManager, "_new_run", built_then_armed)
    answers: list = []

    def create() -> None:
        try:
            answers.append(runs.create(body))
        except RunConflict as exc:
            answers.append(exc)

    first = threading.Thread(target=create)
    first.start()
    built.wait(30)
    time.sleep(0.1)  # in the widened window
    monkeypatch.setattr(RunManager, "_new_run", original)
    create()
    first.join(30)
    try:
        assert sum(isinstance(a, RunConflict) for a in answers) == 1, answers
        assert len(runs.list()) == 1
    finally:
        for run in runs.list():
            run.transport.stop()
        runs.store.close()
