"""`python -m edge_agent` / `fedal agent`: run one agent until its run finishes or a signal."""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click

from fedal.fast_exit import run_then_exit
from fedal.settings import SettingsError


@click.command("agent", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Agent TOML; FEDAL_AGENT_* env vars override it.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.option("--self-check", is_flag=True, help="Check that training, ONNX export and onnxruntime work here, print JSON, exit.")
def agent_cmd(config_path: str | None, log_level: str, self_check: bool) -> None:
    """Run an edge agent: train privately, exchange logits with the coordinator over MQTT."""
    if self_check:
        run_self_check()
    from edge_agent.config import load_agent_config

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:  # before torch is imported: a service with a bad config says so in a fraction of the time and memory
        config = load_agent_config(config_path)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    missing = config.broker.missing_file()  # else a traceback from the TLS set-up, at connect
    if missing:
        raise click.UsageError(f"{missing}; `fedal fleet init --tls` writes one per device")
    for key in ("data_file", "test_file", "local_test_file"):  # else joining is retried for ever, quietly
        path = getattr(config, key)
        if path is not None and not Path(path).is_file():
            raise click.UsageError(f"{key} {path} does not exist (install-agent.sh --data FILE puts the private "
                                   "data where the config says)")
    from edge_agent.own_workspace import claim_workspace
    from fedal.workspace import WorkspaceError

    try:
        claim_workspace(config)
    except OSError as exc:  # e.g. outside the service's writable /var/lib/fedal-agent
        raise click.UsageError(f"workspace {config.workspace}: {exc.strerror or exc} (the agent keeps its checkpoints "
                               "there; the service may write only below /var/lib/fedal-agent)") from None
    except WorkspaceError as exc:  # a user's directory: nothing in it is replaced
        raise click.UsageError(f"workspace {exc}") from None
    from edge_agent.data_files import read_rows

    row_shapes: dict[str, tuple[int, ...]] = {}
    for key in ("data_file", "test_file", "local_test_file"):  # what can never be trained on (numpy only: what
        path = getattr(config, key)  # needs the run's number of classes waits for the run)
        if path is not None:
            try:
                row_shapes[key] = read_rows(Path(path))[0].shape[1:]
            except ValueError as exc:
                raise click.UsageError(f"{key}: {exc}") from None
    for key, shape in row_shapes.items():  # else every evaluation is refused, and the final outputs with it
        if shape != row_shapes["data_file"]:
            raise click.UsageError(f"{key} {getattr(config, key)} holds rows of shape {list(shape)}, but data_file's "
                                   f"are {list(row_shapes['data_file'])}: the model takes one shape")
    from edge_agent.agent import Agent

    agent = Agent(config)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: its terminal closed
        signal.signal(sig, lambda *_: agent.request_stop())  # no lock in a handler (Agent.request_stop)
    sys.exit(agent.run())  # main() ends the process without the teardown (a worker still computing made it abort)


def run_self_check() -> None:
    from edge_agent.selfcheck import SelfCheckError, self_check

    try:
        report = self_check()
    except SelfCheckError as exc:
        click.echo(f"self-check failed: {exc}", err=True)
        sys.exit(1)
    if report["onnx"] != "ok":
        click.echo(f"self-check: warning: {report['onnx']}", err=True)
    click.echo(json.dumps(report, indent=2))
    sys.exit(0)


def main() -> NoReturn:
    run_then_exit(agent_cmd, prog_name="python -m edge_agent")
