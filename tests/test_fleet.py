"""`fedal fleet`: generated credentials work against a real Mosquitto started with the generated
password, ACL and listener files; devices are held to their own topics; TLS agents come online."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from click.testing import CliRunner

from edge_agent.config import load_agent_config
from fedal.protocol import parse_broker_url, topics
from fedal_cli.main import cli
from fleet import passwords
from tests.waiting import free_port, wait_for_port

RUN = "fleet"


def fleet_init(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["fleet", "init", *args])
    return result.exit_code, result.output


def start_mosquitto(out: Path, port: int) -> subprocess.Popen:
    """Mosquitto with the generated fedal.conf (its paths point into `out`, see --broker-dir)."""
    conf = out / "test-mosquitto.conf"
    log = out / "mosquitto.log"
    conf.write_text((out / "broker" / "fedal.conf").read_text() + f"persistence false\nlog_dest file {log}\n"
                    + ("user root\n" if os.geteuid() == 0 else ""))
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_for_port(port):
        proc.kill()
        pytest.fail(f"mosquitto did not start: {log.read_text() if log.exists() else ''}")
    return proc


def password_of(out: Path, cid: str) -> str:
    return tomllib.loads((out / "devices" / cid / "agent.toml").read_text())["broker"]["password"]


def coordinator_password(out: Path) -> str:
    return tomllib.loads((out / "coordinator" / "broker.toml").read_text())["broker"]["password"]


def coordinator_port(out: Path) -> int:
    """The coordinator's own listener (the only one its account may log in to)."""
    port = parse_broker_url(tomllib.loads((out / "coordinator" / "broker.toml").read_text())["broker"]["url"]).port
    assert wait_for_port(port)
    return port


class Client:
    """A raw paho client that records what it receives and how its connection attempt ended."""

    def __init__(self, port: int, user: str | None, password: str | None, ca: Path | None = None, name: str = "t"):
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.connack: queue.Queue[object] = queue.Queue()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{name}-{time.monotonic_ns()}", protocol=mqtt.MQTTv311)
        if user is not None:
            self.c.username_pw_set(user, password)
        if ca is not None:
            self.c.tls_set(ca_certs=str(ca))
        self.c.on_connect = lambda c, u, f, rc, p: self.connack.put(rc)
        self.c.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload)))
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        self.rc = self.connack.get(timeout=20)

    def subscribe(self, topic: str) -> None:
        done: queue.Queue[object] = queue.Queue()
        self.c.on_subscribe = lambda c, u, mid, rcs, p: done.put(rcs)
        self.c.subscribe(topic, qos=1)
        done.get(timeout=10)

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.c.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def until(self, payload: bytes, timeout: float = 20) -> list[tuple[str, bytes]]:
        """Everything received up to and including the first message with `payload`."""
        seen = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                seen.append(self.messages.get(timeout=0.2))
            except queue.Empty:
                continue
            if seen[-1][1] == payload:
                return seen
        raise AssertionError(f"{payload!r} never arrived; got {seen}")

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def test_mosquitto_hashes_agree_both_ways(tmp_path):
    hashed = passwords.mosquitto_hash("s3cret")
    assert passwords.verify("s3cret", hashed) and not passwords.verify("s3cret!", hashed)
    pw = tmp_path / "pw"
    pw.write_text("")
    subprocess.run(["mosquitto_passwd", "-b", str(pw), "pi-1", "hunter2"], check=True, capture_output=True)
    user, theirs = pw.read_text().strip().split(":", 1)
    assert user == "pi-1" and passwords.verify("hunter2", theirs) and not passwords.verify("hunter3", theirs)
    with pytest.raises(ValueError, match="user name"):
        passwords.password_file({"a:b": "x"})


def test_generated_fleet_holds_each_device_to_its_own_topics(tmp_path):
    port = free_port()
    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "3", "--broker", f"mqtt://127.0.0.1:{port}", "--out", str(out),
                              "--bind", "127.0.0.1", "--broker-dir", str(out / "broker"), "--run-id", RUN)
    assert code == 0, output
    summary = json.loads((out / "fleet.json").read_text())
    assert summary["devices"] == ["pi-1", "pi-2", "pi-3"]
    passes = {cid: password_of(out, cid) for cid in summary["devices"]}
    assert len(set(passes.values())) == 3
    assert "pi-1" not in "".join(passes.values())
    assert all(p not in (out / "broker" / "passwd").read_text() for p in passes.values())  # hashes only
    for cid in summary["devices"]:  # what the device will load
        assert (out / "devices" / cid / "agent.toml").stat().st_mode & 0o077 == 0
        cfg = load_agent_config(out / "devices" / cid / "agent.toml")
        assert (cfg.client_id, cfg.broker.username, cfg.run_id) == (cid, cid, RUN)

    broker = start_mosquitto(out, port)
    clients: list[Client] = []
    try:
        refused = Client(port, "coordinator", coordinator_password(out), name="coord-on-devices")
        clients.append(refused)  # the coordinator's account, with its rights over the whole tree, only on its own listener
        assert refused.rc != 0
        coord = Client(coordinator_port(out), "coordinator", coordinator_password(out), name="coord")
        clients.append(coord)
        assert coord.rc == 0
        coord.subscribe(f"fedal/v1/{RUN}/#")
        pi1 = Client(port, "pi-1", passes["pi-1"], name="pi1")
        clients.append(pi1)
        assert pi1.rc == 0

        # pi-1 on its own upload and status topics reaches the coordinator; as pi-2 it does not
        pi1.publish(topics.result(RUN, "pi-2"), b"forged result")
        pi1.publish(topics.status(RUN, "pi-2"), b"forged status", retain=True)
        pi1.publish(topics.status(RUN, "pi-1"), b"pi-1 online", retain=True)
        pi1.publish(topics.result(RUN, "pi-1"), b"pi-1 result")
        got = coord.until(b"pi-1 result")
        assert (topics.status(RUN, "pi-1"), b"pi-1 online") in got
        assert not [m for m in got if m[1].startswith(b"forged")]
        # ... nor may it write the coordinator's topics
        pi1.publish(topics.run_manifest(RUN), b"forged manifest")
        pi1.publish(topics.task(RUN, "pi-2"), b"forged task")
        pi1.publish(topics.result(RUN, "pi-1"), b"marker 2")
        assert not [m for m in coord.until(b"marker 2") if m[1].startswith(b"forged")]

        # pi-1 reads the manifest and its own tasks, never pi-2's (even when it subscribes to them)
        pi1.subscribe(topics.task(RUN, "pi-2"))
        pi1.subscribe(f"fedal/v1/{RUN}/#")
        coord.publish(topics.task(RUN, "pi-2"), b"task for pi-2")
        coord.publish(topics.run_manifest(RUN), b"manifest")
        coord.publish(topics.task(RUN, "pi-1"), b"task for pi-1")
        got = pi1.until(b"task for pi-1")
        assert (topics.run_manifest(RUN), b"manifest") in got
        assert b"task for pi-2" not in [m[1] for m in got]

        # credentials: pi-1's password is not pi-2's, a wrong password and no password are refused
        assert Client(port, "pi-2", passes["pi-1"]).rc != 0
        assert Client(port, "pi-1", "wrong").rc != 0
        assert Client(port, None, None).rc != 0
        assert Client(port, "pi-2", passes["pi-2"]).rc == 0
    finally:
        for c in clients:
            c.close()
        broker.terminate()
        broker.wait(timeout=10)


def test_agent_comes_online_over_tls_with_generated_credentials(tmp_path):
    port = free_port()
    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "2", "--broker", f"mqtts://127.0.0.1:{port}", "--out", str(out), "--tls",
                              "--server-name", "localhost", "--bind", "127.0.0.1", "--broker-dir", str(out / "broker"),
                              "--run-id", RUN)
    assert code == 0, output
    broker = start_mosquitto(out, port)
    ca = out / "coordinator" / "ca.crt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           # the config names the device's paths (/etc/fedal-agent/ca.crt, /var/lib/fedal-agent): point them here
           "FEDAL_AGENT_BROKER__CA_FILE": str(out / "devices" / "pi-1" / "ca.crt"),
           "FEDAL_AGENT_WORKSPACE": str(tmp_path / "ws"), "FEDAL_AGENT_DATA_FILE": str(tmp_path / "ws" / "train.npz")}
    (tmp_path / "ws").mkdir(exist_ok=True)
    np.savez(tmp_path / "ws" / "train.npz", x=np.zeros((4, 40), np.float32), y=np.zeros(4, np.int64))  # read at start
    watcher = Client(coordinator_port(out), "coordinator", coordinator_password(out), ca=ca, name="watch")
    agent = None
    try:
        assert watcher.rc == 0
        assert Client(port, None, None, ca=ca).rc != 0  # TLS alone is not enough
        watcher.subscribe(topics.status(RUN, "pi-1"))
        log = open(tmp_path / "agent.log", "wb")
        agent = subprocess.Popen([sys.executable, "-m", "edge_agent", "--config", str(out / "devices" / "pi-1" / "agent.toml")],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 90
        states: list[str] = []
        while "online" not in states and time.monotonic() < deadline and agent.poll() is None:
            try:
                states.append(json.loads(watcher.messages.get(timeout=0.5)[1])["state"])
            except queue.Empty:
                continue
        assert "online" in states, (tmp_path / "agent.log").read_text()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        deadline = time.monotonic() + 15
        while states[-1] != "offline" and time.monotonic() < deadline:
            try:
                states.append(json.loads(watcher.messages.get(timeout=0.5)[1])["state"])
            except queue.Empty:
                continue
        assert states[-1] == "offline"  # the agent said goodbye over the same TLS session
    finally:
        watcher.close()
        if agent is not None and agent.poll() is None:
            agent.kill()
        broker.terminate()
        broker.wait(timeout=10)


def test_mqtts_without_tls_never_gives_a_plain_listener_on_the_tls_port(tmp_path):
    """mqtts:// with a certificate of one's own: fedal.conf names it, so Mosquitto refuses to start
    until it is there, instead of serving plain MQTT where every device expects TLS."""
    port = free_port()
    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "1", "--broker", f"mqtts://127.0.0.1:{port}", "--out", str(out),
                              "--bind", "127.0.0.1", "--broker-dir", str(out / "broker"))
    assert code == 0, output
    assert f"expects your own certificate and key at {out / 'broker'}/server.crt" in output
    conf = (out / "broker" / "fedal.conf").read_text()
    assert conf.count(f"certfile {out / 'broker'}/server.crt") == 2 and "cafile" not in conf
    log = out / "mosquitto.log"
    (out / "test-mosquitto.conf").write_text(conf + f"persistence false\nlog_dest file {log}\n"
                                             + ("user root\n" if os.geteuid() == 0 else ""))
    proc = subprocess.run(["mosquitto", "-c", str(out / "test-mosquitto.conf")], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode != 0  # no certificate yet: no listener at all
    assert "server.crt" in proc.stderr + (log.read_text() if log.exists() else "")


@pytest.mark.parametrize("args, message", [
    (["--devices", "2", "--broker", "mqtt://h:1883", "--tls"], "needs an mqtts:// broker URL"),
    (["--devices", "2", "--broker", "mqtt://u:p@h"], "without user:password"),
    (["--devices", "2", "--broker", "http://h"], "must start with mqtt:// or mqtts://"),
    (["--devices", "2", "--broker", "mqtt://h", "--prefix", "pi/"], "invalid client id"),
    (["--devices", "2", "--broker", "mqtt://h", "--prefix", "c", "--start", "1", "--coordinator-user", "c2"], "collides"),
    (["--devices", "0", "--broker", "mqtt://h"], "--devices"),
    (["--devices", "2", "--broker", "mqtt://h", "--model", "cnn2d"], "'cnn2d' is not one of 'mlp', 'cnn1d'"),
    (["--devices", "2", "--broker", "mqtt://h", "--bind", "not an ip"], "--bind 'not an ip' is not an IP address"),
    (["--devices", "2", "--broker", "mqtts://h", "--tls", "--server-name", "bad name!"], "--server-name 'bad name!'"),
    (["--devices", "2", "--broker", "mqtts://h", "--tls", "--server-name", "-x.lan"], "is not a DNS name"),
])
def test_init_refuses_options_that_cannot_work(tmp_path, args, message):
    code, output = fleet_init(*args, "--out", str(tmp_path / "out"))
    assert code == 2 and message in output
    assert not (tmp_path / "out" / "fleet.json").exists()


def test_init_takes_addresses_and_names_for_bind_and_server_name(tmp_path):
    for i, extra in enumerate((["--bind", "192.168.1.10"], ["--bind", "::1"], ["--bind", "broker.lan"],
                               ["--server-name", "10.0.0.2", "--server-name", "broker-1.example.org."])):
        code, output = fleet_init("--devices", "2", "--broker", "mqtts://h", "--tls", *extra, "--out", str(tmp_path / f"o{i}"))
        assert code == 0, output


def test_init_refuses_to_overwrite_credentials_and_check_reports_configs(tmp_path):
    out = tmp_path / "out"
    assert fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(out))[0] == 0
    first = password_of(out, "pi-1")
    code, output = fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(out))
    assert code == 2 and "holds a fleet" in output and "--force" in output and password_of(out, "pi-1") == first
    assert fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(out), "--force")[0] == 0
    assert password_of(out, "pi-1") != first
    mine = tmp_path / "mine"  # a folder of the user's: --force is no advice there (it refuses it too)
    mine.mkdir()
    (mine / "x.txt").write_text("mine")
    code, output = fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(mine))
    assert code == 2 and "holds no fleet" in output and "--force" not in output
    code, output = fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", "/proc/fedal-fleet")
    assert code == 2 and "--out /proc/fedal-fleet cannot be created" in output and "Traceback" not in output

    result = CliRunner().invoke(cli, ["fleet", "check", str(out / "devices" / "pi-2" / "agent.toml")])
    assert result.exit_code == 0
    assert result.output.splitlines() == ["client_id=pi-2", "run_id=fleet", "broker=mqtt://pi-2@h:1883", "tls=no", "ca_file="]
    bad = tmp_path / "bad.toml"
    bad.write_text((out / "devices" / "pi-2" / "agent.toml").read_text().replace('client_id = "pi-2"', 'client_id = "pi 2"'))
    result = CliRunner().invoke(cli, ["fleet", "check", str(bad)])
    assert result.exit_code == 1 and "client_id" in result.output and "invalid" in result.output
    # a model the zoo does not have: refused on the workstation, not first on the device
    bad.write_text((out / "devices" / "pi-2" / "agent.toml").read_text().replace('model = "cnn1d"', 'model = "foo"'))
    result = CliRunner().invoke(cli, ["fleet", "check", str(bad)])
    assert result.exit_code == 1 and "unknown model 'foo'; valid names: mlp, cnn1d" in result.output


def test_init_makes_its_out_private_and_leaves_a_users_directory_mode_alone(tmp_path):
    import stat

    made = tmp_path / "made"
    assert fleet_init("--devices", "1", "--broker", "mqtt://h", "--out", str(made))[0] == 0
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    shared = tmp_path / "shared"  # a user's empty group directory: setgid, group access
    shared.mkdir()
    os.chmod(shared, 0o2770)
    assert fleet_init("--devices", "1", "--broker", "mqtt://h", "--out", str(shared))[0] == 0
    assert stat.S_IMODE(shared.stat().st_mode) == 0o2770
    assert (shared / "devices" / "pi-1" / "agent.toml").stat().st_mode & 0o077 == 0  # the secrets stay private
    refused = tmp_path / "refused"  # an earlier fleet and a file of the user's in the way: nothing changes
    assert fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(refused))[0] == 0
    os.chmod(refused, 0o755)
    (refused / "devices" / "pi-3").mkdir()
    (refused / "devices" / "pi-3" / "agent.toml").write_text("mine\n")
    code, output = fleet_init("--devices", "3", "--broker", "mqtt://h", "--out", str(refused), "--force")
    assert code == 2 and "nothing was written" in output
    assert stat.S_IMODE(refused.stat().st_mode) == 0o755


def test_renew_cert_issues_a_new_server_certificate_from_the_same_ca_for_the_same_names(tmp_path):
    """The broker's certificate expires (825 days); `fleet init --force` would re-provision every
    device (a new CA, new passwords). renew-cert keeps the CA the devices trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    out = tmp_path / "out"
    code, output = fleet_init("--devices", "2", "--broker", "mqtts://broker.lan:8883", "--tls", "--server-name",
                              "10.0.0.5", "--out", str(out))
    assert code == 0 and "server certificate valid until" in output, output
    old_cert, old_key = (out / "broker" / "server.crt").read_bytes(), (out / "broker" / "server.key").read_bytes()
    device_files = {p: p.read_bytes() for p in (out / "devices").rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli, ["fleet", "renew-cert", "--out", str(out), "--days", "30"])
    assert result.exit_code == 0 and "broker.lan, 10.0.0.5" in result.output, result.output
    new = x509.load_pem_x509_certificate((out / "broker" / "server.crt").read_bytes())
    ca = x509.load_pem_x509_certificate((out / "ca" / "ca.crt").read_bytes())
    new.verify_directly_issued_by(ca)  # raises if not
    assert (out / "broker" / "server.key").read_bytes() != old_key and new.public_bytes(Encoding.PEM) != old_cert
    assert 29 <= (new.not_valid_after_utc - new.not_valid_before_utc).days <= 31
    assert json.loads((out / "fleet.json").read_text())["server_cert_not_after"] == \
        new.not_valid_after_utc.date().isoformat()
    result = CliRunner().invoke(cli, ["fleet", "renew-cert", "--out", str(out), "--days", "3650"])
    longest = x509.load_pem_x509_certificate((out / "broker" / "server.crt").read_bytes())
    assert result.exit_code == 0 and longest.not_valid_after_utc <= ca.not_valid_after_utc  # never past its CA
    san = new.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["broker.lan"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert oct((out / "broker" / "server.key").stat().st_mode & 0o777) == "0o600"
    assert {p: p.read_bytes() for p in (out / "devices").rglob("*") if p.is_file()} == device_files  # no device changes
    # a device revoked and reissued in a TLS fleet gets the same CA to trust
    for extra in ([], ["--reissue"]):
        assert CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), *extra, "pi-2"]).exit_code == 0
    assert (out / "devices" / "pi-2" / "ca.crt").read_bytes() == (out / "ca" / "ca.crt").read_bytes()
    assert load_agent_config(out / "devices" / "pi-2" / "agent.toml").broker.ca_file == Path("/etc/fedal-agent/ca.crt")
    plain = tmp_path / "plain"
    assert fleet_init("--devices", "2", "--broker", "mqtt://h", "--out", str(plain))[0] == 0
    result = CliRunner().invoke(cli, ["fleet", "renew-cert", "--out", str(plain)])
    assert result.exit_code == 2 and "needs the fleet `fedal fleet init --tls` wrote" in result.output


def test_revoke_locks_one_device_out_and_reissue_rekeys_it(tmp_path):
    """A lost card: `fleet revoke` takes its account off the broker (a reload drops it even while
    connected), the other accounts keep their passwords; `--reissue` gives it a new one."""
    port = free_port()
    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "3", "--broker", f"mqtt://127.0.0.1:{port}", "--out", str(out),
                              "--bind", "127.0.0.1", "--broker-dir", str(out / "broker"), "--run-id", RUN)
    assert code == 0, output
    old = {cid: password_of(out, cid) for cid in ("pi-1", "pi-2", "pi-3")}
    passwd_before = (out / "broker" / "passwd").read_text().splitlines()
    broker = start_mosquitto(out, port)
    clients: list[Client] = []
    try:
        coord = Client(coordinator_port(out), "coordinator", coordinator_password(out), name="coord")
        clients.append(coord)
        coord.subscribe(f"fedal/v1/{RUN}/#")
        lost = Client(port, "pi-2", old["pi-2"], name="lost")
        clients.append(lost)
        dropped: queue.Queue[object] = queue.Queue()
        lost.c.on_disconnect = lambda c, u, f, rc, p: dropped.put(rc)
        lost.publish(topics.result(RUN, "pi-2"), b"before")
        coord.until(b"before")

        result = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-2"])
        assert result.exit_code == 0, result.output
        assert "pi-2: revoked" in result.output and "reload Mosquitto" in result.output
        passwd = (out / "broker" / "passwd").read_text().splitlines()
        assert passwd == [line for line in passwd_before if not line.startswith("pi-2:")]  # the others untouched
        assert "user pi-2" not in (out / "broker" / "acl").read_text()
        assert "user pi-1" in (out / "broker" / "acl").read_text()
        assert not (out / "devices" / "pi-2").exists()
        assert tomllib.loads((out / "coordinator" / "broker.toml").read_text())["client_ids"] == ["pi-1", "pi-3"]
        summary = json.loads((out / "fleet.json").read_text())
        assert summary["devices"] == ["pi-1", "pi-3"] and list(summary["revoked"]) == ["pi-2"]
        assert "pi-2" not in (out / ".fedal-fleet-files").read_text()

        broker.send_signal(signal.SIGHUP)  # what `systemctl reload mosquitto` does
        dropped.get(timeout=20)  # the connected card is dropped
        assert Client(port, "pi-2", old["pi-2"]).rc != 0  # and cannot log in again
        pi1 = Client(port, "pi-1", old["pi-1"], name="pi1")
        clients.append(pi1)
        assert pi1.rc == 0
        pi1.publish(topics.result(RUN, "pi-1"), b"pi-1 still in")
        coord.until(b"pi-1 still in")

        again = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-2"])
        assert again.exit_code == 0 and "pi-2: already revoked" in again.output

        reissued = CliRunner().invoke(cli, ["fleet", "revoke", "--reissue", "--out", str(out), "pi-2"])
        assert reissued.exit_code == 0, reissued.output
        cfg = load_agent_config(out / "devices" / "pi-2" / "agent.toml")
        assert (cfg.client_id, cfg.broker.username, cfg.run_id) == ("pi-2", "pi-2", RUN)
        assert cfg.broker.password not in old.values()
        assert tomllib.loads((out / "coordinator" / "broker.toml").read_text())["client_ids"] == ["pi-1", "pi-2", "pi-3"]
        broker.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while (rc := Client(port, "pi-2", cfg.broker.password).rc) != 0 and time.monotonic() < deadline:
            time.sleep(0.2)  # the reload is asynchronous
        assert rc == 0
        assert Client(port, "pi-2", old["pi-2"]).rc != 0
        new = Client(port, "pi-2", cfg.broker.password, name="new")
        clients.append(new)
        new.publish(topics.result(RUN, "pi-2"), b"re-keyed")
        coord.until(b"re-keyed")
        new.publish(topics.result(RUN, "pi-1"), b"forged")  # its ACL block is back as it was: its own topics only
        new.publish(topics.result(RUN, "pi-2"), b"marker")
        assert b"forged" not in [m[1] for m in coord.until(b"marker")]
    finally:
        for c in clients:
            c.close()
        broker.terminate()
        broker.wait(timeout=10)


@pytest.mark.parametrize("args, message", [
    (["pi-9"], "'pi-9' is not a device of the fleet"),
    (["coordinator"], "is the coordinator's account"),
])
def test_revoke_refuses_what_is_not_a_device(tmp_path, args, message):
    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "2", "--broker", "mqtt://127.0.0.1:1883", "--out", str(out))
    assert code == 0, output
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), *args])
    assert result.exit_code == 2 and message in result.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    missing = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(tmp_path / "nowhere"), "pi-1"])
    assert missing.exit_code == 2 and "revoke needs the fleet" in missing.output


def test_revoke_works_with_the_ca_kept_offline_and_reissue_follows_the_acls_run_id(tmp_path):
    """ca/ (with its key) kept offline as the docs advise: revoking needs no CA, reissuing takes
    the broker's copy. A fleet moved to another run id by editing the ACL (as the docs say)
    reissues configs for that run id. Re-keying a device that was never revoked, and revoking every
    device, work too."""
    import shutil

    from fleet.passwords import verify

    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "3", "--broker", "mqtts://broker.lan:8883", "--tls", "--out", str(out))
    assert code == 0, output
    shutil.move(str(out / "ca"), str(tmp_path / "offline-ca"))
    acl_path = out / "broker" / "acl"
    acl_path.write_text(acl_path.read_text().replace("fedal/v1/fleet/", "fedal/v1/lab2/"))
    old = password_of(out, "pi-1")
    result = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "--reissue", "pi-1"])
    assert result.exit_code == 0 and "pi-1: reissued" in result.output, result.output
    cfg = load_agent_config(out / "devices" / "pi-1" / "agent.toml")
    assert cfg.run_id == "lab2" and cfg.broker.password != old
    assert (out / "devices" / "pi-1" / "ca.crt").read_bytes() == (tmp_path / "offline-ca" / "ca.crt").read_bytes()
    line = next(x for x in (out / "broker" / "passwd").read_text().splitlines() if x.startswith("pi-1:"))
    assert verify(cfg.broker.password, line.split(":", 1)[1]) and not verify(old, line.split(":", 1)[1])
    assert "topic write fedal/v1/lab2/up/pi-1" in acl_path.read_text()
    merged = out / "coordinator" / "broker.toml"  # the operator's notes in it stay where they are
    merged.write_text(merged.read_text().replace("[broker]", "# lab 2 since May\n[broker]")
                      .replace('"coordinator"', '"coordinator"  # its own account')
                      .replace('"pi-3",', '"pi-3",  # by the door'))
    partly = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-2"])
    assert partly.exit_code == 0 and '"pi-3",  # by the door' in merged.read_text(), partly.output
    assert "made again from passwd and coordinator.passwd" in " ".join(partly.output.split())  # a one-listener broker
    assert tomllib.loads(merged.read_text())["client_ids"] == ["pi-1", "pi-3"]
    everyone = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-1", "pi-2", "pi-3"])
    assert everyone.exit_code == 0 and "0 device(s) left" in everyone.output, everyone.output
    assert (out / "broker" / "passwd").read_text() == ""  # the devices' listener: no account left
    assert "user pi-" not in acl_path.read_text() and "user coordinator" in acl_path.read_text()
    assert tomllib.loads(merged.read_text())["client_ids"] == []
    assert "# lab 2 since May\n[broker]" in merged.read_text() and '"coordinator"  # its own account' in merged.read_text()


def test_reissue_keeps_the_settings_edited_into_a_devices_config(tmp_path):
    """`--reissue` wrote a fresh agent.toml: a device's own model, data file or broker options,
    edited in after `fleet init`, were gone from the config to flash. Only what the fleet owns
    changes (identity, run id, password); a config that cannot be kept (not valid, a link) is an
    error before anything is written, not silently replaced."""
    import tomli_w

    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "3", "--broker", "mqtt://broker.lan:1883", "--out", str(out))
    assert code == 0, output
    path = out / "devices" / "pi-1" / "agent.toml"
    edited = tomllib.loads(path.read_text())
    old = edited["broker"]["password"]
    edited.update(model="lenet5", data_file="/srv/data/pi-1.npz", durability="round")
    edited["broker"]["keepalive"] = 17
    text = "# my own note\n" + tomli_w.dumps(edited).replace('keepalive = 17', 'keepalive = 17  # a slow link')
    text = text.replace("[broker]", "# the lab's broker\n[broker]")
    path.write_text(text)
    merged = out / "coordinator" / "broker.toml"  # notes on the fleet's device list stay too
    listed = merged.read_text().replace('"pi-1",', '"pi-1",  # kitchen').replace('    "pi-3",', '    # row 2\n    "pi-3",')
    merged.write_text(listed)
    result = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "--reissue", "pi-1"])
    assert result.exit_code == 0, result.output
    assert "pi-1: reissued (its config's other settings kept)" in result.output
    cfg = load_agent_config(path)
    assert cfg.broker.password != old and cfg.client_id == "pi-1" and cfg.run_id == "fleet"
    assert (cfg.model, str(cfg.data_file), cfg.durability, cfg.broker.keepalive) == ("lenet5", "/srv/data/pi-1.npz",
                                                                                    "round", 17)
    assert path.read_text().startswith("# my own note\n") and oct(path.stat().st_mode & 0o777) == "0o600"
    # comments stay where they were, end-of-line ones too; only the fleet's values change
    kept = path.read_text()
    assert "# the lab's broker\n[broker]" in kept and "keepalive = 17  # a slow link" in kept
    assert kept.replace(cfg.broker.password, "PW") == text.replace(old, "PW")
    assert merged.read_text() == listed  # pi-1 was listed: nothing to change there
    line = next(x for x in (out / "broker" / "passwd").read_text().splitlines() if x.startswith("pi-1:"))
    assert passwords.verify(cfg.broker.password, line.split(":", 1)[1])

    (out / "devices" / "pi-2" / "agent.toml").write_text("model = 'cnn1d'\nkeepalive = [")
    elsewhere = tmp_path / "pi-3.toml"
    elsewhere.write_text((out / "devices" / "pi-3" / "agent.toml").read_text())
    (out / "devices" / "pi-3" / "agent.toml").unlink()
    (out / "devices" / "pi-3" / "agent.toml").symlink_to(elsewhere)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for cid, message in (("pi-2", "is not a valid agent config, so its settings cannot be kept"),
                         ("pi-3", "is a symbolic link")):
        refused = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "--reissue", cid])
        assert refused.exit_code == 2 and message in refused.output, refused.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing written
    (out / "devices" / "pi-2" / "agent.toml").unlink()  # removed: a new config, as the message says
    fresh = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "--reissue", "pi-2"])
    assert fresh.exit_code == 0 and "pi-2: reissued\n" in fresh.output, fresh.output
    assert load_agent_config(out / "devices" / "pi-2" / "agent.toml").model == "cnn1d"


def test_revoke_without_tomlkit_names_what_to_install(tmp_path, monkeypatch):
    """An install of the fleet extra from before it needed tomlkit: a clear message, not a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "tomlkit", None)  # import tomlkit then raises ImportError
    monkeypatch.delitem(sys.modules, "fleet.revoke", raising=False)
    result = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(tmp_path / "fleet"), "pi-1"])
    assert result.exit_code == 1 and "needs tomlkit" in result.output and "fleet extra" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_revoke_keeps_the_operators_lines_in_passwd_and_refuses_damaged_files_in_a_line(tmp_path):
    """passwd was rebuilt from its accounts: an operator's comment lines were dropped. And a
    damaged fleet.json or a passwd that is not UTF-8 ended in a traceback."""
    import json

    out = tmp_path / "fleet"
    code, output = fleet_init("--devices", "3", "--broker", "mqtt://broker.lan:1883", "--out", str(out))
    assert code == 0, output
    passwd = out / "broker" / "passwd"
    monitor = "monitor:$7$101$c2FsdA==$aGFzaA=="
    passwd.write_text("# monitor account added 2024-05-01, do not remove\n" + passwd.read_text() + monitor + "\n")
    result = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-3"])
    assert result.exit_code == 0, result.output
    lines = passwd.read_text().splitlines()
    assert lines[0] == "# monitor account added 2024-05-01, do not remove" and lines[-1] == monitor
    assert not any(line.startswith("pi-3:") for line in lines)
    before = {line.split(":")[0]: line for line in lines}
    result = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "--reissue", "pi-1", "pi-3"])
    assert result.exit_code == 0, result.output
    after = passwd.read_text().splitlines()
    assert after[0] == lines[0] and after[-2:] == [monitor, next(x for x in after if x.startswith("pi-3:"))]
    assert after.index(next(x for x in after if x.startswith("pi-1:"))) == lines.index(before["pi-1"])  # in its place
    assert next(x for x in after if x.startswith("pi-1:")) != before["pi-1"]  # a new hash

    summary_path = out / "fleet.json"
    summary = json.loads(summary_path.read_text())
    for damaged, needle in (({**summary, "revoked": "pi-9"}, "`revoked` is not a table"),
                            ({**summary, "devices": ["pi-1", 3]}, "a device id that is not a name")):
        summary_path.write_text(json.dumps(damaged))
        refused = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-1"])
        assert refused.exit_code == 2 and needle in refused.output and refused.exception is not None \
            and isinstance(refused.exception, SystemExit), refused.output
    summary_path.write_text(json.dumps(summary))
    passwd.write_bytes(passwd.read_bytes() + b"\xff\xfe\n")
    refused = CliRunner().invoke(cli, ["fleet", "revoke", "--out", str(out), "pi-1"])
    assert refused.exit_code == 2 and "is not UTF-8 text" in refused.output, refused.output
