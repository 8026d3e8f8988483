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
from fedal.strategies.fedavg import FedAvgClient, load_numpy_into, model_to_numpy, numpy_weights_problem
from fedal.strategies.local import LocalClient
from fedal.strategies.losses import cross_entropy
from fedal.strategies.stacked import NotStackable, StackedModels
from fedal.strategies.stacked_training import check_batch_sizes, group_batches, group_steps


def train_group(clients: Sequence[ClientHalf], tasks: Sequence[Message]) -> list[dict[str, float]]:
    """`local.train_steps` of every client: each one's mean loss (`loss`). Nothing has changed
    where it raises NotStackable (the batches are drawn only once the stack stands)."""
    p = clients[0].params
    if any(c.params != p for c in clients):
        raise NotStackable("the clients' strategy parameters differ")
    steps = {t.integer("steps", p.tau) for t in tasks}
    if len(steps) != 1:
        raise NotStackable("the clients take different numbers of steps")
    epochs = int(getattr(p, "local_epochs", 0) or 0)
    check_batch_sizes(clients, epochs)
    stack = StackedModels.of(clients)
    stack.pending = None

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return cross_entropy(stack.forward(stack.params, x), y), {}

    return group_steps(stack, clients, group_batches(clients, steps.pop(), epochs), loss)


def handle_local_group(clients: Sequence[LocalClient], tasks: Sequence[Message]) -> list[Message]:
    """`LocalClient.handle` for every client of the group."""
    if tasks[0].phase != "local_train":
        raise NotStackable(f"phase {tasks[0].phase!r} runs client by client")
    reports = train_group(clients, tasks)
    return [c.reply(t, None, **r) for c, t, r in zip(clients, tasks, reports)]


def handle_fedavg_group(clients: Sequence[FedAvgClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedAvgClient.handle` for every client of the group: load the global model, train, upload."""
    if tasks[0].phase != "train":
        raise NotStackable(f"phase {tasks[0].phase!r} runs client by client")
    problems = [numpy_weights_problem(c.model, t.tensors) for c, t in zip(clients, tasks)]
    if any(problems):  # the client refuses them itself, client by client
        raise NotStackable(next(p for p in problems if p))
    for c, t in zip(clients, tasks):
        load_numpy_into(c.model, t.tensors)  # loading twice loads the same: a refusal below leaves it exact
    reports = train_group(clients, tasks)
    return [c.reply(t, model_to_numpy(c.model), num_samples=len(c.y_train), **r)
            for c, t, r in zip(clients, tasks, reports)]


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    LocalClient: handle_local_group,
    FedAvgClient: handle_fedavg_group,
}
