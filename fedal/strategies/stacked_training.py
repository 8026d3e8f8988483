"""The stacked counterpart of training.minibatch_steps: one optimizer step of every client of a
group per batch, each client on its own rows (vectorized simulation; stacked.py).

A group's batches are drawn exactly as each client's own path draws them (`local.local_batches`,
from each client's generator), so the stacked run consumes the same random numbers in the same
order; the groups whose batches would differ in size are refused before anything is drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fedal.protocol import Message
from fedal.strategies.fedal import rows_key
from fedal.strategies.fedavg import numpy_weights_problem
from fedal.strategies.local import local_batches
from fedal.strategies.params import StrategyParams
from fedal.strategies.public_rows import public_inputs
from fedal.strategies.stacked import NotStackable, StackedModels

# (x [N, B, ...], y [N, B], each client's row indices) -> each client's mean loss over its rows
# [N], and any per-client diagnostics of the step ({name: [N]}), as minibatch_steps' step_loss
GroupLoss = Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
# each client's row indices -> the step's (x [N, B, ...], y [N, B, ...])
Inputs = Callable[[Sequence[torch.Tensor]], "tuple[torch.Tensor, torch.Tensor]"]


def require_phase(tasks: Sequence[Message], *phases: str) -> str:
    """The group's phase; NotStackable unless it is one of `phases` (the others run client by client)."""
    phase = tasks[0].phase
    if phase not in phases:
        raise NotStackable(f"phase {phase!r} runs client by client")
    return phase


def same_params(clients: Sequence[Any]) -> StrategyParams:
    """The clients' one set of strategy parameters; NotStackable where they differ."""
    p = clients[0].params
    if any(c.params != p for c in clients):
        raise NotStackable("the clients' strategy parameters differ")
    return p


def step_count(clients: Sequence[Any], tasks: Sequence[Message]) -> int:
    """The one number of steps every task asks for (`steps`, default tau); NotStackable where
    they differ or some client refuses its count."""
    try:
        steps = {c.task_steps(t) for c, t in zip(clients, tasks, strict=True)}
    except ValueError as exc:  # each client refuses it on its own path
        raise NotStackable(str(exc)) from None
    if len(steps) != 1:
        raise NotStackable("the clients take different numbers of steps")
    return steps.pop()


def check_weights(models: Sequence[torch.nn.Module], weights: Sequence[dict[str, np.ndarray]]) -> None:
    """NotStackable, changing nothing, where some client's weights do not load into its model:
    that client refuses them itself, on its own path."""
    for model, w in zip(models, weights):
        problem = numpy_weights_problem(model, w)
        if problem:
            raise NotStackable(problem)


def masked_targets(per_client: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                   shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class targets [N, K, ...] and their masks [N, K] from each client's (targets [K, ...],
    mask [K]), or None for a client without any: zeros, so the term they weigh is exactly 0 for
    it and its step is the one without the term, as on its own path."""
    targets, masks = torch.zeros(len(per_client), *shape), torch.zeros(len(per_client), shape[0])
    for i, pair in enumerate(per_client):
        if pair is not None:
            targets[i], masks[i] = pair[0], pair[1].float()
    return targets, masks


def public_batch(clients: Sequence[Any], round_idx: int, iteration: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each client's public rows of (round, iteration), as its own path draws them
    (public_rows), and the stacked inputs [N, B, ...]: where the clients share one public set
    (a simulation's do), one gathered batch seen N times (expand, not N copies)."""
    p = clients[0].params
    rows = [public_inputs(c.public_x, rows_key(p), round_idx, iteration, p.public_batch_size) for c in clients]
    inputs = [x for _, x in rows]
    if all(x is inputs[0] for x in inputs):
        return [idx for idx, _ in rows], inputs[0].expand(len(inputs), *inputs[0].shape)
    return [idx for idx, _ in rows], torch.stack(inputs)


def group_batches(clients: Sequence[Any], steps: int, epochs: int = 0) -> list[list[torch.Tensor]]:
    """Per step, each client's row indices: `steps` fresh draws of min(batch_size, n) rows, or
    with `epochs` > 0 that many shuffled passes (local_batches). NotStackable, before any draw,
    where the clients' batches would not have one size at every step."""
    p = clients[0].params
    check_batch_sizes(clients, epochs)
    per_client = [list(local_batches(len(c.y_train), p, steps, c.generator, epochs=epochs)) for c in clients]
    return [list(step) for step in zip(*per_client)]


def check_batch_sizes(clients: Sequence[Any], epochs: int = 0) -> None:
    """NotStackable unless every client's batches have one size at every step (with `epochs`,
    the chunks of a pass over n rows: one n)."""
    p = clients[0].params
    sizes = {len(c.y_train) for c in clients}
    if epochs <= 0:
        sizes = {min(p.batch_size, n) for n in sizes}
    if len(sizes) != 1 or 0 in sizes:
        raise NotStackable("the clients' batches differ in size (or are empty)")


def group_steps(stack: StackedModels, clients: Sequence[Any], batches: Sequence[Sequence[torch.Tensor]],
                loss: GroupLoss, clip_norm: float | None = None, inputs: Inputs | None = None) -> list[dict[str, float]]:
    """One stacked step per batch (each client's gradient clipped to `clip_norm`, if given); per
    client the means over the steps of its loss and of each diagnostic (float64, as the
    per-client path averages its float values). `inputs(rows)` gives a step's (x, y) from each
    client's row indices; by default its private training rows."""
    steps: list[dict[str, torch.Tensor]] = []
    for idx in batches:
        if inputs is None:
            x = torch.stack([c.x_train[i] for c, i in zip(clients, idx)])
            y = torch.stack([c.y_train[i] for c, i in zip(clients, idx)])
        else:
            x, y = inputs(idx)
        per, stats = loss(x, y, idx)  # [N]
        stack.step(per.sum(), clip_norm)
        steps.append({"loss": per.detach(), **{k: v.detach() for k, v in stats.items()}})
    stack.write_back()
    if not steps:
        return [{"loss": 0.0} for _ in clients]
    means = {k: torch.stack([s[k] for s in steps]).double().mean(dim=0).tolist() for k in steps[0]}
    return [{k: v[n] for k, v in means.items()} for n in range(len(clients))]
