"""FD's client half (fd.py) for a group of clients of one architecture at once: its local
training, CE + fd_beta * the cross entropy to the per-label teacher, stacked
(stacked_training.py), each client's softmax outputs summed per label as it goes.

A client without a teacher this round (none yet, or fd_beta = 0) gets a term of exactly zero
(masked_targets), so its loss and gradient are cross-entropy alone, as on its own path, and it
reports no `fd_loss`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf
from fedal.strategies.fd import AVG_KEY, COUNT_KEY, FDClient, local_average, read_teacher
from fedal.strategies.losses import cross_entropy
from fedal.strategies.stacked import NotStackable, StackedModels
from fedal.strategies.stacked_training import (
    check_batch_sizes,
    group_batches,
    group_steps,
    masked_targets,
    require_phase,
    same_params,
    step_count,
)


def handle_fd_group(clients: Sequence[FDClient], tasks: Sequence[Message]) -> list[Message]:
    """`FDClient.handle` for every client of the group."""
    require_phase(tasks, "local_train")
    p = same_params(clients)
    if len({c.num_classes for c in clients}) != 1:
        raise NotStackable("the clients' label sets differ")
    steps = step_count(clients, tasks)
    try:
        teachers = [read_teacher(t.tensors, c.num_classes) for c, t in zip(clients, tasks)]
    except ValueError as exc:  # the client refuses it itself, client by client
        raise NotStackable(str(exc)) from exc
    epochs = int(p.local_epochs or 0)
    check_batch_sizes(clients, epochs)
    stack = StackedModels.of(clients)
    stack.pending = None

    n, k, beta = len(clients), clients[0].num_classes, float(p.fd_beta)
    use = [t is not None and beta > 0 for t in teachers]
    probs, has = masked_targets([(torch.from_numpy(t.probs), torch.from_numpy(t.mask)) if use[i] and t is not None
                                 else None for i, t in enumerate(teachers)], (k, k))
    sums = torch.zeros(n * k, k, dtype=torch.float64)  # client i's label l at row i * k + l
    counts = torch.zeros(n * k, dtype=torch.int64)
    offset = (torch.arange(n) * k)[:, None]

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits = stack.forward(stack.params, x)  # [N, B, K]
        ce = cross_entropy(logits, y)
        rows = (y + offset).flatten()
        sums.index_add_(0, rows, F.softmax(logits.detach(), dim=2).flatten(0, 1).double())
        counts.add_(torch.bincount(rows, minlength=n * k)[: n * k])
        if not any(use):
            return ce, {"ce": ce}
        # fd.distillation_term per client: (1/B) sum_b has[y_b] * -sum_c teacher[y_b]_c log p_c
        teacher = torch.gather(probs, 1, y.unsqueeze(-1).expand(-1, -1, k))  # [N, B, K]
        term = (-(teacher * F.log_softmax(logits, dim=2)).sum(dim=2) * torch.gather(has, 1, y)).sum(dim=1) / y.shape[1]
        return ce + beta * term, {"ce": ce, "fd_loss": term}

    reports = group_steps(stack, clients, group_batches(clients, steps, epochs), loss)
    replies = []
    for i, (c, task, r) in enumerate(zip(clients, tasks, reports)):
        stats = {key: r[key] for key in (("loss", "ce", "fd_loss") if use[i] else ("loss", "ce"))}
        own = slice(i * k, (i + 1) * k)
        tensors = {AVG_KEY: local_average(sums[own], counts[own]), COUNT_KEY: counts[own].numpy().copy()}
        replies.append(c.reply(task, tensors, num_samples=len(c.y_train), **stats))
    return replies


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    FDClient: handle_fd_group,
}
