"""The MQTT topic tree of protocol version 1 (documented in docs/protocol.md).

    fedal/v1/<run>/run               coordinator -> all   retained JSON run manifest
    fedal/v1/<run>/down/<client>     coordinator -> one   task envelopes
    fedal/v1/<run>/up/<client>       client -> coordinator result envelopes
    fedal/v1/<run>/status/<client>   client -> all        retained JSON online/offline (Last Will)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "fedal/v1"
# not only dots: an id also names directories (a run's results, an agent's workspace), and "."
# or ".." would name the directory itself or its parent
ID_PATTERN = re.compile(r"(?!\.+$)[A-Za-z0-9_.-]{1,64}")
KINDS = ("run", "down", "up", "status")


class TopicError(ValueError):
    """A topic outside the protocol's tree, or with an invalid id."""


def check_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise TopicError(f"invalid {what} {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . -, not only dots")
    return value


def run_manifest(run: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/run"


def task(run: str, client: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/down/{check_id(client, 'client id')}"


def result(run: str, client: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/up/{check_id(client, 'client id')}"


def status(run: str, client: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/status/{check_id(client, 'client id')}"


def results_filter(run: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/up/+"


def status_filter(run: str) -> str:
    return f"{ROOT}/{check_id(run, 'run id')}/status/+"


@dataclass(frozen=True)
class Topic:
    run: str
    kind: str
    client: str | None


def parse(topic: str) -> Topic:
    parts = topic.split("/")
    if len(parts) < 4 or "/".join(parts[:2]) != ROOT or parts[3] not in KINDS:
        raise TopicError(f"topic {topic!r} is not in the {ROOT} tree")
    run, kind = check_id(parts[2], "run id"), parts[3]
    if kind == "run":
        if len(parts) != 4:
            raise TopicError(f"topic {topic!r}: the manifest topic has no client part")
        return Topic(run, kind, None)
    if len(parts) != 5:
        raise TopicError(f"topic {topic!r}: expected {ROOT}/<run>/{kind}/<client>")
    return Topic(run, kind, check_id(parts[4], "client id"))


def acl_run_level(acl_text: str) -> str | None:
    """The run level a Mosquitto ACL written for these topics gives devices (a run id, or `+` for
    any): from a device's `topic read fedal/v1/<run>/run` rule; None where it has none. The docs
    move a fleet to another run id by editing the ACL, so the ACL, not what was first written
    beside it, says which run a device may join."""
    for line in acl_text.splitlines():
        m = re.fullmatch(rf"topic read {re.escape(ROOT)}/([^/\s]+)/run", line.strip())
        if m:
            return m.group(1)
    return None
