"""In-process simulation: the strategy halves driven by the round engine over the in-process
transport, deterministic for a seed."""

from fedal.sim.config import ConfigError, RunConfig, load_config
from fedal.sim.runner import build_run, simulate, simulated_engine

__all__ = ["ConfigError", "RunConfig", "build_run", "load_config", "simulate", "simulated_engine"]
