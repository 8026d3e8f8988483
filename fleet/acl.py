"""The Mosquitto ACL for a fleet: each device reaches only its own corner of the topic tree.

A device reads the run manifests and its own task topic, and writes its own result and status
topics (status is also its retained Last Will, which Mosquitto checks at connect time). The
coordinator reads and writes everything under `fedal/v1/`. The run level is a `+` wildcard:
credentials belong to a device, not to one run, so starting a new run with another run id needs
no change on the broker, while a device still can never speak for another device.

Explicit `user` blocks instead of `pattern ... %u` lines: every account's rights are readable in
the file, and an account added to the password file later gets nothing until it is listed here.
"""

from __future__ import annotations

from fedal.protocol import topics


def device_rules(client_id: str) -> list[str]:
    cid = topics.check_id(client_id, "client id")
    root = topics.ROOT
    return [
        f"topic read {root}/+/run",
        f"topic read {root}/+/down/{cid}",
        f"topic write {root}/+/up/{cid}",
        f"topic write {root}/+/status/{cid}",
    ]


def coordinator_rules() -> list[str]:
    return [f"topic readwrite {topics.ROOT}/#"]


def acl_file(devices: list[str], coordinator_user: str) -> str:
    lines = ["# Mosquitto ACL written by `fedal fleet init`: one block per account.",
             "# Anonymous clients are refused by the listener (allow_anonymous false).", ""]
    lines += [f"user {coordinator_user}", *coordinator_rules(), ""]
    for cid in devices:
        lines += [f"user {cid}", *device_rules(cid), ""]
    return "\n".join(lines)
