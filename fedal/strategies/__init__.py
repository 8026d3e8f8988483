"""Strategy registry: each name maps to its server half, client half and default knobs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedal.strategies import fedakd as _fedakd
from fedal.strategies import fedal as _fedal
from fedal.strategies import fedavg as _fedavg
from fedal.strategies import feddf as _feddf
from fedal.strategies import fedhkd as _fedhkd
from fedal.strategies import fedmd as _fedmd
from fedal.strategies import local as _local
from fedal.strategies.base import ClientHalf, InvalidResult, PhaseTasks, ServerContext, ServerHalf
from fedal.strategies.params import StrategyParams


@dataclass(frozen=True)
class StrategySpec:
    name: str
    server: type[ServerHalf]
    client: type[ClientHalf]
    preset: dict
    # every phase of a round and its kind: "train" (the training deadline) or "exchange"
    phases: Mapping[str, str]
    # its own parameters, besides params.COMMON_PARAMS: others set to a non-default value are refused
    params: tuple[str, ...]
    homogeneous_models: bool = False
    uses_public_set: bool = False
    # the server half keeps the aggregated model (ServerHalf.global_model()), evaluated as `global_acc`
    global_model: bool = False
    # results report collaborative fairness against a standalone (`local`) run of the same clients
    fairness: bool = False


STRATEGIES: dict[str, StrategySpec] = {
    s.name: s
    for s in (
        StrategySpec("fedal", _fedal.FedALServer, _fedal.FedALClient, _fedal.PRESET, _fedal.PHASES, _fedal.PARAMS, uses_public_set=True),
        StrategySpec("fedmd", _fedmd.FedMDServer, _fedmd.FedMDClient, _fedmd.FEDMD_PRESET, _fedmd.PHASES, _fedmd.PARAMS, uses_public_set=True),
        StrategySpec("fedmd-lf", _fedmd.FedMDServer, _fedmd.FedMDClient, _fedmd.FEDMD_LF_PRESET, _fedmd.PHASES, _fedmd.PARAMS, uses_public_set=True),
        StrategySpec("local", _local.LocalServer, _local.LocalClient, _local.PRESET, _local.PHASES, _local.PARAMS),
        StrategySpec("fedavg", _fedavg.FedAvgServer, _fedavg.FedAvgClient, _fedavg.PRESET, _fedavg.PHASES, _fedavg.PARAMS, homogeneous_models=True,
                     global_model=True),
        StrategySpec("fedhkd", _fedhkd.FedHKDServer, _fedhkd.FedHKDClient, _fedhkd.PRESET, _fedavg.PHASES, _fedhkd.PARAMS, homogeneous_models=True,
                     global_model=True),
        StrategySpec("feddf-al", _feddf.FedDFServer, _feddf.FedDFClient, _feddf.FEDDF_AL_PRESET, _feddf.PHASES, _feddf.PARAMS, uses_public_set=True),
        StrategySpec("feddf", _feddf.FedDFServer, _feddf.FedDFClient, _feddf.FEDDF_PRESET, _feddf.PHASES, _feddf.PARAMS, uses_public_set=True),
        StrategySpec("fedakd", _fedakd.FedAKDServer, _fedakd.FedAKDClient, _fedakd.PRESET, _fedakd.PHASES, _fedakd.PARAMS, homogeneous_models=True,
                     global_model=True, fairness=True),
    )
}
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
