"""The device optimizers: bit-identical to torch.optim, and training never loads torch's compiler stack."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedal.strategies import optim

REPO = Path(__file__).resolve().parents[1]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 5, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


CASES = [
    (optim.Adam, torch.optim.Adam, {"lr": 1e-2}),
    (optim.Adam, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-3, "amsgrad": True}),
    (optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (optim.SGD, torch.optim.SGD, {"lr": 0.1}),
]


@pytest.mark.parametrize("eager_cls,torch_cls,kwargs", CASES)
def test_updates_are_bit_identical_to_torch_optim(eager_cls, torch_cls, kwargs):
    a, b = net(), net()
    opt_a, opt_b = eager_cls(a.parameters(), **kwargs), torch_cls(b.parameters(), **kwargs)
    assert train(a, opt_a, 25, seed=1) == train(b, opt_b, 25, seed=1)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i in sb["state"]:
        for key, value in sb["state"][i].items():
            assert torch.equal(sa["state"][i][key], value), key


@pytest.mark.parametrize("eager_cls,torch_cls,kwargs", CASES[::2])
def test_checkpoints_cross_load_both_ways(eager_cls, torch_cls, kwargs):
    """A checkpoint written by either class resumes identically in the other (saved and loaded
    through torch.save/torch.load as the agent's checkpoint is)."""
    base = net()
    opt = torch_cls(base.parameters(), **kwargs)
    train(base, opt, 10, seed=2)
    buf = io.BytesIO()
    torch.save({"model": base.state_dict(), "optimizer": opt.state_dict()}, buf)

    resumed_eager, resumed_torch = net(), net()
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    resumed_eager.load_state_dict(state["model"])
    resumed_torch.load_state_dict(state["model"])
    opt_eager = eager_cls(resumed_eager.parameters(), **kwargs)
    opt_eager.load_state_dict(copy.deepcopy(state["optimizer"]))
    opt_torch = torch_cls(resumed_torch.parameters(), **kwargs)
    opt_torch.load_state_dict(copy.deepcopy(opt_eager.state_dict()))  # and back the other way
    assert train(resumed_eager, opt_eager, 10, seed=3) == train(resumed_torch, opt_torch, 10, seed=3)


def test_closure_is_evaluated_with_gradients():
    model = net()
    opt = optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert first.requires_grad and opt.step(closure).item() < first.item()


def test_differentiable_optimizers_are_refused():
    p = torch.zeros(2, requires_grad=True)
    opt = optim.SGD([p], lr=0.1, differentiable=True)
    p.sum().backward()
    with pytest.raises(ValueError, match="differentiable"):
        opt.step()


TRAIN_EVERY_STRATEGY = """
import io, sys
import torch
from fedal.sim.config import RunConfig
from fedal.strategies import get_strategy
from tests.helpers import simulated_run
for name in sys.argv[1:]:
    params = {"tau": 2, **({"local_epochs": 1} if "local_epochs" in get_strategy(name).params else {})}
    config = RunConfig(strategy=name, dataset="digits", clients=3, samples_per_client=60, public_size=40,
                       models=["mlp"], rounds=2, strategy_params=params)
    _, clients, server = simulated_run(config)
    for client in clients.values():
        buf = io.BytesIO()
        torch.save(client.state_dict(), buf)
        buf.seek(0)
        client.load_state_dict(torch.load(buf, weights_only=False))
    torch.save(server.state_dict(), io.BytesIO())
print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor", "sympy"))))
"""


def test_training_never_imports_the_compiler_stack():
    """Every strategy's client and server halves train, checkpoint and resume in a fresh process
    without torch._dynamo, the inductor or sympy being imported (84 MB on a device)."""
    from fedal.strategies import STRATEGY_NAMES

    out = subprocess.run([sys.executable, "-c", TRAIN_EVERY_STRATEGY, *STRATEGY_NAMES], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
