"""`fedal simulate`: build data, models and strategy halves from a RunConfig, then drive them
with the one round engine over the in-process transport (simulated clock, optional faults)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedal.data import build_federated
from fedal.engine.inprocess import Faults, in_process_engine
from fedal.engine.results import build_results, final_summary
from fedal.models import build_model
from fedal.sim.config import ConfigError, RunConfig
from fedal.sim.fairness import fairness_summary, standalone_config
from fedal.strategies import ServerContext, get_strategy
from fedal.strategies.global_model import fedavg_style_metrics, global_accuracy

ProgressFn = Callable[[int, dict[str, Any]], None]


def client_ids(n: int) -> list[str]:
    width = max(2, len(str(n - 1)))
    return [f"c{i:0{width}d}" for i in range(n)]


def client_seed(run_seed: int, index: int) -> int:
    return run_seed * 100_003 + index + 1


def build_run(config: RunConfig):
    """Data, client halves and server half for `config` (already resolved)."""
    spec = get_strategy(config.strategy)
    params = config.strategy_params
    data = build_federated(
        config.dataset,
        num_clients=config.clients,
        partition=config.partition,
        alpha=config.alpha,
        samples_per_client=config.samples_per_client,
        public_size=config.public_size,
        seed=config.seed,
        data_dir=config.data_dir,
        local_test_fraction=config.local_test_fraction,
        shift_c=config.shift_c,
        **config.dataset_options(),
    )
    ids = client_ids(config.clients)
    clients = {}
    widths: dict[str, int] = {}  # per model its feature width (FedProto needs one)
    for i, cid in enumerate(ids):
        models = config.resolved_models()
        name = models[i % len(models)]
        torch.manual_seed(client_seed(config.seed, i))
        model = build_model(name, data.input_shape, data.num_classes)
        widths[name] = model.feature_dim
        public = data.public_x if spec.uses_public_set else None
        clients[cid] = spec.client(cid, model, data.clients[i], public, params, seed=client_seed(config.seed, i))
    if spec.same_feature_dim and len(set(widths.values())) > 1:
        raise ConfigError(f"strategy {config.strategy!r} needs one feature width on every client; the models' are "
                          f"{widths}: choose models of one width (--models)")
    context = ServerContext(num_classes=data.num_classes, public_size=len(data.public_x), seed=config.seed,
                            public_x=data.public_x)
    server = spec.server(params, ids, context)
    return data, clients, server


def simulated_engine(config: RunConfig, data, clients: dict, server):
    """The round engine over in-process sessions of `clients`, evaluating as a deployment does."""
    spec = get_strategy(config.strategy)
    tests = {cid: (data.test, data.client_tests[i] if len(data.client_tests[i]) else None)
             for i, cid in enumerate(clients)}

    def global_metrics(summary: dict[str, Any]) -> dict[str, Any]:
        if not spec.global_model:
            return {}
        acc = global_accuracy(server, config.resolved_models()[0], data.num_classes, data.test.x, data.test.y)
        return fedavg_style_metrics(summary, acc)

    faults = Faults(config.dropout, config.stragglers, config.straggle_every, seed=config.seed)
    return in_process_engine(server, clients, phase_kinds=spec.phases, rounds=config.rounds,
                             eval_every=config.eval_every, tests=tests, faults=faults, global_metrics=global_metrics,
                             vectorize=config.vectorize)


def simulate(config: RunConfig, progress: ProgressFn | None = None) -> dict[str, Any]:
    config = config.resolved()
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    data, clients, server = build_run(config)
    engine = simulated_engine(config, data, clients, server)

    rounds = []
    for r in range(config.rounds):
        entry = engine.run_round(r)
        rounds.append(entry)
        if progress:
            progress(r + 1, entry)

    final = final_summary(rounds)
    if get_strategy(config.strategy).fairness:  # CF needs a standalone run of the same clients
        final.update(standalone_fairness(config, final))
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
    clients_info = [{"id": cid, "model": models[i % len(models)]} for i, cid in enumerate(clients)]
    faults = engine.transport
    deployment = None
    if config.dropout or config.stragglers:
        deployment = {"faults": {"dropped_tasks": faults.dropped, "late_results": faults.late,
                                 "stragglers": sorted(faults.stragglers)},
                      "counters": dict(engine.counters)}
    return build_results(config.model_dump(mode="json"), data_info, clients_info, rounds, final,
                         time.perf_counter() - started, deployment=deployment)


def standalone_fairness(config: RunConfig, final: dict[str, Any]) -> dict[str, Any]:
    """Train the standalone baseline (the same clients, no collaboration) in this process and
    report collaborative fairness for the federated `final`."""
    return fairness_summary(final, simulate(standalone_config(config))["final"])
