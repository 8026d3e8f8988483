"""The in-process transport: client sessions called directly, on a simulated clock.

Every task and result crosses the wire as a Packet: the receiver gets what decoding it would
give (the envelope's checks, its own copy of every tensor), so a strategy cannot rely on
anything that would not survive the wire, and the bytes counted are those a deployment sends,
computed from the tensor sizes instead of encoding. Time is simulated: a client answers at once
unless a fault says otherwise, and a deadline passes without anyone waiting for it. Faults (seeded, reproducible):
- dropout P: each client misses each phase with probability P (its task and every re-send of
  it are lost), as a device that is offline for that phase;
- evaluation tasks are measurement, not part of the run: they are never faulted;
- stragglers F: that fraction of the clients (a fixed, seeded choice) answers every k-th phase
  only after the phase's deadline; the work is done, the answer comes too late.
With `vectorize`, the tasks sent before the engine next waits are computed together: clients
whose half has a group step (`fedal.strategies.group_step`) and share a phase, round and
iteration run as one stacked model (fedal/strategies/stacked.py); the others, and any group it
refuses (NotStackable), run one by one as without it. Sessions admit, prepare and answer each
task exactly as on the per-client path.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import logging
import threading
import weakref
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedal.data import ArrayDataset
from fedal.engine.rounds import RoundEngine
from fedal.engine.saved import arrival_restored, arrival_saved
from fedal.engine.settings import PhaseSettings
from fedal.engine.transport import Arrival, Transport
from fedal.protocol import Message, Packet
from fedal.session import ClientSession, NewTask, TaskRefused, evaluation_reply, missed_step_decline
from fedal.strategies import ClientHalf, ServerHalf, group_step
from fedal.strategies.stacked import NotStackable, layout_key


@dataclass(frozen=True)
class Faults:
    dropout: float = 0.0
    stragglers: float = 0.0
    straggle_every: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.stragglers <= 1.0:
            raise ValueError(f"stragglers must be in [0, 1], got {self.stragglers}")
        if self.straggle_every < 1:
            raise ValueError(f"straggle_every must be >= 1, got {self.straggle_every}")

    @property
    def any(self) -> bool:
        return self.dropout > 0 or self.stragglers > 0


# a task sent and not yet computed: (client, task as received, (client, epoch, seq), faulted)
Pending = tuple[str, Message, tuple[str, int, int], bool]
log = logging.getLogger(__name__)


class ClientStatesUnavailable(RuntimeError):
    """A transport could not gather its clients' states now (on Ray: an actor lost twice)."""


class SimulatedTransport(Transport):
    """The simulated clock, the seeded faults and the arrival queue; computing the tasks is the
    subclass's (`_compute`): here in this process, or elsewhere (fedal/sim/ray_backend.py).

    Tasks are computed when the engine next waits (`receive`), all that were sent since, in the
    order they were sent; the clock does not move in between, so this is the same as computing
    each at once."""

    def __init__(self, run_id: str, client_ids: Sequence[str], phases: PhaseSettings,
                 phase_kinds: Mapping[str, str], faults: Faults | None = None):
        self.run_id = run_id
        self.client_ids = list(client_ids)
        self._waiting: list[Pending] = []
        self._waiting_ids: set[str] = set()  # the clients in _waiting (a send asks once per task)
        self.settings = phases
        self.phase_kinds = dict(phase_kinds)
        self.faults = faults or Faults()
        self.clock = 0.0
        self._queue: list[tuple[float, int, Arrival]] = []
        self._order = itertools.count()
        rng = np.random.default_rng([self.faults.seed, 0xD40])
        self._drop_rng = np.random.default_rng([self.faults.seed, 0xD0F])
        ids = sorted(self.client_ids)
        n_late = int(round(self.faults.stragglers * len(ids)))
        self.stragglers = {ids[i] for i in rng.permutation(len(ids))[:n_late]}
        # per (client, epoch, seq) of the phase under way (those of closed phases are let go)
        self._dropped: dict[tuple[str, int, int], bool] = {}
        self._busy_until: dict[tuple[str, int, int], float] = {}
        self._phase: tuple[int, int] = (-1, -1)  # (epoch, seq) of the latest faulted phase
        self.dropped = 0
        self.late = 0
        self.stacking = Stacking()  # how the clients' tasks were computed (vectorized)
        self.counters: Counter[str] = Counter()  # refused_tasks; on Ray also actor_failures, lost_tasks

    @abstractmethod
    def _compute(self, items: list[Pending]) -> list[Packet | None]:
        """Each task's result, None for one that gets no answer (stale; lost)."""

    def start(self, should_stop: Callable[[], bool] | threading.Event) -> bool:
        for cid in self.client_ids:
            self._arrive(0.0, Arrival("status", cid, self.run_id, json.dumps({"state": "online", "ts": 0.0}).encode()))
        return True

    def now(self) -> float:
        return self.clock

    def exhausted(self) -> bool:
        return not self._queue and not self._waiting

    def send(self, client_id: str, packet: Packet) -> int:
        meta = packet.message.meta  # the engine's own: epoch and seq are ints
        key = (client_id, int(meta["epoch"]), int(meta["seq"]))  # type: ignore[arg-type]
        if packet.message.phase == "evaluate":  # a measurement, not part of the run: never faulted
            return self._deliver(client_id, packet, key, faulted=False)
        if key[1:] > self._phase:  # a new phase: the closed ones' tasks are never sent again
            self._phase = key[1:]
            self._dropped = {k: v for k, v in self._dropped.items() if k[1:] >= self._phase}
            self._busy_until = {k: v for k, v in self._busy_until.items() if k[1:] >= self._phase}
        if key not in self._dropped:  # decided once per client and phase, in sending order
            self._dropped[key] = bool(self.faults.dropout and self._drop_rng.random() < self.faults.dropout)
            self.dropped += self._dropped[key]
        if self._dropped[key]:
            return packet.size
        return self._deliver(client_id, packet, key, faulted=True)

    def _deliver(self, client_id: str, packet: Packet, key: tuple[str, int, int], faulted: bool) -> int:
        if self._busy_until.get(key, -1.0) > self.clock:
            return packet.size  # a straggler still working on this task: the re-send waits in its inbox
        if client_id in self._waiting_ids:
            self._flush()  # a client takes its tasks one after the other
        self._waiting.append((client_id, packet.received(), key, faulted))
        self._waiting_ids.add(client_id)
        return packet.size

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        self._waiting_ids = set()
        if waiting:
            for (client_id, task, key, faulted), result in zip(waiting, self._compute(waiting)):
                self._settle(client_id, task, key, faulted, result)

    def _settle(self, client_id: str, task: Message, key: tuple[str, int, int], faulted: bool,
                result: Packet | None) -> None:
        """A computed result arrives: now, or after the deadline for a straggler."""
        if result is not None:
            at = self.clock
            if faulted and client_id in self.stragglers and key[2] % self.faults.straggle_every == 0 \
                    and key not in self._busy_until:
                train = self.phase_kinds.get(task.phase) == "train"
                at += (self.settings.train_deadline_s if train else self.settings.deadline_s) + 1.0
                self._busy_until[key] = at
                self.late += 1
            self._arrive(at, Arrival("result", client_id, self.run_id, wire_bytes=result.size, message=result.received()))

    def receive(self, timeout_s: float) -> Arrival | None:
        self._flush()
        if self._queue and self._queue[0][0] <= self.clock + timeout_s:
            at, _, arrival = heapq.heappop(self._queue)
            self.clock = max(self.clock, at)
            return arrival
        self.clock += timeout_s
        return None

    def arrived_by(self, t: float, clients: Set[str]) -> Arrival | None:
        """The earliest queued result from one of `clients` due at or before `t`. receive() takes
        every due arrival before the clock moves on, so at a deadline there is none unless a
        subclass computes results late; kept exact all the same."""
        self._flush()
        due = [entry for entry in self._queue
               if entry[0] <= t and entry[2].kind == "result" and entry[2].client in clients]
        if not due:
            return None
        entry = min(due)
        self._queue.remove(entry)
        heapq.heapify(self._queue)
        self.clock = max(self.clock, entry[0])
        return entry[2]

    def _arrive(self, at: float, arrival: Arrival) -> None:
        heapq.heappush(self._queue, (at, next(self._order), arrival))

    # -- a simulation's checkpoint, between rounds (fedal/engine/saved.py) -------------------------
    def saved(self) -> dict[str, Any]:
        """The clock, the queued arrivals (a straggler's late result), the fault draws and the
        counts, as tensors and plain data: what the rounds after a checkpoint depend on."""
        self._flush()  # between rounds nothing is waiting; computed now if it were
        order = next(self._order)
        self._order = itertools.count(order)
        return {"clock": self.clock, "order": order,
                "queue": [[at, n, arrival_saved(a)] for at, n, a in sorted(self._queue)],
                "drop_rng": self._drop_rng.bit_generator.state,
                "phase": list(self._phase),
                "dropped": [[*key, v] for key, v in self._dropped.items()],
                "busy_until": [[*key, v] for key, v in self._busy_until.items()],
                "faults": {"dropped": self.dropped, "late": self.late},
                "counters": dict(self.counters),
                "stacking": {"stacked": self.stacking.stacked, "per_client": dict(self.stacking.per_client)}}

    def restore_saved(self, state: dict[str, Any]) -> None:
        self.clock = float(state["clock"])
        self._order = itertools.count(int(state["order"]))
        self._queue = [(float(at), int(n), arrival_restored(a)) for at, n, a in state["queue"]]
        heapq.heapify(self._queue)
        self._drop_rng.bit_generator.state = state["drop_rng"]
        self._phase = (int(state["phase"][0]), int(state["phase"][1]))
        self._dropped = {(c, int(e), int(q)): bool(v) for c, e, q, v in state["dropped"]}
        self._busy_until = {(c, int(e), int(q)): float(v) for c, e, q, v in state["busy_until"]}
        self.dropped, self.late = int(state["faults"]["dropped"]), int(state["faults"]["late"])
        self.counters = Counter(state["counters"])
        self.stacking = Stacking(int(state["stacking"]["stacked"]), Counter(state["stacking"]["per_client"]))

    @abstractmethod
    def client_states(self) -> dict[str, dict[str, Any]]:
        """Each client's state and its session's (ClientHalf.state_dict, ClientSession.saved)."""

    @abstractmethod
    def load_client_states(self, states: Mapping[str, dict[str, Any]]) -> None:
        """The clients and their sessions as `client_states()` gave them."""


@dataclass
class Stacking:
    """How a vectorized run computed its clients' tasks: in stacked groups, or client by client
    and why (NotStackable's reason; "no group step": a half without one, e.g. under differential
    privacy). Reported in the results, so a run that silently fell back shows it."""

    stacked: int = 0
    per_client: Counter[str] = field(default_factory=Counter)
    MAX_REASONS = 20  # distinct reasons kept; the rest count as "other"

    def add(self, other: Stacking) -> None:
        self.stacked += other.stacked
        for reason, n in other.per_client.items():
            self.refused(reason, n)

    def refused(self, reason: str, tasks: int) -> None:
        if reason not in self.per_client and len(self.per_client) >= self.MAX_REASONS:
            reason = "other"
        self.per_client[reason] += tasks

    def summary(self) -> dict[str, Any]:
        return {"stacked_tasks": self.stacked, "per_client_tasks": sum(self.per_client.values()),
                "per_client_reasons": dict(self.per_client.most_common())}


class InProcessTransport(SimulatedTransport):
    """Client sessions in this process, called directly."""

    def __init__(self, run_id: str, sessions: Mapping[str, ClientSession], phases: PhaseSettings,
                 phase_kinds: Mapping[str, str], faults: Faults | None = None, vectorize: bool = False):
        super().__init__(run_id, list(sessions), phases, phase_kinds, faults)
        self.sessions = dict(sessions)
        self.vectorize = vectorize

    @property
    def stacked_tasks(self) -> int:
        """Tasks computed in a stacked group."""
        return self.stacking.stacked

    def client_states(self) -> dict[str, dict[str, Any]]:
        return client_states(self.sessions)

    def load_client_states(self, states: Mapping[str, dict[str, Any]]) -> None:
        load_client_states(self.sessions, states)

    def _compute(self, items: list[Pending]) -> list[Packet | None]:
        answers, stacking = answer_tasks(self.sessions, [(cid, task) for cid, task, *_ in items], self.vectorize)
        self.stacking.add(stacking)
        return count_refusals(self.counters, items, answers)


_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _layout(model: torch.nn.Module) -> tuple:
    """`layout_key` of a model, read once: only a hint for grouping (a stack checks its models'
    layouts itself, so a model changed since is refused there and runs client by client)."""
    key = _LAYOUTS.get(model)
    if key is None:
        key = _LAYOUTS[model] = layout_key(model)
    return key


# Clients of one architecture stack in groups of at most this many: a group's activations grow
# with it (a wide CNN's 333 clients at batch 32 hold 54 MB a layer), and once they no longer fit
# in the CPU's caches each stacked layer runs at memory speed (N = 1000: 25 s a round with groups
# of 333, 15 s with groups of 64; at N = 100, groups of 33-34, no difference).
MAX_GROUP = 64


def group_parts(members: list[int]) -> list[list[int]]:
    """`members` in consecutive parts of at most MAX_GROUP, as equal in size as can be (the same
    clients give the same parts every task, so each part keeps its stack)."""
    parts = -(-len(members) // MAX_GROUP)
    return [members[i * len(members) // parts:(i + 1) * len(members) // parts] for i in range(parts)]


def compute_tasks(sessions: Mapping[str, ClientSession], items: Sequence[tuple[str, Message]],
                  vectorize: bool = False) -> tuple[list[Packet | None], list[TaskRefused | None], Stacking]:
    """Each task's result through its client's session (None: stale, or refused), in order; for
    each task refused, why (its TaskRefused, else None); and how they were computed (Stacking).
    With `vectorize`, the new tasks of clients whose half has a group step run together per
    (class, phase, round, iteration, architecture), in parts of at most MAX_GROUP clients; a group
    the step refuses (NotStackable: nothing changed) and everything else run one by one. A task
    refused costs only itself: its session is left as before it (a replay guard that went back is
    undone, as on_task does for one), every other task is computed, stacked where it would have
    been. A client failing at a task it took (refused_for_cause: not a refusal) stops it all,
    every session it did not answer left as before its task, and is raised."""
    results: list[Packet | None] = [None] * len(items)
    refusals: list[TaskRefused | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    stacking = Stacking()
    prepared: list[ClientSession] = []  # admitted and prepared; answering one forgets its undo
    try:
        _compute_tasks(sessions, items, vectorize, results, refusals, groups, stacking, prepared)
    except TaskRefused:
        for session in prepared:
            session.refused_after_prepare()
        raise
    return results, refusals, stacking


def _refused(refusals: list[TaskRefused | None], k: int, exc: TaskRefused, session: ClientSession) -> None:
    """Task k refused: its session back to before it; a client's own failure raised on."""
    if not refused_for_cause(exc):
        raise exc
    session.refused_after_prepare()
    refusals[k] = exc


def _compute_tasks(sessions: Mapping[str, ClientSession], items: Sequence[tuple[str, Message]], vectorize: bool,
                   results: list[Packet | None], refusals: list[TaskRefused | None], groups: dict[tuple, list[int]],
                   stacking: Stacking, prepared: list[ClientSession]) -> None:
    for k, (client_id, task) in enumerate(items):
        session = sessions[client_id]
        try:
            if not vectorize or task.phase == "evaluate" or group_step(session.client) is None:
                if vectorize and task.phase != "evaluate":  # evaluation is no step of the client's half
                    stacking.refused("no group step (differential privacy: per-sample clipping runs per client)"
                                     if session.client.private is not None else "no group step", 1)
                results[k] = session.on_task(task)
                continue
            verdict = session.admit(task)
            if not isinstance(verdict, NewTask):  # stale, or a repeat answered from the cache
                results[k] = verdict
                continue
            prepared.append(session)
            session.prepare(task)
        except TaskRefused as exc:
            _refused(refusals, k, exc, session)
            continue
        client = session.client
        group = (type(client), task.phase, task.meta.get("round"), task.meta.get("iteration"), _layout(client.model))
        groups.setdefault(group, []).append(k)
    for ks in [part for members in groups.values() for part in group_parts(members)]:
        group_sessions = [sessions[items[k][0]] for k in ks]
        tasks = [items[k][1] for k in ks]
        try:
            if len(ks) < 2:
                raise NotStackable("a group of one (no other client of this architecture in the phase)")
            step = group_step(group_sessions[0].client)
            assert step is not None  # only such clients are grouped
            answers = step([s.client for s in group_sessions], tasks)
            stacking.stacked += len(ks)
        except NotStackable as exc:  # nothing was changed: client by client, as without vectorize
            stacking.refused(str(exc), len(ks))
            for k, s, task in zip(ks, group_sessions, tasks):  # each answered once computed
                try:
                    results[k] = s.answer(task, s.compute(task))
                except TaskRefused as refusal:
                    _refused(refusals, k, refusal, s)
            continue
        for k, s, task, answer in zip(ks, group_sessions, tasks, answers):
            results[k] = s.answer(task, answer)


Answer = tuple[Packet | None, str | None]


def answer_tasks(sessions: Mapping[str, ClientSession], items: Sequence[tuple[str, Message]],
                 vectorize: bool = False) -> tuple[list[Answer], Stacking]:
    """compute_tasks for every transport of a simulation: each task's result (None: stale, or
    refused) and, for a task refused, why. A refusal costs only its own task, as on an agent (the
    other tasks stay stacked as they would have been); a task that builds on a step its client no
    longer has is declined (missed_step_decline), as an agent declines it."""
    results, refusals, stacking = compute_tasks(sessions, items, vectorize)
    out: list[Answer] = []
    for (_cid, task), result, refusal in zip(items, results, refusals):
        if refusal is None:
            out.append((result, None))
            continue
        decline = missed_step_decline(task, refusal)
        out.append((decline, None if decline is not None else f"{refusal.kind}: {refusal}"))
    return out, stacking


def client_states(sessions: Mapping[str, ClientSession]) -> dict[str, dict[str, Any]]:
    """Each session's client state and its own (ClientHalf.state_dict, ClientSession.saved)."""
    return {cid: {"client": s.client.state_dict(), "session": s.saved()} for cid, s in sessions.items()}


def check_states_cover(client_ids: Iterable[str], states: Mapping[str, Any]) -> None:
    missing = sorted(set(client_ids) - set(states))
    if missing:
        raise ValueError(f"no saved state for client(s) {', '.join(missing[:5])}")


def load_client_states(sessions: Mapping[str, ClientSession], states: Mapping[str, dict[str, Any]]) -> None:
    """Each session's client and session state from `states` (client_states)."""
    check_states_cover(sessions, states)
    for cid, session in sessions.items():
        session.client.load_state_dict(states[cid]["client"])
        session.restore_saved(states[cid]["session"])


def refused_for_cause(exc: TaskRefused) -> bool:
    """A task the client will not apply (its own checks say why: ValueError, KeyError; or the
    session's), not the client failing at one it took (a bug, out of memory: RuntimeError and
    the like), which stops a simulation with its error on either backend, as it always did
    in-process (an agent refuses both: a device's service must not stop)."""
    cause = exc.__cause__
    return cause is None or isinstance(cause, (ValueError, KeyError))


def count_refusals(counters: Counter[str], items: Sequence[Pending], answers: Sequence[Answer]) -> list[Packet | None]:
    """The results to deliver; each refused task counted (`refused_tasks`) and said. It gets no
    answer: its phase closes by the engine's quorum and deadline, as in a deployment."""
    for (cid, task, *_rest), (_result, refused) in zip(items, answers):
        if refused is not None:
            counters["refused_tasks"] += 1
            log.warning("client %s refused %s: %s", cid, task.phase, refused)
    return [result for result, _refused in answers]


def in_process_engine(server: ServerHalf, clients: Mapping[str, ClientHalf], *, phase_kinds: Mapping[str, str],
                      rounds: int = 1, eval_every: int | None = None,
                      tests: Mapping[str, tuple[ArrayDataset | None, ArrayDataset | None]] | None = None,
                      faults: Faults | None = None, phases: PhaseSettings | None = None,
                      global_metrics: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                      run_id: str = "sim", vectorize: bool = False) -> RoundEngine:
    """A round engine over in-process client sessions, started, every client online.
    `tests`: per client its common and local test sets, for the evaluate phase (none: no evaluation)."""
    missing = set(server.client_ids) - set(clients)
    if missing:
        raise ValueError(f"no client half for {sorted(missing)}")
    phases = phases or PhaseSettings()
    sessions = {}
    for cid in server.client_ids:
        test, local_test = (tests or {}).get(cid, (None, None))
        client = clients[cid]
        sessions[cid] = ClientSession(run_id, cid, client, instance=run_id,
                                      evaluate=functools.partial(evaluation_reply, client, test=test, local_test=local_test))
    transport = InProcessTransport(run_id, sessions, phases, phase_kinds, faults, vectorize=vectorize)
    return simulated_round_engine(server, transport, phases, phase_kinds, rounds, eval_every, global_metrics)


def simulated_round_engine(server: ServerHalf, transport: SimulatedTransport, phases: PhaseSettings,
                           phase_kinds: Mapping[str, str], rounds: int, eval_every: int | None,
                           global_metrics: Callable[[dict[str, Any]], dict[str, Any]] | None) -> RoundEngine:
    """The round engine over a simulated transport, started, every client online."""
    engine = RoundEngine(server, transport, run_id=transport.run_id, phases=phases, phase_kinds=phase_kinds,
                         rounds=rounds, eval_every=eval_every, global_metrics=global_metrics,
                         instance=transport.run_id)
    transport.start(lambda: False)
    engine.wait_for_clients(phases.start_timeout_s)
    return engine
