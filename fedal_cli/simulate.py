"""`fedal simulate`: an in-process federated run with a progress bar, results to JSON (+ PNG)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from fedal import procs
from fedal.atomic import write_bytes_atomic
from fedal.owned import MARKED_PLOT_FORMATS, ForeignFile, check_replaceable, is_our_plot, is_results, unwritable
from fedal.progress import progress_bar
from fedal_cli.extras import missing_module_message
from fedal_cli.options import config_from_flags, fault_options, run_options

if TYPE_CHECKING:
    from fedal.sim.config import RunConfig


@click.command("simulate")
@run_options
@fault_options
@click.option("--out", type=click.Path(dir_okay=False), default="results.json", show_default=True, help="Results JSON.")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Also write accuracy vs round as an image (.png, .pdf, .svg, .svgz, .ps, .eps).")
@click.option("--checkpoint", type=click.Path(dir_okay=False), help="Write the run's state there after every "
              "--checkpoint-every rounds (removed once the results are written), so that --resume can go on from "
              "it.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), help="Rounds between checkpoints (default 1).")
@click.option("--resume", is_flag=True, help="Go on from the --checkpoint file, if there is one (the same config; "
              "only --rounds and where it computes may change), to the numbers an uninterrupted run gives.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option("--verbose", is_flag=True, help="Let the Ray backend's own logs through.")
def simulate_cmd(config_path, out, plot, checkpoint, checkpoint_every, resume, quiet, verbose, **flags) -> None:
    """Run a federated simulation in this process and write its results."""
    from fedal.sim.config import ConfigError
    from fedal.sim.runner import simulate

    if checkpoint is None and (resume or checkpoint_every is not None):
        raise click.UsageError(f"{'--resume' if resume else '--checkpoint-every'} needs --checkpoint FILE")
    config = config_from_flags(config_path, flags)
    check_outputs(out, plot, config_path)
    saved_to = checkpoint_file(checkpoint, resume, out, plot, config_path) if checkpoint is not None else None
    bars = [progress_bar(total=config.rounds, desc=f"{config.strategy} (preparing the data and clients)", unit="round",
                 disable=quiet)]

    def progress(_round: int, entry: dict) -> None:
        if "mean_acc" in entry:
            bars[-1].set_postfix(mean_acc=f"{entry['mean_acc']:.3f}")
        bars[-1].update(1)

    def stage(name: str) -> None:  # the rounds' bar starts when they do; the CF baseline gets its own
        if name == "rounds":
            bars[-1].reset(total=config.rounds)
            bars[-1].set_description(config.strategy)
        elif name == "standalone":
            bars[-1].close()
            bars.append(progress_bar(total=config.rounds, desc=f"{config.strategy}: standalone baseline for CF", unit="round",
                             disable=quiet))

    fired: list[int] = []
    results: dict | None = None
    try:
        with procs.stop_signals_interrupt() as fired:  # SIGTERM/SIGHUP end the run as Ctrl-C does: Ray's
            results = simulate(config, progress, verbose=verbose, stage=stage,  # actors and snapshots are cleaned up
                               checkpoint=saved_to, checkpoint_every=checkpoint_every or 1, resume=resume)
    except KeyboardInterrupt as exc:  # Stopped, Ctrl-C, or either as Ray hands it back (a bare KeyboardInterrupt)
        bars[-1].close()
        sig = exc.signum if isinstance(exc, procs.Stopped) else (fired[0] if fired else signal.SIGINT)
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) cannot take the line
            click.echo(f"stopped by {signal.Signals(sig).name}: no results written{resumable(saved_to)}", err=True)
        sys.exit(128 + sig)
    except ImportError as exc:  # an extra this run needs is not installed
        raise click.ClickException(missing_module_message(exc)) from None
    except ConfigError as exc:  # what the flags ask that the data, the models or the Ray cluster cannot do
        raise click.UsageError(str(exc)) from None
    except FileNotFoundError as exc:  # a dataset's files missing from --data-dir: the flag to change
        raise click.UsageError(f"{exc} (--data-dir)") from None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        bars[-1].close()
        if saved_to is not None and results is None:  # no results: the path is let go (its lock file goes
            saved_to.close()  # where no checkpoint was written)
    assert results is not None  # (every other way out above raises)
    warn_if_other_data(config, config_path, flags, results)
    try:
        write_results(results, out)
    except (OSError, ForeignFile) as exc:  # a full disk, a file put there meanwhile: the run's hours go to stdout
        click.echo(json.dumps(results, indent=2))
        raise click.ClickException(f"cannot write the results to {out}: {why_unwritten(exc)}; they are on stdout "
                                   "above (redirect it to a file to keep them)") from None
    if saved_to is not None:  # the results hold the run now: its checkpoint goes (if it is still its own)
        saved_to.remove()
    if plot:
        try:
            write_plot(results, plot)
        except (OSError, ForeignFile) as exc:
            raise click.ClickException(f"cannot write the plot to {plot}: {why_unwritten(exc)} (the results are in "
                                       f"{out}; `fedal simulate` plots nothing else)") from None
    final = results["final"]
    accuracy = (f"mean acc {final['mean_acc']:.4f} (min {final['min_acc']:.4f}, max {final['max_acc']:.4f})"
                if "mean_acc" in final else "no client answered the last evaluation")  # (every one refused it)
    click.echo(f"{config.strategy} on {config.dataset}: {accuracy} -> {out}" + (f", plot -> {plot}" if plot else ""))
    if "cf" in final:
        from fedal.sim.fairness import fairness_line

        click.echo(fairness_line(final))
    from fedal.engine.results import mishaps_line, privacy_line, vectorized_line

    if vectorized_line(results):
        click.echo(vectorized_line(results))
    if mishaps_line(results):
        click.echo(mishaps_line(results))
    if privacy_line(results):
        click.echo(privacy_line(results))
    from fedal.strategies.global_model import global_model_line

    if global_model_line(final):  # FedAvg-type strategies: the aggregated model, personal accuracy
        click.echo(global_model_line(final))


def check_outputs(out: str | Path, plot: str | Path | None, config_path: str | Path | None) -> None:
    """Usage errors, before the run, for outputs that could not be written after it (its results
    would be lost), that would overwrite the config file the run reads, or a file the toolkit did
    not write (in a demo's workspace too: its results.json or accuracy.png may be the user's)."""
    for option, path in (("--out", out), ("--plot", plot)):
        if path is None:
            continue
        target = Path(path)
        if config_path is not None and target.resolve() == Path(config_path).resolve():
            raise click.BadParameter(f"{path} is the config file this run reads: writing the results there would "
                                     "overwrite it; give another path", param_hint=option)
        if target.is_dir():  # (before the ownership check: a directory is no file of anyone's to replace)
            raise click.BadParameter(f"{path} is a directory", param_hint=option)
        try:  # a file of ours is rewritten (a run repeated); anything else is the user's, in a workspace too
            check_replaceable(target, is_results if option == "--out" else is_our_plot,
                              "results file" if option == "--out" else "plot")
        except ForeignFile as exc:
            raise click.BadParameter(str(exc), param_hint=option) from None
        why = unwritable(target)
        if why:
            raise click.BadParameter(why, param_hint=option)
    if plot is not None:
        if Path(plot).resolve() == Path(out).resolve():
            raise click.BadParameter(f"{plot} is also --out: the plot would replace the results", param_hint="--plot")
        # the formats that carry the toolkit's mark (a rerun may replace its own plot) and need no
        # external program (pgf needs LaTeX)
        suffix = Path(plot).suffix.lstrip(".").lower()
        if suffix not in MARKED_PLOT_FORMATS:
            raise click.BadParameter(f"{plot}: a plot is written as {', '.join('.' + f for f in MARKED_PLOT_FORMATS)}, "
                                     f"not {'.' + suffix if suffix else 'a file without an extension'}", param_hint="--plot")


def checkpoint_file(path: str | Path, resume: bool, out: str | Path, plot: str | Path | None,
                    config_path: str | Path | None):
    """The run's CheckpointFile; usage errors, before the run, for a --checkpoint path it must
    not write: another output or the config, a file that is no checkpoint (never overwritten), a
    checkpoint without --resume (its rounds would be lost), a folder it cannot write in."""
    from fedal.sim.checkpoint import CheckpointError, CheckpointFile

    target = Path(path)
    for option, other in (("--out", out), ("--plot", plot), ("--config", config_path)):
        if other is not None and target.resolve() == Path(other).resolve():
            raise click.BadParameter(f"{path} is also {option}: give the checkpoint a path of its own",
                                     param_hint="--checkpoint")
    why = unwritable(target)
    if why:
        raise click.BadParameter(why, param_hint="--checkpoint")
    try:
        saved_to = CheckpointFile(target, resume)
    except CheckpointError as exc:
        raise click.BadParameter(str(exc), param_hint="--checkpoint") from None
    if resume and not target.exists():
        click.echo(f"no checkpoint at {path} yet: the run starts from its first round", err=True)
    return saved_to


def resumable(saved_to) -> str:
    """What a stopped run says of its checkpoint, if it wrote one."""
    done = saved_to.resumable() if saved_to is not None else None
    if done is None:
        return ""
    return f"; its first {done} round(s) are in {saved_to.path}: add --resume to go on from there"


# the flags that choose the public set (and so its hash): given, a different set is what was asked
PUBLIC_SET_FLAGS = ("dataset", "data_dir", "seed", "public_size", "mnist1d_samples", "train_splits", "celeba_attribute")


def warn_if_other_data(config: RunConfig, config_path: str | None, flags: dict, results: dict) -> None:
    """A results file repeated (--config results.json) on data that is not the same: its
    data_dir's files changed or are other files. The run is what the data gave; this says so.
    (The hash it ran on was read with its config: a pipe is read once.)"""
    before = config.ran_on_public_hash
    if before is None or any(flags.get(k) is not None for k in PUBLIC_SET_FLAGS):
        return
    now = results["data"]["public_hash"]
    if before != now:
        click.echo(f"warning: this run's public set is not the one {config_path} ran on (public_hash {now[:12]}..., "
                   f"there {before[:12]}...): the files under data_dir changed, so the numbers need not match", err=True)


def why_unwritten(exc: OSError | ForeignFile) -> object:
    """What a failed output write says: the system's reason, or the foreign file's message."""
    return exc if isinstance(exc, ForeignFile) else exc.strerror or exc


def write_results(results: dict, out: str | Path, plot: str | Path | None = None) -> None:
    """ForeignFile where a file the toolkit did not write was put at `out` (or `plot`) during the
    run: checked before the run, and again here, as a checkpoint is."""
    check_replaceable(out, is_results, "results file")
    write_bytes_atomic(Path(out), (json.dumps(results, indent=2) + "\n").encode())  # a torn one would be refused later
    if plot:
        write_plot(results, plot)


def write_plot(results: dict, plot: str | Path) -> None:
    from fedal.sim.plot import plot_accuracy

    check_replaceable(plot, is_our_plot, "plot")

    plot_accuracy({results["config"]["strategy"]: results}, plot)
