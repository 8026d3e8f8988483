"""`python -m coordinator` / `fedal coordinator`."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import NoReturn

import click

from fedal.fast_exit import run_then_exit
from fedal.hosts import is_loopback
from fedal.owned import ForeignFile, check_replaceable, is_results, unwritable
from fedal.settings import SettingsError, exposed_secrets


@click.command("coordinator", context_settings={"help_option_names": ["-h", "--help"]})
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
    check_files(config)
    warn_if_secrets_exposed(config_path)
    warn_if_weak_token(config)
    warn_if_reads_open(config)
    from coordinator.runs import ConfiguredRunError
    from coordinator.store import StoreError
    from fedal.workspace import WorkspaceError, locked

    try:  # one coordinator per state_dir: a second one would take over the broker session and the store
        with locked(config.state_dir, "the coordinator", STATE_LOCK):
            status = serve(config)
    except WorkspaceError as error:
        raise click.UsageError(f"state_dir: {error}") from None
    except ConfiguredRunError as error:
        raise click.UsageError(str(error)) from None
    except StoreError as error:  # e.g. a damaged coordinator.db: one line, the file left as it is
        raise click.ClickException(str(error)) from None
    sys.exit(status)


STATE_LOCK = ".coordinator.lock"


def check_files(config) -> None:
    """The files the config names, checked before anything starts or is created (the state
    directory, the broker connection): a missing or unusable one is a usage error, not a traceback."""
    from coordinator.run import read_public_file

    missing = config.broker.missing_file()
    if missing:
        raise click.UsageError(missing)
    if config.public_file is not None:
        try:
            read_public_file(Path(config.public_file))
        except OSError as exc:
            raise click.UsageError(f"public_file {config.public_file}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    results = Path(config.results_file or Path(config.state_dir) / "results.json")
    try:  # written at the run's end: a file there that is not a run's results is the user's
        check_replaceable(results, is_results, "results file")
    except ForeignFile as exc:
        raise click.UsageError(f"results_file: {exc}") from None
    check_device(config.device)
    state = Path(config.state_dir)  # last: nothing is made for a config refused above
    if state.exists() and not state.is_dir():
        raise click.UsageError(f"state_dir {state} is not a directory")
    try:
        state.mkdir(parents=True, exist_ok=True, mode=0o700)  # (its store lists clients and health: the owner's)
    except OSError as exc:
        raise click.UsageError(f"state_dir {state} cannot be created: {exc.strerror or exc}") from None
    why = unwritable(results)
    if why:  # else the results are lost when the run ends
        raise click.UsageError(f"results_file: {why}")
    check_port(config.api.host, config.api.port)


def check_port(host: str, port: int) -> None:
    """The API's address can be bound (else uvicorn exits with status 3 after the run has started)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        raise click.UsageError(f"api {host}:{port} cannot be served: {exc.strerror or exc}") from None


def check_device(device: str) -> None:
    """A named GPU this machine has (a CPU-only torch, or an index past the last GPU, failed deep in the run)."""
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise click.UsageError(f"device {device}: torch sees {count} CUDA GPU(s) here"
                               f"{' (this torch is a CPU-only build)' if torch.version.cuda is None else ''}; "
                               "use device = \"auto\" or \"cpu\"")


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


MIN_TOKEN_CHARS = 16


def warn_if_weak_token(config) -> None:
    """A short token is guessed: refused guesses are counted and logged, not slowed down."""
    token = config.api.token
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        logging.getLogger("coordinator").warning(
            "api.token has %d characters: use at least %d random ones (e.g. `python -c \"import secrets; "
            "print(secrets.token_urlsafe(24))\"`); anyone who guesses it can stop and create runs",
            len(token), MIN_TOKEN_CHARS)


def warn_if_reads_open(config) -> None:
    """Reads open to the network tell anyone on it the fleet's client ids and each device's
    software versions (what to aim an exploit at), temperatures and memory; on loopback only
    this machine sees them."""
    api = config.api
    if api.read_requires_token or is_loopback(api.host):
        return
    logging.getLogger("coordinator").warning(
        "the API listens on %s and its reads are open: the run's client ids, each device's software versions "
        "and health, /metrics and the event stream, to anyone who reaches port %d; set [api] "
        "read_requires_token = true (the dashboard then asks for the token; a Prometheus scrape sends it "
        "as `authorization: {credentials: TOKEN}`)", api.host, api.port)


def main() -> NoReturn:
    run_then_exit(coordinator_cmd, prog_name="python -m coordinator")
