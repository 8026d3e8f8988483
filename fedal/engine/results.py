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
    privacy = privacy_summary(config, [c["id"] for c in clients], records)
    if privacy is not None:
        out["privacy"] = privacy
    if deployment is not None:
        out["deployment"] = deployment
    out["environment"] = {"fedal": __version__, "torch": torch.__version__, "python": platform.python_version()}
    out["timings"] = {"wall_seconds": round(wall_seconds, 3)}
    return out


def privacy_summary(config: dict[str, Any], client_ids: list[str], records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each client's epsilon after every round (null before it first reported), at the run's
    delta, and the clients that stopped training privately at their budget; None without privacy."""
    settings = (config.get("strategy_params") or {}).get("privacy")
    rounds = [r for r in records if "privacy" in r]
    if settings is None or not rounds:
        return None
    per_client = {cid: [r["privacy"]["epsilon"][i] for r in rounds] for i, cid in enumerate(client_ids)}
    final = {cid: eps[-1] for cid, eps in per_client.items()}
    sigma = rounds[-1]["privacy"].get("noise_multiplier") or [None] * len(client_ids)  # (older records: none)
    known = [e for e in final.values() if e is not None]
    return {
        "delta": settings.get("delta"), "noise_multiplier": settings.get("noise_multiplier"),
        "target_epsilon": settings.get("target_epsilon"), "planned_rounds": settings.get("planned_rounds"),
        "max_grad_norm": settings.get("max_grad_norm"), "epsilon_budget": settings.get("epsilon_budget"),
        "accountant": settings.get("accountant"), "statistic_clip": settings.get("statistic_clip"),
        "rounds": [r["round"] for r in rounds], "epsilon": per_client, "final_epsilon": final,
        "max_epsilon": max(known) if known else None, "exhausted": rounds[-1]["privacy"]["exhausted"],
        "client_noise_multiplier": dict(zip(client_ids, sigma)),
    }


def vectorized_line(results: dict[str, Any]) -> str | None:
    """One line on how a vectorized run computed its clients' tasks; None for a per-client run."""
    counts = results.get("vectorized")
    if not counts:
        return None
    stacked, alone = counts["stacked_tasks"], counts["per_client_tasks"]
    line = f"vectorized: {stacked} of {stacked + alone} client tasks stacked"
    if alone:
        reasons = "; ".join(f"{reason}: {n}" for reason, n in counts["per_client_reasons"].items())
        line += f", {alone} client by client ({reasons})"
    return line


def mishaps_line(results: dict[str, Any]) -> str | None:
    """One line on what went wrong in a run without stopping it (tasks refused, Ray actors that
    died), for a terminal where the warnings scrolled past; None when nothing did."""
    backend = results.get("backend") or {}
    refused = results.get("refused_tasks") or backend.get("refused_tasks", 0)
    parts = [f"{refused} client task(s) refused (see the warnings above)"] if refused else []
    if backend.get("actor_failures"):
        parts.append(f"{backend['actor_failures']} Ray actor failure(s): {backend.get('lost_tasks', 0)} task(s) lost, "
                     f"{backend.get('restored_clients', 0)} client(s) restored from their round-start snapshots")
    return "; ".join(parts) or None


def privacy_line(results: dict[str, Any]) -> str | None:
    """One line on the privacy spent, for a terminal; None for a run without privacy."""
    privacy = results.get("privacy")
    if not privacy or privacy.get("max_epsilon") is None:
        return None
    line = f"differential privacy: epsilon up to {privacy['max_epsilon']:.3g} per client at delta {privacy['delta']:g}"
    if privacy.get("exhausted"):
        line += (f"; {len(privacy['exhausted'])} client(s) stopped training on private data at epsilon_budget "
                 f"{privacy['epsilon_budget']:g}: {', '.join(privacy['exhausted'])}")
    return line
