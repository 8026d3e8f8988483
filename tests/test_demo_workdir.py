"""`fedal demo --workdir DIR` never deletes what the toolkit did not create: a non-empty directory
without the workspace marker is refused (exit 2) untouched; a workspace of an earlier demo is
reused, and only its coordinator/ and agents/ trees are replaced (and the earlier run's own
results.json and accuracy.png, which would otherwise pass as the new run's)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedal import workspace
from fedal.sim import load_config
from fedal_cli.demo import prepare_workspace
from fedal_cli.main import cli
from tests.helpers import fedal_command


def fedal() -> list[str]:
    return fedal_command()


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def demo_args(workdir: str, out: Path) -> list[str]:
    return ["demo", "--dataset", "digits", "--clients", "2", "--rounds", "1", "--strategy", "fedmd", "--public-size", "60",
            "--workdir", workdir, "--out", str(out), "--quiet"]


def test_demo_refuses_a_directory_it_did_not_create(tmp_path):
    thesis = tmp_path / "w"
    thesis.mkdir()
    (thesis / "thesis.txt").write_text("precious")
    (thesis / "coordinator").mkdir()
    (thesis / "coordinator" / "notes.md").write_text("mine too")
    before = snapshot(thesis)
    result = CliRunner().invoke(cli, demo_args(str(thesis), tmp_path / "r.json"))
    assert result.exit_code == 2, result.output
    assert "--workdir" in result.output and workspace.MARKER in result.output
    assert snapshot(thesis) == before and not (tmp_path / "r.json").exists()


def test_demo_refuses_the_current_directory(tmp_path):
    """`--workdir .` from a folder of one's own: the real command, refused before anything starts."""
    (tmp_path / "thesis.txt").write_text("precious")
    proc = subprocess.run([*fedal(), *demo_args(".", tmp_path / "r.json")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "not a FedAL workspace" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["thesis.txt"]
    assert (tmp_path / "thesis.txt").read_text() == "precious"


@pytest.fixture()
def config():
    return load_config(None, dict(strategy="fedmd", dataset="digits", clients=3, rounds=1, public_size=60, seed=0)).resolved()


def test_a_workspace_is_made_adopted_and_reused_clearing_only_its_own_trees(tmp_path, config):
    ws = tmp_path / "ws"
    ws.mkdir()  # empty: adopted
    prepare_workspace(config, ws, "mqtt://127.0.0.1:1", 1)
    assert workspace.is_workspace(ws) and (ws / "agents" / "c02" / "agent.toml").exists()
    (ws / "results.json").write_text("{}")  # what the demo writes next to them, and a user's note
    (ws / "notes.txt").write_text("mine")
    (ws / "agents" / "c02" / "stale.log").write_text("from the last run")

    smaller = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=60)).resolved()
    prepare_workspace(smaller, ws, "mqtt://127.0.0.1:1", 1)
    assert not (ws / "agents" / "c02").exists()  # the earlier run's agents are gone ...
    assert (ws / "agents" / "c01" / "agent.toml").exists()
    assert (ws / "notes.txt").read_text() == "mine" and (ws / "results.json").exists()  # ... nothing else

    # the earlier run's own results (a run stopped midway writes none: they would pass as its)
    (ws / "results.json").write_text('{"config": {"rounds": 1}, "rounds": [], "final": {}}\n')
    prepare_workspace(smaller, ws, "mqtt://127.0.0.1:1", 1)
    assert not (ws / "results.json").exists() and (ws / "notes.txt").read_text() == "mine"


def test_a_link_in_a_workspace_is_removed_never_followed(tmp_path, config):
    ws = tmp_path / "ws"
    prepare_workspace(config, ws, "mqtt://127.0.0.1:1", 1)  # new: created with its marker
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    shutil.rmtree(ws / "agents")
    (ws / "agents").symlink_to(elsewhere)
    prepare_workspace(config, ws, "mqtt://127.0.0.1:1", 1)
    assert (elsewhere / "keep.txt").read_text() == "keep" and not (ws / "agents").is_symlink()


def test_hil_fleet_refuses_a_workdir_it_did_not_create(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "coordinator.toml").write_text("# my own coordinator's config\n")
    before = snapshot(mine)
    proc = subprocess.run([*fedal(), "hil", "fleet", "--clients", "1", "--run-id", "r", "--broker", "mqtt://127.0.0.1:1",
                           "--start-coordinator", "--workdir", str(mine), "--timeout", "1", "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--workdir" in proc.stderr and workspace.MARKER in proc.stderr
    assert snapshot(mine) == before


def test_a_workspace_in_use_by_a_live_run_is_refused_and_released_when_it_ends(tmp_path):
    """A second demo on the --workdir of one under way would clear its coordinator's database and
    its agents' checkpoints: refused while the first holds the workspace (a real process), taken
    once it has ended, however it ended (the kernel drops the lock with the process)."""
    import sys
    import time

    ws = workspace.claim(tmp_path / "ws", "fedal demo")
    (ws / "coordinator").mkdir()
    (ws / "coordinator" / "coordinator.db").write_bytes(b"live state")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time\nfrom fedal import workspace\n"
                               "with workspace.held(sys.argv[1], 'fedal demo'):\n"
                               "    print('held', flush=True)\n    time.sleep(120)\n", str(ws)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(workspace.WorkspaceError, match=rf"is in use by `fedal demo` \(PID {holder.pid}\)"):
            with workspace.held(ws, "fedal demo"):
                pytest.fail("entered a workspace another run holds")
        r = CliRunner().invoke(cli, demo_args(str(ws), tmp_path / "r.json"))
        assert r.exit_code == 2, r.output
        assert f"is in use by `fedal demo` (PID {holder.pid})" in r.stderr
        assert (ws / "coordinator" / "coordinator.db").read_bytes() == b"live state"  # untouched
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own
        holder.wait()
    time.sleep(0.1)
    with workspace.held(ws, "fedal demo"):
        with pytest.raises(workspace.WorkspaceError, match=r"in use"):  # also within one process
            with workspace.held(ws, "another"):
                pytest.fail("entered a workspace this process holds")


def test_the_workspace_lock_is_never_written_through_a_link(tmp_path):
    ws = workspace.claim(tmp_path / "ws", "fedal demo")
    precious = tmp_path / "precious.txt"
    precious.write_text("a user's file\n")
    (ws / workspace.LOCK).symlink_to(precious)
    with pytest.raises(workspace.WorkspaceError, match="remove it: it is a link"):
        with workspace.held(ws, "fedal demo"):
            pytest.fail("held a workspace through a lock file that is a link")
    assert precious.read_text() == "a user's file\n"
