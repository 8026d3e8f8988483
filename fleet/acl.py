"""The Mosquitto ACL for a fleet: each device reaches only its own corner of the topic tree.

A device reads its run's manifest and its own task topic, and writes its own result and status
topics (status is also its retained Last Will, which Mosquitto checks at connect time). The
coordinator reads and writes everything under `fedal/v1/`. The run level is the fleet's run id:
a device could otherwise publish retained messages under any number of run ids nobody reads,
which the broker keeps (in memory and, with persistence, on disk) for ever. A new run under the
same id (a new instance) needs no change; another run id needs the agents' configs and this ACL
regenerated (`fedal fleet init`), or `--any-run-id`, which writes a `+` at the run level.

Explicit `user` blocks instead of `pattern ... %u` lines: every account's rights are readable in
the file, and an account added to the password file later gets nothing until it is listed here.
"""

from __future__ import annotations

from fedal.protocol import topics


def device_rules(client_id: str, run_id: str | None) -> list[str]:
    """run_id None: any run id (`+`)."""
    cid = topics.check_id(client_id, "client id")
    run = "+" if run_id is None else topics.check_id(run_id, "run id")
    root = topics.ROOT
    return [
        f"topic read {root}/{run}/run",
        f"topic read {root}/{run}/down/{cid}",
        f"topic write {root}/{run}/up/{cid}",
        f"topic write {root}/{run}/status/{cid}",
    ]


def coordinator_rules() -> list[str]:
    return [f"topic readwrite {topics.ROOT}/#"]


def acl_file(devices: list[str], coordinator_user: str, run_id: str | None) -> str:
    lines = ["# Mosquitto ACL written by `fedal fleet init`: one block per account.",
             "# Anonymous clients are refused by the listener (allow_anonymous false).", ""]
    lines += [f"user {coordinator_user}", *coordinator_rules(), ""]
    for cid in devices:
        lines += [f"user {cid}", *device_rules(cid, run_id), ""]
    return "\n".join(lines)
