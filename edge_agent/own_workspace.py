"""The directory an agent may write: its workspace, claimed like any FedAL workspace.

The agent replaces its checkpoint, journal, public set cache and final model in place, so a
`workspace` pointed at a user's folder (`.`, `~`) would overwrite files named like those. A new
or empty directory is claimed (marked), a marked one reused. An unmarked one is adopted only if it
holds nothing but the agent's own files and the files its config names (an agent workspace from
before the marker existed, or a state directory the installer filled with the private data), or
if it is the service's own state directory (systemd's $STATE_DIRECTORY).
"""

from __future__ import annotations

import os
from pathlib import Path

from fedal import workspace
from fedal.atomic import TEMPORARY_NAME
from fedal.workspace import WorkspaceError

from .config import AgentConfig

__all__ = ["claim_workspace", "foreign_entries", "OWN_NAMES"]

# what an agent writes into its workspace (edge_agent.agent, public_set, inference)
OWN_NAMES = frozenset({"checkpoint.pt", "round-start.pt", "journal.bin", "public.npz", "agent-status.json",
                       "final", "snapshots", workspace.MARKER, workspace.LOCK,
                       # on a Pi's state directory: the service's dataset cache (FEDAL_CACHE_DIR), firstboot's mark
                       "cache", ".firstboot-done"})


KEPT_UNREADABLE = ".unreadable-"  # checkpoint.pt.unreadable-<time>: a damaged checkpoint, kept (Agent.host)


def _named_files(config: AgentConfig) -> set[Path]:
    named = [config.data_file, config.test_file, config.local_test_file, config.public_file, config.broker.ca_file]
    return {Path(os.path.abspath(p)) for p in named if p is not None}


def foreign_entries(config: AgentConfig, entries: list[Path]) -> list[Path]:
    """Entries of the workspace that neither the agent writes nor its config names."""
    named = _named_files(config)
    out = []
    for entry in entries:
        torn = TEMPORARY_NAME.match(entry.name)  # our own writes, torn by a crash
        if entry.name in OWN_NAMES or (torn and torn["name"] in OWN_NAMES):
            continue
        if entry.name.startswith(f"checkpoint.pt{KEPT_UNREADABLE}"):
            continue
        if Path(os.path.abspath(entry)) in named:
            continue
        out.append(entry)
    return out


def _is_service_state_dir(path: Path) -> bool:
    """systemd names the directories it made for this service (StateDirectory=) in $STATE_DIRECTORY."""
    dirs = [d for d in os.environ.get("STATE_DIRECTORY", "").split(":") if d]
    try:
        return any(Path(d).resolve() == path.resolve() for d in dirs)
    except OSError:
        return False


def claim_workspace(config: AgentConfig) -> Path:
    """The config's workspace, created or marked as the agent's; WorkspaceError if it is a user's."""
    path = Path(config.workspace)
    foreign: list[Path] = []

    def adoptable(entries: list[Path]) -> bool:
        if _is_service_state_dir(path):
            return True
        foreign.extend(foreign_entries(config, entries))
        return not foreign

    try:
        return workspace.claim(path, "fedal agent", adoptable)
    except WorkspaceError as exc:
        if not foreign:
            raise
        shown = ", ".join(e.name for e in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        verb = "is" if len(foreign) == 1 else "are"
        raise WorkspaceError(
            f"{exc}. The agent writes its checkpoints and final model there, and {shown} {verb} not the agent's: set "
            f"`workspace` to a directory of its own. (To let the agent use this one as it is, create the file "
            f"{path / workspace.MARKER}.)") from None
