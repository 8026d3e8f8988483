"""Small builders shared by the strategy tests: tiny data and models, no dataset generation
(waiting for ports and conditions: tests/waiting.py)."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedal.data import ArrayDataset
from fedal.engine.transport import Arrival, Transport
from fedal.protocol import Packet
from fedal.strategies import ServerContext, StrategyParams, get_strategy


class TinyNet(nn.Module):
    """A 2-layer MLP small enough for exact gradient comparisons."""

    def __init__(self, d_in: int = 6, k: int = 4):
        super().__init__()
        self.num_classes = k
        self.net = nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, k))

    def features(self, x):
        """The hidden layer: FedHKD's feature extractor R, as every zoo model has one."""
        return self.net[1](self.net[0](x))

    def head(self, h):
        return self.net[2](h)

    def forward(self, x):
        return self.net(x)


def toy_dataset(n: int = 40, d_in: int = 6, k: int = 4, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(
        x=rng.normal(size=(n, d_in)).astype(np.float32), y=rng.integers(0, k, n).astype(np.int64), num_classes=k, name="toy"
    )


def toy_federation(strategy: str, n_clients: int = 3, k: int = 4, public: int = 50, seed: int = 0, **param_overrides):
    spec = get_strategy(strategy)
    params = StrategyParams(**param_overrides).resolve(spec.preset)
    rng = np.random.default_rng(seed)
    public_x = rng.normal(size=(public, 6)).astype(np.float32)
    ids = [f"c{i}" for i in range(n_clients)]
    clients = {}
    for i, cid in enumerate(ids):
        torch.manual_seed(100 + i)
        clients[cid] = spec.client(cid, TinyNet(k=k), toy_dataset(k=k, seed=i), public_x, params, seed=7 + i)
    server = spec.server(params, ids, ServerContext(num_classes=k, public_size=public, seed=seed, public_x=public_x))
    return server, clients, params


def per_client(config):
    """`config` on the per-client reference path unless it asks for vectorize itself: what a
    deployment (each client on its own device) matches bit for bit; stacked clients give its
    numbers only up to float summation order."""
    return config if config.vectorize is not None else config.model_copy(update={"vectorize": False})


def simulated_run(config, records: list | None = None):
    """`fedal simulate`'s loop for `config` (per client: `per_client`), keeping data, client
    halves and server half (to compare a deployment's final outputs with, not only its
    accuracies); each round's record is appended to `records` when one is given."""
    import torch

    from fedal.sim import build_run, simulated_engine

    config = per_client(config).resolved()
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)  # as `fedal simulate` and each agent run it: the same kernels' splits
    try:
        data, clients, server = build_run(config)
        engine = simulated_engine(config, data, clients, server)
        for r in range(config.rounds):
            record = engine.run_round(r)
            if records is not None:
                records.append(record)
    finally:
        torch.set_num_threads(threads)
    return data, clients, server


def in_process(server, clients, **kwargs):
    """The round engine over in-process sessions of `clients`, no evaluation phase (strategy
    math tests look at the halves themselves)."""
    from fedal.engine.inprocess import in_process_engine
    from fedal.strategies import STRATEGIES

    kinds = next(s.phases for s in STRATEGIES.values() if type(server) is s.server)
    return in_process_engine(server, clients, phase_kinds=kinds, **kwargs)


TIMING_KEYS = ("timings", "wall_s", "compute_s")


def without_timings(results):
    """Results with every wall-clock field left out: what must repeat exactly for a seed."""
    if isinstance(results, dict):
        return {k: without_timings(v) for k, v in results.items() if k not in TIMING_KEYS}
    if isinstance(results, list):
        return [without_timings(v) for v in results]
    return results


def fedal_command() -> list[str]:
    """The `fedal` console script of this interpreter's environment, or its module where the
    environment has none (an interpreter run without the package's scripts on disk)."""
    exe = Path(sys.executable).with_name("fedal")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "fedal_cli.main"]


class ScriptedTransport(Transport):
    """Delivers the arrivals the test queued for each send of a phase's tasks; time only moves
    when nothing is left to deliver (so a phase that waits for its deadline is seen waiting)."""

    def __init__(self):
        self.t = 0.0
        self.queue: collections.deque[Arrival] = collections.deque()
        self.sent: list[str] = []

    def start(self, should_stop) -> bool:
        return True

    def send(self, client_id: str, packet: Packet) -> int:
        self.sent.append(client_id)
        return packet.size

    def receive(self, timeout_s: float) -> Arrival | None:
        if self.queue:
            return self.queue.popleft()
        self.t += timeout_s
        return None

    def now(self) -> float:
        return self.t
