"""Fault profiles: which faults the emulated broker injects, for whom and when, as TOML.

A profile has a `[default]` fault rule for every client, `[clients."<id or glob>"]` rules that
override it field by field for matching MQTT client ids, and `[[partitions]]` (a client cut off
from `start_s` to `end_s` after the proxy starts). Every rule may narrow a field to one direction
with `[<rule>.up]` (client -> broker) or `[<rule>.down]` (broker -> client). Fields left out fall
through to the next layer, ending at "no fault", so a profile states only what it changes.
"""

from __future__ import annotations

import fnmatch
import tomllib
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from fedal.strict_fields import NoCoercion
from fedal.validation import describe as describe_errors

DIRECTIONS = ("up", "down")
DropMode = Literal["reset", "lost", "unacked"]


class ProfileError(ValueError):
    """A profile that cannot be loaded; the message says which file and what is wrong."""


class FaultSettings(NoCoercion):
    """Faults on one link direction; None means "not set here" (the next layer decides)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    latency_ms: float | None = Field(None, ge=0, le=60_000, description="added one-way delay per packet")
    jitter_ms: float | None = Field(None, ge=0, le=60_000, description="extra delay, uniform in [0, jitter_ms]")
    bandwidth_kbps: float | None = Field(None, ge=0, le=10_000_000, description="link rate in kbit/s (0 = unlimited, "
                                         "else at least 1: a slower link held a packet for years)")

    @field_validator("bandwidth_kbps")
    @classmethod
    def _a_rate(cls, v: float | None) -> float | None:
        if v is not None and 0 < v < 1:
            raise ValueError(f"bandwidth_kbps must be 0 (unlimited) or at least 1 kbit/s, got {v:g}")
        return v
    drop: float | None = Field(None, ge=0, le=1, description="probability a PUBLISH is dropped")
    drop_mode: DropMode | None = Field(None, description="how a dropped PUBLISH is lost (docs/hil.md)")
    duplicate: float | None = Field(None, ge=0, le=1, description="probability a PUBLISH is delivered twice")
    reset: float | None = Field(None, ge=0, le=1, description="probability the connection dies at a packet")
    topics: list[str] | None = Field(None, description="MQTT topic filters that drop/duplicate apply to; default #")

    @field_validator("topics")
    @classmethod
    def _filters(cls, v: list[str] | None) -> list[str] | None:
        for f in v or []:
            levels = f.split("/")
            if not f or any(("#" in lv and (lv != "#" or i != len(levels) - 1)) or ("+" in lv and lv != "+")
                            for i, lv in enumerate(levels)):
                raise ValueError(f"{f!r} is not an MQTT topic filter")
        return v


class FaultRule(FaultSettings):
    """Faults for both directions, with optional per-direction overrides."""

    up: FaultSettings | None = None
    down: FaultSettings | None = None


class Partition(NoCoercion):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    client: str = Field("*", description="client id or glob pattern (fnmatch); * = everyone")
    start_s: float = Field(ge=0, description="seconds after the proxy started")
    end_s: float

    @model_validator(mode="after")
    def _window(self) -> Partition:
        if self.end_s <= self.start_s:
            raise ValueError(f"partition of {self.client!r} ends ({self.end_s}) before it starts ({self.start_s})")
        return self

    def matches(self, client_id: str) -> bool:
        return fnmatch.fnmatchcase(client_id, self.client)


class Faults(NoCoercion):
    """The part of a profile the control API can replace during a run."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    default: FaultRule = Field(default_factory=FaultRule)
    clients: dict[str, FaultRule] = Field(default_factory=dict, description="client id or glob -> overrides")


class Profile(Faults):
    name: str = ""
    description: str = ""
    seed: int | None = Field(None, description="seed of the fault decisions; --seed overrides it")
    partitions: list[Partition] = Field(default_factory=list)


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in hil/profiles/*.toml."""
    folder = resources.files("hil") / "profiles"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (`wifi-lossy`) or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ProfileError(f"profile file not found: {path}")
        try:
            text, origin = path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not text
            raise ProfileError(f"profile file {path} cannot be read as TOML text: {exc}") from None
    else:
        resource = resources.files("hil") / "profiles" / f"{name_or_path}.toml"
        if not resource.is_file():
            raise ProfileError(f"unknown profile {name_or_path!r}; built-in: {', '.join(builtin_profiles())} "
                               "(or give a path to a .toml file)")
        text, origin = resource.read_text(), name_or_path
    return parse_profile(text, origin)


def parse_profile(text: str, origin: str = "profile") -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{origin} is not valid TOML: {exc}") from None
    data.setdefault("name", Path(origin).stem)
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"invalid profile {origin}: {describe(exc)}") from None


def describe(exc: ValidationError) -> str:
    return describe_errors(exc, Profile, whole="profile")
