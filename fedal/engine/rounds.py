"""The round engine: drives a strategy's server half phase by phase over any Transport.

Generic: it knows deadlines, quorum, re-sending, deduplication by (epoch, seq), validation,
evaluation and accounting, never an algorithm and never a network. Each phase gets a sequence
number (epoch, seq); the epoch grows with every coordinator start, so clients can tell a
re-sent task from a stale one. A phase closes when every client answered or declined, or at its
deadline once the quorum of the clients that did not decline answered; late clients are left
out of that phase and rejoin with the next.
`fedal simulate` runs it over the in-process transport, the coordinator over MQTT.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import Any

from fedal.engine.accounting import ClientInfo, PhaseState, PhaseStats
from fedal.engine.health import validate_health
from fedal.engine.results import evaluation_summary
from fedal.engine.settings import PhaseSettings
from fedal.engine.transport import Arrival, Transport
from fedal.log_limit import RateLimitedLog, clip
from fedal.protocol import EnvelopeError, Message, Packet, answering, decode, encode
from fedal.strategies import InvalidResult, PhaseTasks, ServerHalf

log = logging.getLogger("fedal.engine")
POLL_S = 0.05
DRAIN_MIN_S = 2.0  # at a deadline, the least time given to answers that came in time (see _take_arrived)
MAX_STATUS_BYTES = 16 * 1024  # a client's status with its health report is well under 2 KiB
MAX_DECLINE_REASON = 64  # characters of a declined task's reason ("sat_out")
MAX_REJECT_REASONS = 200  # the latest reasons a round keeps (all are counted)


class Stopped(Exception):
    """Raised inside the round loop when stop() was called; the run ends as `stopped`."""


class StrategyError(RuntimeError):
    """A strategy's validate() failed with something other than InvalidResult: a bug of ours,
    not a client's bad input. It stops the run (with its traceback) instead of being counted."""


def _no_event(kind: str, **fields: Any) -> None:
    return None


class RoundEngine:
    """One run's rounds. The owner (the simulation runner or the coordinator's service) decides
    when rounds run and what happens between them (persistence, manifests, progress)."""

    def __init__(self, server: ServerHalf, transport: Transport, *, run_id: str, phases: PhaseSettings,
                 phase_kinds: Mapping[str, str], rounds: int, eval_every: int | None = 1,
                 global_metrics: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 notify: Callable[..., None] = _no_event, on_reconnect: Callable[[], None] | None = None,
                 on_pause: Callable[[], None] | None = None, instance: str = "", epoch: int = 0):
        self.server = server
        self.transport = transport
        self.run_id = run_id
        self.settings = phases
        self.phase_kinds = dict(phase_kinds)
        self.rounds = rounds
        self.eval_every = eval_every
        self.global_metrics = global_metrics
        self.notify = notify
        self.on_reconnect = on_reconnect
        self.on_pause = on_pause  # called when a pause point is reached (the owner pauses the run)
        self.pause_points = list(phases.pause_at)  # each is dropped once it held the run
        past = [p.label() for p in self.pause_points if p.round > rounds]
        if past:
            raise ValueError(f"phases.pause_at: {', '.join(past)} is past the run's {rounds} rounds")
        self.held_before: dict[str, Any] | None = None  # the phase a paused run holds before
        self.held_s = 0.0  # time held by pauses, all rounds: a round's wall_s leaves it out
        self.instance = instance
        self.epoch = epoch
        self.seq = 0
        self.client_ids = list(server.client_ids)
        self.clients = {cid: ClientInfo() for cid in self.client_ids}
        self.counters: Counter[str] = Counter()
        self.reject_reasons: Counter[str] = Counter()  # the rejected messages by why
        self.lock = threading.RLock()  # what the API reads (clients, counters, current) is changed under it
        self.stop_event = threading.Event()
        self.resume_event = threading.Event()  # cleared while paused
        self.resume_event.set()
        self.current: PhaseState | None = None
        self.connects = 0
        # this round's reasons (the latest, for tests and logs) and how many there were
        self.round_rejects: deque[str] = deque(maxlen=MAX_REJECT_REASONS)
        self.round_rejected = 0
        self._reject_log = RateLimitedLog(log, "rejected messages", burst=10, rate_per_s=0.5)  # per client
        self._health_warned: dict[str, str] = {}  # the last problem logged per client

    # -- control -----------------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()
        self.resume_event.set()

    def pause(self) -> None:
        """Hold before the next phase; open phases finish, clients keep their state."""
        self.resume_event.clear()

    def resume(self) -> None:
        self.resume_event.set()

    def wait_for_clients(self, timeout_s: float) -> None:
        """Let the fleet come online before the first task goes out (up to timeout_s)."""
        deadline = self.transport.now() + timeout_s
        while self.transport.now() < deadline and not all(i.online for i in self.clients.values()):
            if self.transport.exhausted():
                break
            self.pump()
        offline = sorted(c for c, i in self.clients.items() if not i.online)
        if offline:
            log.info("starting without %s (not online after %.0f s)", offline, timeout_s)

    # -- rounds and phases -------------------------------------------------------------------
    def run_round(self, r: int) -> dict[str, Any]:
        t0, held0 = time.monotonic(), self.held_s
        self.round_rejects.clear()
        self.round_rejected = 0
        up0, down0 = self._bytes()
        t = time.monotonic()
        phase: PhaseTasks | None = self.server.begin_round(r)
        stats = PhaseStats()
        while phase is not None:
            state = self.run_phase(phase, computed_from=t)
            stats.add(state)
            t = time.monotonic()
            phase = self.server.collect(phase, state.results)
        up1, down1 = self._bytes()
        record: dict[str, Any] = {"round": r + 1, "bytes_up": up1 - up0, "bytes_down": down1 - down0}
        if self.eval_every is not None and ((r + 1) % self.eval_every == 0 or r + 1 == self.rounds):
            record.update(self._evaluate(r, stats))
        privacy = self._privacy()
        if privacy:
            record["privacy"] = privacy
        record["rejected"] = self.round_rejected
        record["server"] = self.server.round_metrics()
        record["phases"] = stats.summary()
        record["wall_s"] = round(time.monotonic() - t0 - (self.held_s - held0), 4)  # a pause is no round's time
        for point in [p for p in self.pause_points if p.round == r + 1]:  # a phase this round never had: a typo
            self.pause_points.remove(point)
            log.warning("phases.pause_at: round %d had no phase matching %s; it never paused the run", r + 1, point.label())
        return record

    def _privacy(self) -> dict[str, Any] | None:
        """Each client's epsilon as it last reported it (clients that train with differential
        privacy report it with every training result), and who stopped at its budget."""
        with self.lock:
            eps = [self.clients[c].epsilon for c in self.client_ids]
            exhausted = [c for c in self.client_ids if self.clients[c].dp_exhausted]
            sigma = [self.clients[c].noise_multiplier for c in self.client_ids]
        if all(e is None for e in eps):
            return None
        return {"epsilon": eps, "exhausted": exhausted, "noise_multiplier": sigma}

    def _evaluate(self, r: int, stats: PhaseStats) -> dict[str, Any]:
        tasks = {cid: Message({"phase": "evaluate", "round": r, "iteration": 0}) for cid in self.client_ids}
        state = self.run_phase(PhaseTasks("evaluate", r, 0, tasks))  # after the round's byte count
        stats.add(state)
        accs = [self._reported(state, c, "acc") for c in self.client_ids]
        local = [self._reported(state, c, "local_acc") for c in self.client_ids]
        with self.lock:
            for cid, acc, local_acc in zip(self.client_ids, accs, local):
                info = self.clients[cid]
                info.last_acc = acc if acc is not None else info.last_acc
                info.last_local_acc = local_acc if local_acc is not None else info.last_local_acc
        summary = evaluation_summary(accs, local)
        return {**summary, **(self.global_metrics(summary) if self.global_metrics else {})}

    @staticmethod
    def _reported(state: PhaseState, cid: str, key: str) -> float | None:
        """A client's reported accuracy (validated on arrival), None if it did not answer."""
        value = state.results[cid].meta.get(key) if cid in state.results else None
        return None if value is None else float(value)

    def run_phase(self, phase: PhaseTasks, computed_from: float | None = None) -> PhaseState:
        """computed_from: when the server half started producing `phase` (time.monotonic)."""
        compute_s = 0.0 if computed_from is None else time.monotonic() - computed_from
        point = next((p for p in self.pause_points if p.matches(phase.round, phase.phase, phase.iteration)), None)
        if point is not None:
            self.pause_points.remove(point)
            log.info("pausing before round %d %s iteration %d (phases.pause_at: %s)", phase.round + 1, phase.phase,
                     phase.iteration, point.label())
            (self.on_pause or self.pause)()
        if not self.resume_event.is_set():
            with self.lock:
                self.held_before = {"round": phase.round + 1, "phase": phase.phase, "iteration": phase.iteration}
            held_from = time.monotonic()
            while not self.resume_event.is_set():  # paused: keep handling messages, send nothing new
                self.pump()
                computed_from = None  # a pause is neither compute nor network time
            with self.lock:
                self.held_before = None
                self.held_s += time.monotonic() - held_from
            if self.stop_event.is_set():  # stop() releases the hold too: the held phase is never sent
                raise Stopped()
        self.seq += 1
        key = (self.epoch, self.seq)
        packets = {}
        for cid, task in phase.tasks.items():
            # addressed by its topic; the instance tells a fresh start of the run from an earlier one
            meta = {**task.meta, "instance": self.instance, "epoch": key[0], "seq": key[1]}
            packets[cid] = Packet(Message(meta, task.tensors))  # encoded once, where a link needs bytes
        state = PhaseState(phase, key, packets, set(phase.tasks), started=self.transport.now(),
                           wall_started=time.time(), compute_s=compute_s)
        wall_from = time.monotonic() if computed_from is None else computed_from
        with self.lock:
            self.current = state
        self.notify("phase", phase=phase.phase, round=phase.round + 1, iteration=phase.iteration,
                    clients=len(phase.tasks))
        for cid, packet in packets.items():
            self._send(cid, packet)
        train = self.phase_kinds.get(phase.phase) == "train"
        deadline = state.started + (self.settings.train_deadline_s if train else self.settings.deadline_s)
        last_resend = self.transport.now()
        while state.pending:  # answered or declined, a client is no longer pending
            self.pump()
            now = self.transport.now()
            if now >= deadline:
                # answers that came in time, still waiting behind others (for at most a tenth of
                # the phase's time, two seconds at least)
                self._take_arrived(state, deadline, max(DRAIN_MIN_S, 0.1 * (deadline - state.started)))
                if not state.pending:
                    break
                # the quorum counts the clients that did not decline: the others will not answer
                need = math.ceil(self.settings.quorum * (len(phase.tasks) - len(state.declined)))
                if len(state.results) >= need or self.transport.exhausted():
                    if len(state.results) < need:
                        self.counters["quorum_missed"] += 1
                    break
            if now - last_resend >= self.settings.resend_s:
                last_resend = now
                for cid in sorted(state.pending):
                    if self.clients[cid].online:
                        self._send(cid, packets[cid])
        state.wall_s = time.monotonic() - wall_from
        with self.lock:
            self.current = None  # closed: a late answer is stale, a client back online gets no old task
            for cid in state.pending:
                self.clients[cid].late += 1
        if state.pending:
            log.info("phase %s of round %d (iteration %d) closed at its deadline without %s", phase.phase,
                     phase.round + 1, phase.iteration, sorted(state.pending))
        return state

    def _take_arrived(self, state: PhaseState, by: float, limit_s: float) -> None:
        """Handle the results the phase's pending clients had sent by `by` that still wait in
        the transport: an answer is late when it came after the deadline, not when the engine was
        busy with other messages until then. For at most `limit_s` seconds of work: a pending
        client's backlog of junk results must not hold the phase open."""
        stop_at = time.monotonic() + limit_s
        while state.pending and time.monotonic() < stop_at:
            if self.stop_event.is_set():
                raise Stopped()
            arrival = self.transport.arrived_by(by, frozenset(state.pending))
            if arrival is None:
                return
            self.handle(arrival)

    def pump(self) -> None:
        """Handle the next arrival, if one comes within the poll interval."""
        if self.stop_event.is_set():
            raise Stopped()
        arrival = self.transport.receive(POLL_S)
        if arrival is not None:
            self.handle(arrival)

    def _send(self, cid: str, packet: Packet) -> None:
        sent = self.transport.send(cid, packet)
        with self.lock:
            self.clients[cid].bytes_down += sent

    # -- arrivals ----------------------------------------------------------------------------
    def handle(self, arrival: Arrival) -> None:
        rejected = self.counters["rejected"]
        try:
            self._dispatch(arrival)
        except (Stopped, StrategyError):
            raise
        except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
            # whatever a message holds, it never ends the run
            self.reject(arrival.client if arrival.client in self.clients else None,
                        f"unusable {arrival.kind} message: {type(exc).__name__}: {exc}", "error")
        if self.counters["rejected"] > rejected:
            self.transport.refused(arrival)

    def _dispatch(self, arrival: Arrival) -> None:
        if arrival.kind == "connected":
            self.connects += 1
            if self.connects > 1:  # a reconnect: the owner's retained state and the open tasks again
                if self.on_reconnect:
                    self.on_reconnect()
                cur = self.current
                if cur is not None:
                    for cid in sorted(cur.pending):
                        self._send(cid, cur.packets[cid])
            return
        if arrival.kind == "invalid":
            self.reject(arrival.client if arrival.client in self.clients else None, arrival.reason, arrival.reject_kind,
                        count=arrival.count)
            return
        if arrival.run != self.run_id or arrival.client not in self.clients:
            self.reject(None, f"message from unknown client {arrival.client!r} (run {arrival.run!r})", "topic")
            return
        if arrival.kind == "status":
            self._on_status(arrival.client, arrival.payload, arrival.retained)
        elif arrival.kind == "result":
            self._on_result(arrival.client, arrival.payload, arrival.wire_bytes, arrival.message, arrival.received_at)

    def _on_status(self, cid: str, payload: bytes, retained: bool = False) -> None:
        if len(payload) > MAX_STATUS_BYTES:  # before parsing: a status is a few hundred bytes of JSON
            self.reject(cid, f"status message of {len(payload)} bytes (at most {MAX_STATUS_BYTES})", "status")
            return
        try:
            status = json.loads(payload)
            state, ts = status["state"], float(status.get("ts", 0.0))
        except (ValueError, KeyError, TypeError):
            self.reject(cid, "malformed status message", "status")
            return
        info = self.clients[cid]
        health = self._health(cid, status["health"]) if "health" in status else None
        with self.lock:
            was_online = info.online
            info.online = state == "online"
            if not retained:  # a retained copy comes at subscribing (e.g. a restart): it was seen then, not now
                info.last_seen = time.time()
            if health:
                info.health = health
        if info.online != was_online:
            self.notify("client", client=cid, online=info.online)
        cur = self.current
        if info.online and not was_online and cur is not None and cid in cur.pending and ts >= cur.wall_started:
            # connected after the task went out: send it again, at most once per resend_s (statuses
            # toggled offline/online would otherwise each cost a whole task; the periodic re-send
            # covers the rest)
            now = self.transport.now()
            if now - cur.reconnect_sent.get(cid, -math.inf) >= self.settings.resend_s:
                cur.reconnect_sent[cid] = now
                self._send(cid, cur.packets[cid])

    def _health(self, cid: str, raw: Any) -> dict[str, Any]:
        """The usable part of a status's `health`; what is left out is counted (`health_ignored`),
        and logged as a warning once per client for as long as the problem stays the same."""
        health, problems = validate_health(raw)
        if problems:
            why = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            with self.lock:
                self.counters["health_ignored"] += 1
                repeated = self._health_warned.get(cid) == why
                self._health_warned[cid] = why
            log.log(logging.DEBUG if repeated else logging.WARNING, "ignored in %s's health report: %s", cid, why)
        return health

    def _on_result(self, cid: str, payload: bytes, wire_bytes: int, decoded: Message | None,
                   received_at: float | None = None) -> None:
        info = self.clients[cid]
        with self.lock:
            info.bytes_up += wire_bytes
        try:
            msg = decoded if decoded is not None else decode(payload)
        except EnvelopeError as exc:
            self.reject(cid, f"malformed envelope: {exc}", exc.kind)
            return
        meta = msg.meta  # from `cid`, as its topic (or the in-process session) says
        cur = self.current
        key = (meta.get("epoch"), meta.get("seq"))
        if not all(type(v) is int for v in key):
            self.reject(cid, "result without integer epoch and seq", "sequence")
            return
        if cur is None or key != cur.key:
            with self.lock:
                self.counters["stale"] += 1
                with contextlib.suppress(InvalidResult):  # its work was done, its privacy spent: a valid
                    self._validate_privacy(msg)  # epsilon still counts (an invalid one is left out)
                    self._record_privacy(info, msg)
            return
        refused = cur.refused.get(cid)
        fingerprint = hashlib.sha256(encode(msg)).digest() if refused is not None else b""
        if cid in cur.results or cid in cur.declined or (refused is not None and fingerprint in refused):
            # a redelivery, or the re-send of an answer already refused: counted once
            with self.lock:
                info.duplicates += 1
                self.counters["duplicates"] += 1
            return
        if "declined" in meta:
            if cid not in cur.phase.tasks:  # only a task sent in this phase can be declined
                cur.refuse(cid, fingerprint or hashlib.sha256(encode(msg)).digest())
                self.reject(cid, "declined a task it was not sent in this phase", "result")
                return
            self._on_decline(cid, cur, msg)
            return
        sent, task = msg, cur.phase.tasks.get(cid)
        if task is not None:  # a result names its task by (epoch, seq): the task's context is its own
            msg = answering(msg, task)
        try:
            self._validate_privacy(msg)  # any phase's result: its epsilon goes into the client's ledger
            if cur.phase.phase == "evaluate":
                self._validate_evaluation(cur.phase, cid, msg)
            else:
                self.server.validate(cur.phase, cid, msg)
        except InvalidResult as exc:
            # it stays pending: a valid answer may still come (the phase's deadline decides)
            cur.refuse(cid, fingerprint or hashlib.sha256(encode(sent)).digest())
            self.reject(cid, str(exc), exc.kind)
            return
        except Exception as exc:
            raise StrategyError(f"{type(self.server).__name__}.validate failed on {cid}'s {cur.phase.phase} result: "
                                f"{type(exc).__name__}: {exc}") from exc
        with self.lock:
            self._record_privacy(info, msg)  # validated above
            cur.results[cid] = msg
            # to its arrival: an answer that waited behind others' checks was not that slow
            cur.latencies.append(max(0.0, (self.transport.now() if received_at is None else received_at) - cur.started))
            cur.pending.discard(cid)
            info.answered += 1
            info.last_seen = time.time()
            came_online = not info.online
            info.online = True  # a valid answer proves it, should its retained "online" status have been lost
        if came_online:
            self.notify("client", client=cid, online=True)

    def _on_decline(self, cid: str, cur: PhaseState, msg: Message) -> None:
        """A client that will not answer this task says so (a restarted agent sitting out the rest
        of a round it lost): the phase stops waiting for it, so it closes once the others have
        answered instead of at its deadline (docs/protocol.md section 8)."""
        why = msg.meta["declined"]
        if not (isinstance(why, str) and 0 < len(why) <= MAX_DECLINE_REASON and why.isprintable()) or msg.tensors:
            cur.refuse(cid, hashlib.sha256(encode(msg)).digest())  # its re-send: a duplicate
            self.reject(cid, f"a declined task's reason must be 1 to {MAX_DECLINE_REASON} printable characters "
                             f"and come without tensors (got {str(why)[:MAX_DECLINE_REASON]!r}, "
                             f"{len(msg.tensors)} tensors)", "result")
            return
        with self.lock:
            cur.declined[cid] = why
            cur.pending.discard(cid)
            info = self.clients[cid]
            info.declined += 1
            info.last_seen = time.time()
            self.counters["declined"] += 1
            came_online = not info.online
            info.online = True  # as a valid answer, a decline proves it is there
        if came_online:
            self.notify("client", client=cid, online=True)
        log.info("%s declined its %s task of round %d (iteration %d): %s", cid, cur.phase.phase, cur.phase.round + 1,
                 cur.phase.iteration, why)

    @staticmethod
    def _record_privacy(info: ClientInfo, msg: Message) -> None:
        """A validated result's epsilon into its client's ledger (under the lock): the largest it
        reported, as epsilon only grows and a result that came too late was still paid for."""
        if msg.meta.get("epsilon") is not None:
            eps = float(msg.meta["epsilon"])  # type: ignore[arg-type]  # validated
            info.epsilon = eps if info.epsilon is None else max(info.epsilon, eps)
        info.dp_exhausted = info.dp_exhausted or msg.meta.get("dp_exhausted") is True
        if msg.meta.get("noise_multiplier") is not None:
            info.noise_multiplier = float(msg.meta["noise_multiplier"])  # type: ignore[arg-type]  # validated

    @staticmethod
    def _validate_privacy(msg: Message) -> None:
        eps, exhausted = msg.meta.get("epsilon"), msg.meta.get("dp_exhausted")
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps)
                                or eps < 0):
            raise InvalidResult(f"epsilon {eps!r} is not a non-negative number", kind="privacy")
        if exhausted is not None and not isinstance(exhausted, bool):
            raise InvalidResult(f"dp_exhausted {exhausted!r} is not a boolean", kind="privacy")
        sigma = msg.meta.get("noise_multiplier")
        if sigma is not None and (isinstance(sigma, bool) or not isinstance(sigma, (int, float))
                                  or not math.isfinite(sigma) or sigma <= 0):
            raise InvalidResult(f"noise_multiplier {sigma!r} is not a positive number", kind="privacy")

    @staticmethod
    def _validate_evaluation(phase: PhaseTasks, cid: str, msg: Message) -> None:
        for k in ("phase", "round", "iteration"):
            if msg.meta.get(k) != phase.tasks[cid].meta.get(k):
                raise InvalidResult(f"evaluation result has {k}={msg.meta.get(k)!r}")
        for key in ("acc", "local_acc"):
            acc = msg.meta.get(key)
            if acc is not None and (isinstance(acc, bool) or not isinstance(acc, (int, float)) or not 0.0 <= acc <= 1.0):
                raise InvalidResult(f"{key} {acc!r} is not in [0, 1]")

    def reject(self, cid: str | None, reason: str, kind: str = "result", count: int = 1) -> None:
        """kind: the short reason it is counted under (API `rejects`, /metrics `fedal_rejects_total`);
        count: how many messages the reason stands for."""
        reason = clip(reason)  # it may quote what a client sent, at any length
        with self.lock:
            self.counters["rejected"] += count
            self.reject_reasons[kind] += count
            self.round_rejects.append(f"{cid}: {reason}" if cid else reason)
            self.round_rejected += count
            if cid is not None:
                self.clients[cid].rejected += count
        self._reject_log.warning("rejected%s: %s", f" from {cid}" if cid else "", reason, key=cid)

    # -- accounting --------------------------------------------------------------------------
    def _bytes(self) -> tuple[int, int]:
        with self.lock:
            return (sum(i.bytes_up for i in self.clients.values()), sum(i.bytes_down for i in self.clients.values()))
