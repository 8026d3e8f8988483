"""A broker as `fedal fleet init` provisions it, on loopback: the generated fedal.conf (both
listeners, password and ACL files, client-id binding, size limits, optional TLS) run by a private
Mosquitto; the generated device and coordinator settings; a raw paho client that records how its
connection went. Broker-only: no torch here."""

from __future__ import annotations

import queue
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
from click.testing import CliRunner

from fedal_cli.main import cli
from hil.mosquitto import Mosquitto
from tests.waiting import free_port


@dataclass
class FleetFiles:
    out: Path
    port: int  # the devices' listener
    coordinator_port: int  # the coordinator's listener
    scheme: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def account(self) -> dict:
        """The coordinator's [broker] table as generated (URL of its own listener)."""
        return tomllib.loads((self.out / "coordinator" / "broker.toml").read_text())["broker"]

    def password(self, cid: str) -> str:
        return tomllib.loads((self.out / "devices" / cid / "agent.toml").read_text())["broker"]["password"]

    def agent_config(self, cid: str, url: str | None = None, ca_file: Path | None = None):
        """The device's generated agent config, its device paths pointed at this machine's files."""
        from edge_agent.config import load_agent_config

        cfg = load_agent_config(self.out / "devices" / cid / "agent.toml")
        broker = cfg.broker.model_copy(update={"url": url or cfg.broker.url})
        if cfg.broker.ca_file is not None or ca_file is not None:
            broker = broker.model_copy(update={"ca_file": ca_file or self.out / "devices" / cid / "ca.crt"})
        return cfg.model_copy(update={"broker": broker, "workspace": self.out / "ws" / cid})

    def coordinator_settings(self, **update):
        from coordinator.config import CoordinatorBrokerSettings

        return CoordinatorBrokerSettings(**{**self.account(), **update})


def provision(tmp_path: Path, devices: int = 3, *, prefix: str = "pi-", run_id: str = "fleet", tls: bool = False,
              extra: tuple[str, ...] = ()) -> FleetFiles:
    port = free_port()
    coordinator_port = free_port()
    out = tmp_path / "fleet"
    scheme = "mqtts" if tls else "mqtt"
    args = ["fleet", "init", "--devices", str(devices), "--prefix", prefix, "--broker", f"{scheme}://127.0.0.1:{port}",
            "--coordinator-port", str(coordinator_port), "--run-id", run_id, "--out", str(out),
            "--bind", "127.0.0.1", "--broker-dir", str(out / "broker"), *(["--tls"] if tls else []), *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return FleetFiles(out, port, coordinator_port, scheme)


def acl_only_broker(tmp_path: Path, run_id: str, extra: tuple[str, ...] = ()) -> tuple[Path, Mosquitto]:
    """Three `dev-` devices provisioned for run_id, and one Mosquitto listener enforcing only the
    generated password and ACL files (what a hand-written broker config would reuse: `passwd` and
    `coordinator.passwd` together)."""
    port = free_port()
    out = tmp_path / "fleet"
    result = CliRunner().invoke(cli, ["fleet", "init", "--devices", "3", "--prefix", "dev-", "--broker",
                                      f"mqtt://127.0.0.1:{port}", "--run-id", run_id, "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    both = tmp_path / "one-listener.passwd"  # one listener for both: the devices' and the coordinator's accounts
    both.write_text((out / "broker" / "passwd").read_text() + (out / "broker" / "coordinator.passwd").read_text())
    both.chmod(0o600)
    broker = Mosquitto(tmp_path / "mosquitto", port, password_file=both, acl_file=out / "broker" / "acl").start()
    return out, broker


def start_broker(files: FleetFiles, workdir: Path) -> Mosquitto:
    return Mosquitto(workdir, files.port, fleet_conf=files.out / "broker" / "fedal.conf").start()


class RawClient:
    """A paho client that records its CONNACK, its disconnections and what it receives."""

    def __init__(self, port: int, user: str | None, password: str | None, client_id: str = "", *,
                 clean_session: bool = True, ca: Path | None = None, reconnect: bool = False):
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.connacks: queue.Queue[object] = queue.Queue()
        self.disconnects: list[object] = []
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id or f"raw-{time.monotonic_ns()}",
                             clean_session=clean_session, protocol=mqtt.MQTTv311, reconnect_on_failure=reconnect)
        if user is not None:
            self.c.username_pw_set(user, password)
        if ca is not None:
            self.c.tls_set(ca_certs=str(ca))
        self.c.on_connect = lambda c, u, f, rc, p: self.connacks.put(rc)
        self.c.on_disconnect = lambda c, u, f, rc, p: self.disconnects.append(rc)
        self.c.on_message = lambda c, u, m: self.messages.put((m.topic, bytes(m.payload)))
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        try:
            self.rc = self.connacks.get(timeout=15)
        except queue.Empty:
            self.rc = None

    @property
    def accepted(self) -> bool:
        return self.rc is not None and not self.rc.is_failure

    def subscribe(self, topic: str) -> None:
        done: queue.Queue[object] = queue.Queue()
        self.c.on_subscribe = lambda c, u, mid, rcs, p: done.put(rcs)
        self.c.subscribe(topic, qos=1)
        done.get(timeout=10)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def wait_for(inbox: queue.Queue, want, timeout_s: float = 20) -> list:
    """The (topic, payload) of the items of `inbox` up to and including the first for which
    want((topic, payload)) holds (the coordinator's bus adds a third field, the retain flag)."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            seen.append(tuple(inbox.get(timeout=0.2)[:2]))
        except queue.Empty:
            continue
        if want(seen[-1]):
            return seen
    raise AssertionError(f"never arrived; got {[(t, p[:40]) for t, p in seen]}")
