"""`python -m hil` / `fedal hil`: the hardware-in-the-loop harness's commands."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import NoReturn

import click

from fedal.fast_exit import run_then_exit


@click.group("hil", context_settings={"help_option_names": ["-h", "--help"]})
def hil_cmd() -> None:
    """Hardware-in-the-loop: an emulated broker with fault injection, emulated fleets."""


@hil_cmd.command("broker")
@click.option("--upstream", default="mqtt://127.0.0.1:1883", show_default=True,
              help="The real broker (mqtt://host:port; plain MQTT).")
@click.option("--listen", default="127.0.0.1:1884", show_default=True,
              help="HOST:PORT agents connect to (0.0.0.0:1884 for real Pis on the LAN).")
@click.option("--profile", default="clean", show_default=True,
              help="A built-in fault profile name or a TOML file (see --list-profiles).")
@click.option("--control", default=None, metavar="HOST:PORT",
              help="Serve the control API (GET/PUT /faults, GET /stats, POST /partition) here.")
@click.option("--seed", type=int, default=None, help="Seed of the fault decisions (default: the profile's, else 0).")
@click.option("--list-profiles", is_flag=True, help="List the built-in profiles and exit.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True,
              help="info logs every injected fault.")
def broker_cmd(upstream: str, listen: str, profile: str, control: str | None, seed: int | None, list_profiles: bool,
               log_level: str) -> None:
    """Run the emulated broker: a fault-injecting MQTT proxy in front of a real broker."""
    from fedal.hosts import url_host
    from fedal.protocol import parse_broker_url
    from hil.broker import parse_hostport, serve_forever
    from hil.profiles import ProfileError, builtin_profiles, load_profile

    if list_profiles:
        for name in builtin_profiles():
            click.echo(f"{name:14} {load_profile(name).description}")
        return
    try:
        addr = parse_broker_url(upstream)
        if addr.tls:
            raise ValueError("the emulated broker speaks plain MQTT: give an mqtt:// upstream (a plain listener)")
        listen_at = parse_hostport(listen, "--listen")
        control_at = parse_hostport(control, "--control") if control else None
        prof = load_profile(profile)
    except (ValueError, ProfileError) as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)

    def ready(proxy, control_port) -> None:
        api = f", control API http://{url_host(control_at[0])}:{control_port}" if control_at and control_port else ""
        click.echo(f"hil broker: listening on {listen_at[0]}:{proxy.port}, upstream {addr.host}:{addr.port}, "
                   f"profile {prof.name} (seed {proxy.engine.seed}){api}", err=True)

    try:
        asyncio.run(serve_forever(prof, (addr.host, addr.port), listen_at, control_at, seed, on_ready=ready))
    except OSError as exc:
        raise click.ClickException(f"cannot listen: {exc}") from None


from hil.fleet_cli import fleet_cmd  # noqa: E402 - its heavy imports happen when it runs

hil_cmd.add_command(fleet_cmd)


def main() -> NoReturn:
    run_then_exit(hil_cmd, prog_name="python -m hil")
