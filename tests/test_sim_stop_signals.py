"""`fedal simulate` stopped by a signal: SIGHUP (a closed terminal) and SIGTERM end the run as
Ctrl-C does, through its clean-up (a Ray backend's actors and snapshots), with the shell's exit
status for the signal. Snapshot directories a killed driver could not remove (SIGKILL) are
removed by the next run."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fedal.sim.ray_backend import SNAPSHOT_PREFIX, snapshot_dir
from tests.helpers import fedal_command


def stopped_run(tmp_path, sig: int, *extra: str, before_signal=None) -> tuple[subprocess.Popen, str]:
    """A long `fedal simulate` sent `sig` once its progress bar has counted a round; (process, stderr).
    before_signal(process): called just before the signal is sent."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([*fedal_command(), "simulate", "--dataset", "digits", "--clients", "2", "--rounds", "100000",
                             "--strategy", "fedmd", "--public-size", "60", "--out", "r.json", *extra],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    err: list[str] = []
    started = threading.Event()

    def read() -> None:
        while chunk := proc.stderr.read(1):
            err.append(chunk)
            if re.search(r"\| [1-9]\d*/100000", "".join(err[-200:])):  # a round done: the run is under way
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(120), "".join(err)
        if before_signal is not None:
            before_signal(proc)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)  # stderr's end (the process is gone), then its pipes are closed
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    time.sleep(0.2)
    return proc, "".join(err)


# SIGINT: Ctrl-C, which click reported as "Aborted!", exit 1 (and what Ray turns any stop into)
def ray_session_of(pid: int, since: float) -> list[Path]:
    """The session directories Ray named after driver `pid` since `since` (not an older driver's
    with a reused PID)."""
    return [d for d in Path(tempfile.gettempdir(), "ray").glob(f"session_*_{pid}") if d.stat().st_mtime >= since - 1]


def still_alive(tree: set[tuple[int, float]]) -> list[str]:
    """Those of `tree` (PID, create time) still running as the same process."""
    import psutil

    alive = []
    for pid, created in tree:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {p.name()}")
    return alive


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_a_simulation_through_its_clean_up(tmp_path, sig):
    proc, text = stopped_run(tmp_path, sig)
    assert proc.returncode == 128 + sig, text
    assert f"stopped by {signal.Signals(sig).name}: no results written" in text and "Traceback" not in text
    assert not (tmp_path / "r.json").exists()


def test_snapshot_directories_of_drivers_no_longer_alive_are_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    from fedal.procs import _where

    here = _where()
    dead = tmp_path / f"{SNAPSHOT_PREFIX}{gone.pid}-{here}-abc"
    alive = tmp_path / f"{SNAPSHOT_PREFIX}{os.getppid()}-{here}-def"  # a live process: its run may be under way
    elsewhere = tmp_path / f"{SNAPSHOT_PREFIX}{gone.pid}-0a1b2c3d-ghi"  # another host's or container's PID
    foreign = tmp_path / f"{SNAPSHOT_PREFIX}notapid-{here}-x"
    huge = tmp_path / f"{SNAPSHOT_PREFIX}{10**30}-{here}-y"
    for d in (dead, alive, elsewhere, foreign, huge):
        d.mkdir()
        (d / "c00.pt").write_bytes(b"snapshot")
    made = snapshot_dir(str(tmp_path))
    assert not dead.exists() and alive.exists() and elsewhere.exists() and foreign.exists() and huge.exists()
    assert os.path.basename(made).startswith(f"{SNAPSHOT_PREFIX}{os.getpid()}-{here}-") and os.path.isdir(made)


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("ray_may_start")
# SIGTERM: the one ray.init takes over for itself; SIGHUP reaches the same clean-up through the
# handler the in-process test above checks (one Ray run less in the suite)
@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_a_ray_simulation_stopped_by_a_signal_leaves_no_ray_process_or_snapshot(tmp_path, sig):
    """SIGTERM (which ray.init takes over for itself): the actors, the local Ray instance it
    started (its dashboard and runtime-env agents too, which Ray leaves behind when a call is cut
    short, and whose command lines Ray rewrites), its session directory and the snapshot directory
    all end with the run; a process that merely names the session directory, which the toolkit did
    not start (a `tail -F` of its logs), is left alone."""
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("ray")
    seen: dict[str, object] = {}
    started_at = time.time()

    def before_signal(proc: subprocess.Popen) -> None:
        tree = psutil.Process(proc.pid).children(recursive=True)
        seen["tree"] = {(p.pid, p.create_time()) for p in tree}
        seen["names"] = sorted({p.name() for p in tree})
        sessions = ray_session_of(proc.pid, started_at)
        assert len(sessions) == 1, sessions
        seen["session"] = sessions[0]
        seen["bystander"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)",
                                              str(sessions[0] / "logs" / "raylet.out")])

    proc, text = stopped_run(tmp_path, sig, "--backend", "ray", before_signal=before_signal)
    bystander = seen["bystander"]
    try:
        assert proc.returncode == 128 + sig, text
        assert f"stopped by {signal.Signals(sig).name}: no results written" in text
        assert len(seen["tree"]) >= 4, seen["names"]  # gcs, raylet, their agents, the actors
        deadline = time.monotonic() + 15
        while still_alive(seen["tree"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert still_alive(seen["tree"]) == []
        assert bystander.poll() is None  # not the toolkit's: alive
        assert not seen["session"].exists()
        assert not list(Path(tempfile.gettempdir()).glob(f"{SNAPSHOT_PREFIX}{proc.pid}-*"))
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("ray_may_start")
def test_a_ray_driver_killed_outright_leaves_no_ray_process_behind(tmp_path):
    """SIGKILL of the driver: Ray ends its GCS server and raylet with it, but not the raylet's
    dashboard and runtime-env agents, which lived on for a minute or more; the reaper the driver
    started (fedal/sim/ray_reaper.py) ends them and removes the session directory."""
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("ray")
    seen: dict[str, object] = {}
    started_at = time.time()

    def before_signal(proc: subprocess.Popen) -> None:
        seen["tree"] = {(p.pid, p.create_time()) for p in psutil.Process(proc.pid).children(recursive=True)}
        seen["session"] = ray_session_of(proc.pid, started_at)[0]

    proc, text = stopped_run(tmp_path, signal.SIGKILL, "--backend", "ray", before_signal=before_signal)
    assert proc.returncode == -signal.SIGKILL, text

    deadline = time.monotonic() + 20  # the reaper notices within a second, then gives them 5 s
    while (still_alive(seen["tree"]) or seen["session"].exists()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert still_alive(seen["tree"]) == [] and not seen["session"].exists()


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("ray_may_start")
def test_the_local_ray_instance_is_always_a_new_one(tmp_path):
    """Without --ray-address a run starts its own instance, even where RAY_ADDRESS names a
    cluster (ray.init would join it, and the run's clean-up would then end that cluster's
    processes): here it names an address where nothing listens, which joining would fail on."""
    pytest.importorskip("ray")
    from fedal.ports import free_port

    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    r = subprocess.run([*fedal_command(), "simulate", "--dataset", "digits", "--clients", "2", "--rounds", "1",
                        "--strategy", "fedmd", "--public-size", "60", "--backend", "ray", "--quiet", "--out", "r.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=200, env=env)
    assert r.returncode == 0, r.stderr


def test_a_stop_that_a_library_hands_back_as_a_bare_keyboard_interrupt_keeps_its_signal(monkeypatch, tmp_path):
    """Ray runs Python's signal handlers inside its waits and turns the Stopped they raise into a
    plain KeyboardInterrupt: SIGTERM then ended a Ray run as "Aborted!", exit 1."""
    from click.testing import CliRunner

    import fedal.sim.runner as runner
    from fedal import procs
    from fedal_cli.main import cli

    def like_ray(*_args, **_kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except procs.Stopped:
            raise KeyboardInterrupt() from None
        raise AssertionError("the stop handler did not run")

    monkeypatch.setattr(runner, "simulate", like_ray)
    r = CliRunner().invoke(cli, ["simulate", "--quiet", "--out", str(tmp_path / "r.json")])
    assert r.exit_code == 128 + signal.SIGTERM, r.output
    assert "stopped by SIGTERM: no results written" in r.output and "Aborted" not in r.output
