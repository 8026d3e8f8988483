"""FedAvg's and the local baseline's client halves (fedavg.py, local.py) for a group of clients
of one architecture at once: their local training, cross-entropy minibatch steps, stacked
(stacked_training.py). FedAvg's clients all share one architecture, so a round's clients form
one group. FedAvg's `init` (one client's upload) runs client by client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf
from fedal.strategies.fedavg import FedAvgClient, load_numpy_into, model_to_numpy
from fedal.strategies.local import LocalClient
from fedal.strategies.losses import cross_entropy
from fedal.strategies.stacked import StackedModels
from fedal.strategies.stacked_training import (
    check_batch_sizes,
    check_weights,
    group_batches,
    group_steps,
    require_phase,
    same_params,
    step_count,
)


def train_group(clients: Sequence[ClientHalf], tasks: Sequence[Message]) -> list[dict[str, float]]:
    """`local.train_steps` of every client: each one's mean loss (`loss`). Nothing has changed
    where it raises NotStackable (the batches are drawn only once the stack stands)."""
    p = same_params(clients)
    steps = step_count(clients, tasks)
    epochs = int(getattr(p, "local_epochs", 0) or 0)
    check_batch_sizes(clients, epochs)
    stack = StackedModels.of(clients)
    stack.pending = None

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return cross_entropy(stack.forward(stack.params, x), y), {}

    return group_steps(stack, clients, group_batches(clients, steps, epochs), loss)


def handle_local_group(clients: Sequence[LocalClient], tasks: Sequence[Message]) -> list[Message]:
    """`LocalClient.handle` for every client of the group."""
    require_phase(tasks, "local_train")
    reports = train_group(clients, tasks)
    return [c.reply(t, None, **r) for c, t, r in zip(clients, tasks, reports)]


def handle_fedavg_group(clients: Sequence[FedAvgClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedAvgClient.handle` for every client of the group: load the global model, train, upload."""
    require_phase(tasks, "train")
    check_weights([c.model for c in clients], [t.tensors for t in tasks])
    for c, t in zip(clients, tasks):
        load_numpy_into(c.model, t.tensors)  # loading twice loads the same: a refusal below leaves it exact
    reports = train_group(clients, tasks)
    return [c.reply(t, model_to_numpy(c.model), num_samples=len(c.y_train), **r)
            for c, t, r in zip(clients, tasks, reports)]


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    LocalClient: handle_local_group,
    FedAvgClient: handle_fedavg_group,
}
