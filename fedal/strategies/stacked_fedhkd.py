"""FedHKD's client half (fedhkd.py) for a group of clients at once: its local training, eq. 11
(cross-entropy, lambda * the head term on the global hyper-knowledge, gamma * the feature term),
stacked on the models' stacked features and head (stacked_training.py), with the official
preset's per-client gradient clipping; the knowledge each client then extracts (with its own
noise generator) is computed client by client, as on its own path.

FedHKD's clients share one architecture, so a round's clients form one group; they all receive
the same global knowledge (a group whose tasks carry different knowledge runs client by client).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf
from fedal.strategies.fedavg import load_numpy_into, model_to_numpy
from fedal.strategies.fedhkd import COUNT_KEY, H_KEY, KNOWLEDGE_KEYS, Q_KEY, FedHKDClient, Knowledge, extract_knowledge
from fedal.strategies.losses import cross_entropy
from fedal.strategies.stacked import NotStackable, StackedModels
from fedal.strategies.stacked_training import (
    check_batch_sizes,
    check_weights,
    group_batches,
    group_steps,
    require_phase,
    same_params,
    step_count,
)


def handle_fedhkd_group(clients: Sequence[FedHKDClient], tasks: Sequence[Message]) -> list[Message]:
    """`FedHKDClient.handle` for every client of the group."""
    require_phase(tasks, "train")
    p = same_params(clients)
    steps = step_count(clients, tasks)
    weights = [{k: v for k, v in t.tensors.items() if k not in KNOWLEDGE_KEYS} for t in tasks]
    check_weights([c.model for c in clients], weights)
    knowledge = _one_knowledge(clients, tasks)
    epochs = int(p.local_epochs or 0)
    check_batch_sizes(clients, epochs)
    for c, w in zip(clients, weights):
        load_numpy_into(c.model, w)  # loading twice loads the same: a refusal below leaves it exact
    stack = StackedModels.of(clients)
    stack.pending = None

    lam, gam = float(p.hkd_lambda or 0.0), float(p.hkd_gamma or 0.0)
    use = knowledge is not None and (lam > 0 or gam > 0)
    clip = p.hkd_official_grad_clip if p.hkd_preset == "official" and knowledge is not None else None
    n = len(clients)

    def loss(x: torch.Tensor, y: torch.Tensor, _rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = stack.features(stack.params, x)  # [N, B, d]
        ce = cross_entropy(stack.head(stack.params, h), y)
        if not use or knowledge is None:
            return ce, {"ce": ce}
        head, feature = _knowledge_terms(stack, h, y, knowledge, p, n)
        total = ce
        if lam > 0:
            total = total + lam * head
        if gam > 0:
            total = total + gam * feature
        return total, {"ce": ce, "hkd_head": head, "hkd_feature": feature}

    reports = group_steps(stack, clients, group_batches(clients, steps, epochs), loss, clip_norm=clip)
    replies = []
    for c, task, r in zip(clients, tasks, reports):
        h_mean, q_mean, counts = extract_knowledge(c.model, c.x_train, c.y_train, c.num_classes, p, c.noise_generator)
        stats = {k: r[k] for k in (("loss", "ce", "hkd_head", "hkd_feature") if use else ("loss", "ce"))}
        tensors = {**model_to_numpy(c.model), H_KEY: h_mean, Q_KEY: q_mean, COUNT_KEY: counts}
        replies.append(c.reply(task, tensors, num_samples=len(c.y_train), shared_classes=int((counts > 0).sum()), **stats))
    return replies


def _one_knowledge(clients: Sequence[FedHKDClient], tasks: Sequence[Message]) -> Knowledge | None:
    """The knowledge every task carries (None: none, or no class in it); NotStackable where it
    differs between tasks or does not fit the clients' models."""
    try:
        found = [Knowledge.from_tensors(t.tensors) for t in tasks]
    except KeyError as exc:
        raise NotStackable(f"knowledge without {exc}") from exc
    found = [None if k is None or not k.mask.any() else k for k in found]
    first = found[0]
    if first is None:
        if any(k is not None for k in found):
            raise NotStackable("the clients' knowledge differs")
        return None
    if any(k is None or not (np.array_equal(k.h, first.h) and np.array_equal(k.q, first.q)
                             and np.array_equal(k.mask, first.mask)) for k in found):
        raise NotStackable("the clients' knowledge differs")
    c = clients[0]
    d = getattr(c.model, "feature_dim", None)
    if first.h.shape != (c.num_classes, d) or first.q.shape != (c.num_classes, c.num_classes) \
            or first.mask.shape != (c.num_classes,):
        raise NotStackable("knowledge of other shapes than the clients' models")
    return first


def _knowledge_terms(stack: StackedModels, h: torch.Tensor, y: torch.Tensor, knowledge: Knowledge, p,
                     n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fedhkd.knowledge_terms for every client: each one's head term and feature term, [N] each."""
    present = torch.from_numpy(knowledge.mask)
    big_h = torch.from_numpy(knowledge.h)[present]
    big_q = torch.from_numpy(knowledge.q)[present]
    logits = stack.head(stack.params, big_h.expand(n, *big_h.shape)) / p.hkd_temperature  # [N, J, K]
    rows = present[y].to(h.dtype)  # [N, B]: samples whose class has a global feature
    target = torch.from_numpy(knowledge.h)[y]  # [N, B, d] (rows of absent classes are masked out)
    if p.hkd_preset == "paper":
        head = (F.softmax(logits, dim=-1) - big_q).norm(dim=-1).mean(dim=-1)
        feature = ((h - target).norm(dim=-1) * rows).sum(dim=-1) / y.shape[1]
    else:
        log_p = F.log_softmax(logits, dim=-1)
        head = (torch.xlogy(big_q, big_q) - big_q * log_p).flatten(1).sum(dim=1) / big_q.numel()
        feature = ((h - target).pow(2) * rows.unsqueeze(-1)).flatten(1).sum(dim=1) / h[0].numel()
    return head, feature


GROUP_STEPS: dict[type[ClientHalf], Callable[[Sequence, Sequence[Message]], list[Message]]] = {
    FedHKDClient: handle_fedhkd_group,
}
