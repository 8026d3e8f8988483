"""`fedal simulate --checkpoint FILE`: a simulation's whole state after its last completed round,
in one file, so that a run stopped midway (Ctrl-C, a crash, a job's time limit, a lost machine)
goes on from there with `--resume` to the numbers an uninterrupted run gives.

The file holds the server half's state, every client's (model, optimizer, generators) and its
session's, the round engine's (task numbering, what it knows of each client, its counts), the
simulated transport's (clock, fault draws, a straggler's result still due) and the rounds'
records. Tensors and plain data only, read back with torch.load(weights_only=True): a tampered
file cannot run code. It is written atomically, readable by its owner only (the clients' states
derive from their private data).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fedal.atomic import torch_save_atomic
from fedal.engine.inprocess import SimulatedTransport
from fedal.engine.rounds import RoundEngine
from fedal.engine.saved import engine_saved, restore_engine
from fedal.sim.config import ConfigError, RunConfig

FORMAT = "fedal-simulate-checkpoint"
VERSION = 1
# what a resumed run may change: how many rounds it runs, and where and how it computes them
MAY_DIFFER = ("rounds", "backend", "ray_address", "ray_actors", "client_resources", "threads", "vectorize")


CONTENT = {"config", "public_hash", "completed_rounds", "rounds", "elapsed_s", "engine", "transport", "server", "clients",
           "torch_rng"}


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed with this config (one line saying why)."""


def read(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint's content; None for a file that is not one `fedal simulate` wrote."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001  # any other file: torch raises a variety of errors for it
        return None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return None
    return state


def is_checkpoint(path: str | Path) -> bool:
    return read(path) is not None


def completed_rounds(path: str | Path) -> int | None:
    """Rounds the checkpoint at `path` holds; None if it is no checkpoint."""
    state = read(path)
    return None if state is None else int(state["completed_rounds"])


def check_path(path: str | Path, resume: bool) -> None:
    """Refuse a checkpoint path this run must not write: a folder, a file that is no checkpoint
    (never overwritten), an unfinished run's checkpoint without `resume` (its rounds would be
    lost: resume it, or remove it to start afresh)."""
    target = Path(path)
    if target.is_dir():
        raise CheckpointError(f"{path} is a directory")
    if not target.exists():
        return
    done = completed_rounds(target)
    if done is None:
        raise CheckpointError(f"{path} exists and is no checkpoint of `fedal simulate`: it is never overwritten; "
                              "give another path")
    if not resume:
        raise CheckpointError(f"{path} holds the first {done} round(s) of a run that did not finish: add --resume "
                              "to go on from there, or remove it to start afresh")


def save(path: str | Path, config: RunConfig, public_hash: str, engine: RoundEngine, rounds: list[dict[str, Any]],
         elapsed_s: float) -> None:
    """The run after `len(rounds)` rounds, replacing the previous checkpoint atomically."""
    transport = _simulated(engine)
    state = {
        "format": FORMAT, "version": VERSION,
        "config": config.model_dump(mode="json"), "public_hash": public_hash,
        "completed_rounds": len(rounds), "rounds": json.dumps(rounds), "elapsed_s": float(elapsed_s),
        "engine": engine_saved(engine),
        "transport": transport.saved(),
        "server": engine.server.state_dict(),
        "clients": transport.client_states(),
        "torch_rng": torch.get_rng_state(),
    }
    torch_save_atomic(state, path, private=True)


def load(path: str | Path, config: RunConfig, public_hash: str) -> dict[str, Any]:
    """The checkpoint at `path`, checked against the run that resumes it: the same config (but
    MAY_DIFFER), at most as many rounds done as it runs, the same public set."""
    state = read(path)
    if state is None:
        raise CheckpointError(f"{path} exists and is no checkpoint of `fedal simulate`: it is never overwritten; "
                              "give another path")
    if state.get("version") != VERSION or not CONTENT <= set(state):
        raise CheckpointError(f"{path} is a checkpoint of another version of the toolkit (format {state.get('version')})")
    saved, now = state["config"], config.model_dump(mode="json")
    differ = [k for k in sorted(set(saved) | set(now)) if k not in MAY_DIFFER and saved.get(k) != now.get(k)]
    if differ:
        shown = "; ".join(f"{k} {json.dumps(saved.get(k))} there, {json.dumps(now.get(k))} here" for k in differ[:4])
        raise CheckpointError(f"{path} is a checkpoint of another run ({shown}): resume it with its own config "
                              f"(only {', '.join(MAY_DIFFER)} may change)")
    done = int(state["completed_rounds"])
    if done > config.rounds:
        raise CheckpointError(f"{path} holds {done} completed rounds, more than the {config.rounds} this run asks "
                              "(--rounds)")
    if state["public_hash"] != public_hash:
        raise CheckpointError(f"{path} was run on another public set (the dataset's files changed): it cannot be resumed")
    return state


def restore(engine: RoundEngine, state: dict[str, Any]) -> list[dict[str, Any]]:
    """`engine`, its server half, transport and clients as the checkpoint holds them; returns the
    records of the rounds it completed."""
    transport = _simulated(engine)
    restore_engine(engine, state["engine"])
    transport.restore_saved(state["transport"])
    engine.server.load_state_dict(state["server"])
    transport.load_client_states(state["clients"])
    torch.set_rng_state(state["torch_rng"])
    return list(json.loads(state["rounds"]))


def _simulated(engine: RoundEngine) -> SimulatedTransport:
    if not isinstance(engine.transport, SimulatedTransport):
        raise TypeError("only a simulation's engine is checkpointed here (the coordinator keeps its own store)")
    return engine.transport
