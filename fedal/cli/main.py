"""The `fedal` command: one entry point, one subcommand per job."""

from __future__ import annotations

import click

from fedal import __version__
from fedal.cli.simulate import simulate_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fedal")
def cli() -> None:
    """FedAL Edge: federated knowledge distillation on edge devices."""


cli.add_command(simulate_cmd)


if __name__ == "__main__":
    cli()
