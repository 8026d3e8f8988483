"""Strategy registry: every strategy module declares its own spec(s) (`SPECS`: server half,
client half, preset, phases and their kind, its own parameters); registering one is one line."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fedal.protocol import Message
from fedal.strategies import (
    cfd,
    fccl,
    fd,
    fedakd,
    fedal,
    fedavg,
    feddf,
    fedhkd,
    fedmd,
    fedproto,
    local,
    stacked_cfd,
    stacked_fccl,
    stacked_fd,
    stacked_fedakd,
    stacked_fedal,
    stacked_fedavg,
    stacked_fedhkd,
    stacked_fedproto,
)
from fedal.strategies.base import (
    MISSED_STEP,
    ClientHalf,
    InvalidResult,
    MissedStep,
    PhaseTasks,
    ServerContext,
    ServerHalf,
    StrategySpec,
)
from fedal.strategies.params import StrategyParams

MODULES = (fedal, fedmd, local, fedavg, fedhkd, feddf, fedakd, fd, fedproto, cfd, fccl)  # one line per strategy module
STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for module in MODULES for spec in module.SPECS}
STRATEGY_NAMES = tuple(STRATEGIES)


# vectorized simulation: client halves that can step as a group of one architecture, by exact class
GROUP_STEPS = {**stacked_fedal.GROUP_STEPS, **stacked_fedavg.GROUP_STEPS, **stacked_fd.GROUP_STEPS,
               **stacked_fedproto.GROUP_STEPS, **stacked_fedakd.GROUP_STEPS,
               **stacked_fedhkd.GROUP_STEPS, **stacked_cfd.GROUP_STEPS,
               **stacked_fccl.GROUP_STEPS}


def group_step(client: ClientHalf) -> Callable[[Sequence, Sequence[Message]], list[Message]] | None:
    """The stacked step for `client`'s class (fedal/strategies/stacked.py), if it has one; none
    for a client that trains with differential privacy (per-sample clipping runs per client)."""
    return None if client.private is not None else GROUP_STEPS.get(type(client))


def get_strategy(name: str) -> StrategySpec:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; valid choices: {', '.join(STRATEGY_NAMES)}") from None


__all__ = [
    "STRATEGIES",
    "STRATEGY_NAMES",
    "ClientHalf",
    "InvalidResult",
    "MISSED_STEP",
    "MissedStep",
    "PhaseTasks",
    "ServerContext",
    "ServerHalf",
    "StrategyParams",
    "StrategySpec",
    "get_strategy",
    "group_step",
]
