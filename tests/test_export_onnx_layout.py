"""1-D conv stacks are exported as unit-height 2-D ones so onnxruntime runs its blocked kernels.

Signature of the fast path: no Conv in the exported graph has a 1-D kernel, the channels between
two convolutions are a multiple of the NCHWc block, and (on x86-64, where MLAS always has NCHWc
kernels) onnxruntime's optimised graph runs every Conv as a `com.microsoft.nchwc` node. The
rewrite must not change the outputs, the caller's model, or int8 quantisation.
"""

from __future__ import annotations

import platform

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from export import check_parity, export_onnx, layout
from export.layout import CHANNEL_MULTIPLE, Lifted2d, has_1d_layers, lift_1d_to_2d, nchwc_available
from export.quantize import quantize_int8
from export.session import OrtModel, node_times, session_options
from fedal.models import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ONE_D = [("cnn1d", (40,)), ("cnn1d", (1, 40)), ("cnn1d_wide", (40,))]
ONE_D_IDS = [f"{n}-{'x'.join(map(str, s))}" for n, s in ONE_D]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _x(shape, batch, seed=0):
    return torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))


def _conv_weights(path):
    proto = onnx.load(str(path))
    init = {t.name: list(t.dims) for t in proto.graph.initializer}
    return [init[n.input[1]] for n in proto.graph.node if n.op_type == "Conv"]


def _optimised_ops(path, tmp_path):
    options = session_options(1)
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    return [(n.domain, n.op_type) for n in onnx.load(options.optimized_model_filepath).graph.node]


@pytest.mark.parametrize(("name", "shape"), ONE_D, ids=ONE_D_IDS)
def test_1d_models_export_2d_convs_with_block_aligned_channels(name, shape, tmp_path):
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    path = export_onnx(model, _x(shape, 3), tmp_path / "m.onnx")
    weights = _conv_weights(path)
    assert len(weights) == 2
    assert all(len(w) == 4 and w[2] == 1 for w in weights), weights  # [out, in, 1, k]: no 1-D Conv
    # channels feeding a conv from a conv are padded to the block; the last conv keeps its count
    assert all(w[1] % CHANNEL_MULTIPLE == 0 for w in weights[1:]), weights
    assert weights[-1][0] == [m for m in model.backbone if isinstance(m, nn.Conv1d)][-1].out_channels

    for batch in (1, 32, 1000):
        assert check_parity(model, path, _x(shape, batch, seed=batch), atol=1e-4) <= 1e-4


@pytest.mark.skipif(not X86, reason="NCHWc kernels are always compiled in on x86-64 only")
@pytest.mark.parametrize(("name", "shape"), ONE_D, ids=ONE_D_IDS)
def test_onnxruntime_runs_every_conv_as_nchwc(name, shape, tmp_path):
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    ops = _optimised_ops(export_onnx(model, _x(shape, 3), tmp_path / "m.onnx"), tmp_path)
    convs = [(d, op) for d, op in ops if "Conv" in op]
    assert convs == [("com.microsoft.nchwc", "Conv")] * 2, ops

    # the old 1-D graph is what was slow: per-sample im2col FusedConv, no NCHWc node at all
    old = _optimised_ops(export_onnx(model, _x(shape, 3), tmp_path / "old.onnx", conv1d_as_2d=False), tmp_path)
    assert not any(d == "com.microsoft.nchwc" for d, _ in old), old
    assert [len(w) for w in _conv_weights(tmp_path / "old.onnx")] == [3, 3]


@pytest.mark.skipif(not X86, reason="NCHWc kernels are always compiled in on x86-64 only")
def test_node_times_profiles_the_graph_that_runs(tmp_path):
    torch.manual_seed(0)
    model = build_model("cnn1d_wide", (40,), 10)
    path = export_onnx(model, _x((40,), 3), tmp_path / "m.onnx")
    rows = node_times(path, _x((40,), 64).numpy(), runs=3)
    convs = [r for r in rows if r["op"] == "Conv"]
    assert len(convs) == 2 and all(r["domain"] == "com.microsoft.nchwc" for r in convs)
    assert all(r["ms"] > 0 for r in convs) and sum(r["share"] for r in rows) == pytest.approx(1, abs=0.01)
    assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
    assert convs[0]["inputs"][0][0] == 64


def test_export_leaves_the_callers_model_alone(tmp_path):
    torch.manual_seed(0)
    model = build_model("cnn1d", (40,), 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_onnx(model, _x((40,), 3), tmp_path / "m.onnx")
    assert model.training
    assert [type(m) for m in model.backbone] == [type(m) for m in build_model("cnn1d", (40,), 10).backbone]
    assert not any(isinstance(m, Lifted2d) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_models_without_1d_layers_are_exported_unchanged():
    for name, shape in (("mlp", (40,)), ("lenet5", (1, 8, 8)), ("smallcnn", (3, 32, 32))):
        model = build_model(name, shape, 10)
        assert not has_1d_layers(model) and lift_1d_to_2d(model) is model


class _Mixed(nn.Module):
    """1-D layers the zoo does not use yet: BN, pools, dilation, groups, 'same' padding, no bias,
    a conv outside any Sequential, and a stack that ends in a non-liftable layer."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Sequential(
            nn.Conv1d(3, 20, 3, padding=1), nn.BatchNorm1d(20), nn.GELU(), nn.MaxPool1d(2),
            nn.Conv1d(20, 20, 3, dilation=2, padding="same", bias=False), nn.BatchNorm1d(20), nn.Sigmoid(),
            nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False),
            nn.Conv1d(20, 40, 3, groups=4), nn.ReLU(), nn.Conv1d(40, 18, 1), nn.Tanh(),
            nn.AdaptiveMaxPool1d(3), nn.PReLU(18),
        )
        self.side = nn.Conv1d(18, 18, 2, padding="same")  # asymmetric: stays auto_pad
        self.head = nn.Sequential(nn.Flatten(1), nn.Linear(54, 5), nn.BatchNorm1d(5))

    def forward(self, x):
        return self.head(self.side(self.stack(x)))


def _mixed_model():
    torch.manual_seed(0)
    model = _Mixed()
    with torch.no_grad():  # non-default BN statistics, so eval mode and the padding of BN matter
        model.train()(torch.randn(16, 3, 30) * 3 + 1)
    return model.eval()


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
def test_lifting_other_1d_layers_keeps_the_outputs(tmp_path):
    model = _mixed_model()
    lifted = lift_1d_to_2d(model)
    assert not any(isinstance(m, (nn.Conv1d, nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveMaxPool1d))
                   for m in lifted.modules())
    assert isinstance(lifted.side, Lifted2d)  # lifted on its own
    assert isinstance(lifted.head[2], nn.BatchNorm1d)  # a BN on [B, F] features is not a 1-D conv layer
    padded = [m for m in lifted.modules() if isinstance(m, nn.Conv2d) and m.out_channels == 32]
    assert len(padded) == 1 and padded[0].groups == 1  # 20 -> 32 between the first two convs only

    x = torch.randn(50, 3, 30, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(lifted(x), model(x), atol=1e-5, rtol=0)
    path = export_onnx(model, x[:4], tmp_path / "mixed.onnx")
    assert all(len(w) == 4 for w in _conv_weights(path))
    assert check_parity(model, path, x, atol=1e-4) <= 1e-4


def test_a_lone_conv1d_in_a_sequential_is_lifted(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten(1), nn.Linear(4 * 6, 3))
    lifted = lift_1d_to_2d(model)
    assert [type(m) for m in lifted] == [Lifted2d, nn.Flatten, nn.Linear]
    x = torch.randn(5, 2, 8)
    path = export_onnx(model, x[:2], tmp_path / "lone.onnx")
    assert _conv_weights(path) == [[4, 2, 1, 3]]
    assert check_parity(model, path, x, atol=1e-4) <= 1e-4


def test_padded_channels_stay_exact_zeros():
    torch.manual_seed(0)
    model = build_model("cnn1d", (40,), 10).eval()
    run = next(m for m in lift_1d_to_2d(model).modules() if isinstance(m, Lifted2d))
    h = _x((40,), 8).flatten(1)[:, None, None, :]
    with torch.no_grad():
        h = run.layers[1](run.layers[0](h))  # first conv + ReLU: 24 real + 8 padded channels
    assert h.shape[1] == 32 and torch.count_nonzero(h[:, 24:]) == 0 and torch.count_nonzero(h[:, :24]) > 0


def test_channels_are_padded_only_where_onnxruntime_has_nchwc(tmp_path, monkeypatch):
    """Without NCHWc kernels (e.g. an ARM build without them) padding would only add work."""
    assert nchwc_available() is (True if X86 else nchwc_available())
    model = build_model("cnn1d", (40,), 10)
    monkeypatch.setattr(layout, "nchwc_available", lambda: False)
    monkeypatch.setattr("export.onnx_export.nchwc_available", lambda: False)
    path = export_onnx(model, _x((40,), 3), tmp_path / "plain.onnx")
    assert _conv_weights(path) == [[24, 1, 1, 5], [48, 24, 1, 3]]
    assert check_parity(model, path, _x((40,), 9), atol=1e-4) <= 1e-4
    forced = export_onnx(model, _x((40,), 3), tmp_path / "forced.onnx", channel_multiple=16)
    assert [w[1] for w in _conv_weights(forced)] == [1, 32]


def test_channel_multiple_must_not_be_negative():
    with pytest.raises(ValueError, match="channel_multiple"):
        lift_1d_to_2d(build_model("cnn1d", (40,), 10), channel_multiple=-1)
    no_pad = lift_1d_to_2d(build_model("cnn1d", (40,), 10), channel_multiple=0)
    assert {m.out_channels for m in no_pad.modules() if isinstance(m, nn.Conv2d)} == {24, 48}


@pytest.mark.parametrize("mode", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["cnn1d", "cnn1d_wide"])
def test_int8_quantisation_of_the_2d_graph(name, mode, tmp_path):
    torch.manual_seed(0)
    model = build_model(name, (40,), 10)
    rows = np.random.default_rng(0).normal(size=(300, 40)).astype(np.float32)
    fp32_path = export_onnx(model, torch.from_numpy(rows[:2]), tmp_path / "m.onnx")
    int8_path = quantize_int8(fp32_path, tmp_path / f"m.{mode}.onnx", mode, calibration=rows)
    ops = {n.op_type for n in onnx.load(str(int8_path)).graph.node}
    assert ("MatMulInteger" if mode == "dynamic" else "QuantizeLinear") in ops
    if mode == "static":  # the 2-D convs are quantised, padded all-zero channels included
        q = onnx.load(str(int8_path))
        conv_inputs = {i for n in q.graph.node if n.op_type == "Conv" for i in n.input}
        producers = {o: n.op_type for n in q.graph.node for o in n.output}
        assert conv_inputs and all(producers.get(i) == "DequantizeLinear" for i in conv_inputs)
    fp32, int8 = OrtModel(fp32_path, threads=1)(rows), OrtModel(int8_path, threads=1)(rows, batch_size=32)
    assert int8.shape == fp32.shape and np.isfinite(int8).all()
    assert (int8.argmax(1) == fp32.argmax(1)).mean() >= 0.9
