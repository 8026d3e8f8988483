"""Broker addresses as URLs: mqtt://[user[:password]@]host[:port] or mqtts://... (TLS)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pydantic import ConfigDict, Field, field_validator, model_validator

from fedal.protocol.chunking import DEFAULT_MAX_PAYLOAD
from fedal.strict_fields import NoCoercion

# The largest MQTT payload FedAL publishes (envelope, chunk, manifest or status): `max_payload`
# may not exceed it, `split` keeps chunks within max_payload, and the broker configuration
# `fedal fleet init` writes refuses larger packets, so a device cannot make the broker relay more.
MAX_PAYLOAD = 1024 * 1024


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool
    username: str | None = None
    password: str | None = None

    def redacted(self) -> str:
        user = f"{self.username}:***@" if self.username else ""
        return f"{'mqtts' if self.tls else 'mqtt'}://{user}{self.host}:{self.port}"


def without_password(url: str) -> str:
    """A URL (a broker's, a store's) as an error message may quote it: its password, if any, as ***.
    Textual, so it works on URLs no parser takes (those are what error messages quote)."""
    return re.sub(r"^([^/]*//[^/@]*?:)[^/]*@", r"\1***@", url)


def parse_broker_url(url: str) -> BrokerAddress:
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts"):
        raise ValueError(f"broker URL {without_password(url)!r} must start with mqtt:// or mqtts://")
    if not parts.hostname:
        raise ValueError(f"broker URL {without_password(url)!r} has no host")
    try:  # as the resolver will: `broker..local` or a label over 63 characters is no host name
        parts.hostname.encode("idna")
    except UnicodeError:
        raise ValueError(f"broker URL {without_password(url)!r}: {parts.hostname!r} is not a host name (an empty "
                         "label, or one longer than 63 characters)") from None
    tls = parts.scheme == "mqtts"
    try:
        given = parts.port
    except ValueError:
        raise ValueError(f"broker URL {without_password(url)!r} has an invalid port") from None
    if given == 0:  # (`or` below would have taken it for "no port" and used the default)
        raise ValueError(f"broker URL {without_password(url)!r} has an invalid port: 0")
    port = given or (8883 if tls else 1883)
    return BrokerAddress(
        host=parts.hostname,
        port=port,
        tls=tls,
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


class BrokerSettings(NoCoercion):
    """The `[broker]` table shared by the agent's and the coordinator's configs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    url: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: str | None = None
    ca_file: Path | None = Field(None, description="CA bundle for mqtts:// brokers")
    keepalive: int = Field(30, ge=5, le=3600)
    max_payload: int = Field(DEFAULT_MAX_PAYLOAD, ge=4096, le=MAX_PAYLOAD,
                             description="larger envelopes are chunked; at most the protocol's MAX_PAYLOAD (1 MiB)")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parse_broker_url(v)
        return v

    @model_validator(mode="after")
    def _ca_file_needs_tls(self) -> BrokerSettings:
        if self.ca_file is not None and not parse_broker_url(self.url).tls:
            raise ValueError(f"broker.ca_file is set but the URL {without_password(self.url)!r} is plain mqtt://: "
                             "nothing would be encrypted (the password would cross the network in the clear); "
                             "use mqtts:// (or leave ca_file out)")
        return self

    def missing_file(self) -> str | None:
        """Why this machine cannot use these settings' files (a CA file that is not there), else
        None. Checked where a process starts, not in the model: a fleet's configs are written and
        checked on a workstation that holds none of the devices' files."""
        if self.ca_file is not None and not self.ca_file.is_file():
            return f"broker.ca_file {self.ca_file} does not exist (the CA the broker's certificate is checked against)"
        return None
