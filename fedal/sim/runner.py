"""`fedal simulate`: build data, models and strategy halves from a RunConfig, then drive them
with the one round engine over the in-process transport (simulated clock, optional faults)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedal.engine.inprocess import Faults, in_process_engine
from fedal.engine.results import build_results, final_summary
from fedal.sim import checkpoint
from fedal.sim.build import build_run as build_run
from fedal.sim.build import client_ids as client_ids
from fedal.sim.build import client_seed as client_seed
from fedal.sim.build import client_tests
from fedal.sim.checkpoint import CheckpointFile
from fedal.sim.config import RunConfig
from fedal.sim.fairness import fairness_summary, standalone_config
from fedal.strategies import get_strategy
from fedal.strategies.global_model import fedavg_style_metrics, global_accuracy

ProgressFn = Callable[[int, dict[str, Any]], None]
StageFn = Callable[[str], None]


def global_metrics_of(config: RunConfig, data, server) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The aggregated model's accuracy for strategies that keep one, added to each evaluation."""
    spec = get_strategy(config.strategy)

    def global_metrics(summary: dict[str, Any]) -> dict[str, Any]:
        if not spec.global_model:
            return {}
        acc = global_accuracy(server, config.resolved_models()[0], data.num_classes, data.test.x, data.test.y)
        return fedavg_style_metrics(summary, acc)

    return global_metrics


def simulated_engine(config: RunConfig, data, clients: dict, server):
    """The round engine over in-process sessions of `clients`, evaluating as a deployment does."""
    spec = get_strategy(config.strategy)
    tests = {cid: client_tests(data, i) for i, cid in enumerate(clients)}
    faults = Faults(config.dropout, config.stragglers, config.straggle_every, seed=config.seed)
    return in_process_engine(server, clients, phase_kinds=spec.phases, rounds=config.rounds,
                             eval_every=config.eval_every, tests=tests, faults=faults,
                             global_metrics=global_metrics_of(config, data, server), vectorize=config.vectorized)


def simulate(config: RunConfig, progress: ProgressFn | None = None, verbose: bool = False,
             stage: StageFn | None = None, checkpoint: str | Path | CheckpointFile | None = None,
             checkpoint_every: int = 1, resume: bool = False) -> dict[str, Any]:
    """Run `config` to the end and return its results; `verbose`: let the Ray backend's own logs
    through (off: warnings and errors only). `stage(name)` is told when the long parts begin:
    "build" (the data and the clients; a Ray instance), "rounds", and for a strategy scored by
    collaborative fairness "standalone" (its baseline, whose rounds also go to `progress`).

    `checkpoint`: the run's state is written there after every `checkpoint_every`-th round and
    after the last (fedal/sim/checkpoint.py; the caller removes it once the results are safe: a
    CheckpointFile given here, with its `remove()`);
    with `resume`, a checkpoint found there is gone on from (its rounds go to `progress` first),
    to the numbers an uninterrupted run gives. A CF strategy's standalone baseline is not
    checkpointed: a resumed run trains it afresh.

    The run sets torch's thread count to `config.threads` and gives the caller's back at its end:
    a notebook or script calling it keeps its own."""
    threads = torch.get_num_threads()
    try:
        return _simulate(config, progress, verbose, stage, Saving(checkpoint, checkpoint_every, resume))
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class Saving:
    path: str | Path | CheckpointFile | None = None
    every: int = 1
    resume: bool = False

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.every}")

    def due(self, done: int, rounds: int) -> bool:
        return self.path is not None and (done % self.every == 0 or done == rounds)


def _simulate(config: RunConfig, progress: ProgressFn | None, verbose: bool, stage: StageFn | None,
              saving: Saving) -> dict[str, Any]:
    saved_to = saving.path if isinstance(saving.path, CheckpointFile) or saving.path is None else \
        CheckpointFile(saving.path, saving.resume)
    if isinstance(saving.path, CheckpointFile):  # the caller's: it removes or closes it
        if saving.path.used:
            raise ValueError("a CheckpointFile serves one run: make another for the next")
        if saving.resume and not saving.path.resume:
            raise ValueError("resume=True, but the CheckpointFile was made with resume=False")
        saving.path.used = True
    try:
        return _run(config, progress, verbose, stage, saving, saved_to)
    finally:
        if saved_to is not None and saved_to is not saving.path:  # made here: the path is let go, the file stays
            saved_to.close()


def _run(config: RunConfig, progress: ProgressFn | None, verbose: bool, stage: StageFn | None, saving: Saving,
         saved_to: CheckpointFile | None) -> dict[str, Any]:
    stage = stage or (lambda _name: None)
    stage("build")
    config = config.resolved()
    config = config.model_copy(update={"vectorize": config.vectorized})  # the results say which path ran
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    backend: dict[str, Any] | None = None
    if config.backend == "ray":
        from fedal.sim.ray_backend import ray_run

        data, server, engine, close = ray_run(config, global_metrics_of, verbose=verbose)
        client_names = list(server.client_ids)
    else:
        data, clients, server = build_run(config)
        engine = simulated_engine(config, data, clients, server)
        client_names = list(clients)
        close = None
    finished = False
    resumed_from = None
    before_s = 0.0
    try:
        rounds: list[dict[str, Any]] = []
        saved = saved_to.load(config, data.public_hash) if saved_to is not None else None
        if saved_to is not None and saved is not None:
            rounds, before_s = checkpoint.restore(saved_to.path, engine, saved), float(saved["elapsed_s"])
            resumed_from = len(rounds)
        stage("rounds")
        for done, entry in enumerate(rounds, 1):  # the bar starts where the run stood
            if progress:
                progress(done, entry)
        for r in range(len(rounds), config.rounds):
            entry = engine.run_round(r)
            rounds.append(entry)
            if saved_to is not None and saving.due(r + 1, config.rounds):
                saved_to.save(config, data.public_hash, engine, rounds, before_s + time.perf_counter() - started)
            if progress:
                progress(r + 1, entry)
        finished = True
    finally:
        if close is not None:
            backend = close(finished)

    final = final_summary(rounds)
    if get_strategy(config.strategy).fairness:  # CF needs a standalone run of the same clients
        stage("standalone")
        final.update(standalone_fairness(config, final, progress))
    data_info = {
        "public_hash": data.public_hash,
        "public_size": int(len(data.public_x)),
        "test_size": int(len(data.test)),
        "client_sizes": [int(len(c)) for c in data.clients],
        "local_test_sizes": [int(len(t)) for t in data.client_tests],
        "label_histogram": np.asarray(data.partition_stats).astype(int).tolist(),
    }
    if config.partition == "identity":  # how many celebrities each client's share holds
        data_info["client_identities"] = [int(len(np.unique(c.groups))) for c in data.clients]
    models = config.resolved_models()
    clients_info = [{"id": cid, "model": models[i % len(models)]} for i, cid in enumerate(client_names)]
    faults = engine.transport
    deployment = None
    if config.dropout or config.stragglers:
        deployment = {"faults": {"dropped_tasks": faults.dropped, "late_results": faults.late,
                                 "stragglers": sorted(faults.stragglers)},
                      "counters": dict(engine.counters)}
    results = build_results(config.model_dump(mode="json"), data_info, clients_info, rounds, final,
                            before_s + time.perf_counter() - started, deployment=deployment)
    if resumed_from is not None:
        results["resumed_from_round"] = resumed_from
    if backend is not None:
        results["backend"] = backend
    elif engine.transport.counters.get("refused_tasks"):  # Ray's are in its backend counts
        results["refused_tasks"] = engine.transport.counters["refused_tasks"]
    if config.vectorize:  # which tasks ran stacked, and why the others did not
        results["vectorized"] = engine.transport.stacking.summary()
    return results


def standalone_fairness(config: RunConfig, final: dict[str, Any], progress: ProgressFn | None = None) -> dict[str, Any]:
    """Train the standalone baseline (the same clients, no collaboration) in this process and
    report collaborative fairness for the federated `final`; its rounds go to `progress`."""
    baseline = standalone_config(config).model_copy(update={"backend": "inprocess"})
    return fairness_summary(final, simulate(baseline, progress)["final"])
