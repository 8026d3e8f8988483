"""`fedal simulate`: build data, models and strategy halves from a RunConfig, run, report."""

from __future__ import annotations

import platform
import time
from typing import Any, Callable

import numpy as np
import torch

from fedal import __version__
from fedal.data import build_federated
from fedal.models import build_model
from fedal.sim.config import RunConfig
from fedal.sim.engine import InProcessEngine
from fedal.sim.fairness import standalone_fairness
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
    )
    ids = client_ids(config.clients)
    clients = {}
    for i, cid in enumerate(ids):
        name = config.models[i % len(config.models)]
        torch.manual_seed(client_seed(config.seed, i))
        model = build_model(name, data.input_shape, data.num_classes)
        public = data.public_x if spec.uses_public_set else None
        clients[cid] = spec.client(cid, model, data.clients[i], public, params, seed=client_seed(config.seed, i))
    context = ServerContext(num_classes=data.num_classes, public_size=len(data.public_x), seed=config.seed)
    server = spec.server(params, ids, context)
    return data, clients, server


def simulate(config: RunConfig, progress: ProgressFn | None = None) -> dict[str, Any]:
    config = config.resolved()
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    data, clients, server = build_run(config)
    engine = InProcessEngine(server, clients)

    rounds = []
    for r in range(config.rounds):
        rec = engine.run_round(r)
        entry: dict[str, Any] = {"round": r + 1, "bytes_up": rec.bytes_up, "bytes_down": rec.bytes_down}
        if (r + 1) % config.eval_every == 0 or r + 1 == config.rounds:
            entry.update(evaluate_run(config, clients, server, data))
        entry["rejected"] = rec.rejected
        entry["server"] = rec.server_metrics
        rounds.append(entry)
        if progress:
            progress(r + 1, entry)

    final = evaluate_run(config, clients, server, data)
    if get_strategy(config.strategy).fairness:  # CF needs a standalone run of the same clients
        final.update(standalone_fairness(config, final))
    return {
        "config": config.model_dump(mode="json"),
        "data": {
            "public_hash": data.public_hash,
            "public_size": int(len(data.public_x)),
            "test_size": int(len(data.test)),
            "client_sizes": [int(len(c)) for c in data.clients],
            "local_test_sizes": [int(len(t)) for t in data.client_tests],
            "label_histogram": np.asarray(data.partition_stats).astype(int).tolist(),
        },
        "clients": [
            {"id": cid, "model": config.models[i % len(config.models)]} for i, cid in enumerate(clients)
        ],
        "rounds": rounds,
        "final": final,
        "environment": {"fedal": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "timings": {"wall_seconds": round(time.perf_counter() - started, 3)},
    }


def evaluate_run(config: RunConfig, clients: dict, server, data) -> dict[str, Any]:
    """evaluate_clients, plus for strategies with a global model (StrategySpec.global_model)
    that model on the common test set (`global_acc`) and `personal_acc`."""
    summary = evaluate_clients(clients, data)
    if get_strategy(config.strategy).global_model:
        acc = global_accuracy(server, config.models[0], data.num_classes, data.test.x, data.test.y)
        summary.update(fedavg_style_metrics(summary, acc))
    return summary


def evaluate_clients(clients: dict, data) -> dict[str, Any]:
    """Every client's accuracy on the common test set and, when it has one, on its own local
    test split (its own distribution: the personalised view)."""
    accs = [c.evaluate(data.test.x, data.test.y) for c in clients.values()]
    local = [c.evaluate(t.x, t.y) if len(t) else None for c, t in zip(clients.values(), data.client_tests)]
    return evaluation_summary(accs, local)


def evaluation_summary(accs: list[float | None], local_accs: list[float | None] | None = None) -> dict[str, Any]:
    """Summaries of the clients' reported accuracies; a client without a number (no test data,
    or no answer) appears as null in the per-client lists and is left out of the statistics."""
    out: dict[str, Any] = {}
    for prefix, values in (("", accs), ("local_", local_accs or [])):
        known = [float(a) for a in values if a is not None]
        if not known:
            continue
        out.update({f"{prefix}mean_acc": float(np.mean(known)), f"{prefix}min_acc": float(np.min(known)),
                    f"{prefix}max_acc": float(np.max(known)),
                    f"client_{prefix}acc": [None if a is None else float(a) for a in values]})
    return out

