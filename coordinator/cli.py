"""`python -m coordinator` / `fedal coordinator`."""

from __future__ import annotations

import logging
import sys

import click

from fedal.settings import SettingsError


@click.command("coordinator")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), required=True,
              help="Coordinator TOML; FEDAL_COORD_* env vars override it.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def coordinator_cmd(config_path: str, log_level: str) -> None:
    """Run the coordinator: the round engine over MQTT and the REST API."""
    from coordinator.config import load_coordinator_config
    from coordinator.service import serve

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = load_coordinator_config(config_path)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    sys.exit(serve(config))


def main() -> int:
    coordinator_cmd(prog_name="python -m coordinator")
    return 0
