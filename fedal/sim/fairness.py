"""Collaborative fairness (Lyu et al. 2020, as the FedAKD paper reports it).

CF = 100 * Pearson(standalone accuracies, federated accuracies) over clients: a client that
would do better on its own should also do better in the federation. The standalone accuracies
come from a `local` run of the same clients (same data, seed, initial models, rounds and local
training budget), trained here by the toolkit itself so that a results file is self-contained.
Accuracies are taken on each client's own local test split when the run has one (the paper
evaluates locally), else on the common test set; `cf_on` says which.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedal.sim.config import RunConfig


def collaborative_fairness(standalone, federated) -> float | None:
    """100 * Pearson correlation; None when it is undefined (fewer than two clients with both
    numbers, or one side constant)."""
    pairs = [(float(s), float(f)) for s, f in zip(standalone, federated) if s is not None and f is not None]
    if len(pairs) < 2:
        return None
    s, f = np.array(pairs).T
    if np.ptp(s) == 0 or np.ptp(f) == 0:  # (not np.std: [0.1, 0.1, 0.1] has a std of 1e-17, not 0)
        return None
    return float(100.0 * np.corrcoef(s, f)[0, 1])


def standalone_config(config: RunConfig) -> RunConfig:
    """The same clients, each training on its own: strategy `local` with everything else kept
    (its local training uses the same lr, batch size, local_epochs or tau as the federated run)."""
    return config.resolved().model_copy(update={"strategy": "local"})


def fairness_summary(final: dict[str, Any], standalone_final: dict[str, Any]) -> dict[str, Any]:
    """What `final` gains: the standalone accuracies and CF against the federated ones."""
    local = "client_local_acc" in final and "client_local_acc" in standalone_final
    key = "client_local_acc" if local else "client_acc"
    out: dict[str, Any] = {"standalone_acc": standalone_final.get("client_acc")}
    if "client_local_acc" in standalone_final:
        out["standalone_local_acc"] = standalone_final["client_local_acc"]
    out["cf"] = collaborative_fairness(standalone_final.get(key, []), final.get(key, []))
    out["cf_on"] = "local_test" if local else "test"
    return out


def fairness_line(final: dict[str, Any]) -> str:
    """One line for the CLI: CF and the standalone baseline it was measured against."""
    cf = final.get("cf")
    on = final.get("cf_on", "test")
    accs = final.get("standalone_local_acc" if on == "local_test" else "standalone_acc") or []
    known = [a for a in accs if a is not None]
    base = f", standalone mean acc {np.mean(known):.4f}" if known else ""
    return f"collaborative fairness CF {'n/a' if cf is None else f'{cf:.1f}'} (on the {on.replace('_', ' ')} accuracies{base})"
