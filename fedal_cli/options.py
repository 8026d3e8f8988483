"""The run flags shared by `fedal simulate` and `fedal demo`."""

from __future__ import annotations

from pathlib import Path

import click

from fedal.cli_types import FiniteFloatRange
from fedal.sim.config import DATASET_NAMES, PARTITION_NAMES, TRAIN_SPLIT_NAMES, ConfigError, RunConfig, load_config
from fedal.strategies import STRATEGIES, STRATEGY_NAMES


def _models(_ctx, _param, value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise click.BadParameter("give at least one model name, comma separated")
    return names


def _said(text: str, name: str) -> str:
    """`text` with " (default X)." from the run config's own default: the flags have none of their
    own (a config file may set any of them), and the help never says another."""
    return f"{text} (default {RunConfig.model_fields[name].default})."


RUN_OPTIONS = [
    click.option("--config", "config_path", type=click.Path(dir_okay=False),
                 help="TOML run config (or a results JSON); flags override it."),
    click.option("--strategy", type=click.Choice(STRATEGY_NAMES), help=_said("Algorithm to run", "strategy")),
    click.option("--dataset", type=click.Choice(DATASET_NAMES),
                 help=_said("Dataset (mnist1d and digits are embedded)", "dataset")),
    click.option("--data-dir", type=click.Path(file_okay=False), help="Folder with dataset files (file-backed datasets)."),
    click.option("--clients", type=int, help=_said("Number of clients N", "clients")),
    click.option("--partition", type=click.Choice(PARTITION_NAMES), help=_said("How private data is split", "partition")),
    click.option("--alpha", type=float, help=_said("Dirichlet concentration", "alpha")),
    click.option("--shift-c", type=float, help=_said("Covariate shift C of the covariate-shift partitions", "shift_c")),
    click.option("--train-splits", type=click.Choice(TRAIN_SPLIT_NAMES),
                 help="cinic10, celeba: train on the train split (default) or on train+valid."),
    click.option("--celeba-attribute", help="celeba: the binary attribute to predict (default Smiling)."),
    click.option("--mnist1d-samples", type=click.IntRange(min=10),
                 help="mnist1d: samples to generate, train and test together (default 12000)."),
    click.option("--samples-per-client", type=int,
                 help="Private samples per client (default: an equal share of the training data the public set leaves)."),
    click.option("--public-size", type=int, help=_said("Unlabeled public rows |P|", "public_size")),
    click.option("--local-test-fraction", type=float,
                 help=_said("Share of each client's data kept as its local test split", "local_test_fraction")),
    click.option("--rounds", type=int, help=_said("Rounds T", "rounds")),
    click.option("--tau", type=int, help="Local steps and transfer iterations per round (default: the strategy's, 5 for fedal)."),
    click.option("--seed", type=int, help=_said("Seed driving data, models and sampling", "seed")),
    click.option("--models", callback=_models, help="Comma-separated model names, assigned round-robin (default: the dataset's; "
                 f"its first alone for {', '.join(n for n, s in STRATEGIES.items() if s.homogeneous_models)}; models of one "
                 f"feature width for {', '.join(n for n, s in STRATEGIES.items() if s.same_feature_dim)})."),
    click.option("--eval-every", type=int, help=_said("Evaluate every k rounds (and after the last)", "eval_every")),
    click.option("--threads", type=int, help=_said("torch threads per process", "threads")),
    click.option("--dp-noise-multiplier", type=FiniteFloatRange(min=0, min_open=True),
                 help="Differential privacy: noise multiplier sigma of DP-SGD on the private data (docs/privacy.md)."),
    click.option("--dp-max-grad-norm", type=FiniteFloatRange(min=0, min_open=True),
                 help="Differential privacy: per-sample gradient clipping norm C (default 1.0)."),
    click.option("--dp-delta", type=FiniteFloatRange(0, 1, min_open=True, max_open=True),
                 help="Differential privacy: the delta every client's epsilon is stated at (default 1e-5)."),
    click.option("--dp-epsilon-budget", type=FiniteFloatRange(min=0, min_open=True),
                 help="Differential privacy: a client stops training on its private data before exceeding this epsilon."),
    click.option("--dp-target-epsilon", type=FiniteFloatRange(min=0, min_open=True),
                 help="Differential privacy: calibrate the noise so the run's planned steps reach this epsilon."),
]

RUN_FLAGS = ("strategy", "dataset", "data_dir", "clients", "partition", "alpha", "shift_c", "train_splits", "celeba_attribute",
             "mnist1d_samples", "samples_per_client", "public_size",
             "local_test_fraction", "rounds", "tau", "seed", "models", "eval_every", "threads", "dp_noise_multiplier",
             "dp_max_grad_norm", "dp_delta", "dp_epsilon_budget", "dp_target_epsilon")


def run_options(func):
    for option in reversed(RUN_OPTIONS):
        func = option(func)
    return func


# the in-process transport's faults and execution: `fedal simulate` only (a deployment has real faults)
FAULT_OPTIONS = [
    click.option("--dropout", type=FiniteFloatRange(0.0, 1.0, max_open=True),
                 help=_said("Each client misses each phase with this probability (seeded)", "dropout")),
    click.option("--stragglers", type=FiniteFloatRange(0.0, 1.0),
                 help=_said("This fraction of clients answers after the phase deadline every k-th phase", "stragglers")),
    click.option("--straggle-every", type=click.IntRange(min=1), help=_said("k for --stragglers", "straggle_every")),
    click.option("--vectorize/--no-vectorize", default=None,
                 help="Run the clients of one architecture as one stacked model (every strategy; a group a "
                      "strategy cannot stack, e.g. models with BatchNorm, runs one by one). Default on; "
                      "--no-vectorize runs the per-client reference path."),
    click.option("--backend", type=click.Choice(["inprocess", "ray"]),
                 help="Where client halves run: this process (default) or Ray actors (the `ray` extra)."),
    click.option("--ray-address", help="ray backend: a cluster to join (auto, HEAD:PORT on a node of it, "
                 "ray://host:port); default: start a local instance."),
    click.option("--ray-actors", type=click.IntRange(min=1), help="ray backend: actors hosting the clients "
                 "(default: as many as the cluster's resources hold, each asking --client-resources)."),
    click.option("--client-resources", help="ray backend: each actor's resources, e.g. 'num_cpus=1,num_gpus=0.25'."),
]
FAULT_FLAGS = ("dropout", "stragglers", "straggle_every", "vectorize", "backend", "ray_address", "ray_actors",
               "client_resources")


def fault_options(func):
    for option in reversed(FAULT_OPTIONS):
        func = option(func)
    return func


def config_from_flags(config_path: str | None, flags: dict) -> RunConfig:
    """The run config from --config plus flags; usage errors exit with status 2."""
    try:
        config = load_config(config_path, {k: flags.get(k) for k in RUN_FLAGS + FAULT_FLAGS})
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    for note in config.notes():
        click.echo(note, err=True)
    if config.data_dir and not Path(config.data_dir).is_absolute():  # the saved config finds the same files
        config = config.model_copy(update={"data_dir": str(Path(config.data_dir).absolute())})  # from anywhere
    return config
