"""FCCL's and FCCL+'s client half (fccl.py) for a group of clients of one architecture at once:
the pretraining (fccl), each collaborative step (the cross-correlation loss, FCCL+'s instance
similarity loss) with the next upload, and the local update against each client's own frozen
teachers, all stacked (stacked.py, stacked_training.py); fccl.py's losses take the client axis.
The uploaded forward's graph is kept with the group's stack, as the per-client path keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fedal.protocol import Message
from fedal.protocol.wire_dtype import WireDtypeError, encode_tensor
from fedal.strategies.base import ClientHalf
from fedal.strategies.fccl import (
    S_KEY,
    SBAR_KEY,
    Z_KEY,
    ZBAR_KEY,
    FCCLClient,
    FCCLPlusClient,
    batch_normalise,
    cross_correlation_loss,
    instance_similarity,
    instance_similarity_loss,
    kd_term,
    non_target_kl,
)
from fedal.strategies.losses import cross_entropy
from fedal.strategies.stacked import NotStackable, StackedModels
from fedal.strategies.stacked_training import (
    check_batch_sizes,
    group_batches,
    group_steps,
    public_batch,
    require_phase,
    same_params,
    step_count,
)


def handle_fccl_group(clients: Sequence[FCCLClient], tasks: Sequence[Message]) -> list[Message]:
    """`FCCLClient.handle` for every client of the group."""
    p = same_params(clients)
    if any(c.public_x is None for c in clients):
        raise NotStackable("a client has no public set")
    phase, t0 = require_phase(tasks, "local_pretrain", "collaborate", "local_train"), tasks[0]
    with_average = {ZBAR_KEY in t.tensors for t in tasks}
    if len(with_average) != 1:
        raise NotStackable("some clients have an average this step, some not")
    if phase == "local_pretrain":
        return [c.reply(t, None, **r) for c, t, r in zip(clients, tasks, _pretrain(clients))]
    if phase == "collaborate":
        if with_average.pop():
            _apply_averages(clients, tasks, t0.integer("round"), t0.integer("iteration") - 1)
        elif t0.integer("iteration") == 0:
            for c in clients:
                c.col_diag.clear()  # a new round
        return _uploads(clients, tasks, t0.integer("round"), t0.integer("iteration"))
    # local_train
    if not clients[0].PLUS and any(c.intra is None for c in clients):
        raise NotStackable("a client missed the pretraining: it pretrains on its own path")
    steps = step_count(clients, tasks)
    epochs = int(p.local_epochs or 0)
    check_batch_sizes(clients, epochs)
    if with_average.pop():
        _apply_averages(clients, tasks, t0.integer("round"), (p.tau or 1) - 1)
    keys = ("loss_cc", "loss_isl") if clients[0].PLUS else ("loss_cc",)
    diags = []
    for c in clients:  # the round's collaborative losses, null where no collaborative step was taken
        diags.append({k: float(np.mean(c.col_diag[k])) if c.col_diag.get(k) else float("nan") for k in keys})
        c.col_diag.clear()
    reports = _local_update(clients, steps, epochs)
    return [c.reply(t, None, **r, **d) for c, t, r, d in zip(clients, tasks, reports, diags)]


def _pretrain(clients: Sequence[FCCLClient]) -> list[dict[str, float]]:
    """FCCLClient.pretrain: fccl_pretrain_epochs passes of CE; theta* becomes both teachers."""
    epochs = int(clients[0].params.fccl_pretrain_epochs or 0)
    if epochs <= 0:
        raise NotStackable("no pretraining epochs: nothing to stack")
    check_batch_sizes(clients, epochs)
    stack = StackedModels.of(clients)
    stack.pending = None

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return cross_entropy(stack.forward(stack.params, x), y), {}

    reports = group_steps(stack, clients, group_batches(clients, 0, epochs), loss)
    for c in clients:
        c.intra = c.inference.snapshot(c.model)
        c.inter = c.inference.snapshot(c.model)  # its own copy: the two teachers part from round 1
    return reports


def _forward_public(clients: Sequence[FCCLClient], stack: StackedModels,
                    x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FCCLClient.forward_public of every client: logits and (FCCL+) instance similarities."""
    if not clients[0].PLUS:
        return stack.forward(stack.params, x), None
    h = stack.features(stack.params, x)
    return stack.head(stack.params, h), instance_similarity(h)


def _uploads(clients: Sequence[FCCLClient], tasks: Sequence[Message], round_idx: int, iteration: int) -> list[Message]:
    """FCCLClient.upload of every client, the forward's graph kept with the stack."""
    p = clients[0].params
    stack = StackedModels.of(clients)
    idx, x = public_batch(clients, round_idx, iteration)
    logits, sim = _forward_public(clients, stack, x)
    z = batch_normalise(logits)
    stack.keep_upload(clients, round_idx, iteration, z=z, s=sim)
    replies = []
    for k, (c, t) in enumerate(zip(clients, tasks)):
        c.pending = {"round": round_idx, "iteration": iteration, "indices": idx[k]}
        out = encode_tensor(Z_KEY, z[k].detach().numpy().astype(np.float32), p.wire_dtype, p.wire_int8_scale)
        if sim is not None:
            out.update(encode_tensor(S_KEY, sim[k].detach().numpy().astype(np.float32), p.wire_dtype, p.wire_int8_scale))
        replies.append(c.reply(t, out))
    return replies


def _apply_averages(clients: Sequence[FCCLClient], tasks: Sequence[Message], round_idx: int, iteration: int) -> None:
    """FCCLClient.apply_average of every client: one step on fccl_col_weight * L_cc (+ FCCL+'s
    fccl_isl_weight * L_isl) through the forward of the upload of (round, iteration)."""
    p, plus = clients[0].params, clients[0].PLUS
    pending: list[dict[str, Any]] = []
    for c in clients:
        pend = c.pending
        if pend is None or (pend["round"], pend["iteration"]) != (round_idx, iteration):
            raise NotStackable("an average for an iteration whose logits this client did not upload")
        pending.append(pend)
    b = len(pending[0]["indices"])
    if any(len(pend["indices"]) != b for pend in pending):
        raise NotStackable("uploads of different sizes")
    try:
        zbar = [c.received(t, ZBAR_KEY, None) for c, t in zip(clients, tasks)]
        sbar = [c.received(t, SBAR_KEY, (b, b - 1)) for c, t in zip(clients, tasks)] if plus else []
    except (ValueError, WireDtypeError) as exc:  # the client refuses it itself, client by client
        raise NotStackable(str(exc)) from exc
    stack = StackedModels.of(clients)
    kept = stack.take_upload(clients, round_idx, iteration)
    if kept is not None:
        z, s = kept["z"], kept["s"]
    else:  # recomputed from the same weights
        x = torch.stack([c.public_x[pend["indices"]] for c, pend in zip(clients, pending)])  # type: ignore[index]
        logits, s = _forward_public(clients, stack, x)
        z = batch_normalise(logits)
    if any(zb.shape != z.shape[1:] for zb in zbar):
        raise NotStackable("an average of another shape than the upload (the client refuses it itself)")
    for c in clients:
        c.pending = None
    loss_cc = cross_correlation_loss(z, batch_normalise(torch.stack(zbar)), p.fccl_offdiag_weight)  # [N]
    loss = p.fccl_col_weight * loss_cc
    for c, value in zip(clients, loss_cc.tolist()):
        c.col_diag.setdefault("loss_cc", []).append(value)
    if plus:
        assert s is not None
        loss_isl = instance_similarity_loss(s, torch.stack(sbar), p.fccl_isl_temperature)
        loss = loss + p.fccl_isl_weight * loss_isl
        for c, value in zip(clients, loss_isl.tolist()):
            c.col_diag.setdefault("loss_isl", []).append(value)
    if p.fccl_col_weight == 0 and (not plus or p.fccl_isl_weight == 0):
        return
    stack.step(loss.sum())
    stack.write_back()


def _local_update(clients: Sequence[FCCLClient], steps: int, epochs: int) -> list[dict[str, float]]:
    """FCCLClient.local_update of every client: CE + the non-forgetting terms against each
    client's own frozen teachers; the model it leaves is the next round's inter teacher."""
    p, plus = clients[0].params, clients[0].PLUS
    stack = StackedModels.of(clients)
    stack.pending = None
    t = float(p.fccl_temperature or 1.0)
    w_inter = p.fccl_inter_weight
    w_intra = 0.0 if plus else p.fccl_intra_weight
    inter = stack.frozen("inter", [c.inter.module for c in clients]) if w_inter > 0 else None
    intra = stack.frozen("intra", [c.intra.module for c in clients]) if w_intra > 0 else None

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = stack.forward(stack.params, x)
        total = cross_entropy(out, y)
        if inter is not None:
            with torch.no_grad():
                teacher = stack.forward(inter, x)
            total = total + w_inter * (non_target_kl(out, teacher, y, t) if plus else kd_term(out, teacher, t))
        if intra is not None:
            with torch.no_grad():
                teacher = stack.forward(intra, x)
            total = total + w_intra * kd_term(out, teacher, t)
        return total, {}

    reports = group_steps(stack, clients, group_batches(clients, steps, epochs), loss)
    for c in clients:
        c.inter = c.inference.snapshot(c.model, reuse=c.inter)
    return reports


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    FCCLClient: handle_fccl_group,
    FCCLPlusClient: handle_fccl_group,
}
