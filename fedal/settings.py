"""TOML config files with environment-variable overrides, for the agent and the coordinator.

Precedence: explicit arguments > environment (e.g. FEDAL_AGENT_BROKER__URL) > the TOML file >
defaults. Errors come back as one readable line per problem.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import pydantic_settings
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, TomlConfigSettingsSource

from fedal.validation import describe

S = TypeVar("S", bound=BaseSettings)


class SettingsError(ValueError):
    """A config file or environment that cannot configure the program; the message says why."""


def load_settings(cls: type[S], path: str | Path | None = None, **overrides) -> S:
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise SettingsError(f"config file not found: {path}")
        try:
            tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
        except RecursionError:  # nested past what the parser takes
            raise SettingsError(f"config file {path} is not valid TOML: nested too deep") from None
        except OSError as exc:  # a device's 0600 config read by another user (flash.sh without sudo)
            raise SettingsError(f"config file {path} cannot be read: {exc.strerror or exc}") from None

    class _WithFile(cls):  # type: ignore[misc, valid-type]
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
            if path is not None:
                sources += (TomlConfigSettingsSource(settings_cls, toml_file=path),)
            return sources

    prefix = str(cls.model_config.get("env_prefix", ""))
    env = sorted(k for k in os.environ if prefix and k.upper().startswith(prefix.upper()))
    try:
        loaded = _WithFile(**overrides)
    except ValidationError as exc:
        problems = describe(exc, cls, whole="config")
        # a value may come from the environment as well as the file: say which were set
        source = f" {path}" if path else ""
        if env:
            source += f" (with environment overrides {', '.join(env)})"
        raise SettingsError(f"invalid config{source}: {problems}") from None
    except pydantic_settings.SettingsError as exc:  # e.g. FEDAL_AGENT_BROKER='{bad': not the JSON a table takes
        raise SettingsError(f"environment override: {exc} (a table is given as JSON, or one key at a time as "
                            f"{prefix}TABLE__KEY)") from None
    return cls.model_validate(loaded.model_dump())


def exposed_secrets(path: str | Path, secret_keys: list[str]) -> tuple[list[str], int] | None:
    """The dotted keys of `secret_keys` (`url` counts when it carries user:password@) set in the TOML
    file at `path`, and its mode, when group or others have any access to it; else None."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777
    if not mode & 0o077:
        return None
    data = tomllib.loads(path.read_text())
    found = []
    for key in secret_keys:
        value: object = data
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if key.endswith("url") and isinstance(value, str):
            try:
                value = urlsplit(value).password
            except ValueError:
                value = None
        if value:
            found.append(key)
    return (found, mode) if found else None
