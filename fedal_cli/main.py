"""The `fedal` command: one entry point, one subcommand per job.

This is the application's top: subcommands of the runtimes (agent, coordinator, demo) are
imported only when invoked, so `fedal simulate` works without the network extras and the core
never imports the runtime packages.
"""

from __future__ import annotations

import importlib
from typing import NoReturn

import click

from fedal import __version__
from fedal.fast_exit import run_then_exit

LAZY_COMMANDS = {
    "simulate": ("fedal_cli.simulate", "simulate_cmd", "Run a federated simulation in this process."),
    "demo": ("fedal_cli.demo", "demo_cmd", "Run a federated training across processes over MQTT."),
    "coordinator": ("coordinator.cli", "coordinator_cmd", "Run the coordinator (round engine + REST API)."),
    "agent": ("edge_agent.cli", "agent_cmd", "Run an edge agent."),
    "export": ("export.cli", "export_cmd", "Export a model to ONNX (parity check, int8)."),
    "fleet": ("fleet.cli", "fleet_cmd", "Provision devices: credentials, broker ACL, TLS, config checks."),
    "hil": ("hil.cli", "hil_cmd", "Hardware-in-the-loop: fault-injecting broker proxy, emulated fleets."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(LAZY_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in LAZY_COMMANDS:
            return None
        module, attr, _ = LAZY_COMMANDS[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise click.ClickException(f"`fedal {name}` needs an extra that is not installed ({exc.name}); "
                                       "install fedal-edge[all]") from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(n, LAZY_COMMANDS[n][2]) for n in sorted(LAZY_COMMANDS)])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fedal")
def cli() -> None:
    """FedAL Edge: federated knowledge distillation on edge devices."""


def main() -> NoReturn:
    """The `fedal` command (console script, `python -m fedal_cli`)."""
    run_then_exit(cli)


if __name__ == "__main__":
    main()
