"""The directory an agent may write: its workspace, claimed like any FedAL workspace.

The agent replaces its checkpoint, journal, public set cache and final model in place, so a
`workspace` pointed at a user's folder (`.`, `~`) would overwrite files named like those. A new
or empty directory is claimed (marked), a marked one reused. An unmarked one is adopted only if it
holds nothing but the agent's own files (judged by what they hold, not by name alone) and the
files its config names (an agent workspace from
before the marker existed, or a state directory the installer filled with the private data), or
if it is the service's own state directory (systemd's $STATE_DIRECTORY).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from fedal import workspace
from fedal.atomic import TEMPORARY_NAME
from fedal.workspace import WorkspaceError

from .config import AgentConfig

__all__ = ["claim_workspace", "foreign_entries", "holds_agent_content", "OWN_NAMES"]

# what an agent writes into its workspace (edge_agent.agent, public_set, inference)
OWN_NAMES = frozenset({"checkpoint.pt", "round-start.pt", "journal.bin", "public.npz", "agent-status.json",
                       "final", "snapshots", workspace.MARKER, workspace.LOCK,
                       # on a Pi's state directory: the service's dataset cache (FEDAL_CACHE_DIR), firstboot's mark
                       "cache", ".firstboot-done"})


KEPT_UNREADABLE = ".unreadable-"  # checkpoint.pt.unreadable-<time>: a damaged checkpoint, kept (Agent.host)
KEPT_UNFIT = ".unfit-"  # checkpoint.pt.unfit-<time>: one of another model than the config's, kept (Agent.host)


def _named_files(config: AgentConfig) -> set[Path]:
    named = [config.data_file, config.test_file, config.local_test_file, config.public_file, config.broker.ca_file]
    return {Path(os.path.abspath(p)) for p in named if p is not None}


# what the agent writes inside its folders (edge_agent.agent's final model, inference's snapshots,
# the dataset cache of fedal.data.embedded)
FOLDER_FILES = {"final": re.compile(r"model\.pt|test_logits\.npy|model\.onnx|model\.int8\.onnx|instance"),
                "snapshots": re.compile(r"snapshot-[01]\.onnx"),
                "cache": re.compile(r"(mnist1d|digits)-[0-9a-f]+(\.npz|\.[^.]+\.tmp)")}
CHECKPOINT_KEYS = {"checkpoint.pt": {"run_id", "instance", "id", "client"}, "round-start.pt": {"round", "client"}}


def holds_agent_content(entry: Path) -> bool:
    """Whether an entry named like one of the agent's holds what the agent writes there: an
    unmarked folder is adopted on what it holds, not on names alone (`checkpoint.pt` and `final/`
    are common names; a user's would be overwritten)."""
    if entry.is_symlink():
        return False
    name = entry.name
    if name in FOLDER_FILES:
        if not (entry.is_dir() and all(
                (FOLDER_FILES[name].fullmatch(child.name) or TEMPORARY_NAME.match(child.name)) and not child.is_symlink()
                for child in entry.iterdir())):
            return False
        # final/: the model the agent writes there is a state dict, saved beside the others
        # (a user's final/model.pt and model.onnx would otherwise be overwritten on names alone)
        model = entry / "model.pt"
        if name == "final" and (model.exists() or any(entry.glob("*.onnx"))):
            return model.is_file() and _loads_as_dict(model)
        return True
    if not entry.is_file():
        return False
    if name in CHECKPOINT_KEYS:
        state = _load(entry)
        return isinstance(state, dict) and CHECKPOINT_KEYS[name] <= set(state)
    if name == "public.npz":  # a public set (its hash is checked before use), not any file of that name
        import numpy as np

        try:
            with np.load(entry, allow_pickle=False) as z:
                return isinstance(z, np.lib.npyio.NpzFile) and "x" in z.files
        except Exception:  # noqa: BLE001 (whatever it is, it is no public set the agent wrote)
            return False
    if name == "journal.bin":
        from .checkpoint import first_record_header  # (torch: imported only for an unmarked folder's journal)

        with contextlib.suppress(OSError):
            return "checkpoint" in (first_record_header(entry.read_bytes()[:1 << 16]) or {})
        return False
    if name == "agent-status.json":
        with contextlib.suppress(OSError, ValueError):
            status = json.loads(entry.read_text())
            return isinstance(status, dict) and "client_id" in status
        return False
    return True  # public.npz (a public set, checked against the run's hash before use), the markers


def _load(path: Path) -> object:
    """torch.load of tensors alone (imported only for an unmarked folder's files); None if it is not that."""
    try:
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 (whatever it is, it is nothing the agent wrote)
        return None


def _loads_as_dict(path: Path) -> bool:
    return isinstance(_load(path), dict)


def foreign_entries(config: AgentConfig, entries: list[Path]) -> list[Path]:
    """Entries of the workspace that neither the agent writes nor its config names, and those
    named like the agent's that hold something else (holds_agent_content)."""
    named = _named_files(config)
    out = []
    for entry in entries:
        torn = TEMPORARY_NAME.match(entry.name)  # our own writes, torn by a crash
        if entry.name in OWN_NAMES and not holds_agent_content(entry):
            out.append(entry)
            continue
        if entry.name in OWN_NAMES or (torn and torn["name"] in OWN_NAMES):
            continue
        if entry.name.startswith((f"checkpoint.pt{KEPT_UNREADABLE}", f"checkpoint.pt{KEPT_UNFIT}")):
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
