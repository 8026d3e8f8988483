"""`fedal fleet` keeps what is not its own and what still works: a re-init that cannot finish
writes nothing, the admin's own ACL lines outlive a revoke, a wrong CA key renews nothing, and
a failed write says so instead of a traceback."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedal_cli.main import cli
from fleet import generate


def fleet(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["fleet", *args])
    return result.exit_code, result.output


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_file_where_a_new_device_folder_goes_refuses_the_whole_init(tmp_path):
    """Before, the check asked only whether each planned file existed: the marker, the new CA and
    the broker's files were written, then making devices/dev-2/ failed with a traceback, and the
    CA key of the fleet still on the devices was gone."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "2", "--broker", "mqtts://h", "--tls", "--out", str(out))[0] == 0
    (out / "devices" / "dev-2").write_text("my notes\n")
    before = snapshot(out)
    code, output = fleet("init", "--devices", "2", "--prefix", "dev-", "--broker", "mqtts://h", "--tls",
                         "--out", str(out), "--force")
    assert code == 2 and "devices/dev-2" in output and "nothing was written" in output, output
    assert snapshot(out) == before  # the CA key the devices' certificate chain needs included


def test_a_write_that_fails_midway_is_a_clear_error(tmp_path, monkeypatch):
    real_write = generate._write
    written: list[Path] = []

    def full_disk(path: Path, text, mode: int) -> None:
        if generate._PLAN.get() is None and len(written) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, text, mode)
        if generate._PLAN.get() is None:
            written.append(path)

    monkeypatch.setattr(generate, "_write", full_disk)
    out = tmp_path / "fleet"
    code, output = fleet("init", "--devices", "2", "--broker", "mqtt://h", "--out", str(out))
    assert code == 2 and "No space left on device" in output and generate.MARKER in output, output
    marker = (out / generate.MARKER).read_text()
    assert all(p.relative_to(out).as_posix() in marker for p in written[1:])  # what --force may replace
    monkeypatch.setattr(generate, "_write", real_write)
    assert fleet("init", "--devices", "2", "--broker", "mqtt://h", "--out", str(out), "--force")[0] == 0


def test_every_fleet_file_is_synced_before_its_rename(tmp_path, monkeypatch):
    """A power cut right after `fleet init` or `revoke` must not leave an empty passwd or ca.key."""
    synced: set[int] = set()
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add(os.fstat(fd).st_ino), real_fsync(fd))[1])
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "2", "--broker", "mqtts://h", "--tls", "--out", str(out))[0] == 0
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and all(p.stat().st_ino in synced for p in files)


@pytest.mark.parametrize("broker", ["mqtts://bröker.lan", "mqtts://bro ker"])
def test_a_broker_host_that_is_no_name_is_refused(tmp_path, broker):
    code, output = fleet("init", "--devices", "2", "--broker", broker, "--tls", "--out", str(tmp_path / "f"))
    assert code == 2 and "is not a DNS name or IP address" in output and "Traceback" not in output, output
    assert not (tmp_path / "f").exists()


def test_one_device_is_warned_of(tmp_path):
    result = CliRunner().invoke(cli, ["fleet", "init", "--devices", "1", "--broker", "mqtt://h",
                                      "--out", str(tmp_path / "f")])
    assert result.exit_code == 0
    assert "a run needs at least 2 clients" in result.output


def test_revoke_and_reissue_keep_the_admins_own_acl_lines(tmp_path):
    """Every line after a `user` line counted as that user's: a monitoring `pattern` rule or a
    comment appended to the file went with the last device revoked, and a device's extra rule
    with its reissue."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "3", "--broker", "mqtt://h", "--out", str(out), "--run-id", "lab")[0] == 0
    acl = out / "broker" / "acl"
    extra = "topic read fedal/v1/lab/extra/pi-1"
    text = acl.read_text().replace("user pi-1\n", f"user pi-1\n{extra}\n")
    # a rule of pi-2's after a comment and a blank line is still pi-2's (Mosquitto reads it so): it
    # must go with pi-2's block, not stay behind as a rule of whichever user comes before
    text = text.replace("user pi-3\n", "# pi-2's own\n\ntopic write fedal/v1/lab/extra/pi-2\nuser pi-3\n")
    acl.write_text(text + "\n# monitoring\npattern read fedal/v1/+/run\n")
    assert fleet("revoke", "--out", str(out), "pi-3", "pi-2")[0] == 0
    after = acl.read_text()
    assert "user pi-3" not in after and "fedal/v1/lab/down/pi-3" not in after
    assert "pi-2" not in after.replace("# pi-2's own", "")
    assert "# monitoring\npattern read fedal/v1/+/run\n" in after
    assert "\n\n\n" not in after
    assert fleet("revoke", "--out", str(out), "--reissue", "pi-1")[0] == 0  # re-keyed, its rules as they were
    assert f"user pi-1\n{extra}\n" in acl.read_text() and "pattern read fedal/v1/+/run" in acl.read_text()
    assert fleet("revoke", "--out", str(out), "--reissue", "pi-3")[0] == 0  # a revoked one's rules come back
    again = acl.read_text()
    assert "user pi-3\ntopic read fedal/v1/lab/run\n" in again and again.count("user ") == 3
    assert fleet("revoke", "--out", str(out), "pi-1", "pi-3")[0] == 0
    assert "pattern read fedal/v1/+/run" in acl.read_text() and "user pi-" not in acl.read_text()


def test_renew_cert_with_another_fleets_ca_key_writes_nothing(tmp_path):
    """The issuer's name is the same for every fleet of one run id: a wrong ca.key put back signed
    a certificate no device accepts, over the one that worked."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    for out in (mine, other):
        assert fleet("init", "--devices", "2", "--broker", "mqtts://h", "--tls", "--out", str(out))[0] == 0
    own_key = (mine / "ca" / "ca.key").read_bytes()
    (mine / "ca" / "ca.key").write_bytes((other / "ca" / "ca.key").read_bytes())
    before = snapshot(mine)
    code, output = fleet("renew-cert", "--out", str(mine))
    assert code == 2 and "is not the key of" in output, output
    assert snapshot(mine) == before
    (mine / "broker" / "server.crt").write_bytes((other / "broker" / "server.crt").read_bytes())
    (mine / "ca" / "ca.key").write_bytes(own_key)
    code, output = fleet("renew-cert", "--out", str(mine))  # the right key, a certificate of the other CA
    assert code == 2 and "was not issued by" in output, output


def test_a_renew_cert_that_cannot_write_says_so_and_not_to_copy_the_pair(tmp_path, monkeypatch):
    """The certificate was written, then the key's write failed: a traceback, and a new
    certificate beside the old key that the CLI's next step said to copy to the broker."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "2", "--broker", "mqtts://h", "--tls", "--out", str(out))[0] == 0
    real = generate._write

    def full_disk(path, text, mode):
        if Path(path).name == "server.key":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, text, mode)

    from fleet import renew

    monkeypatch.setattr(renew, "_write", full_disk)
    code, output = fleet("renew-cert", "--out", str(out))
    assert code == 2 and "No space left on device" in output and "do not copy" in output, output
    monkeypatch.setattr(renew, "_write", real)
    assert fleet("renew-cert", "--out", str(out))[0] == 0  # the same command finishes it
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate((out / "broker" / "server.crt").read_bytes())
    key = serialization.load_pem_private_key((out / "broker" / "server.key").read_bytes(), password=None)
    assert cert.public_key() == key.public_key()


def test_a_config_the_user_cannot_read_is_a_clear_error(tmp_path, monkeypatch):
    """`fedal fleet check` (flash.sh runs it) on a device's 0600 config without sudo printed a
    PermissionError traceback."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "2", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    config = out / "devices" / "pi-1" / "agent.toml"
    real = Path.read_text

    def unreadable(self: Path, *args, **kwargs) -> str:
        if self == config:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", unreadable)
    code, output = fleet("check", str(config))
    assert code == 1 and f"config file {config} cannot be read: Permission denied" in output, output
