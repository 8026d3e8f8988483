"""Files holding secrets: every one `fedal fleet init` writes is 0600 whatever the umask (also when
--force replaces a fleet whose files were opened up), and the coordinator says at start when its
config holds the API token or the broker password and group or others can read it."""

from __future__ import annotations

import os
import stat
import time
import tomllib
from pathlib import Path

from click.testing import CliRunner

from fedal.settings import exposed_secrets
from fedal_cli.main import cli
from hil.coordinator_setup import start_coordinator, stop_process, write_coordinator_config
from tests.waiting import free_port


def fleet_files(out: Path) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}


def secrets_of(out: Path) -> list[str]:
    """Every plain password the fleet holds (device configs and the coordinator snippet)."""
    found = [tomllib.loads(p.read_text())["broker"]["password"] for p in out.glob("devices/*/agent.toml")]
    return found + [tomllib.loads((out / "coordinator" / "broker.toml").read_text())["broker"]["password"]]


def holds_secret(path: Path, passwords: list[str]) -> bool:
    text = path.read_text(errors="replace")
    return "PRIVATE KEY" in text or "$7$" in text or any(p in text for p in passwords)


def check_modes(out: Path) -> set[str]:
    passwords = secrets_of(out)
    secret = set()
    for path, mode in fleet_files(out).items():
        if holds_secret(path, passwords):
            assert mode == 0o600, f"{path.relative_to(out)} holds a secret with mode {mode:04o}"
            secret.add(path.relative_to(out).as_posix())
        else:
            assert mode & 0o022 == 0, f"{path.relative_to(out)} is writable by others: {mode:04o}"
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    return secret


def test_fleet_init_writes_every_secret_0600_whatever_the_umask(tmp_path):
    out = tmp_path / "fleet"
    args = ["fleet", "init", "--devices", "2", "--broker", "mqtts://broker.lan:8883", "--tls", "--out", str(out)]
    old = os.umask(0)
    try:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        secret = check_modes(out)
        assert secret == {"devices/pi-1/agent.toml", "devices/pi-2/agent.toml", "coordinator/broker.toml",
                          "broker/passwd", "broker/coordinator.passwd", "broker/server.key", "ca/ca.key"}
        for path in fleet_files(out):  # an operator opened everything up; --force writes new secrets
            path.chmod(0o666)
        result = CliRunner().invoke(cli, [*args, "--force"])
        assert result.exit_code == 0, result.output
        assert check_modes(out) == secret
    finally:
        os.umask(old)


def test_exposed_secrets_names_the_keys_only_when_others_can_read(tmp_path):
    keys = ["api.token", "broker.password", "broker.url"]
    path = tmp_path / "c.toml"
    path.write_text('[api]\nport = 8080\n[broker]\nurl = "mqtt://h:1883"\n')
    path.chmod(0o644)
    assert exposed_secrets(path, keys) is None  # nothing secret in it
    path.write_text('[api]\ntoken = "t"\n[broker]\nurl = "mqtt://coordinator:pw@h:1883"\n')
    assert exposed_secrets(path, keys) == (["api.token", "broker.url"], 0o644)
    path.chmod(0o640)
    assert exposed_secrets(path, keys) == (["api.token", "broker.url"], 0o640)
    path.chmod(0o600)
    assert exposed_secrets(path, keys) is None


def coordinator_log(config: Path, log: Path) -> str:
    """Start the coordinator (no run: the API alone), return its log once the API is up."""
    proc = start_coordinator(config, log)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "API on" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        return log.read_text()
    finally:
        stop_process(proc)


def test_coordinator_warns_at_start_when_its_secrets_are_readable(tmp_path):
    config = tmp_path / "coordinator.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n'
                      f'[api]\nport = {free_port()}\ntoken = "s3cret-token"\n'
                      '[broker]\nurl = "mqtt://127.0.0.1:1"\nusername = "coordinator"\npassword = "pw"\n')
    config.chmod(0o644)
    text = coordinator_log(config, tmp_path / "open.log")
    line = next((x for x in text.splitlines() if "chmod 600" in x), None)
    assert line is not None and "WARNING" in line, text
    assert "api.token" in line and "broker.password" in line and "0644" in line and "s3cret" not in line

    config.chmod(0o600)
    text = coordinator_log(config, tmp_path / "closed.log")
    assert "API on" in text and "chmod 600" not in text


def test_hil_writes_the_coordinator_config_0600(tmp_path):
    """`fedal hil fleet --start-coordinator` puts the coordinator's broker account from the fleet in it."""
    old = os.umask(0)
    try:
        path = write_coordinator_config(tmp_path / "coordinator", "mqtt://127.0.0.1:1883", "r", ["a", "b"], api_port=1,
                                        extra={"broker": {"username": "coordinator", "password": "pw"}})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert exposed_secrets(path, ["broker.password"]) is None
