"""The run manifest: what an agent must know to take part, published retained on
fedal/v1/<run>/run so an agent that (re)connects at any time learns the run's state."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedal.model_names import MAX_NUM_CLASSES
from fedal.protocol.envelope import PROTOCOL_VERSION
from fedal.validation import describe

MAX_ROUNDS = 10**9  # a run's rounds: far past any run, short of numbers a round counter cannot hold


class ManifestError(ValueError):
    """A run manifest that is not valid JSON of this protocol version."""


class RunManifest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    protocol: int = PROTOCOL_VERSION
    run_id: str
    strategy: str
    strategy_params: dict[str, Any]
    num_classes: int = Field(ge=2, le=MAX_NUM_CLASSES)  # beyond: a model of gigabytes on a Pi
    clients: list[str]
    rounds: int = Field(ge=1, le=MAX_ROUNDS)
    eval_every: int = Field(1, ge=1)
    public_hash: str | None = None
    public_size: int | None = Field(None, ge=1)
    public_url: str | None = None
    state: Literal["running", "finished", "stopped"] = "running"
    round: int = 0
    instance: str = Field("", description="changes when a run starts afresh; kept when a coordinator resumes it")

    @field_validator("public_url")
    @classmethod
    def _http_only(cls, v: str | None) -> str | None:
        """Never file:// (the device's own files: its private data as a 'public' set) or other schemes."""
        if v is not None and not v.lower().startswith(("http://", "https://")):
            raise ValueError(f"public_url must be an http:// or https:// URL, got {v[:100]!r}")
        return v

    @model_validator(mode="after")
    def _checkable(self) -> RunManifest:
        if self.public_url is not None and self.public_hash is None:
            raise ValueError("public_url needs public_hash: a fetched set is checked against it")
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, payload: bytes) -> RunManifest:
        try:
            data = json.loads(payload)
            manifest = cls.model_validate(data)
        except ValidationError as exc:  # its fields on one line, as a config's
            raise ManifestError(f"invalid run manifest: {describe(exc)}") from None
        except (ValueError, RecursionError) as exc:  # RecursionError: absurdly nested JSON
            raise ManifestError(f"invalid run manifest: {type(exc).__name__}: {exc}") from None
        if manifest.protocol != PROTOCOL_VERSION:
            raise ManifestError(f"run manifest has protocol {manifest.protocol}, this build speaks {PROTOCOL_VERSION}")
        return manifest
