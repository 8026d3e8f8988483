"""`fedal fleet init`: everything a fleet of N agents needs to meet one broker securely.

    OUT/devices/<id>/agent.toml    one agent config per device, its own password (0600)
    OUT/devices/<id>/ca.crt        with TLS: the CA the agent verifies the broker with
    OUT/coordinator/broker.toml    run id, client ids and a [broker] table for coordinator.toml
    OUT/broker/passwd              the devices' hashes (PBKDF2-SHA512, no plain text), for their listener
    OUT/broker/coordinator.passwd  the coordinator's hash alone, for the coordinator's listener
    OUT/broker/acl                 Mosquitto ACL: each device only its own topics
    OUT/broker/fedal.conf          Mosquitto listener snippet using the files above
    OUT/broker/server.{crt,key}    with TLS: the broker's certificate, signed by the CA
    OUT/ca/ca.{crt,key}            with TLS: the CA; keep ca.key offline
    OUT/fleet.json                 what was generated (no secrets)
    OUT/.fedal-fleet-files         the paths above that this fleet wrote: what --force may replace

Plain passwords exist only in the device and coordinator configs; the broker keeps hashes.
Every file holding a secret (a password, a private key, a password hash) is written 0600.

The broker gets two listeners. Devices connect to the URL's port, where Mosquitto replaces the
client id a client sends by its user name (`use_username_as_clientid`): a device's account can
hold only the session named after it, so with a stolen device's password nobody can take over
(and disconnect) another device's or the coordinator's connection. The coordinator connects to
its own port (default: the URL's port + 1), which only the coordinator's account may log in to;
there it keeps its own client ids, one connection per run. Both refuse packets larger than the
protocol's MAX_PAYLOAD (plus MQTT's own header), so no one can make the broker relay more.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import tempfile
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import tomli_w

from edge_agent.config import AgentConfig
from fedal.hosts import url_host
from fedal.protocol import MAX_MESSAGE_BYTES, MAX_PAYLOAD, BrokerAddress, BrokerSettings, parse_broker_url, topics
from fleet import acl, passwords, tls

# Where install-agent.sh puts things on a device; the generated agent configs point there.
DEVICE_CONFIG_DIR = "/etc/fedal-agent"
DEVICE_STATE_DIR = "/var/lib/fedal-agent"
# What a PUBLISH adds to its payload: fixed header (<= 5), topic (<= 2 + 145 for the longest run and
# client ids), packet id (2); CONNECT and SUBSCRIBE packets stay far below the payload limit.
PACKET_HEADROOM = 1024
# The toolkit's own client ids start so (fedal-coordinator-<run>, fedal-agent-<run>-<client>); an
# account named so would, as a client id on the devices' listener, take over the coordinator's.
RESERVED_PREFIX = "fedal-"


class FleetError(ValueError):
    """Options that cannot make a working fleet; the message says which and why."""


@dataclass
class FleetSpec:
    devices: int
    broker: str
    out: Path
    prefix: str = "pi-"
    start: int = 1
    run_id: str = "fleet"
    tls: bool = False
    server_names: list[str] = field(default_factory=list)
    coordinator_user: str = "coordinator"
    model: str = "cnn1d"
    bind: str | None = None
    broker_dir: str = "/etc/mosquitto/fedal"
    force: bool = False
    coordinator_port: int | None = None  # default: the broker URL's port + 1
    any_run_id: bool = False  # the ACL's run level a `+` (else the fleet's run id)

    def client_ids(self) -> list[str]:
        if self.devices < 1:
            raise FleetError("--devices must be at least 1")
        if self.start < 0:
            raise FleetError("--start must not be negative")
        ids = [f"{self.prefix}{i}" for i in range(self.start, self.start + self.devices)]
        try:
            for cid in ids:
                topics.check_id(cid, "client id")
        except topics.TopicError as exc:
            raise FleetError(f"{exc} (from --prefix {self.prefix!r})") from None
        return ids


# While build_fleet plans a fleet, _write records {path: (content, mode)} here instead of writing.
_PLAN: ContextVar[dict[Path, tuple[str | bytes, int]] | None] = ContextVar("fleet_plan", default=None)
MARKER = ".fedal-fleet-files"
# What `fedal fleet init` wrote before it kept MARKER (its fleet.json says which devices, TLS or not).
_LEGACY_FILES = ("coordinator/broker.toml", "broker/passwd", "broker/coordinator.passwd", "broker/acl",
                 "broker/fedal.conf", "fleet.json")
_LEGACY_TLS_FILES = ("ca/ca.crt", "ca/ca.key", "broker/ca.crt", "broker/server.crt", "broker/server.key",
                     "coordinator/ca.crt")


def _write(path: Path, text: str | bytes, mode: int) -> None:
    """Write via a temporary file made 0600 and given `mode` before the rename: a secret never sits
    under an older file's looser mode (--force), the umask cannot loosen it, a symlink is replaced."""
    plan = _PLAN.get()
    if plan is not None:
        plan[path] = (text, mode)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a power cut after the rename must not leave an empty passwd or ca.key
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _toml(header: str, data: dict) -> str:
    return "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines()) + "\n" + tomli_w.dumps(data)


def _check(spec: FleetSpec) -> tuple[list[str], BrokerAddress]:
    ids = spec.client_ids()
    try:
        addr = parse_broker_url(spec.broker)
        topics.check_id(spec.run_id, "run id")
        topics.check_id(spec.coordinator_user, "coordinator user")
    except ValueError as exc:
        raise FleetError(str(exc)) from None
    if addr.username or addr.password:
        raise FleetError("give --broker without user:password; the fleet makes one account per device")
    if not _host_or_address(addr.host):  # the devices' configs and the broker's certificate name it
        raise FleetError(f"--broker host {addr.host!r} is not a DNS name or IP address (punycode for a name that "
                         "is not ASCII)")
    if spec.coordinator_user in ids:
        raise FleetError(f"coordinator user {spec.coordinator_user!r} collides with a device id")
    for name in [spec.coordinator_user, *ids]:
        if name.startswith(RESERVED_PREFIX):
            raise FleetError(f"account {name!r} starts with {RESERVED_PREFIX!r}, which the toolkit's own client ids use")
    cport = coordinator_port(spec, addr)
    if not 1 <= cport <= 65535 or cport == addr.port:
        raise FleetError(f"--coordinator-port {cport} must be a port (1-65535) other than the devices' {addr.port}")
    if spec.tls and not addr.tls:
        raise FleetError(f"--tls needs an mqtts:// broker URL (got {spec.broker}); the default TLS port is 8883")
    if not spec.broker_dir.startswith("/") or any(c.isspace() or not c.isprintable() for c in spec.broker_dir) \
            or "#" in spec.broker_dir:  # written into fedal.conf, which Mosquitto reads from its own directory
        raise FleetError(f"--broker-dir {spec.broker_dir!r} must be an absolute path without spaces, control "
                         "characters or '#' (Mosquitto's config names the password and ACL files there)")
    if spec.bind is not None and not _host_or_address(spec.bind):
        raise FleetError(f"--bind {spec.bind!r} is not an IP address or host name (Mosquitto's listener would not start)")
    for name in spec.server_names:
        if not _host_or_address(name):
            raise FleetError(f"--server-name {name!r} is not a DNS name or IP address (the certificate's names)")
    out = spec.out
    if out.exists() and not out.is_dir():
        raise FleetError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not spec.force:
        if (out / MARKER).is_file() or (out / "fleet.json").is_file():
            raise FleetError(f"--out {out} holds a fleet; refusing to overwrite its credentials (--force replaces "
                             "that fleet's own files, with new credentials for every device)")
        raise FleetError(f"--out {out} is not empty and holds no fleet that `fedal fleet init` wrote: refusing to "
                         "write into it; choose a new or an empty directory")
    return ids, addr


def coordinator_port(spec: FleetSpec, addr: BrokerAddress) -> int:
    return spec.coordinator_port if spec.coordinator_port is not None else addr.port + 1


def coordinator_url(spec: FleetSpec, addr: BrokerAddress) -> str:
    """The broker URL with the coordinator listener's port."""
    return f"{'mqtts' if addr.tls else 'mqtt'}://{url_host(addr.host)}:{coordinator_port(spec, addr)}"


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _host_or_address(text: str) -> bool:
    """An IP address, or a DNS name (labels of letters, digits and inner hyphens; 253 at most)."""
    with contextlib.suppress(ValueError):  # not an address: a name, then
        ipaddress.ip_address(text)
        return True
    name = text[:-1] if text.endswith(".") else text
    return 0 < len(name) <= 253 and all(_LABEL.fullmatch(label) for label in name.split("."))


def build_fleet(spec: FleetSpec) -> dict:
    """Write the fleet's files under spec.out; returns the fleet.json summary.

    With --force over an earlier fleet only the files that fleet wrote (its MARKER list) are
    replaced or, when this fleet has no such file (a device fewer), removed; every other file in
    --out stays. The files are planned first and checked before any of them is written: a file in
    the way that no fleet wrote refuses the whole run, a directory no fleet wrote is refused at once.
    """
    _check(spec)
    out = spec.out
    previous = _generated_before(out) if out.is_dir() and any(out.iterdir()) else set()
    token = _PLAN.set({})
    try:
        summary = _plan_fleet(spec)
        plan = _PLAN.get()
    finally:
        _PLAN.reset(token)
    rel = {path: path.relative_to(out).as_posix() for path in plan}
    in_the_way = sorted(r for path, r in rel.items() if (path.exists() or path.is_symlink())
                        and (r not in previous or (path.is_dir() and not path.is_symlink())))
    in_the_way += sorted({d.relative_to(out).as_posix() for path in plan for d in _folders_between(out, path)
                          if (d.exists() or d.is_symlink()) and (d.is_symlink() or not d.is_dir())})
    # and the files it would remove (a device fewer): only from folders of its own, never through a link
    in_the_way += sorted({d.relative_to(out).as_posix() for r in previous - set(rel.values())
                          for d in linked_folders(out, out / r)})
    if in_the_way:
        raise FleetError(f"--out {out}: {', '.join(in_the_way[:5])}{' ...' if len(in_the_way) > 5 else ''} "
                         f"exist(s) and no `fedal fleet init` wrote them; nothing was written (move them away)")
    new = set(rel.values())
    if not out.exists():  # made here: only its owner may list the credentials in it. A directory
        try:  # the user had keeps its mode (its group, setgid): the secrets themselves are written 0600
            out.mkdir(parents=True)
        except OSError as exc:
            raise FleetError(f"--out {out} cannot be created: {exc.strerror or exc}") from None
        os.chmod(out, 0o700)
    try:
        _write(out / MARKER, _marker_text(previous | new), 0o644)  # a crash midway still knows every file it wrote
        for path, (text, mode) in plan.items():
            _write(path, text, mode)
    except OSError as exc:  # a full disk, a directory this user may not write
        raise FleetError(f"--out {out}: cannot write {Path(exc.filename or '').name or 'the fleet'}: "
                         f"{exc.strerror or exc}; the files written so far are listed in {out / MARKER} "
                         "(--force replaces them)") from None
    for r in sorted(previous - new):  # this fleet's predecessor's, e.g. a device no longer in it
        stale = out / r
        if stale.is_symlink() or stale.is_file():
            stale.unlink()
            for parent in stale.parents:
                if parent == out or not parent.is_relative_to(out) or any(parent.iterdir()):
                    break
                parent.rmdir()
    _write(out / MARKER, _marker_text(new), 0o644)
    return summary


def linked_folders(out: Path, path: Path) -> list[Path]:
    """The folders between `out` and a file `path` under it that are links: a file of the fleet's
    removed through one would be another folder's."""
    return [d for d in _folders_between(out, path) if d.is_symlink()]


def _folders_between(out: Path, path: Path) -> list[Path]:
    """The folders a file under `out` is written into, below `out`: each must be a real folder."""
    return [p for p in path.parents if p != out and p.is_relative_to(out)]


def _marker_text(files: set[str]) -> str:
    return ("# Files `fedal fleet init` wrote here; `--force` replaces or removes only these.\n"
            + "".join(f"{r}\n" for r in sorted(files)))


def _generated_before(out: Path) -> set[str]:
    """The relative paths an earlier `fedal fleet init` wrote into out; FleetError if none did."""
    marker = out / MARKER
    if marker.is_file():
        files = {line.strip() for line in marker.read_text().splitlines() if line.strip() and not line.startswith("#")}
        return {r for r in files if not Path(r).is_absolute() and ".." not in Path(r).parts}
    try:  # a fleet written before MARKER existed: its fleet.json says what it wrote
        summary = json.loads((out / "fleet.json").read_text())
        devices, with_tls = summary["devices"], summary["tls"]
        if not isinstance(devices, list) or not all(isinstance(d, str) and d for d in devices):
            raise ValueError("devices")
    except (OSError, ValueError, KeyError, TypeError):
        raise FleetError(f"--out {out} is not empty and holds no fleet that `fedal fleet init` wrote (no {MARKER}): "
                         f"--force replaces only a fleet's own files; choose a new or an empty directory") from None
    files = set(_LEGACY_FILES) | {f"devices/{d}/agent.toml" for d in devices}
    if with_tls:
        files |= set(_LEGACY_TLS_FILES) | {f"devices/{d}/ca.crt" for d in devices}
    return {r for r in files if ".." not in Path(r).parts}


def write_device(out: Path, cid: str, run_id: str, model: str, broker_url: str, password: str,
                 ca_cert: str | bytes | None) -> None:
    """OUT/devices/<cid>/agent.toml (and ca.crt with TLS): what one device is flashed with."""
    broker = {"url": broker_url, "username": cid, "password": password}
    if ca_cert is not None:
        broker["ca_file"] = f"{DEVICE_CONFIG_DIR}/ca.crt"
        _write(out / "devices" / cid / "ca.crt", ca_cert, 0o644)
    config = {"client_id": cid, "run_id": run_id, "model": model,
              "data_file": f"{DEVICE_STATE_DIR}/train.npz", "workspace": DEVICE_STATE_DIR, "broker": broker}
    AgentConfig.model_validate(config)  # what the device will load, checked here
    header = (f"Agent config for device {cid} (written by `fedal fleet init`). Holds this device's broker password:\n"
              "install it with firmware_scripts/flash.sh or install-agent.sh, "
              f"which put it at {DEVICE_CONFIG_DIR}/agent.toml\n"
              f"readable by the agent only. The private data goes to data_file; see docs/deploy-raspberry-pi.md.")
    _write(out / "devices" / cid / "agent.toml", _toml(header, config), 0o600)


def _plan_fleet(spec: FleetSpec) -> dict:
    """Every file of the fleet, through _write; returns the fleet.json summary."""
    ids, addr = _check(spec)
    out = spec.out
    secrets = {cid: passwords.new_password() for cid in [spec.coordinator_user, *ids]}

    ca_pem, server_not_after = None, None
    if spec.tls:
        ca_pem, ca_key, ca_cert = tls.make_ca(f"FedAL fleet CA ({spec.run_id})")
        server = tls.make_server_cert(ca_key, ca_cert, [addr.host, *spec.server_names])
        server_not_after = tls.not_after(server.cert)
        _write(out / "ca" / "ca.crt", ca_pem.cert, 0o644)
        _write(out / "ca" / "ca.key", ca_pem.key, 0o600)
        _write(out / "broker" / "ca.crt", ca_pem.cert, 0o644)
        _write(out / "broker" / "server.crt", server.cert, 0o644)
        _write(out / "broker" / "server.key", server.key, 0o600)
        _write(out / "coordinator" / "ca.crt", ca_pem.cert, 0o644)

    for cid in ids:
        write_device(out, cid, spec.run_id, spec.model, spec.broker, secrets[cid], ca_pem.cert if ca_pem else None)

    coord_broker = {"url": coordinator_url(spec, addr), "username": spec.coordinator_user,
                    "password": secrets[spec.coordinator_user]}
    if ca_pem is not None:
        coord_broker["ca_file"] = str((out / "coordinator" / "ca.crt").resolve())
    BrokerSettings.model_validate(coord_broker)
    header = ("Merge into the coordinator's TOML (written by `fedal fleet init`): the run id and client ids the\n"
              "devices were enrolled with, and the coordinator's own broker account, which may read and write the\n"
              "whole fedal/v1/ tree, on the coordinator's listener (its own port). ca_file points into this\n"
              "directory; adjust it if you move the CA. Holds the broker password (and, once merged, the API\n"
              "token): keep coordinator.toml mode 0600.")
    _write(out / "coordinator" / "broker.toml",
           _toml(header, {"run_id": spec.run_id, "client_ids": ids, "broker": coord_broker}), 0o600)

    # the devices' listener takes the devices' accounts only: the coordinator's, with its rights over the
    # whole tree, cannot be used there (where the network reaches) should its password leak
    _write(out / "broker" / "passwd", passwords.password_file({u: secrets[u] for u in ids}), 0o600)
    _write(out / "broker" / "coordinator.passwd",
           passwords.password_file({spec.coordinator_user: secrets[spec.coordinator_user]}), 0o600)
    _write(out / "broker" / "acl", acl.acl_file(ids, spec.coordinator_user, None if spec.any_run_id else spec.run_id),
           0o644)
    _write(out / "broker" / "fedal.conf", mosquitto_conf(spec, addr.port, coordinator_port(spec, addr)), 0o644)

    summary = {"run_id": spec.run_id, "broker": spec.broker, "coordinator_broker": coordinator_url(spec, addr),
               "tls": spec.tls, "coordinator_user": spec.coordinator_user, "acl_run_id": "+" if spec.any_run_id else spec.run_id,
               **({"server_cert_not_after": server_not_after} if server_not_after else {}),
               "devices": ids, "model": spec.model, "created": datetime.now(UTC).isoformat(timespec="seconds")}
    _write(out / "fleet.json", json.dumps(summary, indent=2) + "\n", 0o644)
    return summary


# what the broker queues for one session: twice an agent's default max_message_bytes (one whole
# task envelope, a FedAvg model included, always fits, with the next one behind it)
QUEUED_BYTES = 2 * MAX_MESSAGE_BYTES


def mosquitto_conf(spec: FleetSpec, port: int, coord_port: int) -> str:
    d = spec.broker_dir.rstrip("/")
    bind = f" {spec.bind}" if spec.bind else ""
    if spec.tls:
        tls = [f"cafile {d}/ca.crt", f"certfile {d}/server.crt", f"keyfile {d}/server.key"]
    elif parse_broker_url(spec.broker).tls:  # mqtts:// with a certificate of one's own: never plain MQTT on a TLS port
        tls = ["# mqtts:// without `fleet init --tls`: your own certificate (the devices check it against the",
               "# system's CA bundle, so a publicly signed one) and its key; Mosquitto will not start without them",
               f"certfile {d}/server.crt", f"keyfile {d}/server.key"]
    else:
        tls = []
    return "\n".join([
        "# Mosquitto settings for the FedAL fleet (written by `fedal fleet init`).",
        f"# Copy this directory's files to {d}/ (passwd, coordinator.passwd and server.key readable by the",
        "# mosquitto user only) and this file to /etc/mosquitto/conf.d/; then restart mosquitto.",
        "# Each listener has its own login and ACL settings: keep any other listener's settings below",
        "# its own `listener` line.",
        "per_listener_settings true",
        f"# No packet above the protocol's largest payload ({MAX_PAYLOAD} bytes) plus MQTT headers: a larger",
        "# one disconnects its sender before the broker reads it; a payload above the limit is dropped.",
        f"max_packet_size {MAX_PAYLOAD + PACKET_HEADROOM}",
        f"message_size_limit {MAX_PAYLOAD}",
        "# Tasks and results are a few kB each way per phase: with Nagle's algorithm on, each waits for",
        "# the peer's delayed ACK (up to 40 ms per hop). The toolkit's clients turn it off too.",
        "set_tcp_nodelay true",
        "# A device that is off keeps its session, and the broker queues its tasks: at most this many",
        "# bytes of them (twice the largest envelope an agent takes; the coordinator sends a device its",
        "# open task again when it is back), and a session unused for two weeks is forgotten (a device",
        "# back after that subscribes again; a dead one no longer holds the broker's memory).",
        f"max_queued_bytes {QUEUED_BYTES}",
        "persistent_client_expiration 2w",
        "",
        "# Devices. The broker takes the user name as the client id, whatever the client sends: an",
        "# account holds only its own session, so it cannot disconnect another device or the coordinator.",
        f"listener {port}{bind}",
        "allow_anonymous false",
        f"password_file {d}/passwd",
        f"acl_file {d}/acl",
        "use_username_as_clientid true",
        *tls,
        "",
        "# The coordinator: its account alone may log in here; it keeps its own client ids (one per run).",
        f"listener {coord_port}{bind}",
        "allow_anonymous false",
        f"password_file {d}/coordinator.passwd",
        f"acl_file {d}/acl",
        *tls,
    ]) + "\n"
