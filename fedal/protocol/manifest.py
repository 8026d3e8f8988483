"""The run manifest: what an agent must know to take part, published retained on
fedal/v1/<run>/run so an agent that (re)connects at any time learns the run's state."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fedal.protocol.envelope import PROTOCOL_VERSION


class ManifestError(ValueError):
    """A run manifest that is not valid JSON of this protocol version."""


class RunManifest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    protocol: int = PROTOCOL_VERSION
    run_id: str
    strategy: str
    strategy_params: dict[str, Any]
    num_classes: int = Field(ge=2)
    clients: list[str]
    rounds: int = Field(ge=1)
    eval_every: int = Field(1, ge=1)
    public_hash: str | None = None
    public_size: int | None = None
    public_url: str | None = None
    state: Literal["running", "finished", "stopped"] = "running"
    round: int = 0
    instance: str = Field("", description="changes when a run starts afresh; kept when a coordinator resumes it")

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, payload: bytes) -> RunManifest:
        try:
            data = json.loads(payload)
            manifest = cls.model_validate(data)
        except (ValueError, ValidationError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
            raise ManifestError(f"invalid run manifest: {type(exc).__name__}: {exc}") from None
        if manifest.protocol != PROTOCOL_VERSION:
            raise ManifestError(f"run manifest has protocol {manifest.protocol}, this build speaks {PROTOCOL_VERSION}")
        return manifest
