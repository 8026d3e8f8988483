"""`fedal simulate --checkpoint FILE`: a simulation's whole state after its last completed round,
in one file, so that a run stopped midway (Ctrl-C, a crash, a job's time limit, a lost machine)
goes on from there with `--resume` to the numbers an uninterrupted run gives.

The file holds the server half's state, every client's (model, optimizer, generators) and its
session's, the round engine's (task numbering, what it knows of each client, its counts), the
simulated transport's (clock, fault draws, a straggler's result still due) and the rounds'
records. Tensors and plain data only, read back with torch.load(weights_only=True): a tampered
file cannot run code. It is written atomically, readable by its owner only (the clients' states
derive from their private data), and only over a file this run wrote (or resumed from).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from fedal.atomic import TEMPORARY_NAME, torch_save_atomic
from fedal.engine.inprocess import ClientStatesUnavailable, SimulatedTransport
from fedal.engine.rounds import RoundEngine
from fedal.engine.saved import engine_saved, restore_engine
from fedal.sim.config import ConfigError, RunConfig

log = logging.getLogger("fedal.sim.checkpoint")

FORMAT = "fedal-simulate-checkpoint"
VERSION = 1
# what a resumed run may change: how many rounds it runs, and where and how it computes them
MAY_DIFFER = ("rounds", "backend", "ray_address", "ray_actors", "client_resources", "threads", "vectorize")
CONTENT = {"config": dict, "public_hash": str, "completed_rounds": int, "rounds": str, "elapsed_s": float,
           "engine": dict, "transport": dict, "server": dict, "clients": dict, "torch_rng": torch.Tensor}


class CheckpointError(ConfigError):
    """A checkpoint path this run cannot use (one line saying why)."""


def read(path: str | Path, mmap: bool = False) -> dict[str, Any] | None:
    """The checkpoint's content; None for a file that is not one `fedal simulate` wrote. `mmap`:
    its tensors mapped, not read (a look at what it is costs little). A file that cannot be
    read at all is a CheckpointError: nobody can tell whose it is."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception:  # noqa: BLE001  # any other file: torch raises a variety of errors for it
        return None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return None
    return state


def completed_rounds(path: str | Path) -> int | None:
    """Rounds the checkpoint at `path` holds; None if it is no checkpoint (or none is there)."""
    if not os.path.isfile(path):
        return None
    state = read(path, mmap=True)
    done = None if state is None else state.get("completed_rounds")
    return done if type(done) is int else None


def _foreign(path: str | Path) -> CheckpointError:
    if _damaged_checkpoint(path):
        return CheckpointError(f"{path} is a damaged checkpoint of `fedal simulate` (cut short or changed): it cannot "
                               "be resumed, and is left as it is; remove it to start afresh, or give another path")
    return CheckpointError(f"{path} exists and is no checkpoint of `fedal simulate`: it is never overwritten; "
                           "give another path")


def _damaged_checkpoint(path: str | Path) -> bool:
    """A file torch cannot load that begins as one of these checkpoints does: torch's archive,
    whose first member (the pickled dict, written first) names FORMAT."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
    except OSError:
        return False
    return head.startswith(b"PK\x03\x04") and FORMAT.encode() in head


def check_path(path: str | Path, resume: bool) -> None:
    """Refuse a checkpoint path this run must not write: a folder, a file that is no checkpoint
    (never overwritten), a checkpoint without `resume` (its rounds would be lost: resume it, or
    remove it to start afresh)."""
    target = Path(path)
    if target.is_dir():
        raise CheckpointError(f"{path} is a directory")
    if not target.exists():
        return
    state = read(target, mmap=True)
    if state is None:
        raise _foreign(path)
    if not resume:
        done = state.get("completed_rounds")
        raise CheckpointError(f"{path} holds a run's checkpoint ({done if type(done) is int else '?'} round(s) done): "
                              "add --resume to go on from there, or remove it to start afresh")


class CheckpointFile:
    """The checkpoint of one run at `path`, held by that run alone: a lock beside it
    (`.NAME.lock`, flock) refuses a second run given the same path while the first runs. It is
    written only over the file this run last wrote or resumed from: a file put there meanwhile
    (a user's copy, another tool's) is left alone and this run writes no more checkpoints, saying
    so; one removed meanwhile is written again. Temporary files of a write to it that a kill cut
    short are removed (the lock says no run is writing)."""

    def __init__(self, path: str | Path, resume: bool):
        self._lock = -1
        self.path = Path(path)
        self.resume = resume
        check_path(self.path, resume)
        self._lock = self._take_lock()
        self._ours = self._identity()  # the file there now is ours to replace: none, or the one resumed
        self.stopped = False
        self.used = False  # by a run: a second run of the same object would replace its checkpoint
        self._remove_torn_writes()

    def _take_lock(self) -> int:
        lock = self.path.with_name(f".{self.path.name}.lock")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)  # as --out's folders are made
            fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as exc:  # a name too long for the lock's ".NAME.lock", a folder it may not write
            raise CheckpointError(f"{self.path}: cannot make its lock file {lock.name} there: "
                                  f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(f"{self.path} is in use by another run (it holds {lock.name}): give this run "
                                  "another --checkpoint") from None
        return fd

    def close(self) -> None:
        """Let go of the path (another run may take it); a checkpoint there stays, with its lock
        file (where none is, the lock file goes too: nothing of the run is left)."""
        fd, self._lock = self._lock, -1
        if fd < 0:
            return
        if self._identity() is None:
            with contextlib.suppress(FileNotFoundError):  # ours, made by _take_lock, which this run holds
                self.path.with_name(f".{self.path.name}.lock").unlink()
        os.close(fd)

    def __del__(self) -> None:
        self.close()

    def _identity(self) -> tuple[int, int, int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def load(self, config: RunConfig, public_hash: str) -> dict[str, Any] | None:
        """The checkpoint to resume from (None: there is none, the run starts afresh), checked
        against the run that resumes it (`check_resumable`)."""
        if not self.resume or self._ours is None:
            return None
        state = read(self.path)
        if state is None:
            raise _foreign(self.path)
        check_resumable(self.path, state, config, public_hash)
        return state

    def save(self, config: RunConfig, public_hash: str, engine: RoundEngine, rounds: list[dict[str, Any]],
             elapsed_s: float) -> bool:
        """The run after `len(rounds)` rounds, replacing the previous checkpoint atomically; False
        (with a warning) when it could not be written: the run goes on, a later round tries again."""
        if self.stopped:
            return False
        now = self._identity()
        if now is None and self._ours is not None:
            log.warning("%s was removed during the run: written again", self.path)
        elif now != self._ours:
            self.stopped = True
            log.warning("%s was replaced by another file during the run: left as it is, and this run writes no more "
                        "checkpoints", self.path)
            return False
        try:
            save(self.path, config, public_hash, engine, rounds, elapsed_s)
        except (OSError, ClientStatesUnavailable) as exc:  # a full disk; on Ray, an actor lost twice
            log.warning("no checkpoint after round %d (%s): the run goes on, a later round tries again", len(rounds), exc)
            return False
        finally:  # (a stop signal, too, may come just after the file was put in place: it is this run's,
            try:  # written atomically, so the file there is the old one or the new)
                self._ours = self._identity()
            except BaseException:  # the stop signal came right here: only the first raises, so once more
                self._ours = self._identity()
                raise
        return True

    def remove(self) -> bool:
        """Remove the checkpoint once the run's results are safe, if the file there is still the
        one this run last wrote or resumed from (never another's), and let go of the path;
        whether the checkpoint went."""
        gone = not self.stopped and self._ours is not None and self._identity() == self._ours
        if gone:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._ours = None
        self.close()
        return gone

    def resumable(self) -> int | None:
        """The rounds a --resume would go on from, if the file there is this run's checkpoint."""
        if self.stopped or self._ours is None or self._identity() != self._ours:
            return None
        return completed_rounds(self.path)

    def _remove_torn_writes(self) -> None:
        """`.NAME.<random>.tmp` beside the checkpoint (fedal.atomic.TEMPORARY_NAME), the temporary
        file of an atomic write to it that a kill cut short (under the lock no run is writing one):
        of this owner, readable by it alone."""
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.path.parent):
                torn = TEMPORARY_NAME.match(entry.name)
                if torn and torn["name"] == self.path.name and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o600:
                        os.unlink(entry.path)


def save(path: str | Path, config: RunConfig, public_hash: str, engine: RoundEngine, rounds: list[dict[str, Any]],
         elapsed_s: float) -> None:
    """The run after `len(rounds)` rounds, atomically, at `path`. OSError: it could not be
    written (torch's writer reports a full disk as a RuntimeError, given on as one)."""
    transport = _simulated(engine)
    clients = transport.client_states()  # first: on Ray it may count an actor lost meanwhile
    state = {
        "format": FORMAT, "version": VERSION,
        "config": config.model_dump(mode="json"), "public_hash": public_hash,
        "completed_rounds": len(rounds), "rounds": json.dumps(rounds), "elapsed_s": float(elapsed_s),
        "engine": engine_saved(engine),
        "transport": transport.saved(),
        "server": engine.server.state_dict(),
        "clients": clients,
        "torch_rng": torch.get_rng_state(),
    }
    try:
        torch_save_atomic(state, path, private=True)
    except RuntimeError as exc:
        raise OSError(f"writing {path} failed: {exc}") from exc


def check_resumable(path: str | Path, state: dict[str, Any], config: RunConfig, public_hash: str) -> None:
    """A checkpoint's content, checked against the run that resumes it: whole, the same config
    (but MAY_DIFFER), at most as many rounds done as it runs, the same evaluation schedule for
    the rounds done, the same public set."""
    wrong = [k for k, kind in CONTENT.items() if not isinstance(state.get(k), kind)]
    if state.get("version") != VERSION or wrong:
        raise CheckpointError(f"{path} is damaged or from another version of the toolkit"
                              + (f" (no valid {', '.join(wrong)})" if wrong else f" (format {state.get('version')})"))
    saved, now = _flat(state["config"]), _flat(config.model_dump(mode="json"))
    differ = [k for k in sorted(set(saved) | set(now))
              if k.split(".")[0] not in MAY_DIFFER and saved.get(k) != now.get(k)]
    if differ:
        shown = "; ".join(f"{k} {json.dumps(saved.get(k))} there, {json.dumps(now.get(k))} here" for k in differ[:4])
        hint = (" (a run whose noise is calibrated to a target epsilon plans it for its rounds: they cannot change)"
                if any("planned_rounds" in k for k in differ) else "")
        raise CheckpointError(f"{path} is a checkpoint of another run ({shown}): resume it with its own config "
                              f"(only {', '.join(MAY_DIFFER)} may change){hint}")
    done, before = state["completed_rounds"], int(state["config"].get("rounds", 0))
    if done > config.rounds:
        raise CheckpointError(f"{path} holds {done} completed rounds, more than the {config.rounds} this run asks "
                              "(--rounds)")
    every = config.eval_every  # a run evaluates every k-th round and its last: so were the rounds done
    evaluated = {r for r in range(1, done + 1) if r % every == 0 or r == before}
    if evaluated != {r for r in range(1, done + 1) if r % every == 0 or r == config.rounds}:
        fix = (f"resume it with --rounds {before}" if done < before else
               "its run cannot be made longer; remove the checkpoint to start afresh")
        raise CheckpointError(f"{path}: its {done} round(s) were evaluated as a run of {before} rounds evaluates them "
                              f"(eval_every {every}, and the last), not as a run of {config.rounds}: {fix}")
    if state["public_hash"] != public_hash:
        raise CheckpointError(f"{path} was run on another public set (the dataset's files changed): it cannot be resumed")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A config's fields under dotted names (strategy_params.privacy.planned_rounds)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_flat(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def restore(path: str | Path, engine: RoundEngine, state: dict[str, Any]) -> list[dict[str, Any]]:
    """`engine`, its server half, transport and clients as the checkpoint holds them; returns the
    records of the rounds it completed. A checkpoint whose parts do not fit (damaged, or of
    another version) is a CheckpointError."""
    transport = _simulated(engine)
    try:
        restore_engine(engine, state["engine"])
        transport.restore_saved(state["transport"])
        engine.server.load_state_dict(state["server"])
        transport.load_client_states(state["clients"])
        torch.set_rng_state(state["torch_rng"])
        rounds = json.loads(state["rounds"])
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        raise CheckpointError(f"{path} is damaged or from another version of the toolkit ({type(exc).__name__}: "
                              f"{exc})") from None
    if not (isinstance(rounds, list) and len(rounds) == state["completed_rounds"]):
        raise CheckpointError(f"{path} is damaged: its rounds' records do not match its count")
    return rounds


def _simulated(engine: RoundEngine) -> SimulatedTransport:
    if not isinstance(engine.transport, SimulatedTransport):
        raise TypeError("only a simulation's engine is checkpointed here (the coordinator keeps its own store)")
    return engine.transport
