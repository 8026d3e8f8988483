"""The one round engine: phases, deadlines, quorum, (epoch, seq), accounting, results.

It drives a strategy's server half and talks to clients only through a Transport: in-process
for simulation (`fedal.engine.inprocess`), MQTT for deployment (the coordinator's). No network
and no web imports here.
"""

from fedal.engine.accounting import ClientInfo, PhaseState, PhaseStats
from fedal.engine.rounds import RoundEngine, Stopped, StrategyError
from fedal.engine.settings import PausePoint, PhaseSettings
from fedal.engine.transport import Arrival, Transport

__all__ = ["Arrival", "ClientInfo", "PausePoint", "PhaseSettings", "PhaseState", "PhaseStats", "RoundEngine", "Stopped",
           "StrategyError", "Transport"]
