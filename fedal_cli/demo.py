"""`fedal demo`: a whole deployment on one machine.

Starts a broker (the embedded one unless --broker), the coordinator and N agent processes, each
agent in its own workspace holding only its own partition (and the common test set for
evaluation; the public set it fetches from the coordinator over HTTP and checks against the
run's hash). Shows progress, prints a per-client table, writes the same results JSON as
`fedal simulate`, and leaves no process behind: stopped by Ctrl-C, SIGTERM or SIGHUP it shuts
everything down in order, and its children die with it even if it is killed (fedal.procs).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import click
import numpy as np
import tomli_w

from fedal import procs, workspace
from fedal.cli_types import FiniteFloatRange
from fedal.engine.results import privacy_line
from fedal.models import check_model_input
from fedal.owned import ForeignFile, is_our_plot, is_results
from fedal.ports import free_port, unreachable
from fedal.progress import progress_bar
from fedal.sim.build import build_data
from fedal.sim.config import ConfigError, RunConfig
from fedal.sim.fairness import fairness_line
from fedal.sim.runner import client_ids as make_client_ids
from fedal.sim.runner import client_seed, standalone_fairness
from fedal.strategies import get_strategy
from fedal.strategies.global_model import global_model_line
from fedal_cli.extras import missing_module_message
from fedal_cli.options import config_from_flags, run_options
from fedal_cli.simulate import check_outputs, write_results

RUN_ID = "demo"
BROKER_PROBE_TIMEOUT_S = 10.0  # how long `--broker`'s host:port is given to accept a TCP connection




DEFAULT_OUTPUTS = (("results.json", is_results), ("accuracy.png", is_our_plot))  # where a demo writes them in --workdir


def prepare_workspace(config: RunConfig, workdir: Path, broker_url: str, api_port: int,
                      keep: Sequence[Path] = ()) -> tuple[Path, list[Path], dict]:
    """Partition files, agent configs and the coordinator config for `config` (resolved).

    workdir must be new, empty or a workspace of an earlier run (its marker file): only the
    coordinator/ and agents/ trees written here before are replaced (workspace.WorkspaceError
    otherwise, before anything is touched).
    """
    workspace.claim(workdir, "fedal demo")
    data = build_data(config)  # as `fedal simulate` builds it: ConfigError where it cannot be split as asked
    for name in dict.fromkeys(config.resolved_models()):  # as simulate's build_clients: before the agents fail
        try:
            check_model_input(name, data.input_shape)
        except ValueError as exc:
            raise ConfigError(f"{exc} (--models)") from None
    workspace.clear(workdir, ("coordinator", "agents"))
    kept = {Path(p).resolve() for p in keep}  # the results file this run reads its config from stays
    for name, ours in DEFAULT_OUTPUTS:  # the earlier run's: never read beside this one's files as its
        earlier = workdir / name
        if earlier.is_file() and not earlier.is_symlink() and ours(earlier) and earlier.resolve() not in kept:
            earlier.unlink()
    (workdir / "coordinator").mkdir()
    public_file = workdir / "coordinator" / "public.npz"
    np.savez(public_file, x=data.public_x)
    ids = make_client_ids(config.clients)
    agent_configs = []
    for i, cid in enumerate(ids):
        ws = workspace.claim(workdir / "agents" / cid, "fedal demo")  # the agent's own: it holds its config too
        np.savez(ws / "train.npz", x=data.clients[i].x, y=data.clients[i].y)
        np.savez(ws / "test.npz", x=data.test.x, y=data.test.y)
        agent = {
            "client_id": cid, "run_id": RUN_ID, "model": config.models[i % len(config.models)],
            "seed": client_seed(config.seed, i), "data_file": str(ws / "train.npz"), "test_file": str(ws / "test.npz"),
            "workspace": str(ws), "threads": config.threads, "broker": {"url": broker_url},
        }
        if config.strategy_params.privacy is not None:  # one machine, its own coordinator: the noise a
            agent["dp_seeded_noise"] = True  # simulation of this config draws, so the numbers are its
        if len(data.client_tests[i]):
            np.savez(ws / "local_test.npz", x=data.client_tests[i].x, y=data.client_tests[i].y)
            agent["local_test_file"] = str(ws / "local_test.npz")
        path = ws / "agent.toml"
        path.write_text(tomli_w.dumps(agent))
        agent_configs.append(path)
    coord = {
        "run_id": RUN_ID, "client_ids": ids, "num_classes": data.num_classes, "public_file": str(public_file),
        "state_dir": str(workdir / "coordinator" / "state"), "broker": {"url": broker_url},
        "api": {"host": "127.0.0.1", "port": api_port},
        # the coordinator shares this machine with its agents: the run's thread count, as each
        # agent and `fedal simulate` use (torch's default spins idle threads against them)
        "threads": config.threads,
        "run": json.loads(config.model_dump_json(exclude_none=True)),
    }
    coord_path = workdir / "coordinator" / "coordinator.toml"
    coord_path.write_text(tomli_w.dumps(coord))
    data_info = {
        "public_hash": data.public_hash, "public_size": int(len(data.public_x)), "test_size": int(len(data.test)),
        "client_sizes": [int(len(c)) for c in data.clients],
        "local_test_sizes": [int(len(t)) for t in data.client_tests],
        "label_histogram": np.asarray(data.partition_stats).astype(int).tolist(),
    }
    return coord_path, agent_configs, data_info


def get_json(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def spawn(module: str, config: Path, log_path: Path) -> subprocess.Popen:
    """`python -m module --config config`: a child that dies with this process (fedal.procs)."""
    return procs.spawn_python(module, "--config", str(config), log_path=log_path)


terminate = procs.terminate


def run_demo(config: RunConfig, workdir: Path, broker: str | None = None, api_port: int = 0, linger_s: float = 0,
             quiet: bool = False, timeout_s: float = 3600, on_results: Callable[[dict], None] | None = None,
             keep: Sequence[Path] = ()) -> dict:
    """The run's results. on_results(results) is called as soon as the run has finished, before
    the linger: the results are on disk while the dashboard is still up. The workspace is this
    run's alone until it returns: another demo on it is refused (workspace.WorkspaceError).
    keep: files not to remove as an earlier run's outputs (the results file given as --config)."""
    config = config.resolved()
    workspace.claim(workdir, "fedal demo")
    with workspace.held(workdir, "fedal demo"):
        return _run_demo(config, workdir, broker, api_port, linger_s, quiet, timeout_s, on_results, keep)


def _run_demo(config: RunConfig, workdir: Path, broker: str | None, api_port: int, linger_s: float, quiet: bool,
              timeout_s: float, on_results: Callable[[dict], None] | None, keep: Sequence[Path] = ()) -> dict:
    api_port = api_port or free_port()
    embedded = None
    if broker is None:
        from coordinator.broker import EmbeddedBroker

        embedded = EmbeddedBroker(port=free_port()).start()
        broker = embedded.url
    children: list[subprocess.Popen] = []
    try:
        coord_path, agent_paths, data_info = prepare_workspace(config, workdir, broker, api_port, keep)
        api = f"http://127.0.0.1:{api_port}"
        children.append(spawn("coordinator", coord_path, workdir / "coordinator" / "coordinator.log"))
        for path in agent_paths:
            children.append(spawn("edge_agent", path, path.parent / "agent.log"))
        if not quiet:
            click.echo(f"broker {broker} | dashboard {api}/dashboard/ | REST API {api}/api/v1/runs/{RUN_ID} "
                       f"| workspace {workdir}", err=True)
        logs = [workdir / "coordinator" / "coordinator.log", *(path.parent / "agent.log" for path in agent_paths)]
        results = _follow(api, children, config.rounds, quiet, timeout_s, logs)
        results["data"] = {**data_info, **results.get("data", {})}
        results["clients"] = [{"id": c["id"], "model": config.models[i % len(config.models)]}
                              for i, c in enumerate(results["clients"])]
        if get_strategy(config.strategy).fairness:  # CF's standalone baseline: no communication, so in-process
            results["final"].update(standalone_fairness(config, results["final"]))
        if on_results is not None:
            on_results(results)
        if linger_s > 0:
            if not quiet:
                click.echo(f"run finished; the coordinator stays up {linger_s:.0f} s at {api}", err=True)
            time.sleep(linger_s)
        return results
    finally:
        terminate(children)
        if embedded is not None:
            embedded.stop()


def _follow(api: str, children: list[subprocess.Popen], rounds: int, quiet: bool, timeout_s: float,
            logs: list[Path] | None = None) -> dict:
    """The run's results, following it round by round. `timeout_s` bounds the wait for the next
    round (a stalled run), not the whole run: a long demo is not cut off. children: the
    coordinator, then the agents (`logs`: theirs, in the same order). An agent that dies ends the
    demo at once, saying why: the run would otherwise wait at every phase's deadline for it, or,
    with none left, until timeout_s."""
    logs = logs or []
    coordinator_log = logs[0] if logs else None
    bar = progress_bar(total=rounds, desc="demo", unit="round", disable=quiet)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if children[0].poll() is not None:
                raise click.ClickException(f"the coordinator exited with status {children[0].returncode}"
                                           + procs.last_error(coordinator_log))
            for i, agent in enumerate(children[1:], start=1):
                # 0: it left a finished run (exit_on_finish), or was stopped by a signal it handles
                if agent.poll() is not None and (agent.returncode != 0 or not _finished(api)):
                    log = logs[i] if i < len(logs) else None
                    raise click.ClickException(f"agent {log.parent.name if log else i - 1} exited with status "
                                               f"{agent.returncode}" + ("" if agent.returncode else " before the run "
                                               "finished") + procs.last_error(log))
            try:
                run = get_json(f"{api}/api/v1/runs/{RUN_ID}")
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(0.3)
                continue
            last = run.get("last_round") or {}
            if "mean_acc" in last:
                bar.set_postfix(mean_acc=f"{last['mean_acc']:.3f}", refresh=False)
            if run["completed_rounds"] > bar.n:
                bar.update(run["completed_rounds"] - bar.n)
                deadline = time.monotonic() + timeout_s
            if run["state"] == "finished":
                return get_json(f"{api}/api/v1/runs/{RUN_ID}/results", timeout=10)
            if run["state"] in ("failed", "stopped"):
                raise click.ClickException(f"the run {run['state']}: {run.get('error')}")
            time.sleep(0.3)
        raise click.ClickException(f"no round completed within {timeout_s:.0f} s" + procs.last_error(coordinator_log))
    finally:
        bar.close()


def _finished(api: str) -> bool:
    """Whether the run has finished (asked now: an agent leaves a run that finished a moment ago);
    True when the API does not answer, so only a run known unfinished counts against an agent."""
    try:
        return get_json(f"{api}/api/v1/runs/{RUN_ID}")["state"] == "finished"
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return True


def summary_table(results: dict) -> str:
    dep = results.get("deployment", {}).get("clients", {})
    accs = results["final"].get("client_acc", [])
    local = results["final"].get("client_local_acc", [])  # each device on its own test split
    nan = float("nan")
    lines = [f"{'client':8} {'model':12} {'acc':>7}" + (f" {'own acc':>8}" if local else "")
             + f" {'answered':>9} {'late':>5} {'rejected':>9} {'KB up':>9} {'KB down':>9}"]
    for i, c in enumerate(results["clients"]):
        d = dep.get(c["id"], {})
        acc = accs[i] if i < len(accs) and accs[i] is not None else nan
        own = (f" {local[i] if i < len(local) and local[i] is not None else nan:8.4f}") if local else ""
        lines.append(f"{c['id']:8} {c.get('model', '?'):12} {acc:7.4f}{own} {d.get('answered', 0):9d} {d.get('late', 0):5d} "
                     f"{d.get('rejected', 0):9d} {d.get('bytes_up', 0) / 1024:9.1f} {d.get('bytes_down', 0) / 1024:9.1f}")
    final = results["final"]
    lines.append(f"mean acc {final.get('mean_acc', nan):.4f} (min {final.get('min_acc', nan):.4f}, "
                 f"max {final.get('max_acc', nan):.4f})")
    if "local_mean_acc" in final:
        lines.append(f"mean acc on the devices' own test splits {final['local_mean_acc']:.4f}")
    if "cf" in final:
        lines.append(fairness_line(final))
    if global_model_line(final):  # FedAvg-type strategies: the aggregated model, evaluated by the coordinator
        lines.append(global_model_line(final))
    if privacy_line(results):
        lines.append(privacy_line(results))
    return "\n".join(lines)


def deployable(config: RunConfig) -> RunConfig:
    """The config for a deployment, refused before anything starts where it asks for what only a
    simulation has (the coordinator would refuse it, later and in its log). `vectorize` and the
    Ray backend's settings, which a simulation's results file records, only said how and where
    that simulation computed its clients (the same numbers): dropped."""
    if config.dropout or config.stragglers:
        raise click.UsageError("dropout and stragglers are faults of the simulation (fedal simulate); the demo's "
                               "clients are real processes, with real faults")
    how = {"vectorize": False, "backend": "inprocess", "ray_address": None, "ray_actors": None,  # each client
           "client_resources": None}  # steps on its own, as `--no-vectorize`: its results rerun so exactly
    said = ["backend"] if config.backend != "inprocess" else []
    said += [k for k in ("vectorize", "ray_address", "ray_actors", "client_resources") if getattr(config, k) not in (None, False)]
    if said:
        click.echo(f"note: {', '.join(said)} only say how a simulation computes its clients; the demo's clients are "
                   "processes of their own (not used)", err=True)
    return config.model_copy(update=how)


@click.command("demo")
@run_options
@click.option("--broker", help="External broker URL (mqtt://host:port) instead of the embedded one.")
@click.option("--api-port", type=click.IntRange(0, 65535), default=0, help="Coordinator REST port (0: a free one).")
@click.option("--linger", type=FiniteFloatRange(0, 7 * 86400), default=0.0,
              help="Keep the coordinator up S seconds after the run (at most a week).")
@click.option("--workdir", type=click.Path(file_okay=False), default="runs/demo", show_default=True,
              help=f"Workspace for the coordinator and the agents: a new or empty directory, or one an earlier demo "
                   f"made (it holds {workspace.MARKER}; its coordinator/ and agents/ are replaced).")
@click.option("--out", type=click.Path(dir_okay=False), help="Results JSON (default: results.json in --workdir).")
@click.option("--plot", type=click.Path(dir_okay=False),
              help="Accuracy vs round as an image, .png, .pdf, .svg, .svgz, .ps or .eps (default: accuracy.png in --workdir).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def demo_cmd(config_path, broker, api_port, linger, workdir, out, plot, quiet, **flags) -> None:
    """Run a federated training across processes: broker, coordinator and N agents over MQTT."""
    config = config_from_flags(config_path, flags)
    out = out or str(Path(workdir) / "results.json")
    plot = plot or str(Path(workdir) / "accuracy.png")
    check_outputs(out, plot, config_path)
    config = deployable(config)
    if broker is not None:
        from fedal.protocol import parse_broker_url

        try:
            address = parse_broker_url(broker)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--broker") from None
        problem = unreachable(address.host, address.port, BROKER_PROBE_TIMEOUT_S)
        if problem is not None:  # else the coordinator and the agents would wait for it silently
            raise click.BadParameter(f"nothing answers at {address.redacted()} ({problem}): start the broker first, "
                                     "or leave --broker out to use the embedded one", param_hint="--broker")
    if api_port and unreachable("127.0.0.1", api_port, 2.0) is None:
        raise click.BadParameter(f"port {api_port} is in use on 127.0.0.1: give another, or 0 for a free one",
                                 param_hint="--api-port")
    try:
        workspace.claim(Path(workdir), "fedal demo")  # refused before anything starts
    except workspace.WorkspaceError as exc:
        raise click.BadParameter(str(exc), param_hint="--workdir") from None

    def _report(results: dict) -> None:
        try:
            write_results(results, out, plot)
        except ForeignFile as exc:  # put there during the run (the message names the path)
            raise click.ClickException(f"cannot write the demo's outputs: {exc}") from None
        except OSError as exc:  # said as what it is (not as a missing dataset file below)
            raise click.ClickException(f"cannot write the results to {out} or the plot to {plot}: "
                                       f"{exc.strerror or exc}") from None
        click.echo(summary_table(results))
        click.echo(f"results -> {out}" + (f", plot -> {plot}" if plot else ""))

    try:
        with procs.stop_signals_interrupt():  # SIGTERM/SIGHUP: the same orderly shutdown as Ctrl-C
            run_demo(config, Path(workdir), broker, api_port, linger, quiet, on_results=_report,
                     keep=[Path(config_path)] if config_path else [])
    except workspace.WorkspaceError as exc:  # e.g. another demo runs on it
        raise click.BadParameter(str(exc), param_hint="--workdir") from None
    except ConfigError as exc:  # what the flags ask that the data or the models cannot do
        raise click.UsageError(str(exc)) from None
    except FileNotFoundError as exc:  # a dataset's files missing from --data-dir: the flag to change (as simulate)
        raise click.UsageError(f"{exc} (--data-dir)") from None
    except ValueError as exc:  # e.g. a damaged dataset file
        raise click.ClickException(str(exc)) from None
    except ImportError as exc:  # an extra this run needs is not installed (scipy for SVHN, say)
        raise click.ClickException(missing_module_message(exc)) from None
    except procs.Stopped as exc:
        with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) cannot take the line: the status says it
            click.echo(f"stopped by {exc}: the coordinator, the agents and the broker are shut down", err=True)
        sys.exit(exc.exit_status)
    except KeyboardInterrupt:  # Ctrl-C: said as for the other stop signals (click would say "Aborted!")
        with contextlib.suppress(OSError):
            click.echo("stopped by SIGINT: the coordinator, the agents and the broker are shut down", err=True)
        sys.exit(128 + signal.SIGINT)
