"""Vectorized clients: the client halves of one architecture run as one stacked model.

Simulation only. Every parameter of the group's models is stacked along a new leading axis (one
slice per client) and the models run as one stacked forward (fedal/models/stacked.py), so ten
small models cost a handful of batched matrix multiplies instead of ten rounds of Python and
kernel launches. Each client keeps its own everything: its slice of the weights, its own Adam
moments (Adam is elementwise, so one Adam over the stacked tensors is each client's Adam), its
own data batches drawn from its own generator. The per-client path stays the reference; a group
that cannot be stacked (other optimizers, BatchNorm buffers, differing step counts or batch
sizes) is refused with `NotStackable` and its clients run one by one.

A group's stack outlives the task: after each step the weights and moments are written back
into the clients' own models and optimizers, and the next task of the same clients reuses the
stack as long as nothing else has touched those tensors since (their version counters say so).
Anything that did (a client stepped on its own, a checkpoint was loaded) makes a new stack.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from fedal.models.stacked import stacked_function
from fedal.strategies import optim

Params = dict[str, torch.Tensor]
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
MAX_KEPT_ROWS = 8192  # public rows, over all groups, whose uploads' graphs wait for their feedback steps
_KEEPING: weakref.WeakSet[StackedModels] = weakref.WeakSet()  # the groups that may hold an upload's graph


class NotStackable(Exception):
    """This group must run client by client (the reason says why)."""


def layout_key(model: torch.nn.Module) -> tuple[Any, ...]:
    """Models with equal keys can be stacked: one class, the same parameter names and shapes."""
    return (type(model), tuple((n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()))


def _versions(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t._version for t in tensors)


class StackedModels:
    """The group's weights and Adam states stacked.

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
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.base = models[0]
        self.names = [n for n, _ in self.base.named_parameters()]
        self._forward = stacked_function(self.base)
        self._parts: tuple[Any, Any] | None = None  # features and head, made when first asked
        self.own = [dict(m.named_parameters()) for m in models]  # each client's live parameters
        self.params: Params = {
            n: torch.stack([own[n].detach() for own in self.own]).requires_grad_(True) for n in self.names}
        self.optimizer = self._stacked_adam()
        self.pending: dict[str, Any] | None = None  # what the group step keeps between its tasks
        self._frozen: dict[str, tuple[list[torch.nn.Module], list[torch.Tensor], tuple[int, ...], Params]] = {}
        self._mark: tuple[int, ...] | None = None
        self._pairs: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # write_back's copies

    def _stacked_adam(self) -> torch.optim.Optimizer:
        groups = []
        for opt in self.optimizers:
            if type(opt) is not optim.Adam or len(opt.param_groups) != 1:
                raise NotStackable("only one-group Adam optimizers are stacked")
            groups.append({k: v for k, v in opt.param_groups[0].items() if k != "params"})
        if any(g != groups[0] for g in groups):
            raise NotStackable("the clients' optimizer settings differ")
        settings = {k: v for k, v in groups[0].items() if k not in ("foreach", "fused")}
        if settings.get("amsgrad") or settings.get("differentiable") or settings.get("capturable"):
            raise NotStackable("amsgrad, differentiable or capturable Adam runs client by client")
        # one fused kernel over the stacked tensors (see _adam): the same update as the clients'
        # Adam, to rounding; this optimizer holds the settings and state, `_adam` steps it
        stacked = optim.Adam(list(self.params.values()), **settings, fused=True)
        states = [[opt.state.get(p, {}) for p in opt.param_groups[0]["params"]] for opt in self.optimizers]
        for k, name in enumerate(self.names):
            per_client = [s[k] for s in states]
            if not any(per_client):
                continue
            if not all(per_client) or len({float(s["step"]) for s in per_client}) != 1:
                raise NotStackable("the clients' optimizers have taken different numbers of steps")
            stacked.state[self.params[name]] = {
                "step": torch.tensor(float(per_client[0]["step"]), dtype=torch.float32, device=self.params[name].device),
                "exp_avg": torch.stack([s["exp_avg"] for s in per_client]),
                "exp_avg_sq": torch.stack([s["exp_avg_sq"] for s in per_client]),
            }
        return stacked

    @classmethod
    def of(cls, clients: Sequence[Any]) -> StackedModels:
        """The clients' stack: the one they last stepped in if it is still theirs, else a new one."""
        group = clients[0].group
        if not (isinstance(group, cls) and group.current([c.model for c in clients], [c.optimizer for c in clients])):
            group = cls([c.model for c in clients], [c.optimizer for c in clients])
        for c in clients:
            c.group = group
        return group

    def current(self, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether these are this stack's models and optimizers, untouched since `write_back`."""
        return (self._mark is not None and len(models) == len(self.models)
                and all(a is b for a, b in zip(models, self.models))
                and all(a is b for a, b in zip(optimizers, self.optimizers))
                and self._fingerprint() == self._mark)

    def _client_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for own, opt in zip(self.own, self.optimizers):
            for name in self.names:
                tensors.append(own[name])
                tensors.extend(v for v in opt.state.get(own[name], {}).values() if isinstance(v, torch.Tensor))
        return tensors

    def _fingerprint(self) -> tuple[int, ...]:
        tensors = self._client_tensors()
        return (len(tensors), *(id(t) for t in tensors), *_versions(tensors))

    def forward(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        return self._forward(params, x)

    def features(self, params: Params, x: torch.Tensor) -> torch.Tensor:
        """Each client's features (SplitModel.features), [N, B, feature_dim]."""
        if self._parts is None:
            self._parts = (stacked_function(self.base, "features"), stacked_function(self.base, "head"))
        return self._parts[0](params, x)

    def head(self, params: Params, h: torch.Tensor) -> torch.Tensor:
        """Each client's logits from its features (SplitModel.head)."""
        if self._parts is None:
            self._parts = (stacked_function(self.base, "features"), stacked_function(self.base, "head"))
        return self._parts[1](params, h)

    def keep_upload(self, clients: Sequence[Any], round_idx: int, iteration: int, **graph: Any) -> None:
        """The forward of these clients' upload of (round, iteration), its graph kept for the
        feedback step (as the per-client path keeps it), which then goes through this very forward.
        Kept while all groups' kept graphs hold at most MAX_KEPT_ROWS public rows: every group's
        graph stays alive until its feedback (about 500 MB at N = 1000 on MNIST-1D), so beyond that
        the feedback step recomputes the forward from the same weights (one more forward, the same
        numbers)."""
        self.pending = None
        first = next(iter(graph.values()))
        rows = first.shape[0] * first.shape[1]
        if rows + sum(s.kept_rows() for s in _KEEPING) > MAX_KEPT_ROWS:
            return
        self.pending = {"tasks": [(c.client_id, round_idx, iteration) for c in clients], "rows": rows, **graph}
        _KEEPING.add(self)

    def kept_rows(self) -> int:
        """Public rows of the upload whose graph this group holds (0: none)."""
        return int(self.pending.get("rows", 0)) if self.pending else 0

    def take_upload(self, clients: Sequence[Any], round_idx: int, iteration: int) -> dict[str, Any] | None:
        """What keep_upload kept, if it is these clients' upload of (round, iteration) (else None:
        the feedback step recomputes the forward from the same weights); forgotten either way."""
        kept, self.pending = self.pending, None
        if kept is not None and kept["tasks"] == [(c.client_id, round_idx, iteration) for c in clients]:
            return kept
        return None

    def frozen(self, key: str, modules: Sequence[torch.nn.Module]) -> Params:
        """The parameters of same-layout frozen modules (references), stacked without gradient;
        restacked only when one of them has changed since. Changed means another module, or a
        parameter written since (snapshots, checkpoint loads and `load_state_dict` copy into a
        module's tensors in place, which bumps their versions): checking that takes no walk
        over the modules, which every transfer iteration would pay. A parameter object swapped
        into a module (`load_state_dict(assign=True)`) is not seen; the toolkit never does that
        to a reference: it copies in place or makes a new module."""
        cached = self._frozen.get(key)
        if cached is not None and len(cached[0]) == len(modules) and all(
                a is b for a, b in zip(cached[0], modules)) and cached[2] == _versions(cached[1]):
            return cached[3]
        own = [dict(m.named_parameters()) for m in modules]
        tensors: list[torch.Tensor] = [t for o in own for t in o.values()]
        stacked = {n: torch.stack([o[n].detach() for o in own]) for n in self.names}
        self._frozen[key] = (list(modules), tensors, _versions(tensors), stacked)
        return stacked

    def release_frozen(self, key: str) -> None:
        """Forget the stacked frozen modules under `key` (a reference made anew each round)."""
        self._frozen.pop(key, None)

    def step(self, loss: torch.Tensor, clip_norm: float | None = None) -> None:
        """With `clip_norm`, each client's gradient is clipped to that norm over all its
        parameters first, as torch.nn.utils.clip_grad_norm_ clips one model's. The gradients
        are taken from autograd and handed to Adam's fused kernel directly, never stored in
        `.grad`: between steps a group holds none (they are as large as its weights)."""
        params = list(self.params.values())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        if clip_norm is not None:
            present = [g for g in grads if g is not None]
            if present:
                total = torch.stack([g.flatten(1).norm(dim=1) for g in present]).norm(dim=0)  # [N]
                coef = (clip_norm / (total + 1e-6)).clamp(max=1.0)
                # out of place: autograd may hand one tensor to two parameters, or a stride-0 one
                grads = tuple(None if g is None else g * coef.view(-1, *([1] * (g.dim() - 1))) for g in grads)
        self._adam(params, grads)

    def _adam(self, params: list[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """torch.optim.Adam(fused=True)'s step (torch.optim.adam._fused_adam) without its
        Python around the kernel, which costs more than the kernel at these sizes: the same
        kernel and arguments, so the same update. As Adam, a parameter without a gradient is
        not stepped and gets no state; state is made on a parameter's first step."""
        group = self.optimizer.param_groups[0]
        with_grad: list[torch.Tensor] = []
        taken: list[torch.Tensor] = []
        avgs: list[torch.Tensor] = []
        squares: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        for p, g in zip(params, grads):
            if g is None:
                continue
            state = self.optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            with_grad.append(p)
            taken.append(g if g.stride() == p.stride() else g.contiguous())  # the kernel reads raw memory
            avgs.append(state["exp_avg"])
            squares.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not with_grad:
            return
        beta1, beta2 = (float(b) for b in group["betas"])
        kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay") else torch._fused_adam_
        with torch.no_grad():
            torch._foreach_add_(steps, 1)
            kernel(with_grad, taken, avgs, squares, [], steps, amsgrad=False, lr=group["lr"], beta1=beta1,
                   beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                   maximize=group["maximize"], grad_scale=None, found_inf=None)

    def write_back(self) -> None:
        """The stacked weights and moments into each client's own tensors (in place: the
        optimizers keep their state objects); the stack stays current until they change."""
        clients, stacked = self._pairs or self._link()
        with torch.no_grad():
            torch._foreach_copy_(clients, stacked)
        # `clients` is what _client_tensors walks (the live tensors `of` found current, or made here)
        self._mark = (len(clients), *(id(t) for t in clients), *_versions(clients))

    def _link(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(each client's tensor, the stacked slice it takes), in `_client_tensors`' order; a
        client optimizer's missing or other-shaped state is made (as the stacked one's first).
        Kept once every stacked tensor has its Adam state (after the first step)."""
        clients: list[torch.Tensor] = []
        stacked: list[torch.Tensor] = []
        complete = True
        for i, (own, opt) in enumerate(zip(self.own, self.optimizers)):
            for name in self.names:
                clients.append(own[name])
                stacked.append(self.params[name].detach()[i])
                state = self.optimizer.state.get(self.params[name])
                if not state:
                    complete = False
                    continue
                mine = opt.state.get(own[name])
                if not (mine and {k for k, v in mine.items() if isinstance(v, torch.Tensor)} == set(_ADAM_STATE)
                        and mine["exp_avg"].shape == state["exp_avg"][i].shape):
                    mine = opt.state[own[name]] = {k: (state[k] if k == "step" else state[k][i]).clone()
                                                   for k in _ADAM_STATE}
                for key, value in mine.items():
                    if isinstance(value, torch.Tensor):
                        clients.append(value)
                        stacked.append(state[key] if key == "step" else state[key][i])
        if complete:
            self._pairs = (clients, stacked)
        return clients, stacked
