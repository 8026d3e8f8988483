"""Results and state on a full disk and across restarts (a crash-consistency review): every
results or status file is written whole or not at all; a run whose results cannot be written
stays finished, with its rounds in the store; a simulation's results go to stdout when their file
cannot take them; an agent that cannot write its final model exits for its service to restart
it; and a finished run found in the store stays finished when the coordinator that found it is
stopped before it reaches the broker."""

from __future__ import annotations

import errno
import json
import resource
import signal
import subprocess
import threading
import time
import tomllib

from coordinator import run as run_module
from coordinator.run import Run
from fedal.sim import load_config
from tests.deployment import Deployment
from tests.helpers import fedal_command

FILE_LIMIT = 20_000  # bytes: the results of the run below are larger, the library's own writes smaller


def limited_file_size() -> None:
    """A disk that takes no file past FILE_LIMIT: writes fail with EFBIG (SIGXFSZ ignored)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def test_simulation_results_that_no_file_takes_go_to_stdout(tmp_path):
    proc = subprocess.run([*fedal_command(), "simulate", "--dataset", "digits", "--clients", "3", "--rounds", "20",
                           "--strategy", "fedmd", "--public-size", "60", "--quiet", "--out", "r.json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, preexec_fn=limited_file_size)
    assert proc.returncode == 1, proc.stderr
    assert "cannot write the results to r.json: File too large; they are on stdout" in proc.stderr
    results = json.loads(proc.stdout)
    assert len(json.dumps(results, indent=2)) > FILE_LIMIT and [r["round"] for r in results["rounds"]] == list(range(1, 21))
    assert list(tmp_path.iterdir()) == []  # no torn file, no temporary one (a rerun would refuse a torn one)


def test_a_run_whose_results_cannot_be_written_stays_finished(unstarted_run, monkeypatch):
    def full_disk(path, data, private=False):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_module, "write_bytes_atomic", full_disk)
    unstarted_run._resume()
    unstarted_run._finish("finished")
    assert unstarted_run.state == "finished"
    assert "results not written to" in unstarted_run.error and "a restart writes them" in unstarted_run.error
    assert unstarted_run.store.load("race").state == "finished"
    assert not (unstarted_run.cfg.state_dir / "results.json").exists()


def test_a_finished_run_found_by_a_coordinator_stopped_before_the_broker_stays_finished(unstarted_run):
    run = unstarted_run
    run._resume()
    run.store.save("race", {"config_hash": run.config_hash, "completed_rounds": 5, "epoch": 0, "instance": "i1",
                            "started_at": 900.0, "state": "finished"}, [], {}, run.server.state_dict())
    run.store.set_state("race", "finished", 1000.0)
    results = run.cfg.state_dir / "results.json"
    results.write_text('{"written": "when it finished"}\n')

    again = Run(run.cfg)  # the coordinator started again; its broker (port 1) never answers
    runner = threading.Thread(target=again.run)
    runner.start()
    deadline = time.monotonic() + 30
    while again.store.load("race").epoch != 1 and time.monotonic() < deadline:  # resumed: the next epoch stored
        time.sleep(0.05)
    assert again.store.load("race").state == "finished"  # were it killed now: still finished
    again.stop()  # stopped while it waits for the broker
    runner.join(30)
    stored = again.store.load("race")
    assert (stored.state, stored.finished_at) == ("finished", 1000.0)
    assert again.state == "finished" and results.read_text() == '{"written": "when it finished"}\n'
    again.store.close()


def test_an_agent_that_cannot_write_its_final_model_exits_and_its_restart_writes_it(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, tau=1, public_size=60, seed=2))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    workspace = tomllib.loads(dep.agent_path("c01").read_text())["workspace"]
    final = tmp_path / "dep" / "agents" / "c01" / "final"
    assert str(final.parent) == workspace
    blocker = final / "model.pt"  # where the final weights go: a folder, as a full card fails the write
    blocker.mkdir(parents=True)
    try:
        dep.start_all()
        dep.finish()
        c01 = dep.agents["c01"]
        assert c01.wait(timeout=120) == 75
        assert dep.agents["c00"].wait(timeout=120) == 0
        log = "".join(p.read_text() for p in final.parent.glob("agent-*.log"))
        assert "cannot write the final model to" in log and "exiting with status 75" in log
        blocker.rmdir()
        restarted = dep.start_agent("c01")
        assert restarted.wait(timeout=120) == 0
        assert (final / "model.pt").is_file() and (final / "instance").is_file()
    finally:
        dep.close()


def test_a_run_started_afresh_under_another_config_keeps_the_earlier_rounds_in_a_file(unstarted_run):
    run = unstarted_run
    run._resume()
    records = [{"round": 1, "mean_acc": 0.5}, {"round": 2, "mean_acc": 0.6}]
    run.store.save("race", {"config_hash": run.config_hash, "completed_rounds": 2, "epoch": 0, "instance": "old-1",
                            "started_at": 900.0, "state": "running"}, records, {}, run.server.state_dict())
    changed = run.cfg.model_copy(update={"run": run.cfg.run.model_copy(update={"threads": 2})})
    again = Run(changed)  # the coordinator started again with one [run] key changed
    assert again.config_hash != run.config_hash
    again._resume()
    kept = json.loads((run.cfg.state_dir / "previous-runs" / "race-old-1.json").read_text())
    assert kept["rounds"] == records and kept["completed_rounds"] == 2 and kept["config_hash"] == run.config_hash
    assert again.store.load("race").records == [] and again.store.load("race").completed_rounds == 0
    again.store.close()


def test_a_second_coordinator_on_the_same_state_dir_is_refused(tmp_path):
    """Its own API port gets it past the port check; it would take over the first one's broker
    session and store."""
    import os

    from hil.coordinator_setup import start_coordinator, stop_process, write_coordinator_config
    from tests.waiting import free_port, wait_until

    port = free_port()
    path = write_coordinator_config(tmp_path / "coord", f"mqtt://127.0.0.1:{free_port()}", "solo", ["a", "b"],
                                    api_port=port, rounds=1, public_size=60)
    first = start_coordinator(path, tmp_path / "first.log")
    try:
        wait_until(lambda: (tmp_path / "coord" / "state" / ".coordinator.lock").exists(), timeout_s=60,
                   what="the first coordinator to hold its state_dir")
        second = subprocess.run([*fedal_command(), "coordinator", "--config", str(path)], capture_output=True, text=True,
                                timeout=120, env={**os.environ, "FEDAL_COORD_API__PORT": str(free_port())})
        assert second.returncode == 2, second.stderr[-2000:]
        assert "is in use by `the coordinator` (PID" in second.stderr and str(first.pid) in second.stderr
        assert first.poll() is None
    finally:
        stop_process(first)


def test_run_wide_counters_outlive_a_coordinator_restart(unstarted_run):
    """They were in memory only: after a restart the run said 0 rejected while its clients said 5."""
    run = unstarted_run
    run._resume()
    run.engine.counters.update({"rejected": 5, "stale": 2})
    run.engine.reject_reasons.update({"envelope": 5})
    run.transport.bus.tasks_held = 3  # the transport's own counters too
    run._save(completed=0)
    again = Run(run.cfg)
    again._resume()
    again.transport.bus.tasks_held = 1  # counted by this start
    assert again.counters["held_offline"] == 4
    assert again.engine.counters["rejected"] == 5 and again.engine.counters["stale"] == 2
    assert again.engine.reject_reasons == {"envelope": 5}
    assert again.snapshot()["counters"]["rejected"] == 5
    again.store.close()


def test_an_output_whose_directory_takes_no_new_file_is_said_unwritable():
    """Outputs are written to a temporary file renamed over the name: a writable file in a
    directory that takes no new file passed the check, and the write failed at the run's end."""
    import os
    import shutil
    import tempfile

    import pytest

    from fedal.owned import unwritable

    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    base = tempfile.mkdtemp(prefix="fedal-unwritable-")  # (pytest's tmp_path is private to root)
    try:
        os.chmod(base, 0o755)
        target = os.path.join(base, "results.json")
        with open(target, "w") as fh:
            fh.write("{}")
        os.chown(target, 65534, 65534)  # the user's own file, in a directory that is not theirs
        os.setegid(65534)
        os.seteuid(65534)
        try:
            why = unwritable(target)
        finally:
            os.seteuid(0)
            os.setegid(0)
        assert why == f"{target} is not writable here"
        assert unwritable(target) is None  # (as root it is)
    finally:
        shutil.rmtree(base)


def test_a_stored_client_field_this_version_does_not_know_is_left_out_at_resume(unstarted_run):
    """A store written by a later version (a rollback) may hold per-client fields this one lacks:
    they are left out, the rest restored (it raised TypeError, and the run could not resume)."""
    run = unstarted_run
    run._resume()
    run.store.save("race", {"config_hash": run.config_hash, "completed_rounds": 1, "epoch": 0, "instance": "i1",
                            "started_at": 900.0, "state": "running"}, [],
                   {"a": {"answered": 4, "declined": 2, "from_a_later_version": 1}}, run.server.state_dict())
    again = Run(run.cfg)
    try:
        assert again._resume() == 1
        assert again.engine.clients["a"].answered == 4 and again.engine.clients["a"].declined == 2
        assert not again.engine.clients["a"].online
    finally:
        again.store.close()


def test_counts_made_after_the_last_rounds_save_outlive_a_shutdown(unstarted_run):
    """Only a round's save kept the counters: what came since (a round under way, messages after
    the run's end) was lost at every restart, and the exported counters went back (Prometheus
    reads a decrease as a reset, and rate() then counts the whole total again)."""
    run = unstarted_run
    run._resume()
    run._save(completed=0)
    run.engine.counters.update({"rejected": 3})
    run.engine.clients["a"].answered = 7
    run.closing.set()
    run.follow_clients()  # the run thread, at the coordinator's shutdown
    again = Run(run.cfg)
    again._resume()
    assert again.engine.counters["rejected"] == 3 and again.engine.clients["a"].answered == 7
    again.store.close()


def test_a_run_whose_resume_failed_leaves_the_stored_counts_alone(unstarted_run):
    """The counts are saved at shutdown; a run whose resume failed (here: its earlier rounds could
    not be kept in previous-runs/) wrote its empty counts over the stored ones, before they were
    kept anywhere."""
    import pytest

    run = unstarted_run
    run._resume()
    run.engine.clients["a"].answered = 7
    run.engine.counters.update({"rejected": 3})
    run._save(completed=0)
    (run.cfg.state_dir / "previous-runs").write_text("in the way")
    other = Run(run.cfg.model_copy(update={"run": run.cfg.run.model_copy(update={"rounds": 6})}))
    with pytest.raises(OSError):
        other._resume()  # another config: the stored rounds must be kept first, and cannot be
    other.closing.set()
    other.follow_clients()  # the run thread at shutdown
    stored = run.store.load(run.cfg.run_id)
    assert stored.clients["a"]["answered"] == 7 and stored.counters["counters"]["rejected"] == 3
