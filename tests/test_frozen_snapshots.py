"""Snapshots taken every round (FedAL's less-forgetting references, FCCL's inter-domain teacher)
overwrite the previous one in place instead of deep-copying the module: the same weights as a
fresh copy, no new module, and never a view of the live model."""

from __future__ import annotations

import torch

from fedal.models import build_model
from fedal.strategies.frozen import Frozen, TorchInference, frozen_copy
from tests.helpers import in_process, toy_federation


def _train_a_little(model: torch.nn.Module, seed: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()


def test_reused_snapshot_equals_a_fresh_copy_and_is_not_the_live_model():
    torch.manual_seed(0)
    model = build_model("cnn1d_wide", (40,), 10)
    backend = TorchInference()
    first = backend.snapshot(model)
    _train_a_little(model, 1)
    second = backend.snapshot(model, reuse=first)
    fresh = backend.snapshot(model)
    assert second.module is first.module  # overwritten in place
    for (name, a), b in zip(second.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
        assert a.data_ptr() != model.state_dict()[name].data_ptr()
    assert not second.module.training and not any(p.requires_grad for p in second.parameters())
    before = {k: v.clone() for k, v in second.state_dict().items()}
    _train_a_little(model, 2)  # the live model moves on; the snapshot does not
    assert all(torch.equal(before[k], v) for k, v in second.state_dict().items())
    x = torch.randn(5, 40)
    assert torch.equal(second(x), fresh(x))


def test_a_snapshot_of_another_layout_is_not_reused():
    a, b = build_model("cnn1d", (40,), 10), build_model("mlp", (40,), 10)
    old = frozen_copy(b)
    assert frozen_copy(a, into=old) is not old
    onnx_like = Frozen(frozen_copy(a), predict=lambda x: x)  # another backend's snapshot: left alone
    assert TorchInference().snapshot(a, reuse=onnx_like).module is not onnx_like.module


def test_fedal_rounds_reuse_their_reference_modules():
    server, clients, _ = toy_federation("fedal", tau=2)
    engine = in_process(server, clients)
    client = next(iter(clients.values()))
    engine.run_round(0)
    refs = client.ref_loc.module, client.ref_glo.module
    assert refs[0] is not refs[1]
    engine.run_round(1)
    assert (client.ref_loc.module, client.ref_glo.module) == refs
