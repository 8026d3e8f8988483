"""Agent configuration: a TOML file with FEDAL_AGENT_* environment overrides
(nested keys with a double underscore, e.g. FEDAL_AGENT_BROKER__URL)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fedal.model_names import MODEL_NAMES
from fedal.protocol import MAX_MESSAGE_BYTES, BrokerSettings, topics
from fedal.settings import load_settings
from fedal.strict_fields import NoCoercion

MIN_HEALTH_EVERY_S = 0.5  # a report more often would only load the broker (each is retained)


class AgentBrokerSettings(BrokerSettings):
    # at least 1 s each: a device retrying faster than that would only load a broker that is down
    reconnect_min_s: float = Field(1.0, ge=1, allow_inf_nan=False)
    reconnect_max_s: float = Field(30.0, ge=1, allow_inf_nan=False)
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, ge=4096, description="refuse chunked tasks larger than this; "
                                   "also what unfinished chunked tasks may hold, together")

    @model_validator(mode="after")
    def _backoff_grows(self) -> AgentBrokerSettings:
        if self.reconnect_max_s < self.reconnect_min_s:  # paho would wait the larger first, then the smaller
            raise ValueError(f"reconnect_max_s ({self.reconnect_max_s:g}) must be at least reconnect_min_s "
                             f"({self.reconnect_min_s:g})")
        return self


class AgentConfig(BaseSettings, NoCoercion):
    model_config = SettingsConfigDict(env_prefix="FEDAL_AGENT_", env_nested_delimiter="__", extra="forbid",
                                      allow_inf_nan=False)

    client_id: str
    run_id: str
    broker: AgentBrokerSettings = Field(default_factory=AgentBrokerSettings)
    model: str = Field(description="private model architecture (zoo name); never leaves the device")
    seed: int = Field(0, ge=0, le=2**64 - 1, description="model initialisation and minibatch sampling")
    dp_seeded_noise: bool = Field(
        False, description="in a private run, draw the differential-privacy noise and sampling from `seed`, as a "
        "simulation does (reproducible) instead of from the operating system; anyone who knows the seed (the "
        "coordinator may) can then take the noise away again: for tests and demos on one machine only")
    data_file: Path = Field(description=".npz with x (float32) and y (int64): the private training data")
    test_file: Path | None = Field(None, description=".npz with x, y: the common test set, for evaluation")
    local_test_file: Path | None = Field(None, description=".npz with x, y: this device's own held-out test split")
    public_file: Path | None = Field(None, description=".npz with x: the public set; else fetched once over HTTP")
    workspace: Path = Field(Path("fedal-agent"), description="checkpoints and outputs")
    threads: int = Field(1, ge=1, le=1024, description="torch intra-op threads")
    inference_backend: Literal["torch", "onnx", "auto"] = Field(
        "torch", description="frozen forward passes (references, evaluation): torch, onnxruntime, or the faster"
    )
    export_int8: bool = Field(False, description="also write the final model as int8 ONNX")
    durability: Literal["journal", "phase", "round"] = Field(
        "journal", description="journal: a checkpoint per round plus an fsync'd journal record per task (a restart "
        "replays it: nothing lost); phase: a checkpoint after every task (most bytes written); round: a checkpoint "
        "per round only (a crashed agent sits out the rest of the round under way)"
    )
    exit_on_finish: bool = True
    health_every_s: float = Field(60.0, ge=0, description="report the device's health (temperature, throttling, load, "
                                  "memory, disk, versions) with the status on connecting and at most this often "
                                  f"(at least {MIN_HEALTH_EVERY_S} s: each report is a retained publish); 0: never")
    health_root: Path = Field(Path("/"), description="where /proc, /sys and /etc are read for the health report "
                              "(a container with the host's mounted elsewhere)")

    @field_validator("client_id", "run_id")
    @classmethod
    def _ids(cls, v: str) -> str:
        return topics.check_id(v)

    @field_validator("health_every_s")
    @classmethod
    def _health_every(cls, v: float) -> float:
        if 0 < v < MIN_HEALTH_EVERY_S:
            raise ValueError(f"0 (no health reports) or at least {MIN_HEALTH_EVERY_S} s, not {v}")
        return v

    @field_validator("model")
    @classmethod
    def _zoo_model(cls, v: str) -> str:
        """Checked wherever the config is read (fleet init and check, flash.sh, the agent's start),
        not first on the device when it joins a run."""
        if v not in MODEL_NAMES:
            raise ValueError(f"unknown model {v!r}; valid names: {', '.join(MODEL_NAMES)}")
        return v


def load_agent_config(path: str | Path | None = None, **overrides) -> AgentConfig:
    return load_settings(AgentConfig, path, **overrides)
