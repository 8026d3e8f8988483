"""Frozen models: the less-forgetting references, evaluation, (later) frozen teachers.

They only run forward, without gradients, so a device may run them on a faster inference
engine while checkpoints keep the torch weights. A client half asks its `inference` object
for them; `TorchInference` is the default, the agent can install an onnxruntime one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch

Predictor = Callable[[torch.Tensor], torch.Tensor]


def frozen_copy(model: torch.nn.Module, into: torch.nn.Module | None = None) -> torch.nn.Module:
    """An eval-mode, gradient-free copy of `model`. With `into` (an earlier copy of a model of the
    same class and shapes) the weights are copied into its tensors instead: a snapshot taken
    every round then costs a tensor copy, not a deepcopy of the whole module."""
    if into is not None:
        src, dst = _tensors(model), _tensors(into)
        if type(model) is type(into) and len(src) == len(dst) and all(
                a.shape == b.shape and a.dtype == b.dtype for a, b in zip(src, dst)):
            with torch.no_grad():
                for a, b in zip(src, dst):
                    b.copy_(a)
            return into
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers in the module's own order (the same for two modules of one class
    and layout); cheaper to walk than a state_dict, which a snapshot every round would build."""
    return [*model.parameters(), *model.buffers()]


class Frozen:
    """A snapshot: the torch module (what checkpoints store) and how to run it."""

    def __init__(self, module: torch.nn.Module, predict: Predictor | None = None):
        self.module = module
        self._predict = predict

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._predict is not None:
            return self._predict(x)
        with torch.no_grad():
            return self.module(x)

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def parameters(self):
        return self.module.parameters()


class TorchInference:
    """Forward passes in torch: the reference behaviour every other backend is checked against."""

    name = "torch"

    def snapshot(self, model: torch.nn.Module, reuse: Frozen | None = None) -> Frozen:
        """A frozen copy of `model`; `reuse`, a snapshot this backend made before that is no longer
        needed, is overwritten in place (same weights as a fresh copy, no allocation)."""
        if reuse is not None and reuse._predict is None:
            return Frozen(frozen_copy(model, into=reuse.module))
        return Frozen(frozen_copy(model))

    @torch.no_grad()
    def predict(self, model: torch.nn.Module, x: np.ndarray | torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        was_training = model.training
        model.eval()
        xt = torch.as_tensor(x)
        out = torch.cat([model(xt[i : i + batch_size]) for i in range(0, len(xt), batch_size)])
        model.train(was_training)
        return out
