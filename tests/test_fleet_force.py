"""`fedal fleet init --force` replaces only what an earlier `fedal fleet init` wrote in --out: a
user's own files there stay, a directory no fleet wrote is refused untouched, and a device that
left the fleet takes its stale credentials with it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from click.testing import CliRunner

from fedal_cli.main import cli
from fleet.generate import MARKER


def fleet_init(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["fleet", "init", *args])
    return result.exit_code, result.output


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_force_refuses_a_directory_no_fleet_wrote(tmp_path):
    home = tmp_path / "home"
    (home / "broker").mkdir(parents=True)
    (home / "thesis.txt").write_text("precious")
    (home / "broker" / "acl").write_text("my own broker's acl")
    (home / "fleet.json").write_text('{"my": "notes"}')
    mode = home.stat().st_mode
    before = snapshot(home)

    code, output = fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(home), "--force")
    assert code == 2 and "holds no fleet" in output, output
    assert snapshot(home) == before and home.stat().st_mode == mode  # not even chmod 0700


def test_force_replaces_the_fleet_and_keeps_the_users_files(tmp_path):
    out = tmp_path / "fleet"
    assert fleet_init("--devices", "3", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    written = set((out / MARKER).read_text().split()) - {"#"}
    assert "devices/pi-3/agent.toml" in written and "fleet.json" in written
    old_pw = (out / "devices" / "pi-1" / "agent.toml").read_text()
    (out / "notes.txt").write_text("mine")
    (out / "devices" / "pi-1" / "train.npz").write_bytes(b"my data")  # the user's, next to a generated file
    (out / "test-mosquitto.conf").write_text("listener 1883\n")

    code, output = fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(out), "--force")
    assert code == 0, output
    assert (out / "devices" / "pi-1" / "agent.toml").read_text() != old_pw  # replaced: new credentials
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "devices" / "pi-1" / "train.npz").read_bytes() == b"my data"
    assert (out / "test-mosquitto.conf").read_text() == "listener 1883\n"
    assert not (out / "devices" / "pi-3").exists()  # the device that left: its password is gone with it
    assert json.loads((out / "fleet.json").read_text())["devices"] == ["pi-1", "pi-2"]
    assert "devices/pi-3/agent.toml" not in (out / MARKER).read_text()


def test_force_refuses_a_user_file_in_the_way_before_writing_anything(tmp_path):
    out = tmp_path / "fleet"
    assert fleet_init("--devices", "2", "--broker", "mqtts://h", "--out", str(out))[0] == 0  # no TLS files
    (out / "ca").mkdir()
    (out / "ca" / "ca.key").write_text("the user's own CA key")
    before = snapshot(out)

    code, output = fleet_init("--devices", "2", "--broker", "mqtts://h", "--out", str(out), "--force", "--tls")
    assert code == 2 and "ca/ca.key" in output and "nothing was written" in output, output
    assert snapshot(out) == before


def test_force_over_a_fleet_written_before_the_file_list(tmp_path):
    """A fleet of an earlier version has fleet.json but no MARKER: its files are still known."""
    out = tmp_path / "fleet"
    assert fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    (out / MARKER).unlink()
    (out / "mine.txt").write_text("mine")
    old = (out / "devices" / "pi-2" / "agent.toml").read_text()
    code, output = fleet_init("--devices", "1", "--broker", "mqtt://h", "--out", str(out), "--force")
    assert code == 0, output
    assert not (out / "devices" / "pi-2").exists() and (out / "mine.txt").read_text() == "mine"
    assert old != (out / "devices" / "pi-1" / "agent.toml").read_text()


def test_force_never_writes_through_a_symlink(tmp_path):
    out = tmp_path / "fleet"
    assert fleet_init("--devices", "1", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not the fleet's")
    target = out / "broker" / "acl"
    target.unlink()
    os.symlink(elsewhere, target)
    assert fleet_init("--devices", "1", "--broker", "mqtt://h", "--out", str(out), "--force")[0] == 0
    assert elsewhere.read_text() == "not the fleet's"
    assert not target.is_symlink() and "pi-1" in target.read_text()


def linked_device_folder(tmp_path: Path, out: Path) -> Path:
    """pi-3's folder swapped for a link to an installed agent's /etc folder (a test on one machine)."""
    import shutil

    installed = tmp_path / "etc-fedal-agent"
    installed.mkdir()
    (installed / "agent.toml").write_text('client_id = "pi-3"  # the installed agent\'s config\n')
    shutil.rmtree(out / "devices" / "pi-3")
    (out / "devices" / "pi-3").symlink_to(installed)
    return installed


def test_force_and_revoke_never_remove_files_through_a_linked_device_folder(tmp_path):
    """Before: the stale or revoked device's files were unlinked through the link (another
    folder's agent.toml was deleted), then a NotADirectoryError left the revoke half done."""
    out = tmp_path / "fleet"
    assert fleet_init("--devices", "3", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    installed = linked_device_folder(tmp_path, out)
    before = snapshot(out) | {"installed": (installed / "agent.toml").read_bytes()}

    code, output = fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(out), "--force")
    assert code == 2 and "devices/pi-3" in output and "nothing was written" in output, output
    revoke = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-3"])
    assert revoke.exit_code != 0 and "devices/pi-3 is a link" in revoke.output and "nothing was changed" in revoke.output
    assert revoke.exception is None or isinstance(revoke.exception, SystemExit)  # said, not a traceback
    assert snapshot(out) | {"installed": (installed / "agent.toml").read_bytes()} == before


def test_a_revoke_that_cannot_write_says_so_and_the_same_command_finishes_it(tmp_path, monkeypatch):
    """Before: a traceback (PermissionError) and a revoke half applied: passwd without the
    device while fleet.json and the coordinator's config still listed it."""
    import errno

    from fleet import revoke

    out = tmp_path / "fleet"
    assert fleet_init("--devices", "3", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    write = revoke._write

    def full_after_the_accounts(path, text, mode):
        if path.name == "fleet.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(path, text, mode)

    monkeypatch.setattr(revoke, "_write", full_after_the_accounts)
    first = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-2"])
    assert first.exit_code != 0, first.output
    assert "cannot write fleet.json: No space left on device" in first.output
    assert "run the same command again" in first.output
    assert first.exception is None or isinstance(first.exception, SystemExit)  # said, not a traceback
    monkeypatch.setattr(revoke, "_write", write)
    again = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-2"])
    assert again.exit_code == 0, again.output
    assert json.loads((out / "fleet.json").read_text())["devices"] == ["pi-1", "pi-3"]
    assert "pi-2" in json.loads((out / "fleet.json").read_text())["revoked"]
