"""Export-only rewrite of 1-D convolution stacks as 2-D ones of unit height.

Why: onnxruntime's CPU provider runs a 1-D `Conv` through its generic path (im2col + one small
GEMM per sample and layer): with the zoo's short signals (length 40 -> 20 -> 5 after pooling) each GEMM is
tiny, so `cnn1d`/`cnn1d_wide` ran 1.5-2.5x *slower* than torch eager on a batch of 1000. A 2-D
`Conv` whose input channel count is a multiple of the MLAS NCHWc block (8 with AVX2, 16 with
AVX-512; NEON builds that have NCHWc kernels use their own) is instead rewritten by
onnxruntime's NchwcTransformer into `NchwcConv` nodes: blocked channel layout kept across the
whole conv stack, direct convolution kernels, bias and ReLU fused. So the exported graph gets
`Conv2d(kernel (1, k))` on `[B, C, 1, L]` instead of `Conv1d(kernel k)` on `[B, C, L]`, and the
channels *between* two such convolutions are zero-padded up to a multiple of `channel_multiple`
(`cnn1d`: 24 -> 32) so every convolution after the first qualifies; `export_onnx` pads only where
the local onnxruntime has NCHWc kernels (`nchwc_available`), since elsewhere it would only add work.

Both changes compute the same function: a unit-height 2-D convolution/pooling is the 1-D one,
padded output channels have zero weights and bias, and the next convolution's weights for them
are zero, so they add exact zeros. Only torch modules are rewritten (on a copy, never the
caller's model), so the ONNX is still produced by the ordinary exporter and checked against the
original model by `check_parity`.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import tempfile

import torch
from torch import nn

__all__ = ["CHANNEL_MULTIPLE", "Lifted2d", "has_1d_layers", "lift_1d_to_2d", "nchwc_available"]

CHANNEL_MULTIPLE = 16  # a multiple of both x86 NCHWc block sizes (AVX2: 8, AVX-512: 16)

# Layers that act on each channel separately and elementwise along the length: they run
# unchanged on [B, C, 1, L], and padded (all-zero-weight) channels through them stay harmless.
_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Identity,
    nn.Dropout,
)
# Layers that fix the input as [B, C, L] and so may start a lifted run.
_RUN_STARTS = (nn.Conv1d, nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool1d)


@functools.lru_cache(maxsize=1)
def nchwc_available() -> bool:
    """Whether this machine's onnxruntime rewrites 2-D Convs into NCHWc kernels.

    Always on x86-64 (AVX2/AVX-512); on ARM only in builds with the NEON NCHWc kernels. Where it
    is off, padding channels would only add work, so `export_onnx` pads only when this is True.
    Probed once per process on a two-conv graph (a few milliseconds).
    """
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return False
    import numpy as np

    weight = numpy_helper.from_array(np.zeros((16, 16, 1, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["h"], pads=[0, 1, 0, 1]),
         helper.make_node("Conv", ["h", "w"], ["y"], pads=[0, 1, 0, 1])],
        "nchwc_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 1, 8])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 8)  # readable by older onnxruntime builds too
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = os.path.join(tmp, "probe.onnx")
        options.log_severity_level = 3
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
            optimised = onnx.load(options.optimized_model_filepath)
        except Exception:  # an odd build: treat as "no NCHWc", the export itself does not depend on it
            return False
    return any(node.domain == "com.microsoft.nchwc" for node in optimised.graph.node)


class Lifted2d(nn.Module):
    """A run of 1-D layers computed as 2-D ones on `x.unsqueeze(-2)`, then squeezed back."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.unsqueeze(-2)).squeeze(-2)


def has_1d_layers(model: nn.Module) -> bool:
    """True if `model` holds a layer `lift_1d_to_2d` would rewrite."""
    return any(_liftable_start(m) for m in model.modules())


def lift_1d_to_2d(model: nn.Module, channel_multiple: int = CHANNEL_MULTIPLE) -> nn.Module:
    """A copy of `model` with its 1-D conv stacks as unit-height 2-D ones; `model` itself if none.

    Inside a plain `nn.Sequential`, each maximal run that starts with a Conv1d or 1-D pooling layer and
    continues through Conv1d, BatchNorm1d, 1-D pooling and elementwise layers becomes one
    `Lifted2d` (one Unsqueeze in, one Squeeze out, so onnxruntime keeps the blocked layout through
    the run). A 1-D conv/pool layer anywhere else is lifted on its own. In a run, the channels
    between two ungrouped convolutions are zero-padded up to a multiple of `channel_multiple`
    (0 or 1: no padding). Layers with options that have no exact 2-D twin here (non-zero padding
    modes, pooling with indices) are left as they are.
    """
    if channel_multiple < 0:
        raise ValueError(f"channel_multiple must be >= 0, got {channel_multiple}")
    if not has_1d_layers(model):
        return model
    lifted = copy.deepcopy(model)
    for parent in list(lifted.modules()):
        if type(parent) is nn.Sequential:  # a subclass may index its children in its own forward
            _lift_runs(parent, channel_multiple)
    for parent in list(lifted.modules()):
        if isinstance(parent, Lifted2d):
            continue
        for name, child in list(parent.named_children()):
            if _liftable_start(child):
                setattr(parent, name, Lifted2d([_to_2d(child)]))
    return lifted


def _liftable_start(module: nn.Module) -> bool:
    if isinstance(module, nn.Conv1d):
        return module.padding_mode == "zeros" and type(module) is nn.Conv1d
    if isinstance(module, (nn.MaxPool1d, nn.AdaptiveMaxPool1d)):
        return not module.return_indices
    return isinstance(module, (nn.AvgPool1d, nn.AdaptiveAvgPool1d))


def _continues_run(module: nn.Module) -> bool:
    if _liftable_start(module):
        return True
    if isinstance(module, nn.BatchNorm1d):
        return type(module) is nn.BatchNorm1d
    return type(module) in _ELEMENTWISE


def _lift_runs(seq: nn.Sequential, channel_multiple: int) -> None:
    children = list(seq.children())
    rebuilt: list[nn.Module] = []
    i = 0
    while i < len(children):
        if not _liftable_start(children[i]):
            rebuilt.append(children[i])
            i += 1
            continue
        j = i + 1
        while j < len(children) and _continues_run(children[j]):
            j += 1
        run = [_to_2d(m) for m in children[i:j]]
        if channel_multiple > 1:
            _pad_channels(run, channel_multiple)
        rebuilt.append(Lifted2d(run))
        i = j
    if any(isinstance(m, Lifted2d) for m in rebuilt):
        for name in list(seq._modules):
            del seq._modules[name]
        for k, module in enumerate(rebuilt):
            seq.add_module(str(k), module)


def _to_2d(m: nn.Module) -> nn.Module:
    """The 2-D twin of one layer on [B, C, 1, L] (elementwise layers are returned as they are)."""
    if isinstance(m, nn.Conv1d):
        pad = _explicit_padding(m)
        padding = pad if isinstance(pad, str) else (0, pad)
        conv = nn.Conv2d(m.in_channels, m.out_channels, (1, m.kernel_size[0]), (1, m.stride[0]),
                         padding, (1, m.dilation[0]), m.groups, m.bias is not None,
                         dtype=m.weight.dtype, device=m.weight.device)
        with torch.no_grad():
            conv.weight.copy_(m.weight.unsqueeze(2))
            if m.bias is not None:
                conv.bias.copy_(m.bias)
        conv.train(m.training)
        return conv
    if isinstance(m, nn.BatchNorm1d):
        bn = nn.BatchNorm2d(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                            **_factory(m))
        bn.load_state_dict(m.state_dict())
        bn.train(m.training)
        return bn
    if isinstance(m, nn.MaxPool1d):
        return nn.MaxPool2d((1, _one(m.kernel_size)), (1, _one(m.stride)), (0, _one(m.padding)),
                            (1, _one(m.dilation)), ceil_mode=m.ceil_mode)
    if isinstance(m, nn.AvgPool1d):
        return nn.AvgPool2d((1, _one(m.kernel_size)), (1, _one(m.stride)), (0, _one(m.padding)),
                            ceil_mode=m.ceil_mode, count_include_pad=m.count_include_pad)
    if isinstance(m, nn.AdaptiveAvgPool1d):
        return nn.AdaptiveAvgPool2d((1, _one(m.output_size)))
    if isinstance(m, nn.AdaptiveMaxPool1d):
        return nn.AdaptiveMaxPool2d((1, _one(m.output_size)))
    return m


def _explicit_padding(conv: nn.Conv1d) -> int | str:
    """Numeric padding for 'valid'/'same' where it is symmetric: exported as numbers, not as an
    auto_pad that onnxruntime refuses with dilation ("Dilation not supported for SAME_UPPER")."""
    if not isinstance(conv.padding, str):
        return conv.padding[0]
    if conv.padding == "valid":
        return 0
    total = conv.dilation[0] * (conv.kernel_size[0] - 1)
    return total // 2 if total % 2 == 0 else conv.padding


def _one(value) -> int | None:
    return value[0] if isinstance(value, (tuple, list)) else value


def _factory(m: nn.Module) -> dict:
    """device/dtype of a layer's floating-point state, for building its twin alike."""
    tensor = next((t for t in m.state_dict().values() if t.is_floating_point()), None)
    return {} if tensor is None else {"device": tensor.device, "dtype": tensor.dtype}


def _pad_channels(run: list[nn.Module], multiple: int) -> None:
    """Zero-pad the channels flowing from one ungrouped Conv2d to the next one in `run`.

    Only counts above `multiple` are padded (24 -> 32 costs 33% more multiply-adds in the next
    layer but turns onnxruntime's per-sample im2col path into its blocked kernels; 6 -> 16 would
    mostly add work). Everything between the two convolutions is per-channel, so the padded
    channels carry values that the next convolution multiplies by zero weights.
    """
    convs = [k for k, m in enumerate(run) if isinstance(m, nn.Conv2d)]
    for a, b in zip(convs, convs[1:]):
        src, dst = run[a], run[b]
        channels = src.out_channels
        target = math.ceil(channels / multiple) * multiple
        if src.groups != 1 or dst.groups != 1 or channels <= multiple or target == channels:
            continue
        extra = target - channels
        run[a] = _pad_conv(src, out_extra=extra)
        run[b] = _pad_conv(run[b], in_extra=extra)
        for k in range(a + 1, b):
            if isinstance(run[k], nn.BatchNorm2d):
                run[k] = _pad_batchnorm(run[k], extra)


def _pad_conv(conv: nn.Conv2d, out_extra: int = 0, in_extra: int = 0) -> nn.Conv2d:
    padded = nn.Conv2d(conv.in_channels + in_extra, conv.out_channels + out_extra, conv.kernel_size,
                       conv.stride, conv.padding, conv.dilation, 1, conv.bias is not None,
                       dtype=conv.weight.dtype, device=conv.weight.device)
    with torch.no_grad():
        padded.weight.zero_()
        padded.weight[:conv.out_channels, :conv.in_channels] = conv.weight
        if conv.bias is not None:
            padded.bias.zero_()
            padded.bias[:conv.out_channels] = conv.bias
    padded.train(conv.training)
    return padded


def _pad_batchnorm(bn: nn.BatchNorm2d, extra: int) -> nn.BatchNorm2d:
    """Padded channels get the identity transform (mean 0, var 1, weight 1, bias 0)."""
    padded = nn.BatchNorm2d(bn.num_features + extra, bn.eps, bn.momentum, bn.affine,
                            bn.track_running_stats, **_factory(bn))
    with torch.no_grad():
        n = bn.num_features
        if bn.affine:
            padded.weight[:n] = bn.weight
            padded.bias[:n] = bn.bias
        if bn.track_running_stats:
            padded.running_mean[:n] = bn.running_mean
            padded.running_var[:n] = bn.running_var
            padded.num_batches_tracked.copy_(bn.num_batches_tracked)
    padded.train(bn.training)
    return padded
