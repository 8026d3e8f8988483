"""`fedal simulate`: an in-process federated run with a progress bar, results to JSON (+ PNG)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from tqdm import tqdm

from fedal.sim.config import DATASET_NAMES, PARTITION_NAMES, ConfigError, load_config
from fedal.strategies import STRATEGY_NAMES


def _models(_ctx, _param, value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise click.BadParameter("give at least one model name, comma separated")
    return names


@click.command("simulate")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML run config; flags override it.")
@click.option("--strategy", type=click.Choice(STRATEGY_NAMES), help="Algorithm to run.")
@click.option("--dataset", type=click.Choice(DATASET_NAMES), help="Dataset (mnist1d and digits are embedded).")
@click.option("--data-dir", type=click.Path(file_okay=False), help="Folder with dataset files (file-backed datasets).")
@click.option("--clients", type=int, help="Number of clients N.")
@click.option("--partition", type=click.Choice(PARTITION_NAMES), help="How private data is split.")
@click.option("--alpha", type=float, help="Dirichlet concentration.")
@click.option("--samples-per-client", type=int, help="Private samples per client.")
@click.option("--public-size", type=int, help="Unlabeled public rows |P|.")
@click.option("--rounds", type=int, help="Rounds T.")
@click.option("--tau", type=int, help="Local steps and transfer iterations per round.")
@click.option("--seed", type=int, help="Seed driving data, models and sampling.")
@click.option("--models", callback=_models, help="Comma-separated model names, assigned round-robin.")
@click.option("--eval-every", type=int, help="Evaluate every k rounds.")
@click.option("--threads", type=int, help="torch threads per process.")
@click.option("--out", type=click.Path(dir_okay=False), default="results.json", show_default=True, help="Results JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Also write accuracy vs round as a PNG.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def simulate_cmd(config_path, out, plot, quiet, **flags) -> None:
    """Run a federated simulation in this process and write its results."""
    from fedal.sim.runner import simulate

    try:
        config = load_config(config_path, flags)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None

    bar = tqdm(total=config.rounds, desc=config.strategy, unit="round", disable=quiet, file=sys.stderr)

    def progress(_round: int, entry: dict) -> None:
        if "mean_acc" in entry:
            bar.set_postfix(mean_acc=f"{entry['mean_acc']:.3f}")
        bar.update(1)

    try:
        results = simulate(config, progress)
    except (ValueError, FileNotFoundError) as exc:
        bar.close()
        raise click.ClickException(str(exc)) from None
    bar.close()

    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2) + "\n")
    if plot:
        from fedal.sim.plot import plot_accuracy

        plot_accuracy({config.strategy: results}, plot)
    final = results["final"]
    click.echo(
        f"{config.strategy} on {config.dataset}: mean acc {final['mean_acc']:.4f} "
        f"(min {final['min_acc']:.4f}, max {final['max_acc']:.4f}) -> {out_path}"
    )
