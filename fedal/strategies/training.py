"""The one minibatch training loop every client half trains with.

A strategy says what a step's loss is; this loop does the rest (train mode, zero_grad,
backward, optional gradient clipping, the optimizer step). It is the single place where a
stacked executor (vectorized clients) or differentially private training (per-sample clipping
and noise) would plug in, so strategies never implement either themselves.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable

import torch

from fedal.privacy import PrivateTraining

StepLoss = Callable[[torch.Tensor], "tuple[torch.Tensor, dict[str, float]]"]


class TrainingStopped(BaseException):
    """Raised between two steps once the thread's stop is asked for (`stoppable`). A
    BaseException: no handler of a task's errors takes it for a refused task or a failed durable
    write; the task is left unanswered, its state never made durable."""


_STOP = threading.local()


@contextlib.contextmanager
def stoppable(stop_asked: Callable[[], bool]):
    """Within, on this thread: training stops between two steps (TrainingStopped) once
    `stop_asked()` is true. An agent asked to stop in a long task then ends in a step's time,
    instead of a process torn down with torch still computing in its worker thread."""
    _STOP.asked = stop_asked
    try:
        yield
    finally:
        _STOP.asked = None


def stop_point() -> None:
    """TrainingStopped where this thread's stop is asked for (see `stoppable`)."""
    asked = getattr(_STOP, "asked", None)
    if asked is not None and asked():
        raise TrainingStopped


_MODULES: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def train_mode(model: torch.nn.Module) -> None:
    """model.train(), unless every module already is: a client switches to train mode before each
    upload and each training task, and train() sets the flag on every submodule each time. The
    modules are listed once per model (a model's layers are fixed once it is built)."""
    modules = _MODULES.get(model)
    if modules is None:
        modules = _MODULES[model] = list(model.modules())
    if not all(m.training for m in modules):
        model.train()


@contextlib.contextmanager
def replaying(model: torch.nn.Module):
    """Within: a train-mode forward repeated for its graph (a client restored between its upload and
    the feedback recomputes the upload's forward). Its BatchNorm statistics were counted when the
    upload ran, and the checkpoint holds them so: the replay leaves them as they are (momentum 0:
    the running statistics are rewritten with themselves, exactly, and the backward still finds
    them at the version it saved)."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)  # noqa: SLF001
             and m.track_running_stats]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    train_mode(model)
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (momentum, tracked) in zip(norms, saved, strict=True):
                m.momentum = momentum
                if tracked is not None:
                    m.num_batches_tracked.copy_(tracked)  # (a count no backward reads)


def minibatch_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[torch.Tensor],
                    step_loss: StepLoss, clip_norm: float | None = None,
                    private: PrivateTraining | None = None,
                    public_loss: Callable[[], torch.Tensor | None] | None = None) -> list[dict[str, float]]:
    """One optimizer step per batch of row indices; `step_loss(idx)` returns the mean loss over
    those rows and any diagnostics. Returns each step's diagnostics with its `loss` (callers
    aggregate). With `private` (rows of private data, batches from `private.batches`), each step
    is DP-SGD: per-sample gradients clipped, summed and noised (fedal/privacy/training.py); an
    empty batch is a step of noise alone. `public_loss()`, a term that touches no private data,
    joins each step's gradient after that, unclipped (None: none this step)."""
    train_mode(model)
    params = [p for p in model.parameters() if p.requires_grad]
    steps = []
    with private.per_sample(model) if private is not None else contextlib.nullcontext():
        for idx in batches:
            stop_point()
            optimizer.zero_grad()
            loss, stats = step_loss(idx) if len(idx) else (None, {})
            if loss is not None:
                loss.backward()
            if private is not None:
                private.privatize(params, len(idx))
            elif clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip_norm)
            if public_loss is not None:
                with private.public_term() if private is not None else contextlib.nullcontext():
                    term = public_loss()
                    if term is not None:
                        term.backward()
            optimizer.step()
            steps.append({**stats, "loss": loss.item()} if loss is not None else dict(stats))
    return steps
