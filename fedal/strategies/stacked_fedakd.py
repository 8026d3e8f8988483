"""FedAKD's client half (fedakd.py) for a group of clients at once: step 1, the global model
distilled into each personal model on its private data, stacked (stacked_training.py); steps 2
and 3 (the selection, then each client's own subset distilled into its copy of the global model
with a fresh optimizer: subsets of different sizes) run client by client, as on their own path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf
from fedal.strategies.fedakd import FedAKDClient
from fedal.strategies.losses import cross_entropy, kl_to_student
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


def handle_fedakd_group(clients: Sequence[FedAKDClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedAKDClient.handle` for every client of the group."""
    require_phase(tasks, "train")
    p = same_params(clients)
    n = step_count(clients, tasks)
    check_weights([c.global_model for c in clients], [t.tensors for t in tasks])
    epochs = int(p.local_epochs or 0)
    check_batch_sizes(clients, epochs)
    for c, t in zip(clients, tasks):
        c.load_task_weights(t)  # loading twice loads the same: a refusal below leaves it exact
    stack = StackedModels.of(clients)
    stack.pending = None

    # 1. global -> local: CE + akd_alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
    teachers = [c.inference.predict(c.global_model, c.x_train) for c in clients]
    weight, temperature = float(p.akd_alpha), float(p.akd_temperature)

    def loss(x: torch.Tensor, y: torch.Tensor, rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = stack.forward(stack.params, x)
        teacher = torch.stack([t[i] for t, i in zip(teachers, rows)])
        return cross_entropy(out, y) + weight * temperature**2 * kl_to_student(teacher, out, temperature), {}

    reports = group_steps(stack, clients, group_batches(clients, n, epochs), loss)
    return [c.local_to_global(t, n, r["loss"]) for c, t, r in zip(clients, tasks, reports)]


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    FedAKDClient: handle_fedakd_group,
}
