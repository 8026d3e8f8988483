"""In-process simulation: the strategy halves driven without a network, deterministic for a seed."""

from fedal.sim.config import ConfigError, RunConfig, load_config
from fedal.sim.engine import InProcessEngine, RoundRecord
from fedal.sim.runner import build_run, simulate

__all__ = ["ConfigError", "InProcessEngine", "RoundRecord", "RunConfig", "build_run", "load_config", "simulate"]
