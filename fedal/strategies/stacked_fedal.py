"""FedAL's client half (fedal.py) for a group of clients of one architecture at once; FedDF's
(feddf.py), which is FedAL's with a parameter average before the transfer stage, as well.

The same two stages as `FedALClient.handle`, each client with its own data, batches, weights,
Adam moments and feedback, computed as one stacked model (stacked.py). The losses are
fedal.py's own functions (`local_loss`, `transfer_terms`), which take a leading client axis.
The uploaded logits' autograd graph is kept with the group's stack, as the per-client path keeps
it, and recomputed from the same weights only where the feedback comes to another group.
Everything that can refuse a task is checked before anything changes, so a refused group runs
client by client from an untouched state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedal.protocol import Message
from fedal.protocol.wire_dtype import encode_tensor, wire_round
from fedal.strategies.base import ClientHalf
from fedal.strategies.fedal import (
    FedALClient,
    compute_kept_diagnostics,
    local_loss,
    logits_iteration,
    transfer_terms,
)
from fedal.strategies.fedavg import load_numpy_into
from fedal.strategies.feddf import FedDFClient
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


def handle_group(clients: Sequence[FedALClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedALClient.handle` for every client of the group: each one's result for its task, all
    tasks of one phase, round and iteration. Raises NotStackable, with nothing changed, where
    the clients must run one by one."""
    same_params(clients)
    if require_phase(tasks, "local_train", "transfer") == "local_train":
        diags, stack = _local_train(clients, tasks)
    else:
        diags, stack = _transfer(clients, tasks)
    return _replies(clients, tasks, diags, stack)


Diagnostics = list[dict[str, float]]


def _local_train(clients: Sequence[FedALClient], tasks: Sequence[Message]) -> tuple[Diagnostics, StackedModels]:
    diags, stack = stacked_local_steps(clients, tasks)
    for c in clients:
        c.snapshot_ref_glo()
    return diags, stack


def stacked_local_steps(clients: Sequence[FedALClient], tasks: Sequence[Message]) -> tuple[Diagnostics, StackedModels]:
    """`FedALClient.local_steps` of every client: stage 1, CE + lambda_lf_loc * KL(p(theta_ref_loc) || p)."""
    p = clients[0].params
    steps = step_count(clients, tasks)
    check_batch_sizes(clients)
    stack = StackedModels.of(clients)
    stack.pending = None
    for c in clients:  # as FedALClient.local_steps: a new round, the round-start reference
        c.new_round_diagnostics()
        c.ref_loc = c.inference.snapshot(c.model, reuse=c.ref_loc) if p.lambda_lf_loc > 0 else None
    ref = stack.frozen("ref_loc", [c.ref_loc.module for c in clients]) if p.lambda_lf_loc > 0 else None

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ref_logits = None
        if ref is not None:
            with torch.no_grad():
                ref_logits = stack.forward(ref, x)
        return local_loss(p, stack.forward(stack.params, x), y, ref_logits), {}

    diags = group_steps(stack, clients, group_batches(clients, steps), loss)
    stack.release_frozen("ref_loc")  # this task's alone: the next round snapshots a new one
    return diags, stack


def _transfer(clients: Sequence[FedALClient], tasks: Sequence[Message]) -> tuple[Diagnostics, StackedModels]:
    p = clients[0].params
    # everything that may refuse the task, before anything changes
    if any("fbar" not in t.tensors for t in tasks):
        raise NotStackable("a client without feedback this iteration")
    fbar, grads = [], []
    for c, t in zip(clients, tasks):
        pend = c.pending
        if pend is None or (pend["round"], pend["iteration"]) != (t.meta["round"], t.meta["iteration"]):
            raise NotStackable("feedback for an iteration whose logits this client did not upload")
        try:
            fbar.append(c.received(t, "fbar"))
            grads.append(c.received(t, "grad") if "grad" in t.tensors and p.lambda_adv > 0 else None)
        except ValueError as exc:
            raise NotStackable(str(exc)) from exc
    if len({g is None for g in grads}) != 1 or any(c.public_x is None for c in clients):
        raise NotStackable("the clients' feedback differs in kind")
    rows, x = public_batch(clients, tasks[0].integer("round"), tasks[0].integer("iteration"))
    if any(not torch.equal(r, c.pending["indices"]) for r, c in zip(rows, clients)):  # type: ignore[index]  # set: checked above
        raise NotStackable("a client uploaded other public rows (another rows setting before a restore)")
    stack = StackedModels.of(clients)
    kept = stack.take_upload(clients, tasks[0].integer("round"), tasks[0].integer("iteration"))
    f = kept["logits"] if kept is not None else stack.forward(stack.params, x)
    if any(fb.shape != f.shape[1:] or (g is not None and g.shape != f.shape[1:]) for fb, g in zip(fbar, grads)):
        raise NotStackable("feedback of another shape than the logits")

    targets = []
    for k, (c, t) in enumerate(zip(clients, tasks)):
        c.pending = None
        own = torch.from_numpy(wire_round(f[k].detach().numpy(), p.wire_dtype, p.wire_int8_scale))
        targets.append(c.kd_target(fbar[k], own, t.integer("n_avg", 1)))
    target = torch.stack(targets)
    ref = None
    if p.lambda_lf_glo > 0 and all(c.ref_glo is not None for c in clients):
        frozen = stack.frozen("ref_glo", [c.ref_glo.module for c in clients])
        with torch.no_grad():
            ref = stack.forward(frozen, x)
    kd, lf = transfer_terms(p, f, target, ref)  # [N] each
    loss = kd.sum() if lf is None else (kd + lf).sum()
    adv = None if grads[0] is None else torch.stack([p.lambda_adv * g / f.shape[1] for g in grads if g is not None])
    # diagnostics: as on each client's own path, computed with the round's other iterations
    # (compute_kept_diagnostics), here for the whole group in one call on its last one
    detached_kd, detached_f = kd.detach(), f.detach()
    for k, c in enumerate(clients):
        c.kept_terms.append((detached_kd[k], detached_f[k], target[k], None if ref is None else ref[k],
                             None if adv is None else adv[k]))
    if adv is not None:
        loss = loss + (f * adv).sum()
    stack.step(loss)
    stack.write_back()
    last = [t.integer("iteration") + 1 >= p.tau for t in tasks]
    if all(last):
        compute_kept_diagnostics(clients)
    return [c.transfer_diagnostics(last=done) for c, done in zip(clients, last)], stack


def _replies(clients: Sequence[FedALClient], tasks: Sequence[Message], diags: Diagnostics,
             stack: StackedModels) -> list[Message]:
    """As FedALClient.handle ends: each reply with the logits that open the next iteration."""
    p = clients[0].params
    t0 = tasks[0]
    nxt = logits_iteration(t0.phase, t0.integer("iteration"), p.tau or 1)
    uploads: list[dict[str, np.ndarray]] = [{} for _ in clients]
    if nxt is not None:
        round_idx = t0.integer("round")
        idx, x = public_batch(clients, round_idx, nxt)
        logits = stack.forward(stack.params, x)
        out = logits.detach()
        for k, c in enumerate(clients):
            c.pending = {"round": round_idx, "iteration": nxt, "indices": idx[k]}
            uploads[k] = encode_tensor("logits", out[k].numpy().astype(np.float32), p.wire_dtype, p.wire_int8_scale)
        stack.keep_upload(clients, round_idx, nxt, logits=logits)
    return [c.reply(t, up, **d) for c, t, up, d in zip(clients, tasks, uploads, diags)]


def handle_feddf_group(clients: Sequence[FedDFClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedDFClient.handle` for every client of the group: local training (after loading the
    group's start where sent) and FedAL's transfer stage; `init` and `average` (one upload or
    one forward each) run client by client."""
    if require_phase(tasks, "local_train", "transfer") == "transfer":
        return handle_group(clients, tasks)
    same_params(clients)
    try:
        weights = [c.group_weights(t) for c, t in zip(clients, tasks)]
    except ValueError as exc:  # the client refuses it itself, client by client
        raise NotStackable(str(exc)) from exc
    for c, w in zip(clients, weights):
        if w:
            load_numpy_into(c.model, w)  # loading twice loads the same: a refusal below leaves it exact
    diags, _ = stacked_local_steps(clients, tasks)
    for c in clients:
        if c.params.feddf_ref_glo == "local_train":  # as FedDFClient.handle
            c.snapshot_ref_glo()
    return [c.reply(t, c.weights(), num_samples=len(c.y_train), arch=c.arch, **d)
            for c, t, d in zip(clients, tasks, diags)]


# The client halves this module steps as a group (their exact class: a subclass may handle more).
GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    FedALClient: handle_group,
    FedDFClient: handle_feddf_group,
}
