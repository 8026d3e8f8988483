"""`fedal simulate` / `fedal demo` outputs: paths that could not be written after the run, and a
`--out` that is the config file being read, are usage errors (exit 2) before the run starts;
`fedal demo` writes its results and plot into its --workdir, and refuses simulation-only settings
before it starts anything."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedal_cli.main import cli
from tests.helpers import fedal_command

QUICK = ["--dataset", "digits", "--clients", "2", "--rounds", "1", "--strategy", "fedmd", "--public-size", "60", "--quiet"]


def fedal(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*fedal_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_results_file_is_never_overwritten_by_the_run_it_configures(tmp_path):
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"config": {"strategy": "fedmd", "dataset": "digits", "clients": 2, "rounds": 1}}))
    before = saved.read_bytes()
    r = fedal("simulate", "--config", "results.json", "--rounds", "1", cwd=tmp_path)  # --out defaults to results.json
    assert r.returncode == 2, r.stderr
    assert "is the config file this run reads" in r.stderr and "Traceback" not in r.stderr
    assert saved.read_bytes() == before


@pytest.mark.parametrize("extra, needle", [
    (["--out", "/proc/results.json"], "not writable"),
    (["--out", "file.txt/results.json"], "is not a directory"),
    (["--out", "."], "is a directory"),
    (["--plot", "acc.txt"], "a plot is written as"),
    (["--plot", "/proc/acc.png"], "not writable"),
])
def test_outputs_that_could_not_be_written_are_refused_before_the_run(tmp_path, monkeypatch, extra, needle):
    (tmp_path / "file.txt").write_text("a user's file\n")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["simulate", *QUICK, *extra])
    assert r.exit_code == 2, r.output
    assert needle in r.stderr, r.output
    assert isinstance(r.exception, SystemExit)  # click's usage exit, no error raised out of the command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # nothing ran, nothing written


def test_the_demo_refuses_simulation_faults_before_starting_anything(tmp_path, monkeypatch):
    (tmp_path / "faults.toml").write_text('strategy = "fedmd"\ndataset = "digits"\ndropout = 0.2\n')
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["demo", "--config", "faults.toml", "--workdir", "ws"])
    assert r.exit_code == 2, r.output
    assert "faults of the simulation" in r.stderr and not (tmp_path / "ws").exists()


def test_the_demo_writes_its_results_and_plot_into_its_workdir(tmp_path):
    """...also from a simulation's results file, which records how it stacked its clients."""
    sim = fedal("simulate", *QUICK, "--out", "sim.json", cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    assert json.loads((tmp_path / "sim.json").read_text())["config"]["vectorize"] is not False
    r = fedal("demo", "--config", "sim.json", "--workdir", "ws", "--quiet", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "ws" / "results.json").read_text())
    assert results["config"]["strategy"] == "fedmd" and (tmp_path / "ws" / "accuracy.png").stat().st_size > 0
    assert not (tmp_path / "runs").exists()


def test_the_demo_refuses_a_broker_nothing_answers_at_and_a_busy_api_port(tmp_path, monkeypatch):
    """Both were waited for silently (the demo sat at 0 % for an hour); now usage errors before
    anything starts."""
    import socket

    from fedal.ports import free_port

    monkeypatch.chdir(tmp_path)
    port = free_port()  # nothing listens there
    r = CliRunner().invoke(cli, ["demo", "--broker", f"mqtt://127.0.0.1:{port}", "--workdir", "ws", "--quiet"])
    assert r.exit_code == 2, r.output
    assert f"nothing answers at mqtt://127.0.0.1:{port}" in r.stderr and "start the broker first" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = CliRunner().invoke(cli, ["demo", "--api-port", str(busy.getsockname()[1]), "--workdir", "ws", "--quiet"])
    assert r.exit_code == 2, r.output
    assert "is in use on 127.0.0.1" in r.stderr
    assert not (tmp_path / "ws").exists()


def test_a_stalled_demo_names_the_coordinators_last_error_and_its_log(tmp_path):
    """The follow loop's limit is on the wait for the next round, and its error (as a
    coordinator's exit) quotes the log's last error line and says where the log is."""
    import click

    from fedal_cli.demo import _follow

    log = tmp_path / "coordinator.log"
    log.write_text("2026-01-01 00:00:00,000 coordinator INFO run demo (fedal)\n"
                   "2026-01-01 00:00:01,000 coordinator.bus WARNING still waiting for the broker at mqtt://h:1\n")
    alive = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(click.ClickException) as err:
            _follow("http://127.0.0.1:9", [alive], 3, True, 1.0, [log])
    finally:
        alive.kill()
        alive.wait()
    assert err.value.message == ("no round completed within 1 s: 2026-01-01 00:00:01,000 coordinator.bus WARNING "
                                 f"still waiting for the broker at mqtt://h:1 (log: {log})")
    exited = subprocess.Popen(["sh", "-c", "exit 3"])
    exited.wait()
    log.write_text(log.read_text() + "ERROR:    [Errno 98] error while attempting to bind: address already in use\n")
    with pytest.raises(click.ClickException) as err:
        _follow("http://127.0.0.1:9", [exited], 3, True, 30.0, [log])
    assert err.value.message == ("the coordinator exited with status 3: ERROR:    [Errno 98] error while attempting "
                                 f"to bind: address already in use (log: {log})")


def test_a_demo_whose_agent_dies_stops_at_once_naming_it(tmp_path):
    """Only the coordinator was watched: with an agent killed (OOM, a crash) every phase waited
    for it until its deadline (300 s for local training), with all of them dead the demo waited an
    hour, and nothing was said."""
    import click

    from fedal_cli.demo import _follow

    logs = [tmp_path / "coordinator" / "coordinator.log", tmp_path / "agents" / "c00" / "agent.log",
            tmp_path / "agents" / "c01" / "agent.log"]
    for log in logs:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
    logs[2].write_text("2026-01-01 00:00:01,000 edge_agent ERROR cannot load the private data: MemoryError\n")
    coordinator, fine = subprocess.Popen(["sleep", "30"]), subprocess.Popen(["sleep", "30"])
    killed = subprocess.Popen(["sleep", "30"])
    killed.kill()
    killed.wait()
    left = subprocess.Popen(["true"])  # an agent leaving a finished run exits 0: not a failure (no API here
    left.wait()  # answers, so the run is not known to be unfinished)
    try:
        with pytest.raises(click.ClickException) as err:
            _follow("http://127.0.0.1:9", [coordinator, left, killed], 3, True, 30.0, [logs[0], logs[1], logs[2]])
    finally:
        for p in (coordinator, fine):
            p.kill()
            p.wait()
    assert err.value.message == ("agent c01 exited with status -9: 2026-01-01 00:00:01,000 edge_agent ERROR cannot "
                                 f"load the private data: MemoryError (log: {logs[2]})")


@pytest.mark.parametrize("command", ["simulate", "demo"])
@pytest.mark.parametrize("extra, needle", [
    (["--public-size", "100000"], "digits: public_size must be at most"),
    (["--samples-per-client", "100000"], "samples each"),
    (["--models", "mlp,cnn1d"], "(--models)"),  # a signal model on digits' images
])
def test_settings_the_dataset_cannot_take_are_usage_errors(tmp_path, monkeypatch, command, extra, needle):
    """Bad arguments exit with status 2 (they exited 1, and the demo with a traceback)."""
    monkeypatch.chdir(tmp_path)
    args = [a for a in QUICK if a not in ("--public-size", "60")] + extra
    if command == "demo":
        args += ["--workdir", "ws"]
    r = CliRunner().invoke(cli, [command, *args])
    assert r.exit_code == 2, r.output
    assert needle in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "results.json").exists()


def test_the_demo_takes_a_ray_simulations_results_as_its_config(capsys):
    """Where a simulation computed its clients (Ray actors, stacked) does not change its numbers:
    the demo drops it, as it dropped `vectorize`, and says so; faults stay refused."""
    import click

    from fedal.sim import load_config
    from fedal_cli.demo import deployable

    config = load_config(None, {"strategy": "fedmd", "dataset": "digits", "backend": "ray", "ray_actors": 2,
                                "client_resources": "num_cpus=1", "vectorize": True})
    deployed = deployable(config)
    assert (deployed.backend, deployed.ray_actors, deployed.client_resources, deployed.vectorize) == \
        ("inprocess", None, None, False)  # its clients step one by one: recorded so, a rerun takes that path
    assert "note: backend, vectorize, ray_actors, client_resources only say how a simulation" in capsys.readouterr().err
    deployable(load_config(None, {"strategy": "fedmd", "dataset": "digits"}))
    assert capsys.readouterr().err == ""  # nothing to say
    with pytest.raises(click.UsageError, match="faults of the simulation"):
        deployable(load_config(None, {"strategy": "fedmd", "dataset": "digits", "dropout": 0.1}))


def test_ctrl_c_stops_the_demo_as_the_other_stop_signals_do(tmp_path):
    import signal

    from tests.waiting import signal_when_ready

    proc = subprocess.Popen([*fedal_command(), "demo", "--dataset", "digits", "--clients", "2", "--rounds", "10000",
                             "--strategy", "fedmd", "--public-size", "60", "--quiet", "--workdir", "ws"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lock = tmp_path / "ws" / ".fedal-workspace.lock"
    # the workspace is held: the run is under way, its signal handling in place
    _, err = signal_when_ready(proc, lambda: lock.exists() and lock.read_text().strip(), signal.SIGINT, settle_s=1)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "stopped by SIGINT: the coordinator, the agents and the broker are shut down" in err
    assert "Aborted!" not in err and "Traceback" not in err


def test_a_demo_agent_stopped_by_a_signal_it_handles_counts_though_it_exits_0(tmp_path):
    """An agent ends with status 0 when it leaves a finished run, and also when SIGTERM stops it:
    with the run still going, that is an agent gone."""
    import http.server
    import json
    import threading

    import click

    from fedal_cli.demo import RUN_ID, _follow

    class Running(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"state": "running", "completed_rounds": 0, "last_round": None}).encode()
            self.send_response(200 if self.path == f"/api/v1/runs/{RUN_ID}" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            """quiet"""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Running)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    coordinator = subprocess.Popen(["sleep", "30"])
    stopped = subprocess.Popen(["true"])
    stopped.wait()
    log = tmp_path / "agents" / "c00" / "agent.log"
    log.parent.mkdir(parents=True)
    log.write_text("")
    try:
        with pytest.raises(click.ClickException) as err:
            _follow(f"http://127.0.0.1:{server.server_address[1]}", [coordinator, stopped], 3, True, 30.0,
                    [tmp_path / "coordinator.log", log])
    finally:
        coordinator.kill()
        coordinator.wait()
        server.shutdown()
        server.server_close()
    assert err.value.message.startswith("agent c00 exited with status 0 before the run finished")


@pytest.mark.parametrize("command", ["simulate", "demo"])
def test_the_help_states_the_defaults_a_run_without_the_flag_takes(command):
    """The defaults live in the run config (a TOML file may set any of them), so the flags have
    none of their own; their help states the config's, which is what a run without them takes."""
    text = " ".join(CliRunner().invoke(cli, [command, "--help"], terminal_width=400).output.split())
    from fedal.sim import load_config

    config = load_config(None, {})
    for phrase in (f"Number of clients N (default {config.clients})", f"Rounds T (default {config.rounds})",
                   f"Algorithm to run (default {config.strategy})", f"(default {config.dataset})",
                   f"Unlabeled public rows |P| (default {config.public_size})", "5 for fedal"):
        assert phrase in text, phrase
    assert config.resolved().strategy_params.tau == 5 and config.strategy == "fedal"


@pytest.mark.timeout(120)  # (read twice, the pipe blocks for ever)
@pytest.mark.parametrize("through", ["file", "pipe"])
def test_a_repeated_run_on_another_public_set_says_so_from_a_file_or_a_pipe(tmp_path, monkeypatch, through):
    """The results file's public_hash is read with its config, once: a `--config <(...)` pipe
    cannot be read a second time, and the warning was silently lost there."""
    monkeypatch.chdir(tmp_path)
    first = CliRunner().invoke(cli, ["simulate", *QUICK, "--out", "first.json"])
    assert first.exit_code == 0, first.output
    saved = json.loads((tmp_path / "first.json").read_text())
    saved["data"]["public_hash"] = "0" * 64  # the files under data_dir as they were then
    text = json.dumps(saved)
    if through == "file":
        (tmp_path / "then.json").write_text(text)
        config = "then.json"
    else:
        os.mkfifo(tmp_path / "then.pipe")
        writer = threading.Thread(target=(tmp_path / "then.pipe").write_text, args=(text,), daemon=True)
        writer.start()
        config = "then.pipe"
    again = CliRunner().invoke(cli, ["simulate", "--config", config, "--quiet", "--out", "again.json"])
    assert again.exit_code == 0, again.output
    assert "public set is not the one" in again.stderr and "000000000000" in again.stderr
    same = CliRunner().invoke(cli, ["simulate", "--config", "first.json", "--quiet", "--out", "same.json"])
    assert same.exit_code == 0 and "public set is not the one" not in same.stderr


def test_a_run_whose_last_evaluation_nobody_answered_says_so(tmp_path, monkeypatch):
    """final is {} when every client refused the last evaluation: the closing line raised a
    KeyError after the results were written."""
    import fedal.sim.runner as runner

    real = runner.simulate

    def unevaluated(*args, **kwargs):
        results = real(*args, **kwargs)
        return {**results, "final": {}}

    monkeypatch.setattr(runner, "simulate", unevaluated)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["simulate", *QUICK, "--out", "r.json"])
    assert r.exit_code == 0, r.output
    assert "no client answered the last evaluation -> r.json" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["final"] == {}
