"""`fedal fleet`: generate a fleet's credentials (`init`), renew its broker certificate
(`renew-cert`), revoke or re-key devices (`revoke`), check an agent config (`check`), build an
offline wheelhouse for the devices (`wheelhouse`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fedal import procs
from fedal.model_names import MODEL_NAMES


@click.group("fleet")
def fleet_cmd() -> None:
    """Provision a fleet of devices: credentials, broker ACL, TLS; check agent configs."""


@fleet_cmd.command("init")
@click.option("--devices", type=click.IntRange(min=1, max=100_000), required=True,
              help="Number of devices N (at most 100,000: a config, a password and an ACL block each).")
@click.option("--prefix", default="pi-", show_default=True, help="Device ids are PREFIX + number.")
@click.option("--start", type=click.IntRange(min=0), default=1, show_default=True, help="Number of the first device.")
@click.option("--broker", required=True, help="Broker URL the devices use: mqtt://host[:port] or mqtts://host[:port].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Directory to write into.")
@click.option("--run-id", default="fleet", show_default=True, help="Run id written into the agent configs.")
@click.option("--tls", is_flag=True, help="Make a CA and the broker's server certificate (needs an mqtts:// URL).")
@click.option("--server-name", "server_names", multiple=True,
              help="Extra DNS name or IP for the server certificate (the URL's host is always in it); repeatable.")
@click.option("--coordinator-user", default="coordinator", show_default=True, help="The coordinator's broker account.")
@click.option("--model", type=click.Choice(MODEL_NAMES), default="cnn1d", show_default=True,
              help="Private model written into every agent config.")
@click.option("--bind", help="Address the Mosquitto listener binds to (default: all interfaces).")
@click.option("--broker-dir", default="/etc/mosquitto/fedal", show_default=True,
              help="Where the broker's files will live; used for the paths in fedal.conf.")
@click.option("--coordinator-port", type=int,
              help="Port of the broker listener only the coordinator may use (default: the URL's port + 1).")
@click.option("--force", is_flag=True,
              help="Replace the fleet an earlier `fleet init` wrote in --out (new credentials); other files there stay.")
@click.option("--any-run-id", is_flag=True,
              help="Let devices use any run id (a + in the ACL) instead of --run-id only; a device may then fill the "
                   "broker with retained messages under run ids nobody reads.")
def init_cmd(**options) -> None:
    """Per-device agent configs and passwords, Mosquitto password and ACL files, optional TLS."""
    from fleet.generate import FleetError, FleetSpec, build_fleet

    options["server_names"] = list(options["server_names"])
    spec = FleetSpec(**options)
    try:
        summary = build_fleet(spec)
    except FleetError as exc:
        raise click.UsageError(str(exc)) from None
    out = spec.out
    click.echo(f"fleet of {len(summary['devices'])} devices for run {summary['run_id']!r} written to {out}")
    click.echo(f"  devices:     {out / 'devices'}/<id>/agent.toml  ({summary['devices'][0]} .. {summary['devices'][-1]})")
    click.echo(f"  coordinator: {out / 'coordinator' / 'broker.toml'} (merge into coordinator.toml, keep it mode 0600;"
               f" it connects to {summary['coordinator_broker']})")
    click.echo(f"  broker:      {out / 'broker'}/{{passwd,coordinator.passwd,acl,fedal.conf}}"
               + (" + TLS certificate" if spec.tls else ""))
    if spec.tls:
        click.echo(f"  CA key:      {out / 'ca' / 'ca.key'} (keep offline; needed only to issue a new server certificate)")
        click.echo(f"  server certificate valid until {summary['server_cert_not_after']}: `fedal fleet renew-cert "
                   f"--out {out}` issues a new one from the same CA (no device changes)")
    elif spec.broker.startswith("mqtt://"):
        click.echo("  warning: mqtt:// sends passwords in clear text; use --tls with an mqtts:// URL outside a trusted LAN")
    else:
        click.echo(f"  note: mqtts:// without --tls: fedal.conf expects your own certificate and key at "
                   f"{spec.broker_dir.rstrip('/')}/server.crt and server.key (the devices check it against the system's "
                   "CA bundle: a publicly signed one); --tls makes a CA and a certificate instead")
    if len(summary["devices"]) < 2:  # as revoke warns: broker.toml's client_ids would not load
        click.echo(f"  warning: {len(summary['devices'])} device: a run needs at least 2 clients (the coordinator "
                   "refuses broker.toml's client_ids until `fleet init --force` makes more)", err=True)


@fleet_cmd.command("renew-cert")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The directory `fedal fleet init --tls` wrote (its ca/ and broker/).")
@click.option("--days", type=click.IntRange(min=1, max=3650), default=825, show_default=True,
              help="Validity of the new certificate.")
def renew_cert_cmd(out: Path, days: int) -> None:
    """A new server certificate for the broker from the fleet's CA, for the same names: no device changes."""
    from fleet.generate import FleetError
    from fleet.renew import renew_server_cert

    try:
        info = renew_server_cert(out, days)
    except FleetError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(f"new server certificate for {', '.join(map(str, info['names']))} (valid until {info['not_after']}; "
               f"the CA until {info['ca_not_after']}) written to {out / 'broker'}/server.{{crt,key}}")
    click.echo("  next: copy both to the broker's directory (fedal.conf's certfile and keyfile) and restart "
               "Mosquitto; the devices keep their configs")


@fleet_cmd.command("revoke")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="The directory `fedal fleet init` wrote.")
@click.option("--reissue", is_flag=True,
              help="Give the devices new passwords (and configs to flash) instead of taking them out of the fleet.")
@click.argument("devices", nargs=-1, required=True)
def revoke_cmd(out: Path, reissue: bool, devices: tuple[str, ...]) -> None:
    """Lock DEVICES out of the broker (a lost or stolen card), or re-key them with --reissue; the other
    accounts keep their passwords."""
    from fleet.generate import FleetError

    try:
        from fleet.revoke import revoke_devices
    except ImportError as exc:  # an install from before the fleet extra needed it (tomlkit)
        raise click.ClickException(f"`fedal fleet revoke` needs {exc.name}, which this install lacks: "
                                   "install the fleet extra again (pip install 'fedal-edge[fleet]', or "
                                   "scripts/install.sh)") from None
    try:
        info = revoke_devices(out, list(devices), reissue=reissue)
    except FleetError as exc:
        raise click.UsageError(str(exc)) from None
    done = info.done
    for cid, what in done.items():
        click.echo(f"{cid}: {what}")
    if any(what.startswith("reissued") for what in done.values()):
        click.echo(f"  flash or install {out / 'devices'}/<id>/agent.toml on each reissued device")
    if any(what != "already revoked" for what in done.values()):
        click.echo(f"  next: copy {out / 'broker'}/passwd and acl to the broker's directory and reload Mosquitto "
                   "(`sudo systemctl reload mosquitto`: it re-reads both and drops a connected client they no longer "
                   "admit; a one-listener broker of your own: its password file made again from passwd and "
                   "coordinator.passwd)")
        click.echo(f"  the fleet's devices are now {', '.join(info.devices) or 'none'} ({out / 'coordinator' / 'broker.toml'}'s "
                   "client_ids): use them for the next run. A run under way keeps its client_ids (changing them "
                   "starts it afresh): a revoked device stays offline and the phases close by their quorum")
        if len(info.devices) < 2:
            click.echo(f"  warning: {len(info.devices)} device(s) left: a run needs at least 2 clients", err=True)


@fleet_cmd.command("check")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
def check_cmd(config: Path) -> None:
    """Validate an agent config; print its key facts as key=value lines (exit 1 if invalid)."""
    from edge_agent.config import load_agent_config
    from fedal.protocol import parse_broker_url
    from fedal.settings import SettingsError

    try:
        cfg = load_agent_config(config)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    addr = parse_broker_url(cfg.broker.url)
    user = cfg.broker.username or addr.username
    click.echo(f"client_id={cfg.client_id}")
    click.echo(f"run_id={cfg.run_id}")
    click.echo(f"broker={'mqtts' if addr.tls else 'mqtt'}://{f'{user}@' if user else ''}{addr.host}:{addr.port}")
    click.echo(f"tls={'yes' if addr.tls else 'no'}")
    click.echo(f"ca_file={cfg.broker.ca_file or ''}")


@fleet_cmd.command("wheelhouse")
@click.option("--arch", default="aarch64", show_default=True, help="The devices' architecture: aarch64 (64-bit Pi OS) or x86_64.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory to write the wheels into (new, empty, or a wheelhouse this command wrote).")
@click.option("--python-version", default="3.11", show_default=True,
              help="The devices' Python (Raspberry Pi OS Bookworm: 3.11).")
@click.option("--constraints", type=click.Path(dir_okay=False, path_type=Path),
              help="Pinned versions (default: firmware_scripts/constraints/ARCH.txt of this checkout).")
@click.option("--wheel", type=click.Path(dir_okay=False, path_type=Path),
              help="The agent's wheel (default: built from this checkout).")
@click.option("--index-url", help="Package index to download from (default: pip's, i.e. PyPI).")
@click.option("--find-links", "find_links", multiple=True, help="Extra directory or URL of wheels for pip; repeatable.")
@click.option("--no-index", is_flag=True, help="Only --find-links, no package index (torch from --torch-index if given, "
              "e.g. a mirror of PyTorch's CPU index in the lab).")
@click.option("--torch-index", metavar="URL",
              help="Take torch alone from this index, e.g. PyTorch's CPU wheels https://download.pytorch.org/whl/cpu "
                   "(needed for a Pi 3B+, Pi 4 or Zero 2 W: docs/deploy-raspberry-pi.md).")
@click.option("--torch-version", metavar="V", help="torch's version instead of the constraints' pin (e.g. 2.13.0).")
def wheelhouse_cmd(**options) -> None:
    """Every wheel the devices' agent install needs, for an install without a package index.

    The pinned CPU-only torch and the rest of the agent extra for the devices' platform, and this
    toolkit's wheel, checked to be complete for the device. `flash.sh --wheelhouse DIR` puts it
    on an SD card; the device then installs with `pip install --no-index --find-links`.
    """
    from fleet.wheelhouse import UsageProblem, WheelhouseError, WheelhouseSpec, build_wheelhouse

    options["find_links"] = list(options["find_links"])
    if options["no_index"] and not options["find_links"]:  # pip would find nothing and say so in its own words
        raise click.UsageError("--no-index needs --find-links (where the wheels are)")
    if options["no_index"] and options["index_url"]:
        raise click.UsageError("--no-index and --index-url contradict each other")
    spec = WheelhouseSpec(**options)
    try:
        with procs.stop_signals_interrupt():  # SIGTERM/SIGHUP as Ctrl-C: pip ended, the work directory removed
            manifest = build_wheelhouse(spec, progress=lambda msg: click.echo(f"wheelhouse: {msg}", err=True))
    except procs.Stopped as exc:
        click.echo(f"stopped by {exc}: pip ended, its work directory removed", err=True)
        sys.exit(exc.exit_status)
    except UsageProblem as exc:
        raise click.UsageError(str(exc)) from None
    except WheelhouseError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wheelhouse for {manifest['arch']} (CPython {manifest['python']}) written to {spec.out}: "
               f"{len(manifest['files'])} wheels, {manifest['bytes'] / 2**20:.1f} MiB")
    click.echo(f"  agent: {manifest['agent_wheel']}; torch {manifest['torch'] or '(none)'}; "
               f"installs offline: {', '.join(manifest['extras'])}")
    click.echo(f"  next: firmware_scripts/flash.sh --image IMG --config agent.toml --wheelhouse {spec.out}")
