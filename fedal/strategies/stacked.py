"""Vectorized clients: the client halves of one architecture run as one stacked model.

Simulation only. Every parameter of the group's models is stacked along a new leading axis (one
slice per client) and the models run as one `vmap` of `functional_call`, so ten small models
cost a handful of batched matrix multiplies instead of ten rounds of Python and kernel launches.
Each client keeps its own everything: its slice of the weights, its own Adam moments (Adam is
elementwise, so one Adam over the stacked tensors is each client's Adam), its own data batches
drawn from its own generator. The per-client path stays the reference; a group that cannot be
stacked (other optimizers, BatchNorm buffers, differing step counts or batch sizes) is refused
with `NotStackable` and its clients run one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.func import functional_call, vmap

from fedal.strategies import optim

Params = dict[str, torch.Tensor]


class NotStackable(Exception):
    """This group must run client by client (the reason says why)."""


def layout_key(model: torch.nn.Module) -> tuple[Any, ...]:
    """Models with equal keys can be stacked: one class, the same parameter names and shapes."""
    return (type(model), tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()))


class StackedModels:
    """The group's weights and Adam states stacked, for the duration of one phase.

    `forward(params, x)` runs every client's model on its own inputs: params [N, ...] and x
    [N, B, ...] -> [N, B, K]. `step(loss)` is one Adam step of every client on the sum of their
    losses (client n's weights get exactly the gradient of its own loss). `write_back()` puts the
    weights and moments back into the clients' own models and optimizers.
    """

    def __init__(self, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]):
        if len({layout_key(m) for m in models}) != 1:
            raise NotStackable("the models differ in architecture")
        if any(len(list(m.buffers())) for m in models):
            raise NotStackable("models with buffers (BatchNorm) run client by client")
        if any(isinstance(layer, torch.nn.modules.dropout._DropoutNd) for m in models for layer in m.modules()):
            raise NotStackable("models with dropout run client by client (their randomness is per client)")
        self.optimizers = list(optimizers)
        self.base = models[0]
        self.names = [n for n, _ in self.base.named_parameters()]
        self.own = [dict(m.named_parameters()) for m in models]  # each client's live parameters
        self.params: Params = {
            n: torch.stack([own[n].detach() for own in self.own]).requires_grad_(True) for n in self.names}
        self.optimizer = self._stacked_adam()

    def _stacked_adam(self) -> torch.optim.Optimizer:
        groups = []
        for opt in self.optimizers:
            if type(opt) is not optim.Adam or len(opt.param_groups) != 1:
                raise NotStackable("only one-group Adam optimizers are stacked")
            groups.append({k: v for k, v in opt.param_groups[0].items() if k != "params"})
        if any(g != groups[0] for g in groups):
            raise NotStackable("the clients' optimizer settings differ")
        stacked = optim.Adam(list(self.params.values()), **groups[0])
        states = [[opt.state.get(p, {}) for p in opt.param_groups[0]["params"]] for opt in self.optimizers]
        for k, name in enumerate(self.names):
            per_client = [s[k] for s in states]
            if not any(per_client):
                continue
            if not all(per_client) or len({float(s["step"]) for s in per_client}) != 1:
                raise NotStackable("the clients' optimizers have taken different numbers of steps")
            stacked.state[self.params[name]] = {
                "step": per_client[0]["step"].clone(),
                "exp_avg": torch.stack([s["exp_avg"] for s in per_client]),
                "exp_avg_sq": torch.stack([s["exp_avg_sq"] for s in per_client]),
            }
        return stacked

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return vmap(self.one)(params, x)

    def one(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """One client's model on its inputs, inside `vmap`: its slice of `params`."""
        return functional_call(self.base, params, (x,))

    def per_client(self, fn: Callable[..., torch.Tensor], *stacked: Any) -> torch.Tensor:
        """`fn(*slices)` for every client, vmapped: each argument stacked along its first axis."""
        return vmap(fn)(*stacked)

    def step(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def write_back(self) -> None:
        with torch.no_grad():
            for i, (own, opt) in enumerate(zip(self.own, self.optimizers)):
                for name in self.names:
                    own[name].copy_(self.params[name][i])
                    state = self.optimizer.state.get(self.params[name])
                    if state:
                        opt.state[own[name]] = {"step": state["step"].clone(),
                                                "exp_avg": state["exp_avg"][i].clone(),
                                                "exp_avg_sq": state["exp_avg_sq"][i].clone()}


def stack_modules(modules: Sequence[torch.nn.Module], names: Sequence[str]) -> Params:
    """The parameters `names` of same-layout modules (frozen references), stacked, no gradient."""
    own = [dict(m.named_parameters()) for m in modules]
    return {n: torch.stack([o[n].detach() for o in own]) for n in names}
