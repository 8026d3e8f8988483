"""K same-architecture models run as one: parameters stacked along a leading client axis.

`stacked_forward(model, params, x)` computes `model`'s function with client k's weights
(`params[name][k]`) on client k's inputs (`x[k]`) for every k at once: [K, B, ...] -> [K, B, C].
Linear layers become one batched matrix multiply; 1-D convolutions one batched matrix multiply
over im2col columns built from shifted slices (channels-last, so no transposes between layers),
and max-pooling one pooling over all clients in the channels-last layout. On a CPU these beat `vmap` of the
module, which turns each convolution into a grouped one and each pooling into a pooling with
indices, neither faster per sample than K separate calls. Models made of other layers run under
`vmap(functional_call)`: the same numbers, without the speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from .cnn1d import _AsChannels

__all__ = ["has_fast_path", "stacked_forward", "stacked_function"]

Params = dict[str, torch.Tensor]

_LAYERS = (nn.Flatten, nn.Linear, nn.ReLU, nn.Conv1d, nn.MaxPool1d, _AsChannels, nn.Sequential)


def has_fast_path(model: nn.Module) -> bool:
    """Whether every layer has a hand-stacked form (else `stacked_forward` uses `vmap`)."""
    children = [model.get_submodule(n) for n in ("backbone", "classifier") if hasattr(model, n)]
    return bool(children) and all(
        isinstance(m, _LAYERS) and _plain(m) for c in children for m in c.modules())


def _plain(m: nn.Module) -> bool:
    if isinstance(m, nn.Conv1d):
        k = m.kernel_size[0]
        return (m.stride, m.dilation, m.groups, m.padding_mode) == ((1,), (1,), 1, "zeros") \
            and m.padding == (k // 2,) and k % 2 == 1
    if isinstance(m, nn.MaxPool1d):
        return m.stride == m.kernel_size and not m.padding and m.dilation == 1 and not m.ceil_mode
    if isinstance(m, nn.Flatten):
        return m.start_dim == 1 and m.end_dim == -1
    return True


StackedFunction = Callable[[Params, torch.Tensor], torch.Tensor]


def stacked_function(model: nn.Module) -> StackedFunction:
    """`model`'s stacked forward, (params, x [K, B, ...]) -> [K, B, num_classes], its layers
    read once (a group calls it every step)."""
    if not has_fast_path(model):
        return vmap(lambda p, xx: functional_call(model, p, (xx,)))
    plan = [*_plan(model.get_submodule("backbone"), "backbone"), *_plan(model.get_submodule("classifier"), "classifier")]

    def forward(params: Params, x: torch.Tensor) -> torch.Tensor:
        h = x
        for op, key, arg in plan:
            h = op(h, params, key, arg)
        return h

    return forward


def stacked_forward(model: nn.Module, params: Params, x: torch.Tensor) -> torch.Tensor:
    """Every client's logits on its own inputs: x [K, B, ...] -> [K, B, num_classes]."""
    return stacked_function(model)(params, x)


Op = Callable[[torch.Tensor, Params, str, int], torch.Tensor]


def _plan(module: nn.Module, prefix: str) -> list[tuple[Op, str, int]]:
    """(operation, parameter prefix, size) per layer; between convolutions h is channels-last, [K, B, L, C]."""
    layers = list(module.named_children()) if isinstance(module, nn.Sequential) else [("", module)]
    plan: list[tuple[Op, str, int]] = []
    channels_last = False
    for name, layer in layers:
        key = f"{prefix}.{name}" if name else prefix
        if isinstance(layer, _AsChannels):
            plan.append((lambda h, p, k, a: h.flatten(2).unsqueeze(-1), key, 0))
        elif isinstance(layer, nn.Conv1d):
            channels_last = True
            plan.append((lambda h, p, k, a: _conv(h, p[f"{k}.weight"], p.get(f"{k}.bias")), key, 0))
        elif isinstance(layer, nn.MaxPool1d):
            plan.append((lambda h, p, k, a: _pool(h, a), key, int(layer.kernel_size)))  # type: ignore[arg-type]
        elif isinstance(layer, nn.ReLU):
            plan.append((lambda h, p, k, a: F.relu(h), key, 0))
        elif isinstance(layer, nn.Flatten) and channels_last:
            # a conv stack's channels-last [K, B, L, C] flattens as torch does [B, C, L]
            plan.append((lambda h, p, k, a: h.transpose(2, 3).flatten(2), key, 0))
            channels_last = False
        elif isinstance(layer, nn.Flatten):
            plan.append((lambda h, p, k, a: h.flatten(2), key, 0))
        elif isinstance(layer, nn.Linear):
            plan.append((lambda h, p, k, a: _linear(h, p[f"{k}.weight"], p.get(f"{k}.bias")), key, 0))
        else:
            raise TypeError(f"no stacked form for {type(layer).__name__}")
    return plan


def _linear(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    wt = w.transpose(1, 2)  # [K, in, out]
    return torch.bmm(h, wt) if b is None else torch.baddbmm(b.unsqueeze(1), h, wt)


def _conv(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """'Same' 1-D convolution, stride 1: [K, B, L, Ci] * w [K, Co, Ci, k] -> [K, B, L, Co]."""
    k_clients, batch, length, c_in = h.shape
    kernel = w.shape[-1]
    pad = kernel // 2
    hp = F.pad(h, (0, 0, pad, pad))
    cols = torch.cat([hp[:, :, j:j + length, :] for j in range(kernel)], dim=-1)  # [K, B, L, k * Ci]
    wm = w.permute(0, 3, 2, 1).reshape(k_clients, kernel * c_in, -1)  # [K, k * Ci, Co]
    flat = cols.view(k_clients, batch * length, kernel * c_in)
    out = torch.bmm(flat, wm) if b is None else torch.baddbmm(b.unsqueeze(1), flat, wm)
    return out.view(k_clients, batch, length, -1)


def _pool(h: torch.Tensor, size: int) -> torch.Tensor:
    """Max-pooling by `size` along L, floor as torch's. Handed to torch channels-last ([K*B, C, L]
    with C innermost), the layout its CPU kernel vectorizes: a reshaped max or a chain of maxima
    is slower, forward and backward."""
    k_clients, batch, length, c = h.shape
    pooled = F.max_pool1d(h.reshape(k_clients * batch, length, c).transpose(1, 2), size)
    return pooled.transpose(1, 2).reshape(k_clients, batch, -1, c)
