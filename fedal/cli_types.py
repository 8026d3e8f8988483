"""Command-line value types shared by the `fedal` commands (fedal_cli, hil, fleet)."""

from __future__ import annotations

import math
from typing import Any

import click

__all__ = ["FiniteFloatRange"]


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and ±inf: it compares with < and >, so `nan` passed
    every range (`--linger nan` lingered not at all, `--timeout nan` never timed out)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
