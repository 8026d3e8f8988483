"""An agent writes only into a workspace of its own: a user's folder given as `workspace` is
refused with nothing in it touched; an agent workspace from before the marker, the installer's
state directory with the private data, and systemd's StateDirectory are adopted; a second agent
on a workspace in use is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomli_w

from edge_agent.config import AgentConfig
from edge_agent.own_workspace import claim_workspace
from fedal import workspace
from fedal.workspace import WorkspaceError


def _config(ws, data=None) -> AgentConfig:
    return AgentConfig(client_id="c00", run_id="lab", model="mlp", data_file=data or ws / "train.npz", workspace=ws,
                       broker={"url": "mqtt://127.0.0.1:1"})


def test_a_users_folder_is_refused_by_the_agent_command_and_left_as_it_was(tmp_path):
    ws = tmp_path / "home"
    ws.mkdir()
    (ws / "notes.txt").write_text("mine")
    (ws / "checkpoint.pt").write_bytes(b"someone else's checkpoint")
    config = tmp_path / "agent.toml"
    (tmp_path / "train.npz").write_bytes(b"")
    config.write_text(tomli_w.dumps(_config(ws, data=tmp_path / "train.npz").model_dump(mode="json", exclude_defaults=True)))
    out = subprocess.run([sys.executable, "-m", "edge_agent", "--config", str(config)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert "notes.txt" in out.stderr and "not the agent's" in out.stderr and workspace.MARKER in out.stderr
    assert sorted(p.name for p in ws.iterdir()) == ["checkpoint.pt", "notes.txt"]
    assert (ws / "checkpoint.pt").read_bytes() == b"someone else's checkpoint"


def test_the_agent_itself_refuses_a_users_folder_before_it_connects(tmp_path):
    from edge_agent.agent import Agent

    ws = tmp_path / "home"
    ws.mkdir()
    (ws / "thesis").mkdir()
    agent = Agent(_config(ws))
    assert agent.run() == 2
    assert [p.name for p in ws.iterdir()] == ["thesis"]
    assert agent.link.connects == 0


def test_a_new_or_empty_directory_is_claimed(tmp_path):
    assert claim_workspace(_config(tmp_path / "new" / "ws")) == tmp_path / "new" / "ws"
    assert workspace.is_workspace(tmp_path / "new" / "ws")
    (tmp_path / "empty").mkdir()
    claim_workspace(_config(tmp_path / "empty"))
    assert workspace.is_workspace(tmp_path / "empty")


def agent_files(folder):
    """What an agent from before the marker left in its workspace, as it writes each file."""
    import json

    import torch

    from edge_agent.checkpoint import Journal

    (folder / "final").mkdir(parents=True)
    torch.save({"run_id": "lab", "instance": "i", "id": "c1", "client": {}, "round": 3}, folder / "checkpoint.pt")
    Journal(folder / "journal.bin").reset("c1")
    (folder / "agent-status.json").write_text(json.dumps({"client_id": "c00", "counters": {}}))
    import numpy as np

    np.savez(folder / "public.npz", x=np.zeros((4, 2), np.float32))
    (folder / ".checkpoint.pt.k3j2.tmp").write_bytes(b"x")
    torch.save({"fc.weight": torch.zeros(2, 2)}, folder / "final" / "model.pt")
    (folder / "final" / "instance").write_text("i\n")
    (folder / "snapshots").mkdir()
    (folder / "snapshots" / "snapshot-1.onnx").write_bytes(b"x")


@pytest.mark.parametrize("theirs", ["checkpoint", "final", "final-model", "public", "journal", "status", "cache"])
def test_files_named_like_the_agents_that_hold_something_else_are_not_adopted(tmp_path, theirs):
    """An unmarked folder was adopted on names alone: a user's `checkpoint.pt` (the commonest
    PyTorch file name) was loaded and then overwritten, their final/model.onnx deleted."""
    import torch

    ws = tmp_path / "my-experiment"
    agent_files(ws)
    if theirs == "checkpoint":
        torch.save({"epoch": 41, "weights": torch.zeros(3)}, ws / "checkpoint.pt")
    elif theirs == "final":
        (ws / "final" / "model.onnx.bak").write_bytes(b"USER")
    elif theirs == "final-model":  # the agent's names, a user's files: adopted on names alone, then overwritten
        (ws / "final" / "model.pt").write_text("my notes on the model\n")
        (ws / "final" / "model.onnx").write_text("not a model\n")
    elif theirs == "public":
        (ws / "public.npz").write_text("a user's file of that name\n")
    elif theirs == "journal":
        (ws / "journal.bin").write_text("day 1: ...\n")
    elif theirs == "status":
        (ws / "agent-status.json").write_text('{"mine": true}')
    else:
        (ws / "cache").mkdir()
        (ws / "cache" / "thesis.tex").write_text("...")
    before = {p: p.read_bytes() for p in ws.rglob("*") if p.is_file()}
    with pytest.raises(WorkspaceError, match="not the agent's"):
        claim_workspace(_config(ws))
    assert not workspace.is_workspace(ws)
    assert {p: p.read_bytes() for p in ws.rglob("*") if p.is_file()} == before


def test_an_unmarked_agent_workspace_and_the_installers_state_dir_are_adopted(tmp_path):
    old = tmp_path / "old"  # written by an agent from before the marker
    agent_files(old)
    claim_workspace(_config(old))
    assert workspace.is_workspace(old)

    state = tmp_path / "state"  # install-agent.sh put the private data and the test set there
    state.mkdir()
    (state / "pi-3.npz").write_bytes(b"data")
    (state / "test.npz").write_bytes(b"test")
    (state / ".firstboot-done").write_text("")  # and what the service and firstboot keep there
    (state / "cache").mkdir()
    cfg = _config(state, data=state / "pi-3.npz").model_copy(update={"test_file": state / "test.npz"})
    claim_workspace(cfg)
    assert workspace.is_workspace(state)


def test_a_file_the_config_does_not_name_is_not_adopted_even_among_the_agents_own(tmp_path):
    ws = tmp_path / "ws"
    agent_files(ws)
    (ws / "other.npz").write_bytes(b"x")
    with pytest.raises(WorkspaceError, match="other.npz is not the agent's"):
        claim_workspace(_config(ws))
    assert not workspace.is_workspace(ws)


def test_the_services_state_directory_is_the_agents_whatever_it_holds(tmp_path, monkeypatch):
    state = tmp_path / "fedal-agent"
    (state / "cache").mkdir(parents=True)
    (state / ".bash_history").write_text("")
    with pytest.raises(WorkspaceError):
        claim_workspace(_config(state))
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path / 'elsewhere'}:{state}")
    claim_workspace(_config(state))
    assert workspace.is_workspace(state)


def test_a_second_agent_on_a_workspace_in_use_is_refused(tmp_path):
    from edge_agent.agent import Agent

    ws = claim_workspace(_config(tmp_path / "ws"))
    with workspace.held(ws, "the agent c00"):
        agent = Agent(_config(ws))
        assert agent.run() == 1
        assert agent.link.connects == 0


def test_a_lock_file_another_user_made_still_locks(tmp_path, monkeypatch):
    """Run once by hand as root, the agent left .fedal-workspace.lock 0644 root: the service user
    could not open it for writing and exited 1 at every restart. A lock needs no write access."""
    import os

    ws = claim_workspace(_config(tmp_path / "ws"))
    (ws / workspace.LOCK).write_text("`root` (PID 1)\n")
    real_open = os.open

    def as_another_user(path, flags, *mode):
        if str(path).endswith(workspace.LOCK) and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *mode)

    monkeypatch.setattr(os, "open", as_another_user)
    with workspace.held(ws, "the agent c00"):
        with pytest.raises(WorkspaceError, match="in use by `root` \\(PID 1\\)"):  # still exclusive
            with workspace.held(ws, "a second agent"):
                raise AssertionError("a second holder got the lock")
