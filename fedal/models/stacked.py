"""K same-architecture models run as one: parameters stacked along a leading client axis.

`stacked_function(model)` gives `model`'s function with client k's weights (`params[name][k]`)
on client k's inputs (`x[k]`) for every k at once: [K, B, ...] -> [K, B, C]. Linear layers
become one batched matrix multiply; 1-D convolutions one batched matrix multiply over im2col
columns built from shifted slices (channels-last, so no transposes between layers), and
max-pooling one pooling over all clients in the channels-last layout, before the ReLU that
precedes it (they commute). On a CPU these beat `vmap`
of the module, which turns each convolution into a grouped one and each pooling into a pooling
with indices, neither faster per sample than K separate calls. Models made of other layers (or
in another order) run under `vmap(functional_call)`: the same numbers, without the speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from .cnn1d import _AsChannels

__all__ = ["has_fast_path", "stacked_function"]

Params = dict[str, torch.Tensor]
StackedFunction = Callable[[Params, torch.Tensor], torch.Tensor]
Op = Callable[[torch.Tensor, Params, str, int], torch.Tensor]
Plan = list[tuple[Op, str, int]]


class _NoStackedForm(Exception):
    """A layer, or a layer in this place, that the hand-stacked forms do not cover."""


def has_fast_path(model: nn.Module) -> bool:
    """Whether every layer has a hand-stacked form (else `stacked_function` uses `vmap`)."""
    try:
        _model_plan(model)
    except _NoStackedForm:
        return False
    return True


def stacked_function(model: nn.Module, part: str = "all") -> StackedFunction:
    """`model`'s stacked forward, (params, x [K, B, ...]) -> [K, B, num_classes], its layers
    read once (a group calls it every step). `part`: "features" runs the backbone alone
    ([K, B, feature_dim], SplitModel.features), "head" the classifier alone on features."""
    if part not in ("all", "features", "head"):
        raise ValueError(f"part is 'all', 'features' or 'head', not {part!r}")
    try:
        plan = _model_plan(model)
    except _NoStackedForm:
        if part == "all":
            return vmap(lambda p, xx: functional_call(model, p, (xx,)))
        sub, prefix = (model.get_submodule("backbone"), "backbone.") if part == "features" \
            else (model.get_submodule("classifier"), "classifier.")
        return vmap(lambda p, xx: functional_call(sub, {k[len(prefix):]: v for k, v in p.items()
                                                        if k.startswith(prefix)}, (xx,)))
    if part != "all":
        split = next(i for i, (_, key, _) in enumerate(plan) if key.startswith("classifier"))
        plan = plan[:split] if part == "features" else plan[split:]

    def forward(params: Params, x: torch.Tensor) -> torch.Tensor:
        h = x
        for op, key, arg in plan:
            h = op(h, params, key, arg)
        return h

    return forward


def _model_plan(model: nn.Module) -> Plan:
    if not (isinstance(getattr(model, "backbone", None), nn.Module)
            and isinstance(getattr(model, "classifier", None), nn.Module)):
        raise _NoStackedForm("not a backbone + classifier model")
    layers = [(f"backbone.{n}", m) for n, m in _children(model.get_submodule("backbone"))]
    layers += [(f"classifier.{n}" if n else "classifier", m) for n, m in _children(model.get_submodule("classifier"))]
    return _plan(layers)


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return list(module.named_children()) if isinstance(module, nn.Sequential) else [("", module)]


def _plan(layers: list[tuple[str, nn.Module]]) -> Plan:
    """(operation, parameter prefix, size) per layer. From `_AsChannels` to `Flatten` h is
    channels-last, [K, B, L, C]; convolutions and pooling only run there, linear layers only
    outside it."""
    plan: Plan = []
    channels_last = False
    for key, layer in layers:
        if isinstance(layer, _AsChannels) and not channels_last:
            channels_last = True
            plan.append((lambda h, p, k, a: h.flatten(2).unsqueeze(-1), key, 0))
        elif isinstance(layer, nn.Conv1d) and channels_last and _same_padding(layer):
            plan.append((lambda h, p, k, a: _conv(h, p[f"{k}.weight"], p.get(f"{k}.bias")), key, 0))
        elif isinstance(layer, nn.MaxPool1d) and channels_last and _tiling(layer):
            pool: tuple[Op, str, int] = (lambda h, p, k, a: _pool(h, a), key, int(layer.kernel_size))  # type: ignore[arg-type]
            if plan and plan[-1][0] is _relu:  # ReLU then max-pooling: pooled first (see _relu)
                plan.insert(len(plan) - 1, pool)
            else:
                plan.append(pool)
        elif isinstance(layer, nn.ReLU):
            plan.append((_relu, key, 0))
        elif isinstance(layer, nn.Flatten) and (layer.start_dim, layer.end_dim) == (1, -1):
            if channels_last:  # [K, B, L, C] flattens as torch does [B, C, L]
                plan.append((lambda h, p, k, a: h.transpose(2, 3).flatten(2), key, 0))
            else:
                plan.append((lambda h, p, k, a: h.flatten(2), key, 0))
            channels_last = False
        elif isinstance(layer, nn.Linear) and not channels_last:
            plan.append((lambda h, p, k, a: _linear(h, p[f"{k}.weight"], p.get(f"{k}.bias")), key, 0))
        else:
            raise _NoStackedForm(f"{type(layer).__name__} at {key}")
    if channels_last:
        raise _NoStackedForm("the model ends before its convolutions are flattened")
    return plan


def _relu(h: torch.Tensor, p: Params, k: str, a: int) -> torch.Tensor:
    """ReLU. Before a max-pooling it runs after it instead: max and ReLU commute (the same values,
    and the same gradients: where the maximum is positive both reach the same element, elsewhere
    both are zero), and pooled there are `size` times fewer elements, forward and backward."""
    return F.relu(h)


def _same_padding(conv: nn.Conv1d) -> bool:
    k = conv.kernel_size[0]
    return (conv.stride, conv.dilation, conv.groups, conv.padding_mode) == ((1,), (1,), 1, "zeros") \
        and conv.padding == (k // 2,) and k % 2 == 1


def _tiling(pool: nn.MaxPool1d) -> bool:
    return pool.stride == pool.kernel_size and not pool.padding and pool.dilation == 1 and not pool.ceil_mode \
        and not pool.return_indices


def _linear(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    wt = w.transpose(1, 2)  # [K, in, out]
    return torch.bmm(h, wt) if b is None else torch.baddbmm(b.unsqueeze(1), h, wt)


def _conv(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """'Same' 1-D convolution, stride 1: [K, B, L, Ci] * w [K, Co, Ci, k] -> [K, B, L, Co]."""
    k_clients, batch, length, c_in = h.shape
    kernel = w.shape[-1]
    pad = kernel // 2
    hp = F.pad(h, (0, 0, pad, pad))
    if c_in == 1:  # one input channel (a model's first layer): the k shifts are one window view
        cols = hp.squeeze(-1).unfold(2, kernel, 1)  # [K, B, L, k]
    else:
        cols = torch.cat([hp[:, :, j:j + length, :] for j in range(kernel)], dim=-1)  # [K, B, L, k * Ci]
    wm = w.permute(0, 3, 2, 1).reshape(k_clients, kernel * c_in, -1)  # [K, k * Ci, Co]
    flat = cols.reshape(k_clients, batch * length, kernel * c_in)
    out = torch.bmm(flat, wm) if b is None else torch.baddbmm(b.unsqueeze(1), flat, wm)
    return out.view(k_clients, batch, length, -1)


def _pool(h: torch.Tensor, size: int) -> torch.Tensor:
    """Max-pooling by `size` along L, floor as torch's. Handed to torch channels-last ([K*B, C, L]
    with C innermost), the layout its CPU kernel vectorizes: a reshaped max or a chain of maxima
    is slower, forward and backward. Without a gradient to keep (references, evaluation) torch
    takes another kernel, two to four times slower than the maximum over a reshaped view, which
    is then the same numbers."""
    k_clients, batch, length, c = h.shape
    if not (h.requires_grad and torch.is_grad_enabled()):
        kept = length // size * size
        return h[:, :, :kept].reshape(k_clients, batch, length // size, size, c).amax(dim=3)
    pooled = F.max_pool1d(h.reshape(k_clients * batch, length, c).transpose(1, 2), size)
    return pooled.transpose(1, 2).reshape(k_clients, batch, -1, c)
