"""Values made strict JSON: a request body's NaN, Infinity or 1e400 (Python's json reads them as
floats) quoted back in a validation error made the APIs answer 500 instead of 422."""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float written as text (strict JSON has no NaN or infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
