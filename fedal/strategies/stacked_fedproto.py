"""FedProto's client half (fedproto.py, the prototype variant) for a group of clients of one
architecture at once: its local training, CE + proto_lambda * L_R (the distance of each sample's
features to its class's global prototype), stacked on the models' stacked features and head
(stacked_training.py); the prototypes it uploads are then each client's own, as on its own path.

A client without global prototypes this round (none yet, or proto_lambda = 0) gets a zero mask,
so L_R is exactly zero for it and its step is cross-entropy alone, as on its own path; it
reports the loss alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf
from fedal.strategies.fedproto import COUNT_KEY, PROTO_KEY, FedProtoClient, local_prototypes
from fedal.strategies.losses import cross_entropy
from fedal.strategies.stacked import NotStackable, StackedModels
from fedal.strategies.stacked_training import check_batch_sizes, group_batches, group_steps


def handle_fedproto_group(clients: Sequence[FedProtoClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedProtoClient.handle` for every client of the group."""
    if tasks[0].phase != "local_train":
        raise NotStackable(f"phase {tasks[0].phase!r} runs client by client")
    p = clients[0].params
    if any(c.params != p for c in clients) or len({(c.num_classes, c.feature_dim) for c in clients}) != 1:
        raise NotStackable("the clients' strategy parameters, label sets or feature widths differ")
    steps = {t.integer("steps", p.tau) for t in tasks}
    if len(steps) != 1 or 0 in steps:
        raise NotStackable("the clients take different numbers of steps (or none)")
    try:
        globs = [c.global_prototypes(t) for c, t in zip(clients, tasks)]
    except ValueError as exc:  # the client refuses it itself, client by client
        raise NotStackable(str(exc)) from exc
    epochs = int(p.local_epochs or 0)
    check_batch_sizes(clients, epochs)
    stack = StackedModels.of(clients)
    stack.pending = None

    n, k, d = len(clients), clients[0].num_classes, clients[0].feature_dim
    lam = float(p.proto_lambda or 0.0)
    use = [g is not None and lam > 0 for g in globs]
    protos = torch.zeros(n, k, d)
    mask = torch.zeros(n, k)
    for i, g in enumerate(globs):
        if use[i] and g is not None:
            protos[i], mask[i] = g[0], g[1].float()

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = stack.features(stack.params, x)  # [N, B, d]
        ce = cross_entropy(stack.head(stack.params, h), y)
        if not any(use):
            return ce, {}
        # fedproto.proto_distance per client: sum over rows whose class has a prototype / (B * d)
        target = torch.gather(protos, 1, y.unsqueeze(-1).expand(-1, -1, d))  # [N, B, d]
        rows = torch.gather(mask, 1, y).unsqueeze(-1)
        dist = ((h - target).pow(2) * rows).flatten(1).sum(dim=1) / (h.shape[1] * d)
        return ce + lam * dist, {"ce": ce, "proto_loss": dist}

    reports = group_steps(stack, clients, group_batches(clients, steps.pop(), epochs), loss)
    replies = []
    for i, (c, task, r) in enumerate(zip(clients, tasks, reports)):
        stats = {key: r[key] for key in (("loss", "ce", "proto_loss") if use[i] else ("loss",))}
        mine, counts = local_prototypes(c.model, c.x_train, c.y_train, c.num_classes)
        replies.append(c.reply(task, {PROTO_KEY: mine, COUNT_KEY: counts}, num_samples=len(c.y_train), **stats))
    return replies


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    FedProtoClient: handle_fedproto_group,
}
