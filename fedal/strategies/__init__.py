"""Strategy registry: every strategy module declares its own spec(s) (`SPECS`: server half,
client half, preset, phases and their kind, its own parameters); registering one is one line."""

from __future__ import annotations

from fedal.strategies import cfd, fccl, fd, fedakd, fedal, fedavg, feddf, fedhkd, fedmd, fedproto, local
from fedal.strategies.base import ClientHalf, InvalidResult, PhaseTasks, ServerContext, ServerHalf, StrategySpec
from fedal.strategies.params import StrategyParams

MODULES = (fedal, fedmd, local, fedavg, fedhkd, feddf, fedakd, fd, fedproto, cfd, fccl)  # one line per strategy module
STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for module in MODULES for spec in module.SPECS}
STRATEGY_NAMES = tuple(STRATEGIES)


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
    "PhaseTasks",
    "ServerContext",
    "ServerHalf",
    "StrategyParams",
    "StrategySpec",
    "get_strategy",
]
