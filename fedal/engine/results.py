"""The results JSON, one builder for `fedal simulate` and the coordinator."""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from fedal import __version__


def evaluation_summary(accs: list[float | None], local_accs: list[float | None] | None = None) -> dict[str, Any]:
    """Summaries of the clients' reported accuracies; a client without a number (no test data,
    or no answer) appears as null in the per-client lists and is left out of the statistics."""
    out: dict[str, Any] = {}
    for prefix, values in (("", accs), ("local_", local_accs or [])):
        known = [float(a) for a in values if a is not None]
        if not known:
            continue
        out.update({f"{prefix}mean_acc": float(np.mean(known)), f"{prefix}min_acc": float(np.min(known)),
                    f"{prefix}max_acc": float(np.max(known)),
                    f"client_{prefix}acc": [None if a is None else float(a) for a in values]})
    return out


def final_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The accuracies of the last evaluated round (the last round is always evaluated)."""
    last_eval = next((r for r in reversed(records) if "mean_acc" in r), None)
    return {k: v for k, v in last_eval.items() if k.endswith("_acc")} if last_eval else {}


def build_results(config: dict[str, Any], data: dict[str, Any], clients: list[dict[str, Any]],
                  records: list[dict[str, Any]], final: dict[str, Any], wall_seconds: float,
                  deployment: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch  # the version only; the engine itself computes nothing with torch

    out: dict[str, Any] = {"config": config, "data": data, "clients": clients, "rounds": records, "final": final}
    if deployment is not None:
        out["deployment"] = deployment
    out["environment"] = {"fedal": __version__, "torch": torch.__version__, "python": platform.python_version()}
    out["timings"] = {"wall_seconds": round(wall_seconds, 3)}
    return out
