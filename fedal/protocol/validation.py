"""Checks on the numbers a message carries, shared by the coordinator (results) and the agent (tasks).

Finite is not enough: a logit of 3.4e38 is finite, yet one such row dominates an average, turns a
softmax into a one-hot and overflows float32 arithmetic downstream. Every floating-point tensor a
strategy exchanges (logits, features, gradients, weights) is bounded by the run's
`max_abs_value` instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

DEFAULT_MAX_ABS_VALUE = 1e4


def tensor_problem(tensors: Mapping[str, np.ndarray], max_abs_value: float) -> tuple[str, str] | None:
    """(reason, message) when a float tensor holds NaN/inf ("non_finite") or a value of magnitude
    above max_abs_value ("magnitude"); None when every one is usable."""
    for name, arr in tensors.items():
        if arr.dtype.kind != "f" or arr.size == 0:
            continue
        peak = float(np.abs(arr).max())  # one pass: NaN propagates through max, infinity exceeds any bound
        if not math.isfinite(peak):
            return "non_finite", f"tensor {name!r} contains NaN or infinity"
        if peak > max_abs_value:
            return "magnitude", (f"tensor {name!r} holds a value of magnitude {peak:.4g}, "
                                 f"above the run's max_abs_value {max_abs_value:g}")
    return None
