"""`fedal fleet revoke` reads the broker's passwd and acl as Mosquitto 2.0 does, and writes a
reissued device's files only into the fleet's own folders: a hand-edited line is still found,
an operator's indented block stays the operator's, a folder linked elsewhere or a file the user
put in a device folder is never written through or over."""

from __future__ import annotations

import shutil

from fleet.revoke import _acl_blocks
from tests.fleet_broker import RawClient, provision, start_broker
from tests.test_fleet_keeps_files import fleet, snapshot


def test_a_revoked_device_whose_passwd_line_was_hand_edited_is_locked_out(tmp_path):
    """Mosquitto trims the blanks around a name: ` pi-2 :<hash>` is pi-2's account. The name was
    kept as written, the revoke said `revoked` and the old password still opened the broker."""
    files = provision(tmp_path, devices=3)
    passwd = files.out / "broker" / "passwd"
    old_password = files.password("pi-2")
    passwd.write_text(passwd.read_text().replace("pi-2:", " pi-2 :"))
    code, output = fleet("revoke", "--out", str(files.out), "pi-2")
    assert code == 0 and "revoked" in output, output
    assert "pi-2" not in passwd.read_text()
    broker = start_broker(files, tmp_path / "broker")
    try:
        stolen = RawClient(files.port, "pi-2", old_password, "pi-2")
        kept = RawClient(files.port, "pi-1", files.password("pi-1"), "pi-1")
        try:
            assert not stolen.accepted and kept.accepted
        finally:
            stolen.close()
            kept.close()
    finally:
        broker.stop()


def test_an_indented_operator_block_stays_the_operators_when_a_device_is_revoked(tmp_path):
    """`  user ops` is a user line for Mosquitto (its first word), but was not for the revoke,
    which took the indented `topic` lines under it for the device block above: rewritten, the
    operator's rule became the last device's and `ops` lost it."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "3", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    acl = out / "broker" / "acl"
    acl.write_text(acl.read_text() + "  user ops\n  topic readwrite ops/#\n")
    pi3_rules = _acl_blocks(acl.read_text())[1]["pi-3"]
    assert fleet("revoke", "--out", str(out), "pi-1")[0] == 0
    blocks = _acl_blocks(acl.read_text())[1]
    assert blocks["ops"] == ["  topic readwrite ops/#"] and blocks["pi-3"] == pi3_rules and "pi-1" not in blocks
    assert acl.read_text().endswith("  user ops\n  topic readwrite ops/#\n")


def test_reissue_never_writes_through_a_linked_device_folder(tmp_path):
    """Only a revoked device's folder was checked for a link: a reissued device's config and the
    fleet's CA were written into the folder the link points at, over the user's own ca.crt."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "3", "--broker", "mqtts://h", "--tls", "--out", str(out))[0] == 0
    elsewhere = tmp_path / "elsewhere"
    shutil.move(out / "devices" / "pi-2", elsewhere)
    (elsewhere / "ca.crt").write_text("the user's own CA\n")
    (out / "devices" / "pi-2").symlink_to(elsewhere)
    before = snapshot(out) | {f"elsewhere/{k}": v for k, v in snapshot(elsewhere).items()}
    code, output = fleet("revoke", "--out", str(out), "--reissue", "pi-2")
    assert code != 0 and "devices/pi-2 is a link" in output and "nothing was changed" in output, output
    assert snapshot(out) | {f"elsewhere/{k}": v for k, v in snapshot(elsewhere).items()} == before


def test_reissue_never_replaces_a_file_the_user_put_in_a_revoked_devices_folder(tmp_path):
    """A device revoked, its folder made again by the user with a ca.crt of their own: the
    reissue replaced that file with the fleet's CA and listed it as the fleet's."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "3", "--broker", "mqtts://h", "--tls", "--out", str(out))[0] == 0
    assert fleet("revoke", "--out", str(out), "pi-3")[0] == 0
    (out / "devices" / "pi-3").mkdir()
    (out / "devices" / "pi-3" / "ca.crt").write_text("the user's own CA\n")
    before = snapshot(out)
    code, output = fleet("revoke", "--out", str(out), "--reissue", "pi-3")
    assert code != 0 and "devices/pi-3/ca.crt" in output and "nothing was changed" in output, output
    assert snapshot(out) == before
    (out / "devices" / "pi-3" / "ca.crt").unlink()
    code, output = fleet("revoke", "--out", str(out), "--reissue", "pi-3")
    assert code == 0 and "reissued" in output, output
    assert (out / "devices" / "pi-3" / "ca.crt").read_bytes() == (out / "ca" / "ca.crt").read_bytes()


def test_a_revoke_leaves_every_other_accounts_lines_as_they_are(tmp_path):
    """The password file was rebuilt from one entry per account: an operator's account written
    twice lost its later line (the one Mosquitto may take), whichever device was revoked."""
    out = tmp_path / "fleet"
    assert fleet("init", "--devices", "3", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    passwd = out / "broker" / "passwd"
    ops = ["ops:$7$101$b2xk$b2xkaGFzaA==", "ops:$7$101$bmV3$bmV3aGFzaA=="]  # an old line and the new one
    passwd.write_text(passwd.read_text() + "\n".join(ops) + "\n")
    assert fleet("revoke", "--out", str(out), "pi-2")[0] == 0
    lines = passwd.read_text().splitlines()
    assert lines[-2:] == ops and not any(line.startswith("pi-2:") for line in lines)
