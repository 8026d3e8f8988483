"""The one minibatch training loop every client half trains with.

A strategy says what a step's loss is; this loop does the rest (train mode, zero_grad,
backward, optional gradient clipping, the optimizer step). It is the single place where a
stacked executor (vectorized clients) or differentially private training (per-sample clipping
and noise) would plug in, so strategies never implement either themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

StepLoss = Callable[[torch.Tensor], "tuple[torch.Tensor, dict[str, float]]"]


def minibatch_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[torch.Tensor],
                    step_loss: StepLoss, clip_norm: float | None = None) -> list[dict[str, float]]:
    """One optimizer step per batch of row indices; `step_loss(idx)` returns the loss to minimise
    and any diagnostics. Returns each step's diagnostics with its `loss` (callers aggregate)."""
    model.train()
    steps = []
    for idx in batches:
        loss, stats = step_loss(idx)
        optimizer.zero_grad()
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip_norm)
        optimizer.step()
        steps.append({**stats, "loss": loss.item()})
    return steps
