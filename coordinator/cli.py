"""`python -m coordinator` / `fedal coordinator`."""

from __future__ import annotations

import logging
import sys

import click

from fedal.settings import SettingsError, exposed_secrets


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
    warn_if_secrets_exposed(config_path)
    sys.exit(serve(config))


SECRET_KEYS = ["api.token", "broker.password", "broker.url"]


def warn_if_secrets_exposed(config_path: str) -> None:
    """The config may hold the API token and the broker password; anyone else able to read it can
    stop runs over the API or speak for the coordinator on the broker."""
    exposed = exposed_secrets(config_path, SECRET_KEYS)
    if exposed:
        keys, mode = exposed
        logging.getLogger("coordinator").warning(
            "%s holds secrets (%s) but is open to group/others (mode %04o): run `chmod 600 %s`",
            config_path, ", ".join(keys), mode, config_path)


def main() -> int:
    coordinator_cmd(prog_name="python -m coordinator")
    return 0
