"""The agent's durability in process (real files on a workspace, the agent's own task path):
the journal's format survives a torn tail and ignores a stale journal; a fresh agent on a copy of
the workspace taken after any task reaches exactly (torch.equal) the state the agent had;
durability "round" sits out the round under way; the bytes written per round stay within one
checkpoint plus the round's tasks. Crashes of real agent processes: tests/test_agent_crash.py."""

from __future__ import annotations

import copy
import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from edge_agent.agent import Agent
from edge_agent.checkpoint import Journal, load
from edge_agent.config import AgentConfig
from fedal.protocol import decode, encode, split
from tests.helpers import in_process, toy_federation

HOSTED = "c0"  # the client that runs inside an agent; the others are plain in-process sessions


def make_agent(workspace: Path, durability: str = "journal") -> Agent:
    config = AgentConfig(client_id=HOSTED, run_id="sim", model="mlp", data_file=workspace / "unused.npz",
                         workspace=workspace, durability=durability)
    workspace.mkdir(parents=True, exist_ok=True)
    return Agent(config)


class ThroughAgent:
    """An in-process session that is an agent's task path: encode, decode, session, durability."""

    def __init__(self, agent: Agent, on_applied=None, chunk: int | None = None):
        self.agent = agent
        self.on_applied = on_applied
        self.chunk = chunk  # publish tasks in chunks of about this many bytes, as a broker limit makes the coordinator
        self.payloads: list[bytes] = []
        self.wires: list[bytes | None] = []

    def on_task(self, task):
        payload = encode(task)
        parts = split(payload, self.chunk) if self.chunk else [payload]
        for part in parts[:-1]:
            assert self.agent.apply_task(part) is None  # a chunk: nothing to answer yet
        wire = self.agent.apply_task(parts[-1])
        self.payloads.append(payload)
        self.wires.append(None if wire is None else wire.payload)  # the bytes it published
        if self.on_applied is not None:
            self.on_applied(payload, wire)
        return wire


def fresh_client(strategy: str):
    _, clients, _ = toy_federation(strategy, tau=2)
    return clients[HOSTED]


def run_hosted(strategy: str, workspace: Path, rounds: int, durability: str = "journal", on_applied=None):
    """The toy federation for `rounds` rounds with HOSTED inside an agent on `workspace`."""
    server, clients, _ = toy_federation(strategy, tau=2)
    agent = make_agent(workspace, durability)
    agent.host(clients[HOSTED], "sim")
    engine = in_process(server, clients)
    through = ThroughAgent(agent, on_applied)
    engine.transport.sessions[HOSTED] = through
    for r in range(rounds):
        engine.run_round(r)
    return agent, through


def assert_same(a, b, where: str = "state") -> None:
    """Equal, not close: tensors with torch.equal, containers element by element."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def session_fields(agent: Agent) -> tuple:
    s = agent.session
    return s.last_key, s.last_result.payload if s.last_result else None, s.round_no, s.round_steps


def test_journal_drops_a_torn_tail_and_ignores_a_stale_journal(tmp_path):
    j = Journal(tmp_path / "journal.bin")
    j.reset("ckpt-a")
    digest = hashlib.sha256(b"r").hexdigest()
    ends = []
    for seq in range(3):
        j.append((1, seq), bytes([seq]) * (100 + seq), digest)
        ends.append(j.path.stat().st_size)
    j.close()
    records, torn = j.read("ckpt-a")
    assert torn == 0 and [r.key for r in records] == [(1, 0), (1, 1), (1, 2)]
    assert records[2].payload == bytes([2]) * 102 and records[2].result_sha256 == digest
    assert j.read("ckpt-b") == ([], 0)  # another checkpoint's journal has nothing for it

    with open(j.path, "r+b") as fh:  # a power cut mid-append: the last record is cut short
        fh.truncate(ends[2] - 5)
    records, torn = j.read("ckpt-a")
    assert [r.key for r in records] == [(1, 0), (1, 1)] and torn == ends[2] - 5 - ends[1]
    assert j.path.stat().st_size == ends[1]
    j.append((1, 3), b"next", digest)  # follows the last intact record, not the torn bytes
    j.close()
    records, torn = j.read("ckpt-a")
    assert [r.key for r in records] == [(1, 0), (1, 1), (1, 3)] and torn == 0

    data = bytearray(j.path.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in the last record: its CRC no longer matches
    j.path.write_bytes(bytes(data))
    records, torn = j.read("ckpt-a")
    assert [r.key for r in records] == [(1, 0), (1, 1)] and torn > 0


@pytest.mark.parametrize(("strategy", "chunk"), [("fedal", None), ("fedavg", None), ("fedal", 600)])
def test_a_restarted_agent_reaches_exactly_the_state_after_every_task(strategy, chunk, tmp_path, one_torch_thread):
    """After each task the workspace is copied as a crash would leave it; a new agent (a fresh
    client built as at start) on that copy must hold exactly the state the running one had."""
    copies: list[tuple[Path, dict, tuple]] = []
    holder: dict[str, Agent] = {}

    def on_applied(_payload, wire):
        if wire is None:
            return
        agent = holder["agent"]
        dest = tmp_path / f"copy{len(copies)}"
        shutil.copytree(agent.workspace, dest)
        copies.append((dest, copy.deepcopy(agent.client.state_dict()), copy.deepcopy(session_fields(agent))))

    server, clients, _ = toy_federation(strategy, tau=2)
    agent = holder["agent"] = make_agent(tmp_path / "ws")
    agent.host(clients[HOSTED], "sim")
    engine = in_process(server, clients)
    through = engine.transport.sessions[HOSTED] = ThroughAgent(agent, on_applied, chunk)
    for r in range(3):
        engine.run_round(r)
    assert len(copies) >= 4
    if chunk:  # the journal holds the reassembled envelopes
        assert any(len(split(p, chunk)) > 1 for p in through.payloads)
    replayed = []
    for dest, state, fields in copies:
        restarted = make_agent(dest)
        restarted.host(fresh_client(strategy), "sim")
        assert_same(restarted.client.state_dict(), state)
        assert session_fields(restarted) == fields
        assert restarted.counters["replay_diverged"] == 0
        replayed.append(restarted.counters["replayed"])
    # past each round's first task the state came from the journal, not from a checkpoint
    assert max(replayed) == (3 if strategy == "fedal" else 2)  # fedal: local_train + tau transfers; fedavg: init + train

    # the agent's path changes nothing: the same federation without agents ends in the same state
    server, plain, _ = toy_federation(strategy, tau=2)
    engine = in_process(server, plain)
    for r in range(3):
        engine.run_round(r)
    assert_same(plain[HOSTED].state_dict(), agent.client.state_dict())


def test_a_redelivered_task_after_a_restart_is_answered_from_the_replayed_cache(tmp_path, one_torch_thread):
    agent, through = run_hosted("fedal", tmp_path / "ws", rounds=2)
    last_payload, last_wire = through.payloads[-1], agent.session.last_result.payload
    restarted = make_agent(tmp_path / "ws")
    restarted.host(fresh_client("fedal"), "sim")
    assert restarted.apply_task(last_payload).payload == last_wire
    assert restarted.counters["duplicates"] == 1 and restarted.counters["tasks"] == 0


def test_round_durability_sits_out_the_round_under_way(tmp_path, one_torch_thread):
    marks: list[tuple[int, bytes, dict]] = []
    holder: dict[str, Agent] = {}

    def on_applied(payload, wire):
        agent = holder["agent"]
        if len(marks) == 0 and agent.session.round_no == 1:  # round 1's first task: copy after it
            shutil.copytree(agent.workspace, tmp_path / "crashed")
            marks.append((agent.session.round_no, payload, copy.deepcopy(load(agent.ckpt_path)["client"])))

    server, clients, _ = toy_federation("fedal", tau=2)
    agent = holder["agent"] = make_agent(tmp_path / "ws", "round")
    agent.host(clients[HOSTED], "sim")
    engine = in_process(server, clients)
    through = ThroughAgent(agent, on_applied)
    engine.transport.sessions[HOSTED] = through
    for r in range(3):
        engine.run_round(r)
    assert not (tmp_path / "ws" / "journal.bin").exists()
    (round_no, _, start_state), = marks

    restarted = make_agent(tmp_path / "crashed", "round")
    restarted.host(fresh_client("fedal"), "sim")
    assert restarted.sit_out == round_no and restarted.counters["replayed"] == 0
    assert_same(restarted.client.state_dict(), start_state)  # back at round 1's start
    rounds = [(p, decode(p).meta["round"]) for p in through.payloads]
    rest_of_round = [p for p, r in rounds if r == round_no][1:]
    declines = [restarted.apply_task(p) for p in rest_of_round]
    assert rest_of_round and all(d is not None and d.message.meta == {"declined": "sat_out", **key(p)}
                                 for d, p in zip(declines, rest_of_round))  # declined, named by its key
    assert restarted.counters["sat_out"] == len(rest_of_round) and restarted.counters["tasks"] == 0
    next_round = next(p for p, r in rounds if r == round_no + 1)
    assert restarted.apply_task(next_round) is not None  # takes part again from the next round
    assert restarted.sit_out is None and restarted.counters["tasks"] == 1


def key(payload: bytes) -> dict[str, int]:
    meta = decode(payload).meta
    return {"epoch": meta["epoch"], "seq": meta["seq"]}


def test_a_failed_journal_write_sends_nothing_and_rejoins_from_disk(tmp_path, one_torch_thread):
    agent, through = run_hosted("fedal", tmp_path / "ws", rounds=1)
    before = copy.deepcopy(agent.client.state_dict())
    fields = session_fields(agent)
    _, ref_through = run_hosted("fedal", tmp_path / "ref", rounds=2)
    next_payload = ref_through.payloads[len(through.payloads)]  # the task that comes next

    def full_disk(*_args):
        raise OSError(28, "No space left on device")

    agent.journal.append = full_disk
    assert agent.apply_task(next_payload) is None
    assert agent.counters["durability_errors"] == 1 and agent.client is None  # left, to rejoin at once
    agent.journal = Journal(agent.journal.path)
    agent.host(fresh_client("fedal"), "sim")
    assert_same(agent.client.state_dict(), before)
    assert session_fields(agent) == fields
    assert agent.apply_task(next_payload).payload == ref_through.wires[len(through.payloads)]  # as if nothing failed


def test_journal_bytes_per_round_are_one_checkpoint_plus_the_rounds_tasks(tmp_path, one_torch_thread):
    agent, through = run_hosted("fedal", tmp_path / "ws", rounds=3)
    phase_agent, _ = run_hosted("fedal", tmp_path / "phase", rounds=3, durability="phase")
    ckpt = agent.ckpt_path.stat().st_size
    for r in (1, 2):
        written = sum(n for (rnd, _ph, _k), n in agent.written.items() if rnd == r)
        tasks = sum(len(p) for p in through.payloads if decode(p).meta["round"] == r)
        assert written <= 1.2 * ckpt + tasks
        assert written < sum(n for (rnd, _ph, _k), n in phase_agent.written.items() if rnd == r)


def test_a_crash_between_a_new_checkpoint_and_the_journal_reset_ignores_the_old_journal(tmp_path, one_torch_thread):
    """What a crash leaves between the round's new checkpoint (renamed in place) and its fresh
    journal: the previous round's journal, naming the previous checkpoint. The new checkpoint
    already holds everything that journal did; replaying it again would apply tasks twice."""
    copies: list[tuple[Path, dict, tuple]] = []
    holder: dict[str, Agent] = {}

    def on_applied(_payload, wire):
        agent = holder["agent"]
        dest = tmp_path / f"copy{len(copies)}"
        shutil.copytree(agent.workspace, dest)
        copies.append((dest, copy.deepcopy(agent.client.state_dict()), copy.deepcopy(session_fields(agent))))

    server, clients, _ = toy_federation("fedal", tau=2)
    agent = holder["agent"] = make_agent(tmp_path / "ws")
    agent.host(clients[HOSTED], "sim")
    engine = in_process(server, clients)
    engine.transport.sessions[HOSTED] = ThroughAgent(agent, on_applied)
    for r in range(2):
        engine.run_round(r)
    first_of_round_1 = next(i for i, (_, _, fields) in enumerate(copies) if fields[2] == 1)
    end_of_round_0 = copies[first_of_round_1 - 1]
    crashed = tmp_path / "crashed"
    shutil.copytree(end_of_round_0[0], crashed)  # the old journal (round 0's, three tasks)
    shutil.copy(copies[first_of_round_1][0] / "checkpoint.pt", crashed / "checkpoint.pt")  # the new checkpoint
    assert len(Journal(crashed / "journal.bin").read(load(end_of_round_0[0] / "checkpoint.pt")["id"])[0]) == 3

    restarted = make_agent(crashed)
    restarted.host(fresh_client("fedal"), "sim")
    assert restarted.counters["replayed"] == 0
    assert_same(restarted.client.state_dict(), end_of_round_0[1])
    assert session_fields(restarted) == end_of_round_0[2]
    # and the journal now follows the new checkpoint: the round's first task is journaled after it
    assert restarted.journal.read(load(crashed / "checkpoint.pt")["id"]) == ([], 0)


def test_a_replay_that_does_not_reproduce_the_published_result_falls_back_to_the_checkpoint(tmp_path, one_torch_thread):
    """E.g. another torch or thread count after an upgrade: the replayed state is not the one
    that was published from, so it is not used; the agent sits the round out from its start."""
    agent, _ = run_hosted("fedal", tmp_path / "ws", rounds=2)
    ckpt = load(agent.ckpt_path)
    journal = Journal(agent.journal.path)
    records, _ = journal.read(ckpt["id"])
    assert len(records) == 3
    journal.reset(ckpt["id"])  # the same tasks, but the second one's published result was another
    for i, rec in enumerate(records):
        journal.append(rec.key, rec.payload, hashlib.sha256(b"another result").hexdigest() if i == 1 else rec.result_sha256)
    journal.close()

    restarted = make_agent(tmp_path / "ws")
    restarted.host(fresh_client("fedal"), "sim")
    assert restarted.counters["replay_diverged"] == 1 and restarted.counters["replayed"] == 0
    assert restarted.sit_out == ckpt["round_start"] == 1
    assert_same(restarted.client.state_dict(), ckpt["client"])
    assert restarted.session.last_key == tuple(ckpt["last_key"]) < records[0].key
