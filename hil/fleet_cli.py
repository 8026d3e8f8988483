"""`fedal hil fleet`: N emulated agents against a real coordinator, optionally started here too."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path

import click

from fedal import workspace
from fedal.cli_types import FiniteFloatRange


@click.command("fleet")
@click.option("--clients", type=click.IntRange(1, 100_000), required=True, help="Number of emulated agents.")
@click.option("--broker", default="mqtt://127.0.0.1:1883", show_default=True, help="Broker URL (mqtt:// or mqtts://).")
@click.option("--run-id", required=True, help="The run to join (the coordinator's run_id).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic logits and accuracies.")
@click.option("--prefix", default="e", show_default=True, help="Client ids are PREFIX0000, PREFIX0001, ...")
@click.option("--username", help="Broker user for every emulated agent (default: from the URL).")
@click.option("--password", help="Broker password (default: from the URL).")
@click.option("--ca-file", type=click.Path(dir_okay=False, exists=True), help="CA bundle for mqtts:// brokers.")
@click.option("--credentials-dir", type=click.Path(file_okay=False, exists=True),
              help="Per-device broker accounts: the devices/ folder of `fedal fleet init` (DIR/<id>/agent.toml).")
@click.option("--ids", help="Comma-separated client ids instead of PREFIX0000.. (e.g. the devices of `fedal fleet init`).")
@click.option("--public-file", type=click.Path(dir_okay=False, exists=True),
              help="Provisioned public set (.npz); else fetched once.")
@click.option("--reconnect-min", type=FiniteFloatRange(0.05), default=1.0, show_default=True, help="Reconnect backoff start (s).")
@click.option("--reconnect-max", type=FiniteFloatRange(0.1), default=30.0, show_default=True, help="Reconnect backoff cap (s).")
@click.option("--status-file", type=click.Path(dir_okay=False), help="Write the fleet's counters here (JSON) on exit.")
@click.option("--timeout", type=FiniteFloatRange(0), default=0.0, help="Give up after S seconds (0: wait for the run to finish).")
@click.option("--start-coordinator", is_flag=True,
              help="Also start a real coordinator for these clients (config and synthetic public set in --workdir).")
@click.option("--coordinator-broker", default=None,
              help="With --start-coordinator: the broker URL the coordinator uses (default: --broker). Give the real "
                   "broker when --broker is a `fedal hil broker` proxy: behind drops and resets the coordinator, whose "
                   "every reconnect re-sends all open tasks, can stall a large fleet.")
@click.option("--workdir", type=click.Path(file_okay=False), default="runs/fleet", show_default=True,
              help="With --start-coordinator: where its config, state and log go.")
@click.option("--strategy", default="fedal", show_default=True, help="With --start-coordinator: the strategy.")
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True, help="With --start-coordinator: rounds.")
@click.option("--tau", type=click.IntRange(1), default=None, help="With --start-coordinator: tau (default: the preset).")
@click.option("--num-classes", type=click.IntRange(2), default=10, show_default=True, help="With --start-coordinator: K.")
@click.option("--public-size", type=click.IntRange(1, 1_000_000), default=1000, show_default=True,
              help="With --start-coordinator: |P| (synthetic rows of 8 values).")
@click.option("--batch", type=click.IntRange(1), default=32, show_default=True, help="With --start-coordinator: public batch B.")
@click.option("--api-port", type=click.IntRange(0, 65535), default=0, help="With --start-coordinator: REST port (0: free).")
@click.option("--resend-s", type=FiniteFloatRange(0.1, 3600), default=None,
              help="With --start-coordinator: the coordinator's phases.resend_s, how soon an unanswered task is sent "
                   "again (default 30; a few seconds behind a proxy with `lost` drops, e.g. --profile chaos).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def fleet_cmd(clients, broker, run_id, seed, prefix, username, password, ca_file, credentials_dir, ids, public_file,
              reconnect_min, reconnect_max, status_file, timeout, start_coordinator, coordinator_broker, workdir,
              strategy, rounds, tau, num_classes, public_size, batch, api_port, resend_s, quiet) -> None:
    """Emulated agents: N MQTT clients that follow the protocol exactly, with synthetic results (no training)."""
    from fedal.ports import unreachable
    from fedal.progress import progress_bar
    from fedal.protocol import parse_broker_url, topics
    from hil.fleet import Fleet, client_ids, device_credentials
    from hil.mosquitto import free_port, raise_open_files_limit

    if coordinator_broker is not None and not start_coordinator:
        raise click.UsageError("--coordinator-broker is for the coordinator --start-coordinator starts")
    try:
        address = parse_broker_url(broker)
        if coordinator_broker is not None:
            try:
                parse_broker_url(coordinator_broker)
            except ValueError as exc:
                raise ValueError(f"--coordinator-broker: {exc}") from None
        topics.check_id(run_id, "run id")
        if ids:
            ids = [topics.check_id(c.strip(), "client id") for c in ids.split(",") if c.strip()]
            if len(ids) != clients:
                raise ValueError(f"--ids lists {len(ids)} clients, --clients says {clients}")
            if len(set(ids)) != len(ids):  # the coordinator refuses them too, later
                raise ValueError(f"--ids lists a client more than once: {sorted({c for c in ids if ids.count(c) > 1})}")
        else:
            ids = client_ids(clients, prefix)
        credentials = device_credentials(credentials_dir, ids) if credentials_dir else None
        if credentials_dir:
            check_acl_run_id(Path(credentials_dir), run_id)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if reconnect_max < reconnect_min:
        raise click.UsageError("--reconnect-max must be at least --reconnect-min")
    if status_file:  # written at the end: checked now, not after the whole run
        from fedal.owned import ForeignFile, check_replaceable, is_fleet_status, unwritable

        try:
            check_replaceable(status_file, is_fleet_status, "fleet status file")
        except ForeignFile as exc:
            raise click.BadParameter(str(exc), param_hint="--status-file") from None
        why = unwritable(status_file)
        if why:
            raise click.BadParameter(why, param_hint="--status-file")
    problem = unreachable(address.host, address.port, 3.0)
    if problem is not None:  # said once here; the agents keep retrying (a broker may come up later)
        click.echo(f"warning: nothing answers at {address.redacted()} yet ({problem}); the emulated agents keep "
                   "trying to connect", err=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    raise_open_files_limit(clients + 1024)  # one socket per emulated agent

    stop = {"signal": None}

    def _on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(sig, _on_signal)  # before anything starts: every way out goes through the finally below
    coordinator = None
    api = None
    coordinator_started = 0.0
    held = contextlib.ExitStack()  # the workspace's lock, with --start-coordinator
    if start_coordinator:
        from fedal.strategies import get_strategy

        try:
            get_strategy(strategy)
        except ValueError as exc:  # names the valid choices
            raise click.BadParameter(str(exc), param_hint="--strategy") from None
        from hil.coordinator_setup import poll_run, stop_process, wait_for_run, write_coordinator_config
        from hil.coordinator_setup import start_coordinator as spawn_coordinator

        api_port = api_port or free_port()
        wd = Path(workdir)
        extra = {}
        account = Path(credentials_dir).parent / "coordinator" / "broker.toml" if credentials_dir else None
        if account is not None and account.exists():  # the coordinator's own account from `fedal fleet init`
            import tomllib

            try:
                extra["broker"] = tomllib.loads(account.read_text(encoding="utf-8")).get("broker", {})
                if not isinstance(extra["broker"], dict):
                    raise ValueError("its [broker] is not a table")
            except (OSError, ValueError, RecursionError) as exc:  # (TOMLDecodeError, UnicodeDecodeError: ValueErrors)
                raise click.UsageError(f"{account} cannot give the coordinator its broker account: {exc}") from None
            if coordinator_broker is not None:  # asked for by name: over the account's own listener
                extra["broker"]["url"] = coordinator_broker
        from fedal.workspace import WorkspaceError

        try:  # this run's alone until it ends: another on the same --workdir is refused, not mixed in
            held.enter_context(workspace.held(workspace.claim(wd, "fedal hil fleet --start-coordinator"),
                                              "fedal hil fleet --start-coordinator"))
            path = write_coordinator_config(wd, coordinator_broker or broker, run_id, ids, api_port=api_port,
                                            strategy=strategy, rounds=rounds,
                                            seed=seed, num_classes=num_classes, public_size=public_size,
                                            public_batch_size=batch, tau=tau, extra=extra,
                                            phases=None if resend_s is None else {"resend_s": resend_s})
        except WorkspaceError as exc:
            raise click.BadParameter(str(exc), param_hint="--workdir") from None
        coordinator_started = time.time()
        coordinator = spawn_coordinator(path, wd / "coordinator.log")
        api = f"http://127.0.0.1:{api_port}"
        click.echo(f"coordinator: {api}/api/v1/runs/{run_id} (log {wd / 'coordinator.log'})", err=True)

    try:
        models, input_shape = global_model_layout(strategy) if start_coordinator else (None, None)
        fleet = Fleet(broker, run_id, ids, seed, username=username, password=password, ca_file=ca_file,
                      credentials=credentials, public_file=public_file, reconnect_min_s=reconnect_min,
                      reconnect_max_s=reconnect_max, models=models, input_shape=input_shape).start()
    except BaseException:
        if coordinator is not None:
            stop_process(coordinator)
        held.close()
        raise
    bar = progress_bar(total=None, desc=f"fleet {run_id}", unit="round", disable=quiet)
    deadline = time.monotonic() + timeout if timeout else None
    outcome = "interrupted"
    status_unwritten = False
    try:
        while True:
            if fleet.finished():
                outcome = "finished"
                break
            if stop["signal"] is not None:
                break
            if fleet.error is not None:
                outcome = "failed"
                break
            if coordinator is not None and coordinator.poll() is not None:
                outcome = "coordinator exited"
                break
            if api is not None and _finished_before(poll_run(api, run_id), coordinator_started):
                outcome = "finished before"  # the run in --workdir's store: nothing is left to do
                break
            if deadline is not None and time.monotonic() > deadline:
                outcome = "timed out"
                break
            if not quiet:
                _progress(bar, fleet)
            time.sleep(1.0)
    finally:
        fleet.stop()
        if not quiet:
            _progress(bar, fleet)  # where the run ended (the loop leaves before its last update)
        bar.close()
        if status_file:
            try:
                fleet.write_status(status_file)
            except OSError as exc:  # the rest still runs: the coordinator stopped in order, the summary said
                click.echo(f"cannot write the status file {status_file}: {exc.strerror or exc}", err=True)
                status_unwritten = True
        if coordinator is not None:
            if outcome == "finished":  # let it record the end (results file) before it is stopped
                try:
                    wait_for_run(api, run_id, lambda r: r["state"] in ("finished", "failed"), 60, coordinator)
                except (TimeoutError, RuntimeError) as exc:
                    click.echo(f"coordinator: {exc}", err=True)
            stop_process(coordinator)
        held.close()
    summary = fleet.summary()
    summary.pop("per_client")
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) cannot take them: the exit status says it
        click.echo(json.dumps({"outcome": outcome, **summary}, indent=1))
        if outcome == "coordinator exited" and coordinator is not None:  # why, not only that
            from fedal.procs import last_error

            click.echo(f"the coordinator exited with status {coordinator.returncode}"
                       f"{last_error(wd / 'coordinator.log')}", err=True)
        if outcome == "finished before":
            click.echo(f"run {run_id} had already finished in {wd / 'state'} (its results: "
                       f"{wd / 'state' / 'results.json'}); a coordinator started on it resumes it, so nothing was "
                       "left to run: give another --run-id or --workdir to run it again", err=True)
    if stop["signal"] is not None and outcome == "interrupted":  # as a shell reports a process ended by it
        raise SystemExit(128 + int(stop["signal"]))
    if outcome != "finished" or status_unwritten:
        raise SystemExit(1)


def check_acl_run_id(credentials_dir: Path, run_id: str) -> None:
    """ValueError if the fleet the credentials come from lets its devices write under another run id
    (`fleet init` writes it into the broker ACL): every connection would be refused, for ever."""
    from fedal.protocol.topics import acl_run_level

    try:  # the ACL itself: the docs move a fleet to another run id by editing it
        acl: str | None = acl_run_level((credentials_dir.parent / "broker" / "acl").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        acl = None
    if acl is None:  # no ACL beside the credentials (copied elsewhere): what fleet init recorded
        try:
            summary = json.loads((credentials_dir.parent / "fleet.json").read_text())
        except (OSError, ValueError, RecursionError):
            return  # not a `fleet init` output, or an older one (its ACL has `+`)
        acl = summary.get("acl_run_id") if isinstance(summary, dict) else None
    if isinstance(acl, str) and acl not in ("+", run_id):
        raise ValueError(f"the fleet in {credentials_dir.parent} lets its devices write only under run id {acl!r} "
                         f"(its broker ACL): give --run-id {acl}, or provision it with `fleet init --any-run-id`")


def _progress(bar, fleet) -> None:
    manifests = [a.manifest for a in fleet.agents if a.manifest is not None]
    if manifests:
        m = max(manifests, key=lambda m: m.round)
        if bar.total != m.rounds:
            bar.total = m.rounds
        bar.n = m.round + (1 if m.state == "finished" else 0)
    c = fleet.totals()
    bar.set_postfix(online=f"{fleet.online()}/{len(fleet.agents)}", tasks=c.get("tasks", 0),
                    rejected=c.get("rejected", 0), refresh=True)


def global_model_layout(strategy: str) -> tuple[list[str] | None, tuple[int, ...] | None]:
    """For a strategy whose coordinator scores the averaged model (global_acc): the model and
    input shape of the run it starts (its default dataset's single model), so the emulated
    weights load into it; (None, None) for the others."""
    from fedal.data import load_dataset
    from fedal.sim.config import RunConfig
    from fedal.strategies import get_strategy

    if not get_strategy(strategy).global_model:
        return None, None
    run = RunConfig(strategy=strategy)
    return run.resolved_models(), load_dataset(run.dataset, run.data_dir)[1].input_shape


def _finished_before(run: dict | None, since: float) -> bool:
    """Whether the coordinator found its run finished in its store: ended before it started."""
    return bool(run) and run.get("state") == "finished" and (run.get("finished_at") or since) < since
