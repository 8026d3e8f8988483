"""CFD's and MHAT's client half (cfd.py) for a group of clients of one architecture at once:
the local training (Local's cross-entropy steps, stacked_fedavg.train_group) and the distillation
on the rows D, lambda_kd * CE(target, softmax(f / T)) on each client's own minibatches of D,
stacked (stacked_training.py). The quantized soft labels each client then uploads (with its delta
coding) are computed client by client, as on its own path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf
from fedal.strategies.cfd import NO_REF, TARGET_KEY, CFDClient, check_levels, soft_cross_entropy, soft_target
from fedal.strategies.stacked import NotStackable, StackedModels
from fedal.strategies.stacked_fedavg import train_group
from fedal.strategies.stacked_training import group_steps, require_phase, same_params, step_count


def handle_cfd_group(clients: Sequence[CFDClient], tasks: Sequence[Message]) -> list[Message]:
    """`CFDClient.handle` for every client of the group."""
    if require_phase(tasks, "local_train", "distill") == "local_train":
        reports = train_group(clients, tasks)
        replies = []
        for c, t, r in zip(clients, tasks, reports):
            tensors, ref = c.upload(t.integer("round"), t.integer("ref", NO_REF))
            replies.append(c.reply(t, tensors, ref=ref, **r))
        return replies
    return _distill(clients, tasks)


def _distill(clients: Sequence[CFDClient], tasks: Sequence[Message]) -> list[Message]:
    p = same_params(clients)
    if not p.lambda_kd or len({len(c.rows) for c in clients}) != 1:
        raise NotStackable("nothing to distil (lambda_kd = 0), or distillation rows of different sizes")
    steps = step_count(clients, tasks)
    bits = int(p.cfd_bits or 16)
    targets = []
    for c, t in zip(clients, tasks):
        levels = t.tensors.get(TARGET_KEY)
        try:
            if levels is None:
                raise ValueError(f"a distill task carries {TARGET_KEY}")
            check_levels(np.asarray(levels), (len(c.rows), c.num_classes), bits, TARGET_KEY, slack=1.0)
        except ValueError as exc:  # the client refuses it itself, client by client
            raise NotStackable(str(exc)) from exc
        targets.append(soft_target(np.asarray(levels), bits))
    stack = StackedModels.of(clients)
    stack.pending = None

    n = len(clients[0].rows)
    b = min(p.public_batch_size, n)
    batches = [[torch.randperm(n, generator=c.generator)[:b] for c in clients] for _ in range(steps)]
    rows = [c.public[c.rows] for c in clients]

    def inputs(idx: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([r[i] for r, i in zip(rows, idx)]), torch.stack([t[0][i] for t, i in zip(targets, idx)])

    def loss(x: torch.Tensor, target: torch.Tensor, idx: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        has = torch.stack([t[1][i] for t, i in zip(targets, idx)])
        return p.lambda_kd * soft_cross_entropy(stack.forward(stack.params, x), target, has, p.temperature_kd), {}

    reports = group_steps(stack, clients, batches, loss, inputs=inputs)
    return [c.reply(t, None, loss_kd=r["loss"]) for c, t, r in zip(clients, tasks, reports)]


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    CFDClient: handle_cfd_group,
}
