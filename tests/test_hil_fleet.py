"""Emulated agents (hil/emulated_agent.py, hil/fleet.py, `fedal hil fleet`).

In-process: the emulated agent answers the real strategies' server halves with results their
validation accepts, and follows the agent's protocol rules (join by instance, (epoch, seq) dedup
from the cached bytes, chunk reassembly, refusals). Over a real broker: 100 emulated agents in one
`python -m hil fleet` process drive a real coordinator process through Mosquitto for a FedAL run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import numpy as np
import pytest

from fedal.protocol import Message, Reassembler, RunManifest, answering, decode, encode, split, topics
from fedal.strategies import ServerContext, StrategyParams, get_strategy
from hil.emulated_agent import EmulatedAgent, PublicSetSource

RUN = "unit"
K, P, B = 10, 200, 32


class _Public(PublicSetSource):
    def size(self, expected_hash, url):  # no coordinator here: the size the manifest announces
        return P


def manifest(strategy: str, clients: list[str], params: StrategyParams, instance: str = "i-1", state: str = "running"):
    return RunManifest(run_id=RUN, strategy=strategy, strategy_params=params.model_dump(mode="json"), num_classes=K,
                       clients=clients, rounds=2, public_hash="h", public_size=P, public_url="http://127.0.0.1:9/x",
                       state=state, instance=instance).to_json()


def joined_agents(strategy: str, n: int = 3, **overrides):
    spec = get_strategy(strategy)
    params = StrategyParams(public_batch_size=B, **overrides).resolve(spec.preset)
    ids = [f"c{i}" for i in range(n)]
    server = spec.server(params, ids, ServerContext(K, P, seed=0))
    agents = {cid: EmulatedAgent(RUN, cid, index=i, public=_Public()) for i, cid in enumerate(ids)}
    for a in agents.values():
        assert a.on_message(a.manifest_topic, manifest(strategy, ids, params)) == []
        assert a.joined is not None
    return server, agents


def send(agent: EmulatedAgent, task: Message, key: tuple[int, int], instance: str = "i-1") -> list:
    meta = {**task.meta, "run": RUN, "client": agent.client_id, "instance": instance, "epoch": key[0], "seq": key[1]}
    return agent.on_message(agent.task_topic, encode(Message(meta, task.tensors)))


def run_round(server, agents, r: int, seq: int) -> int:
    """One round of the server half against the emulated agents; every result must validate."""
    phase = server.begin_round(r)
    while phase is not None:
        seq += 1
        results = {}
        for cid, task in phase.tasks.items():
            (pub,) = send(agents[cid], task, (0, seq))
            assert pub.topic == topics.result(RUN, cid)
            res = answering(decode(pub.payload), task)  # as the engine reads it
            assert (res.meta["epoch"], res.meta["seq"]) == (0, seq)
            server.validate(phase, cid, res)  # raises InvalidResult if the coordinator would refuse it
            results[cid] = res
        phase = server.collect(phase, results)
    return seq


@pytest.mark.parametrize("strategy", ["fedal", "fedmd", "fedmd-lf", "local", "fedavg"])
def test_results_pass_the_server_halves_validation(strategy):
    server, agents = joined_agents(strategy, tau=2)
    seq = run_round(server, agents, 0, 0)
    seq = run_round(server, agents, 1, seq)
    for a in agents.values():
        assert a.counters["rejected"] == 0 and a.counters["errors"] == 0
        assert a.counters["tasks"] == {"fedal": 6, "fedmd": 6, "fedmd-lf": 6, "local": 2, "fedavg": 2}[strategy] + (
            1 if strategy == "fedavg" and a.client_id == "c0" else 0)  # FedAvg's init goes to the first client
        applied = {"fedal": 4, "fedmd": 4, "fedmd-lf": 4, "local": 0, "fedavg": 2}[strategy]
        assert a.status()["feedback_applied"] == applied and a.status()["feedback_twice"] == []


def test_fedal_results_have_the_real_client_halves_shape():
    server, agents = joined_agents("fedal", tau=2)
    a = agents["c0"]
    phase = server.begin_round(0)
    (pub,) = send(a, phase.tasks["c0"], (0, 1))
    res = decode(pub.payload)
    assert res.tensors["logits"].shape == (B, K) and res.tensors["logits"].dtype == np.float32
    assert set(res.meta) == {"loss", "epoch", "seq"}  # a result names its task by (epoch, seq)
    results = {cid: answering(decode(send(ag, phase.tasks[cid], (0, 1))[0].payload), phase.tasks[cid])
               for cid, ag in agents.items() if cid != "c0"}
    transfer = server.collect(phase, {"c0": answering(res, phase.tasks["c0"]), **results})
    assert set(transfer.tasks["c0"].tensors) == {"fbar", "grad"}  # the next rows: computed by both ends
    res = decode(send(a, transfer.tasks["c0"], (0, 2))[0].payload)
    assert set(res.meta) == {"epoch", "seq"} and res.tensors["logits"].shape == (B, K)  # diagnostics: at the end
    others = {cid: answering(decode(send(ag, transfer.tasks[cid], (0, 2))[0].payload), transfer.tasks[cid])
              for cid, ag in agents.items() if cid != "c0"}
    last = server.collect(transfer, {"c0": answering(res, transfer.tasks["c0"]), **others})
    res = decode(send(a, last.tasks["c0"], (0, 3))[0].payload)
    # the round's feedback with an adversarial gradient, after a local_train with less-forgetting on
    assert {"loss_kd", "gnorm_kd", "gnorm_lf", "gnorm_adv"} <= set(res.meta) and not res.tensors


def test_dedup_stale_instance_and_refusals_follow_the_agent():
    server, agents = joined_agents("fedal", tau=2)
    a = agents["c0"]
    task = server.begin_round(0).tasks["c0"]
    first = send(a, task, (0, 5))
    again = send(a, task, (0, 5))  # a QoS 1 redelivery or a coordinator re-send: the cached bytes, not recomputed
    assert again == first and a.counters["duplicates"] == 1 and a.counters["tasks"] == 1
    assert send(a, task, (0, 4)) == [] and a.counters["stale"] == 1  # older than the last one
    assert send(a, task, (0, 9), instance="earlier-run") == [] and a.counters["stale"] == 2
    assert send(a, Message({**task.meta, "seq": "x"}, task.tensors), (0, "6")) == [] and a.counters["rejected"] == 1
    bad = Message({"phase": "transfer", "round": 0, "iteration": 1, "n_avg": 2}, {"fbar": np.zeros((B, K), np.float32)})
    declined = send(a, bad, (0, 10))  # feedback for logits it never uploaded: declined, as an agent does
    assert [decode(p.payload).meta for p in declined] == [{"declined": "missed_step", "epoch": 0, "seq": 10}]
    assert a.counters["missed_step"] == 1 and a.counters["rejected"] == 1
    assert a.last_key == (0, 5)  # a declined task leaves the last key alone
    wrong = {"phase": "nonsense", "instance": "i-1", "epoch": 0, "seq": 11}
    assert a.on_message(a.task_topic, encode(Message(wrong))) == [] and a.counters["rejected"] == 2
    assert a.on_message(a.task_topic, b"garbage") == [] and a.counters["rejected"] == 3
    assert a.on_message("fedal/v1/unit/down/c9", b"") == [] and a.counters["rejected"] == 4


def test_chunked_tasks_are_reassembled_and_big_results_chunked():
    server, agents = joined_agents("fedavg", n=2)
    a = agents["c0"]
    init = server.begin_round(0)
    res = answering(decode(send(a, init.tasks["c0"], (0, 1))[0].payload), init.tasks["c0"])
    train = server.collect(init, {"c0": res})
    meta = {**train.tasks["c0"].meta, "run": RUN, "client": "c0", "instance": "i-1", "epoch": 0, "seq": 2}
    parts = split(encode(Message(meta, train.tasks["c0"].tensors)), 4096)
    assert len(parts) > 1
    big = EmulatedAgent(RUN, "c0", public=_Public(), max_payload=4096)
    params = StrategyParams().resolve(get_strategy("fedavg").preset)
    big.on_message(big.manifest_topic, manifest("fedavg", ["c0", "c1"], params))
    out = []
    for part in parts[::-1]:  # any order
        out += big.on_message(big.task_topic, part)
    assert big.counters["tasks"] == 1 and big.counters["rejected"] == 0
    assert len(out) > 1 and all(len(p.payload) <= 4096 for p in out)  # the result goes back chunked too
    whole = Reassembler().feed  # the coordinator's side: the chunks make the validated result
    msgs = [whole("c0", p.payload) for p in out]
    server.validate(train, "c0", answering(next(m for m in msgs if m is not None), train.tasks["c0"]))


def test_tasks_before_the_manifest_are_held_and_a_finished_run_ends_the_agent():
    spec = get_strategy("fedal")
    params = StrategyParams(public_batch_size=B, tau=2).resolve(spec.preset)
    server = spec.server(params, ["c0", "c1"], ServerContext(K, P, seed=0))
    a = EmulatedAgent(RUN, "c0", public=_Public())
    assert send(a, server.begin_round(0).tasks["c0"], (0, 1)) == []  # overtook the retained manifest
    out = a.on_message(a.manifest_topic, manifest("fedal", ["c0", "c1"], params))
    assert len(out) == 1 and a.counters["tasks"] == 1
    assert a.on_message(a.manifest_topic, manifest("fedal", ["c1", "c2"], params)) == []  # not enrolled
    assert a.counters["rejected"] == 1
    assert a.on_message(a.manifest_topic, b"") == [] and a.counters["rejected"] == 1  # cleared retained manifest
    a.on_message(a.manifest_topic, manifest("fedal", ["c0", "c1"], params, state="finished"))
    assert a.finished


def test_fleet_cli_refuses_bad_arguments():
    from click.testing import CliRunner

    from hil.cli import hil_cmd

    for args in (["--clients", "2", "--run-id", "bad/id"], ["--clients", "3", "--run-id", "r", "--ids", "a,b"],
                 ["--clients", "2", "--run-id", "r", "--broker", "http://x"]):
        result = CliRunner().invoke(hil_cmd, ["fleet", *args])
        assert result.exit_code == 2, (args, result.output)
    result = CliRunner().invoke(hil_cmd, ["fleet", "--clients", "2", "--run-id", "r", "--start-coordinator",
                                          "--strategy", "fedxx", "--workdir", "unused"])
    assert result.exit_code == 2, result.output  # was a traceback (exit 1)
    assert "unknown strategy 'fedxx'; valid choices: fedal" in result.stderr and not Path("unused").exists()


def test_fleet_of_100_drives_a_real_coordinator(mosquitto, tmp_path):
    """`fedal hil fleet --start-coordinator`: 100 emulated agents and a real coordinator process."""
    run_id = f"fleet-{uuid.uuid4().hex[:8]}"
    rounds, tau = 2, 2
    status_file = tmp_path / "fleet-status.json"
    workdir = tmp_path / "coordinator"
    fleet = subprocess.run([sys.executable, "-m", "hil", "fleet", "--clients", "100", "--broker", mosquitto,
                            "--run-id", run_id, "--status-file", str(status_file), "--timeout", "170", "--quiet",
                            "--start-coordinator", "--workdir", str(workdir), "--rounds", str(rounds), "--tau", str(tau),
                            "--resend-s", "5"],
                           capture_output=True, text=True, timeout=200)
    assert fleet.returncode == 0, (fleet.stdout[-2000:], fleet.stderr[-3000:])
    assert json.loads(fleet.stdout)["outcome"] == "finished"
    # (a chaos run's lost messages wait for the next re-send: the CLI sets how soon)
    assert tomllib.loads((workdir / "coordinator.toml").read_text())["phases"]["resend_s"] == 5.0
    results = json.loads((workdir / "state" / "results.json").read_text())
    records = results["rounds"]
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert set(r["phases"]) == {"local_train", "transfer", "evaluate"}
        for name, stats in r["phases"].items():
            assert stats["participation"] == 1.0, (name, stats)
            assert stats["compute_s"] >= 0 and stats["wall_s"] >= stats["compute_s"]
        assert r["phases"]["transfer"]["count"] == 100 * tau
        assert 0.0 <= r["mean_acc"] <= 1.0
    deployment = results["deployment"]
    assert deployment["counters"].get("rejected", 0) == 0
    assert len(deployment["clients"]) == 100
    assert all(c["answered"] == rounds * (tau + 2) and c["late"] == 0 for c in deployment["clients"].values())
    status = json.loads(status_file.read_text())
    assert status["finished"] == 100 and status["error"] is None
    assert status["counters"]["tasks"] == 100 * rounds * (tau + 2)
    assert status["counters"].get("rejected", 0) == 0
    assert status["feedback_applied"] == 100 * rounds * tau
    assert status["feedback_applied_twice"] == {} and status["iterations_applied_twice"] == {}
    assert status["public_set_fetches"] == 1  # one download for the whole fleet, checked against the hash


def test_fleet_says_when_nothing_answers_at_the_broker():
    """It showed a bar at 0 rounds and nothing else (the refused connections were only counted)."""
    from fedal.ports import free_port

    port = free_port()
    r = subprocess.run([sys.executable, "-m", "hil", "fleet", "--clients", "2", "--broker", f"mqtt://127.0.0.1:{port}",
                        "--run-id", "x", "--quiet", "--timeout", "2"], capture_output=True, text=True, timeout=120)
    assert f"warning: nothing answers at mqtt://127.0.0.1:{port} yet" in r.stderr, r.stderr
    assert json.loads(r.stdout)["outcome"] == "timed out"


def test_a_fleet_stopped_by_sigterm_exits_as_the_shell_reports_it():
    import signal

    from fedal.ports import free_port
    from tests.waiting import signal_when_ready

    proc = subprocess.Popen([sys.executable, "-m", "hil", "fleet", "--clients", "2", "--broker",
                             f"mqtt://127.0.0.1:{free_port()}", "--run-id", "x", "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = signal_when_ready(proc, lambda: catches_sigterm(proc.pid), signal.SIGTERM)  # its handler is in place
    assert proc.returncode == 128 + signal.SIGTERM, err  # was 1
    assert json.loads(out)["outcome"] == "interrupted"


def catches_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM (/proc's SigCgt mask)."""
    import signal

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def test_a_second_fleet_on_a_finished_workdir_says_so_instead_of_waiting(mosquitto, tmp_path, monkeypatch):
    """The coordinator resumes the run it finds in --workdir's store; finished, nothing is left to
    run: the command ends at once (it waited for ever). And a status file that cannot be written
    at the end is said in one line, the coordinator still stopped in order and the summary given."""
    from click.testing import CliRunner

    from hil.cli import hil_cmd
    from hil.fleet import Fleet

    run_id = f"again-{uuid.uuid4().hex[:8]}"
    args = ["--clients", "2", "--broker", mosquitto, "--run-id", run_id, "--start-coordinator", "--workdir",
            str(tmp_path / "w"), "--rounds", "1", "--tau", "1", "--public-size", "60", "--quiet", "--timeout", "120"]
    first = subprocess.run([sys.executable, "-m", "hil", "fleet", *args], capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-2000:]

    def full_disk(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Fleet, "write_status", full_disk)
    started = time.monotonic()
    again = CliRunner().invoke(hil_cmd, ["fleet", *args, "--status-file", str(tmp_path / "status.json")])
    assert again.exit_code == 1, again.output
    assert time.monotonic() - started < 90  # not the --timeout: it saw the run had finished
    assert f"run {run_id} had already finished in {tmp_path / 'w' / 'state'}" in again.stderr
    assert "cannot write the status file" in again.stderr and "No space left on device" in again.stderr
    assert json.loads(again.stdout)["outcome"] == "finished before"
    log = (tmp_path / "w" / "coordinator.log").read_text()
    assert log.count("resuming run") == 1  # the second coordinator found it finished
    assert "Traceback" not in again.stderr
