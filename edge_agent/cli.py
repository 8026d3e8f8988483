"""`python -m edge_agent` / `fedal agent`: run one agent until its run finishes or a signal."""

from __future__ import annotations

import logging
import signal
import sys

import click

from fedal.settings import SettingsError


@click.command("agent")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="Agent TOML; FEDAL_AGENT_* env vars override it.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
def agent_cmd(config_path: str | None, log_level: str) -> None:
    """Run an edge agent: train privately, exchange logits with the coordinator over MQTT."""
    from edge_agent.agent import Agent
    from edge_agent.config import load_agent_config

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        config = load_agent_config(config_path)
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    agent = Agent(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    sys.exit(agent.run())


def main() -> int:
    agent_cmd(prog_name="python -m edge_agent")
    return 0
