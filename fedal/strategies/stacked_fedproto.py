"""FedProto's client halves (fedproto.py) for a group of clients of one architecture at once.

The prototype variant (FedProtoClient): its local training, CE + proto_lambda * L_R (the
distance of each sample's features to its class's global prototype), stacked on the models'
stacked features and head (stacked_training.py); the prototypes it uploads are then each
client's own, as on its own path. A client without global prototypes this round (none yet, or
proto_lambda = 0) gets a zero mask, so L_R is exactly zero for it and its step is cross-entropy
alone, as on its own path; it reports the loss alone.

The public variant (FedProtoPublicClient), FedAL's round with features in place of logits: the
local CE steps, each step towards the average features, the next features uploaded, their graph
kept with the group's stack as stacked_fedal.py keeps the logits'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf
from fedal.strategies.fedal import logits_iteration
from fedal.strategies.fedproto import (
    AVERAGE_KEY,
    COUNT_KEY,
    FEATURES_KEY,
    PROTO_KEY,
    FedProtoClient,
    FedProtoPublicClient,
    local_prototypes,
)
from fedal.strategies.losses import cross_entropy
from fedal.strategies.stacked import NotStackable, StackedModels
from fedal.strategies.stacked_training import (
    check_batch_sizes,
    group_batches,
    group_steps,
    masked_targets,
    public_batch,
    require_phase,
    same_params,
    step_count,
)


def handle_fedproto_group(clients: Sequence[FedProtoClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedProtoClient.handle` for every client of the group."""
    require_phase(tasks, "local_train")
    p = same_params(clients)
    if len({(c.num_classes, c.feature_dim) for c in clients}) != 1:
        raise NotStackable("the clients' label sets or feature widths differ")
    steps = step_count(clients, tasks)
    try:
        globs = [c.global_prototypes(t) for c, t in zip(clients, tasks)]
    except ValueError as exc:  # the client refuses it itself, client by client
        raise NotStackable(str(exc)) from exc
    epochs = int(p.local_epochs or 0)
    check_batch_sizes(clients, epochs)
    stack = StackedModels.of(clients)
    stack.pending = None

    k, d = clients[0].num_classes, clients[0].feature_dim
    lam = float(p.proto_lambda or 0.0)
    use = [g is not None and lam > 0 for g in globs]
    protos, mask = masked_targets([g if use[i] else None for i, g in enumerate(globs)], (k, d))

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

    reports = group_steps(stack, clients, group_batches(clients, steps, epochs), loss)
    replies = []
    for i, (c, task, r) in enumerate(zip(clients, tasks, reports)):
        stats = {key: r[key] for key in (("loss", "ce", "proto_loss") if use[i] else ("loss",))}
        mine, counts = local_prototypes(c.model, c.x_train, c.y_train, c.num_classes)
        replies.append(c.reply(task, {PROTO_KEY: mine, COUNT_KEY: counts}, num_samples=len(c.y_train), **stats))
    return replies




# -- fedproto-public: FedAL's round with features on the public rows ----------------------------

def handle_fedproto_public_group(clients: Sequence[FedProtoPublicClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedProtoPublicClient.handle` for every client of the group: the local CE steps, each
    feedback step towards the average features, and the uploads of the next features (their
    graph kept with the group's stack, as the per-client path keeps it)."""
    p = same_params(clients)
    if any(c.public_x is None for c in clients):
        raise NotStackable("a client has no public set")
    tau = p.tau or 1
    phase = require_phase(tasks, "local_train", "transfer")
    if phase == "local_train":
        steps = step_count(clients, tasks)
        check_batch_sizes(clients)
        stack = StackedModels.of(clients)
        stack.pending = None
        for c in clients:
            c.round_diag = []

        def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return cross_entropy(stack.forward(stack.params, x), y), {}

        diags: list[dict[str, float]] = group_steps(stack, clients, group_batches(clients, steps), loss)
    else:
        stack = _apply_averages(clients, tasks)
        last = tasks[0].integer("iteration") + 1 >= tau
        diags = []
        for c in clients:
            diag: dict[str, float] = {}
            if last and c.round_diag:  # the round's diagnostics, once
                diag, c.round_diag = {"proto_loss": float(np.mean(c.round_diag))}, []
            diags.append(diag)
    nxt = logits_iteration(phase, tasks[0].integer("iteration"), tau)
    uploads: list[dict[str, np.ndarray]] = [{} for _ in clients]
    if nxt is not None:
        round_idx = tasks[0].integer("round")
        idx, x = public_batch(clients, round_idx, nxt)
        h = stack.features(stack.params, x)
        out = h.detach()
        for k, c in enumerate(clients):
            c.pending = {"round": round_idx, "iteration": nxt, "indices": idx[k]}
            uploads[k] = {FEATURES_KEY: out[k].numpy().astype(np.float32)}
        stack.keep_upload(clients, round_idx, nxt, features=h)
    return [c.reply(t, up, **d) for c, t, up, d in zip(clients, tasks, uploads, diags)]


def _apply_averages(clients: Sequence[FedProtoPublicClient], tasks: Sequence[Message]) -> StackedModels:
    """FedProtoPublicClient.apply_average for every client: one step on proto_lambda * MSE(h, target)."""
    p = clients[0].params
    if any(AVERAGE_KEY not in t.tensors for t in tasks):
        raise NotStackable("a client without an average this iteration")
    for c, t in zip(clients, tasks):
        pend = c.pending
        if pend is None or (pend["round"], pend["iteration"]) != (t.meta["round"], t.meta["iteration"]):
            raise NotStackable("an average for an iteration whose features this client did not upload")
    stack = StackedModels.of(clients)
    kept = stack.take_upload(clients, tasks[0].integer("round"), tasks[0].integer("iteration"))
    h = kept["features"] if kept is not None else stack.features(
        stack.params, torch.stack([c.public_x[c.pending["indices"]] for c in clients]))  # type: ignore[index]
    averages = [t.tensors[AVERAGE_KEY] for t in tasks]
    if any(a.dtype != np.float32 or a.shape != tuple(h.shape[1:]) for a in averages):
        raise NotStackable("an average of another form than the features (the client refuses it itself)")
    targets = []
    for k, (c, t, a) in enumerate(zip(clients, tasks, averages)):
        c.pending = None
        mean = torch.from_numpy(np.array(a))
        n_avg = t.integer("n_avg", 1)
        targets.append(mean if p.kd_target == "all" or n_avg <= 1 else (n_avg * mean - h[k].detach()) / (n_avg - 1))
    mse = (h - torch.stack(targets)).pow(2).flatten(1).mean(dim=1)  # F.mse_loss per client, [N]
    stack.step(float(p.proto_lambda or 0.0) * mse.sum())
    stack.write_back()
    for c, value in zip(clients, mse.tolist()):
        c.round_diag.append(value)
    return stack


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    FedProtoClient: handle_fedproto_group,
    FedProtoPublicClient: handle_fedproto_public_group,
}
