"""Accuracy-vs-round plots from results JSON (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from fedal.owned import MARK, MARKED_PLOT_FORMATS


def plot_accuracy(runs: dict[str, dict], path: str | Path, x: str = "round") -> Path:
    """One line per run label: mean client accuracy against rounds (or local steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    shown: set[float] = set()  # the rounds (or steps) plotted
    for label, res in runs.items():
        pts = [r for r in res["rounds"] if "mean_acc" in r]
        tau = res["config"]["strategy_params"]["tau"]
        xs = [r["round"] * (tau if x == "steps" else 1) for r in pts]
        shown.update(float(v) for v in xs)
        # one evaluation (a run of one round, or eval_every past its rounds): a line of one point draws nothing
        ax.plot(xs, [r["mean_acc"] for r in pts], label=label, marker="o" if len(pts) == 1 else None)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds and steps are whole numbers
    if len(shown) == 1:  # (one x: matplotlib's own margin puts fractions of a round on the axis)
        (only,) = shown
        ax.set_xlim(only - 1, only + 1)
    ax.set_xlabel("local steps (rounds x tau)" if x == "steps" else "round")
    ax.set_ylabel("mean client accuracy (common test set)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = path.suffix.lstrip(".").lower()  # the Creator says the toolkit wrote it (fedal.owned)
    fig.savefig(path, dpi=120, metadata={"Creator": MARK} if fmt in MARKED_PLOT_FORMATS else None)
    plt.close(fig)
    return path
