"""A run's parts from its RunConfig: the federated data, the client halves (any subset, as every
process that hosts clients builds its own), the server half. Deterministic for a config."""

from __future__ import annotations

import numpy as np
import torch

from fedal.data import SplitError, build_federated
from fedal.models import build_model, check_model_input
from fedal.privacy.settings import UnreachableTarget
from fedal.sim.config import ConfigError, RunConfig
from fedal.strategies import ServerContext, get_strategy


def client_ids(n: int) -> list[str]:
    width = max(2, len(str(n - 1)))
    return [f"c{i:0{width}d}" for i in range(n)]


def client_seed(run_seed: int, index: int) -> int:
    """Client `index`'s seed; within torch's 64 bits for every run seed (below 2^63), and the
    same as it always was for the seeds below 1.8e14 (modulo changes nothing there)."""
    return (run_seed * 100_003 + index + 1) % 2**64


def build_run(config: RunConfig):
    """Data, client halves and server half for `config` (already resolved)."""
    data = build_data(config)
    ids = client_ids(config.clients)
    clients = build_clients(config, data, range(config.clients))
    return data, clients, build_server(config, data, ids)


def build_data(config: RunConfig):
    """The federated data of `config`: deterministic from it, so any process can build it. A
    dataset that cannot be split as the config asks is a ConfigError (its files were fine)."""
    try:
        return _federated(config)
    except SplitError as exc:
        raise ConfigError(str(exc)) from None


def _federated(config: RunConfig):
    return build_federated(
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


def build_clients(config: RunConfig, data, indices, public_x: np.ndarray | None = None) -> dict:
    """The client halves with these indices (models seeded per client, as every process builds
    them); `public_x`: the public inputs to give them, if not `data`'s own."""
    spec = get_strategy(config.strategy)
    params = config.strategy_params
    ids = client_ids(config.clients)
    models = config.resolved_models()
    # one tensor for all of them: each iteration's public inputs are then gathered once (public_inputs)
    shared_public = torch.from_numpy(np.ascontiguousarray(data.public_x if public_x is None else public_x)) \
        if spec.uses_public_set else None
    rows = params.cfd_public_rows  # (a deployment's public set may come from a file of another size: checked here)
    if rows is not None and spec.uses_public_set and rows > len(data.public_x):
        raise ConfigError(f"strategy_params.cfd_public_rows {rows} is more than the public set's {len(data.public_x)} "
                          "rows (public_size)")
    if "mhat_server_model" in spec.params:  # the server's own model: checked before any work, as the clients' are
        try:
            check_model_input(params.mhat_server_model, data.input_shape)
        except ValueError as exc:
            raise ConfigError(f"{exc} (strategy_params.mhat_server_model)") from None
    clients = {}
    widths: dict[str, int] = {}  # per model its feature width (FedProto needs one)
    for i in indices:
        name = models[i % len(models)]
        torch.manual_seed(client_seed(config.seed, i))
        try:
            model = build_model(name, data.input_shape, data.num_classes)
        except ValueError as exc:  # a model the dataset's inputs do not fit: --models
            raise ConfigError(f"{exc} (--models)") from None
        widths[name] = model.feature_dim
        try:
            clients[ids[i]] = spec.client(ids[i], model, data.clients[i], shared_public, params,
                                          seed=client_seed(config.seed, i))
        except UnreachableTarget as exc:  # the privacy settings ask what no noise gives
            raise ConfigError(f"privacy: {exc}") from None
    if spec.same_feature_dim and len(set(widths.values())) > 1:
        raise ConfigError(f"strategy {config.strategy!r} needs one feature width on every client; the models' are "
                          f"{widths}: choose models of one width (--models)")
    return clients


def build_server(config: RunConfig, data, ids: list[str]):
    context = ServerContext(num_classes=data.num_classes, public_size=len(data.public_x), seed=config.seed,
                            public_x=data.public_x)
    return get_strategy(config.strategy).server(config.strategy_params, ids, context)


def client_tests(data, index: int) -> tuple:
    """Client `index`'s common and local test sets, for the evaluate phase."""
    local = data.client_tests[index]
    return data.test, local if len(local) else None
