"""`fedal simulate --checkpoint FILE --resume`: a run stopped midway goes on from its last
completed round to the numbers an uninterrupted run gives, for every strategy, per client and
vectorized, with faults; the file is the toolkit's alone to write, never a user's file, and it
is read back without running code."""

from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import subprocess
import sys
import time

import pytest

from fedal.sim import load_config, simulate
from fedal.sim.checkpoint import CheckpointError, CheckpointFile, completed_rounds
from fedal.strategies import STRATEGY_NAMES
from tests.helpers import fedal_command, without_timings

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Stop(Exception):
    """Stands for Ctrl-C, a crash or a job's time limit after some rounds."""


def stop_after(rounds: int):
    def progress(done: int, _entry: dict) -> None:
        if done == rounds:
            raise Stop
    return progress


def _config(strategy: str = "fedal", **extra):
    base = dict(strategy=strategy, dataset="mnist1d", clients=4, samples_per_client=100, public_size=100,
                mnist1d_samples=1000, rounds=4, seed=3, dropout=0.2, stragglers=0.3, vectorize=False)
    if strategy != "fedakd":  # (FedAKD's own preset)
        base["strategy_params"] = {"tau": 2}
    return load_config(None, {**base, **extra})


def _same(a: dict, b: dict) -> None:
    a, b = without_timings(a), without_timings(b)
    assert a["rounds"] == b["rounds"]
    assert a["final"] == b["final"] and a.get("deployment") == b.get("deployment")
    assert a.get("vectorized") == b.get("vectorized") and a["clients"] == b["clients"]


def _stopped_and_resumed(config, path, after: int = 2, resumed=None) -> dict:
    with pytest.raises(Stop):
        simulate(config, stop_after(after), checkpoint=path)
    assert completed_rounds(path) == after
    return simulate(resumed or config, checkpoint=path, resume=True)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_a_resumed_run_gives_the_numbers_of_one_never_stopped(strategy, tmp_path):
    config = _config(strategy)
    resumed = _stopped_and_resumed(config, tmp_path / "run.ckpt")
    assert resumed["resumed_from_round"] == 2
    _same(simulate(config), resumed)


@pytest.mark.parametrize("strategy", ["fedal", "fedmd"])
def test_a_resumed_vectorized_run_too(strategy, tmp_path):
    config = _config(strategy, vectorize=True, clients=6, models=["mlp", "cnn1d"])
    resumed = _stopped_and_resumed(config, tmp_path / "run.ckpt", after=1)
    assert resumed["vectorized"]["stacked_tasks"] > 0
    _same(simulate(config), resumed)


def test_a_finished_run_goes_on_for_more_rounds(tmp_path):
    """Only the rounds (and where it computes) may change on --resume: a run of 2 rounds, resumed
    with 4, is the run of 4 rounds."""
    path = tmp_path / "run.ckpt"
    first = simulate(_config(rounds=2), checkpoint=path)
    assert completed_rounds(path) == 2
    again = simulate(_config(rounds=2), checkpoint=path, resume=True)  # its results again, no round run
    assert again["resumed_from_round"] == 2 and without_timings(again["rounds"]) == without_timings(first["rounds"])
    _same(simulate(_config(rounds=4)), simulate(_config(rounds=4), checkpoint=path, resume=True))


def test_checkpoints_every_k_rounds_and_after_the_last(tmp_path):
    path = tmp_path / "run.ckpt"
    seen = []
    simulate(_config(rounds=5), lambda done, _e: seen.append(completed_rounds(path)), checkpoint=path, checkpoint_every=2)
    assert seen == [None, 2, 2, 4, 5]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the clients' states derive from their private data


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    with pytest.raises(Stop):
        simulate(_config(), stop_after(2), checkpoint=path)
    with pytest.raises(CheckpointError, match=r"another run \(alpha 1\.0 there, 2\.0 here\)"):
        simulate(_config(alpha=2.0), checkpoint=path, resume=True)
    with pytest.raises(CheckpointError, match="more than the 1 this run asks"):
        simulate(_config(rounds=1), checkpoint=path, resume=True)
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    for resume in (True, False):
        with pytest.raises(CheckpointError, match="no checkpoint of `fedal simulate`: it is never overwritten"):
            simulate(_config(), checkpoint=other, resume=resume)
    with pytest.raises(CheckpointError, match="add --resume"):  # its rounds are not thrown away unasked
        simulate(_config(), checkpoint=path)
    assert other.read_text() == "mine" and completed_rounds(path) == 2
    # cut short (a full disk, a copy that stopped): said to be a damaged one, not another's file
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = cut.read_bytes()
    for resume in (True, False):
        with pytest.raises(CheckpointError, match="is a damaged checkpoint of `fedal simulate`.*left as it is"):
            simulate(_config(), checkpoint=cut, resume=resume)
    assert cut.read_bytes() == before


def test_the_evaluation_schedule_of_the_rounds_done_must_hold(tmp_path):
    """With eval_every > 1 a run evaluates every k-th round and its last: a changed --rounds
    would make the rounds done those of another run, so it is refused where it would; where it
    would not, the run is that of the new length."""
    path = tmp_path / "run.ckpt"
    simulate(_config(rounds=3, eval_every=2), checkpoint=path)  # round 3 evaluated as the last
    with pytest.raises(CheckpointError, match="its run cannot be made longer"):
        simulate(_config(rounds=5, eval_every=2), checkpoint=path, resume=True)
    path.unlink()
    with pytest.raises(Stop):
        simulate(_config(rounds=5, eval_every=2), stop_after(3), checkpoint=path)
    with pytest.raises(CheckpointError, match="resume it with --rounds 5"):  # round 3 would go unevaluated
        simulate(_config(rounds=3, eval_every=2), checkpoint=path, resume=True)
    path.unlink()
    with pytest.raises(Stop):
        simulate(_config(rounds=5, eval_every=2), stop_after(2), checkpoint=path)
    _same(simulate(_config(rounds=6, eval_every=2)), simulate(_config(rounds=6, eval_every=2), checkpoint=path, resume=True))


def _tampered(path, change):
    import torch

    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


def test_a_damaged_checkpoint_is_refused_with_a_reason(tmp_path):
    path = tmp_path / "run.ckpt"
    with pytest.raises(Stop):
        simulate(_config(), stop_after(2), checkpoint=path)
    good = path.read_bytes()
    for change, says in ((lambda s: s.pop("completed_rounds"), "no valid completed_rounds"),
                         (lambda s: s.update(completed_rounds="2"), "no valid completed_rounds"),
                         (lambda s: s["engine"].pop("seq"), "KeyError"),
                         (lambda s: s.update(rounds="[{"), "damaged"),
                         (lambda s: s["clients"]["c00"]["client"]["model"].update(
                             {k: v[:1] for k, v in s["clients"]["c00"]["client"]["model"].items()}), "damaged")):
        path.write_bytes(good)
        _tampered(path, change)
        with pytest.raises(CheckpointError, match=says):
            simulate(_config(), checkpoint=path, resume=True)


def test_a_checkpoint_path_serves_one_run_at_a_time(tmp_path):
    """The same --checkpoint given to two runs: the second is refused while the first holds it."""
    path = tmp_path / "run.ckpt"
    first = CheckpointFile(path, resume=False)
    with pytest.raises(CheckpointError, match="in use by another run"):
        simulate(_config(rounds=1), checkpoint=path)
    simulate(_config(rounds=1), checkpoint=first)
    with pytest.raises(ValueError, match="serves one run"):  # its checkpoint would be replaced unasked
        simulate(_config(rounds=1), checkpoint=first)
    assert first.remove() and sorted(p.name for p in tmp_path.iterdir()) == []  # the lock file went too
    simulate(_config(rounds=1), checkpoint=path)  # the path is free again; the API leaves the checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == [".run.ckpt.lock", "run.ckpt"]


def test_a_file_put_where_the_checkpoint_was_is_left_alone(tmp_path, caplog):
    """A file put over the checkpoint during the run (a user's copy, another tool's) is not this
    run's to replace or remove: it writes no more checkpoints and says so. One removed is
    written again."""
    from fedal.atomic import torch_save_atomic

    path = tmp_path / "run.ckpt"

    def meanwhile(done, _entry):
        if done == 1:
            torch_save_atomic({"format": "fedal-simulate-checkpoint", "completed_rounds": 1, "mine": True}, path)
    saved_to = CheckpointFile(path, resume=False)
    with caplog.at_level("WARNING", logger="fedal.sim.checkpoint"):
        simulate(_config(), meanwhile, checkpoint=saved_to)
    assert "was replaced by another file" in caplog.text
    assert not saved_to.remove()  # once the results are safe (fedal simulate): only its own file goes
    assert __import__("torch").load(path, weights_only=True)["mine"] is True

    removed = tmp_path / "removed.ckpt"
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedal.sim.checkpoint"):
        simulate(_config(), lambda done, _e: removed.unlink() if done == 2 else None, checkpoint=removed)
    assert "was removed during the run: written again" in caplog.text and completed_rounds(removed) == 4


def test_torn_writes_of_a_killed_run_are_removed_and_nothing_else(tmp_path):
    path = tmp_path / "run.ckpt"
    torn, other, foreign = (tmp_path / ".run.ckpt.k2x9_a0b.tmp", tmp_path / ".run.ckpt.notes",
                            tmp_path / ".run.ckpt.abcdefgh.tmp")
    for f in (torn, other, foreign):
        f.write_bytes(b"x")
    torn.chmod(0o600)
    foreign.chmod(0o644)  # not what an atomic write of a checkpoint leaves
    simulate(_config(rounds=1), checkpoint=path)
    assert not torn.exists() and other.exists() and foreign.exists()


def test_the_fault_draws_kept_are_those_of_the_phase_under_way(tmp_path):
    """Closed phases' tasks are never sent again: their drop and straggle marks are let go, so
    a long run's memory and each checkpoint stay the size of one phase."""
    import torch

    path = tmp_path / "run.ckpt"
    simulate(_config(rounds=4), checkpoint=path)
    transport = torch.load(path, weights_only=True)["transport"]
    assert 0 < len(transport["dropped"]) <= 4 and len({tuple(k[1:3]) for k in transport["dropped"]}) == 1


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_tampered_checkpoint_runs_no_code(tmp_path):
    """The file is read with torch.load(weights_only=True): a pickle that would open (create) a
    file when loaded is no checkpoint, and nothing of it runs."""
    import torch

    marker = tmp_path / "ran"
    path = tmp_path / "run.ckpt"
    torch.save({"format": "fedal-simulate-checkpoint", "completed_rounds": 1, "x": _Payload(str(marker))}, path)
    assert completed_rounds(path) is None and not marker.exists()
    with pytest.raises(CheckpointError, match="is a damaged checkpoint of `fedal simulate`"):
        simulate(_config(), checkpoint=path, resume=True)
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(_Payload(str(marker)))) and marker.exists()  # (the payload is live)


def _cli(*args, cwd, **kw):
    return subprocess.Popen([*fedal_command(), "simulate", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


RUN = ["--clients", "4", "--samples-per-client", "100", "--public-size", "100", "--mnist1d-samples", "1000",
       "--rounds", "5", "--seed", "3", "--dropout", "0.2", "--quiet"]


def test_a_killed_simulate_goes_on_with_resume(tmp_path):
    """Real processes: one killed outright (SIGKILL, no clean-up) after its second round's
    checkpoint, then `--resume`: the results of a run never stopped, and the checkpoint is
    removed once they are written."""
    ckpt = tmp_path / "run.ckpt"
    killed = _cli(*RUN, "--out", "r.json", "--checkpoint", str(ckpt), "--tau", "40", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while (completed_rounds(ckpt) or 0) < 2 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert completed_rounds(ckpt) in (2, 3, 4) and not (tmp_path / "r.json").exists()

    again = _cli(*RUN, "--out", "r.json", "--checkpoint", str(ckpt), "--tau", "40", cwd=tmp_path)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 2 and "add --resume" in err  # its rounds are not thrown away unasked
    resumed = _cli(*RUN, "--out", "r.json", "--checkpoint", str(ckpt), "--tau", "40", "--resume", cwd=tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert not ckpt.exists() and not (tmp_path / ".run.ckpt.lock").exists()  # nothing of it is left
    done = json.loads((tmp_path / "r.json").read_text())
    assert done["resumed_from_round"] >= 2
    reference = _cli(*RUN, "--out", "ref.json", "--tau", "40", cwd=tmp_path)
    reference.communicate(timeout=300)
    _same(json.loads((tmp_path / "ref.json").read_text()), done)


def test_simulate_refuses_checkpoint_paths_it_must_not_write(tmp_path):
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"a user's file")
    for extra, says in ((["--checkpoint", str(mine)], "is never overwritten"),
                        (["--checkpoint", str(mine), "--resume"], "no checkpoint of `fedal simulate`"),
                        (["--resume"], "--resume needs --checkpoint FILE"),
                        (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint FILE"),
                        (["--checkpoint", "r.json"], "is also --out"),
                        (["--checkpoint", str(tmp_path)], "is a directory")):
        proc = _cli(*RUN, "--out", "r.json", *extra, cwd=tmp_path)
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and says in err, (extra, err)
    assert mine.read_bytes() == b"a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.pt"]
    # a name whose lock file (".NAME.lock") the file system cannot take: said, not a traceback
    proc = _cli(*RUN, "--out", "r.json", "--checkpoint", "c" * 250, cwd=tmp_path)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "cannot make its lock file" in err and "Traceback" not in err, err


def test_a_checkpoint_in_folders_not_made_yet_gets_them(tmp_path):
    """--out and --plot make their folders; --checkpoint ran into a FileNotFoundError for its lock."""
    saved_to = CheckpointFile(tmp_path / "runs" / "exp1" / "state.ckpt", resume=False)
    try:
        simulate(_config(rounds=1), checkpoint=saved_to)
        assert (tmp_path / "runs" / "exp1" / "state.ckpt").is_file()
    finally:
        saved_to.close()


@pytest.mark.skipif(sys.platform != "linux", reason="the stop test signals a child process")
def test_a_stopped_simulate_says_where_its_rounds_are(tmp_path):
    ckpt = tmp_path / "run.ckpt"
    proc = _cli(*RUN, "--out", "r.json", "--checkpoint", str(ckpt), "--tau", "40", cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert f"are in {ckpt}: add --resume to go on from there" in err


def test_a_stop_signal_while_the_checkpoint_is_named_still_says_where_its_rounds_are(tmp_path, monkeypatch):
    """SIGTERM right as a save noted which file it had written (the first stop signal raises
    there): the run forgot it, and said "no results written" without "add --resume" (seen once
    in CI, where the test below stops a run the moment its checkpoint appears)."""
    from fedal.procs import Stopped
    from fedal.sim import build_run, simulated_engine

    config = _config(rounds=2).resolved()
    data, clients, server = build_run(config)
    engine = simulated_engine(config, data, clients, server)
    ckpt = CheckpointFile(tmp_path / "run.ckpt", resume=False)
    done = [engine.run_round(0)]
    real, calls = CheckpointFile._identity, []

    def signalled_once(self):
        calls.append(1)
        if len(calls) == 2:  # the first look is before the write; the second names what was written
            raise Stopped(signal.SIGTERM)
        return real(self)

    monkeypatch.setattr(CheckpointFile, "_identity", signalled_once)
    with pytest.raises(Stopped):
        ckpt.save(config, data.public_hash, engine, done, 0.0)
    monkeypatch.setattr(CheckpointFile, "_identity", real)
    assert ckpt.resumable() == 1  # what the stopped run says: its first round is there
    ckpt.close()
