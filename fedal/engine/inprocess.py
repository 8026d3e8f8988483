"""The in-process transport: client sessions called directly, on a simulated clock.

Every task and result still crosses the wire envelope (encode, then decode), so the bytes
counted are those a deployment sends and a strategy cannot rely on anything that would not
survive the wire. Time is simulated: a client answers at once unless a fault says otherwise,
and a deadline passes without anyone waiting for it. Faults (seeded, reproducible):
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
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedal.data import ArrayDataset
from fedal.engine.rounds import RoundEngine
from fedal.engine.settings import PhaseSettings
from fedal.engine.transport import Arrival, Transport
from fedal.protocol import Message, decode
from fedal.session import ClientSession, NewTask, evaluation_reply
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


class InProcessTransport(Transport):
    def __init__(self, run_id: str, sessions: Mapping[str, ClientSession], phases: PhaseSettings,
                 phase_kinds: Mapping[str, str], faults: Faults | None = None, vectorize: bool = False):
        self.run_id = run_id
        self.vectorize = vectorize
        self._waiting: list[tuple[str, Message, tuple[str, int, int], bool]] = []  # vectorize: not yet computed
        self.stacked_tasks = 0  # tasks computed in a stacked group
        self.sessions = dict(sessions)
        self.settings = phases
        self.phase_kinds = dict(phase_kinds)
        self.faults = faults or Faults()
        self.clock = 0.0
        self._queue: list[tuple[float, int, Arrival]] = []
        self._order = itertools.count()
        rng = np.random.default_rng([self.faults.seed, 0xD40])
        self._drop_rng = np.random.default_rng([self.faults.seed, 0xD0F])
        ids = sorted(self.sessions)
        n_late = int(round(self.faults.stragglers * len(ids)))
        self.stragglers = {ids[i] for i in rng.permutation(len(ids))[:n_late]}
        self._dropped: dict[tuple[str, int, int], bool] = {}
        self._busy_until: dict[tuple[str, int, int], float] = {}
        self.dropped = 0
        self.late = 0

    def start(self, should_stop: Callable[[], bool] | threading.Event) -> bool:
        for cid in self.sessions:
            self._arrive(0.0, Arrival("status", cid, self.run_id, json.dumps({"state": "online", "ts": 0.0}).encode()))
        return True

    def now(self) -> float:
        return self.clock

    def exhausted(self) -> bool:
        return not self._queue and not self._waiting

    def send(self, client_id: str, payload: bytes) -> int:
        task = decode(payload)
        key = (client_id, int(task.meta["epoch"]), int(task.meta["seq"]))  # type: ignore[arg-type]
        if task.phase == "evaluate":  # a measurement, not part of the run: never faulted
            return self._deliver(client_id, task, key, len(payload), faulted=False)
        if key not in self._dropped:  # decided once per client and phase, in sending order
            self._dropped[key] = bool(self.faults.dropout and self._drop_rng.random() < self.faults.dropout)
            self.dropped += self._dropped[key]
        if self._dropped[key]:
            return len(payload)
        return self._deliver(client_id, task, key, len(payload), faulted=True)

    def _deliver(self, client_id: str, task: Message, key: tuple[str, int, int], size: int, faulted: bool) -> int:
        if self._busy_until.get(key, -1.0) > self.clock:
            return size  # a straggler still working on this task: the re-send waits in its inbox
        if self.vectorize and group_step(self.sessions[client_id].client) is not None \
                and all(w[0] != client_id for w in self._waiting):
            self._waiting.append((client_id, task, key, faulted))
            return size
        self._flush()
        self._settle(client_id, task, key, faulted, self.sessions[client_id].on_task(task))
        return size

    def _settle(self, client_id: str, task: Message, key: tuple[str, int, int], faulted: bool,
                result: bytes | None) -> None:
        """A computed result arrives: now, or after the deadline for a straggler."""
        if result is not None:
            at = self.clock
            if faulted and client_id in self.stragglers and key[2] % self.faults.straggle_every == 0 \
                    and key not in self._busy_until:
                train = self.phase_kinds.get(task.phase) == "train"
                at += (self.settings.train_deadline_s if train else self.settings.deadline_s) + 1.0
                self._busy_until[key] = at
                self.late += 1
            self._arrive(at, Arrival("result", client_id, self.run_id, result, wire_bytes=len(result)))

    def _flush(self) -> None:
        """Compute the waiting tasks: stackable groups together, everything else one by one."""
        waiting, self._waiting = self._waiting, []
        groups: dict[tuple, list[tuple[str, Message, tuple[str, int, int], bool]]] = {}
        for item in waiting:
            client_id, task, key, faulted = item
            session = self.sessions[client_id]
            verdict = session.admit(task)
            if not isinstance(verdict, NewTask):  # stale, or a repeat answered from the cache
                self._settle(client_id, task, key, faulted, verdict)
                continue
            session.prepare(task)
            client = session.client
            group = (type(client), task.phase, task.meta.get("round"), task.meta.get("iteration"), layout_key(client.model))
            groups.setdefault(group, []).append(item)
        for items in groups.values():
            sessions = [self.sessions[client_id] for client_id, *_ in items]
            tasks = [task for _, task, *_ in items]
            try:
                if len(items) < 2:
                    raise NotStackable("a group of one")
                step = group_step(sessions[0].client)
                assert step is not None  # only such clients wait
                results = step([s.client for s in sessions], tasks)
                self.stacked_tasks += len(items)
            except NotStackable:  # nothing was changed: client by client, as without vectorize
                results = [s.compute(task) for s, task in zip(sessions, tasks)]
            for s, (client_id, task, key, faulted), result in zip(sessions, items, results):
                self._settle(client_id, task, key, faulted, s.answer(task, result))

    def receive(self, timeout_s: float) -> Arrival | None:
        self._flush()
        if self._queue and self._queue[0][0] <= self.clock + timeout_s:
            at, _, arrival = heapq.heappop(self._queue)
            self.clock = max(self.clock, at)
            return arrival
        self.clock += timeout_s
        return None

    def _arrive(self, at: float, arrival: Arrival) -> None:
        heapq.heappush(self._queue, (at, next(self._order), arrival))


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
    engine = RoundEngine(server, transport, run_id=run_id, phases=phases, phase_kinds=phase_kinds, rounds=rounds,
                         eval_every=eval_every, global_metrics=global_metrics, instance=run_id)
    transport.start(lambda: False)
    engine.wait_for_clients(phases.start_timeout_s)
    return engine
