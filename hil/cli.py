"""`python -m hil` / `fedal hil`: the hardware-in-the-loop harness's commands."""

from __future__ import annotations

import click


@click.group("hil", context_settings={"help_option_names": ["-h", "--help"]})
def hil_cmd() -> None:
    """Hardware-in-the-loop: an emulated broker with fault injection, emulated fleets."""


def main() -> int:
    hil_cmd(prog_name="python -m hil")
    return 0
