"""torch.optim's Adam and SGD without torch's compiler stack, for devices with little memory.

torch.optim opts its methods out of torch.compile through wrappers (torch._disable_dynamo,
Optimizer.step's grad-mode wrapper) that import torch._dynamo on first use, and with it the
inductor and sympy: +84 MB resident and seconds of start-up on a Raspberry Pi, for eager
training that never compiles anything. These subclasses call the very functions underneath those
wrappers (inspect.unwrap), with gradients off as the step wrapper would: the same kernels, so
bit-identical updates, and the same state_dict format (checkpoints load into either class).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class _EagerMethods:
    """Mixed in before a torch.optim class: the methods its compile wrappers guard."""

    torch_class: type[torch.optim.Optimizer]  # the class whose step runs underneath
    defaults: dict[str, Any]  # torch.optim.Optimizer's

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        inspect.unwrap(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        inspect.unwrap(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return inspect.unwrap(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inspect.unwrap(torch.optim.Optimizer.load_state_dict)(self, state_dict)

    def step(self, closure=None):
        if self.defaults.get("differentiable"):
            raise ValueError("differentiable optimizers need torch.optim's own step")
        with torch.no_grad():
            return inspect.unwrap(self.torch_class.step)(self, closure)


class Adam(_EagerMethods, torch.optim.Adam):
    """torch.optim.Adam, same arguments and state; steps without torch's compiler stack."""

    torch_class = torch.optim.Adam


class SGD(_EagerMethods, torch.optim.SGD):
    """torch.optim.SGD, same arguments and state; steps without torch's compiler stack."""

    torch_class = torch.optim.SGD
