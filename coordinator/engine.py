"""The round engine: drives a strategy's server half over MQTT, phase by phase.

Generic: it knows deadlines, quorum, re-sending, deduplication, validation, evaluation and
persistence, never an algorithm. Each phase gets a sequence number (epoch, seq); the epoch
grows with every coordinator start, so agents can tell a re-sent task from a stale one.
A phase closes when every client answered, or at its deadline once the quorum answered; late
clients are left out of that phase and rejoin with the next one.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import math
import queue
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from coordinator.bus import CoordinatorBus
from coordinator.config import CoordinatorConfig
from coordinator.events import EventHub
from coordinator.store import RunStore, default_store_url
from fedal import __version__
from fedal.data import content_hash, load_dataset, public_set
from fedal.protocol import EnvelopeError, Message, Reassembler, RunManifest, encode, topics
from fedal.engine.results import evaluation_summary
from fedal.strategies import InvalidResult, PhaseTasks, ServerContext, get_strategy
from fedal.strategies.global_model import fedavg_style_metrics, global_accuracy

log = logging.getLogger("coordinator.engine")
TRAIN_PHASES = ("local_train", "train")


class Stopped(Exception):
    """Raised inside the round loop when stop() was called; the run ends as `stopped`."""


@dataclass
class ClientInfo:
    online: bool = False
    last_seen: float | None = None
    answered: int = 0
    late: int = 0
    rejected: int = 0
    duplicates: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    last_acc: float | None = None
    last_local_acc: float | None = None


@dataclass
class PhaseState:
    phase: PhaseTasks
    key: tuple[int, int]
    payloads: dict[str, bytes]
    pending: set[str]
    results: dict[str, Message] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    wall_started: float = field(default_factory=time.time)
    latencies: list[float] = field(default_factory=list)  # seconds from sending to each accepted result
    compute_s: float = 0.0  # the server half producing this phase's tasks (begin_round / collect)
    wall_s: float = 0.0  # from the server half starting on this phase to the phase closing


class PhaseStats:
    """Per phase name over one round: response latencies (p50/p95), participation, and the mean
    server-half compute time and end-to-end time of one phase (e.g. one transfer iteration)."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {}
        self.sent: dict[str, int] = {}
        self.answered: dict[str, int] = {}
        self.compute: dict[str, list[float]] = {}
        self.wall: dict[str, list[float]] = {}

    def add(self, state: "PhaseState") -> None:
        name = state.phase.phase
        self.latencies.setdefault(name, []).extend(state.latencies)
        self.sent[name] = self.sent.get(name, 0) + len(state.phase.tasks)
        self.answered[name] = self.answered.get(name, 0) + len(state.results)
        self.compute.setdefault(name, []).append(state.compute_s)
        self.wall.setdefault(name, []).append(state.wall_s)

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        out = {}
        for name, sent in self.sent.items():
            lat = self.latencies.get(name) or []
            out[name] = {
                "count": sent,
                "participation": round(self.answered[name] / sent, 4) if sent else None,
                "p50_s": round(float(np.percentile(lat, 50)), 4) if lat else None,
                "p95_s": round(float(np.percentile(lat, 95)), 4) if lat else None,
                "compute_s": round(float(np.mean(self.compute[name])), 4),
                "wall_s": round(float(np.mean(self.wall[name])), 4),
            }
        return out


def pick_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


class RoundEngine:
    """One run. `store` and `events` are shared by all runs of a coordinator (RunManager)."""

    def __init__(self, config: CoordinatorConfig, store: RunStore | None = None, events: EventHub | None = None,
                 origin: str = "config"):
        if config.client_ids is None:
            raise ValueError("a run needs client_ids")
        self.cfg = config
        self.origin = origin
        self.run_config = config.run.model_copy(update={"clients": len(config.client_ids)}).resolved()
        self.spec = get_strategy(self.run_config.strategy)
        self.client_ids = list(config.client_ids)
        self.public_bytes: bytes | None = None
        self.public_hash: str | None = None
        public_size = 0
        if config.public_file is not None:
            self.public_bytes = config.public_file.read_bytes()
            with np.load(io.BytesIO(self.public_bytes), allow_pickle=False) as z:
                x = np.ascontiguousarray(z["x"], dtype=np.float32)
            self.public_hash, public_size = content_hash(x), len(x)
        elif self.spec.uses_public_set:
            # the same rows `fedal simulate` holds out for this dataset, size and seed
            rc = self.run_config
            x = public_set(rc.dataset, rc.public_size, rc.seed, rc.data_dir)
            buf = io.BytesIO()
            np.savez(buf, x=x)
            self.public_bytes, self.public_hash, public_size = buf.getvalue(), content_hash(x), len(x)
        self.device = pick_device(config.device)
        context = ServerContext(config.num_classes, public_size, self.run_config.seed, self.device)
        self.server = self.spec.server(self.run_config.strategy_params, self.client_ids, context)

        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.bus = CoordinatorBus(config.broker, config.run_id, self.inbox)
        b = config.broker
        self.reassembler = Reassembler(max_size=b.max_message_bytes, max_sender_bytes=b.reassembly_bytes_per_client,
                                       max_total_bytes=b.reassembly_bytes_total)
        self.store = store or RunStore(config.store_url or default_store_url(config.state_dir))
        self.lock = threading.RLock()
        self.stop_event = threading.Event()
        self.finished_event = threading.Event()
        self.resume_event = threading.Event()  # cleared while paused
        self.resume_event.set()
        self.pause_points = list(config.phases.pause_at)  # each is dropped once it held the run
        past = [p.label() for p in self.pause_points if p.round > self.run_config.rounds]
        if past:
            raise ValueError(f"phases.pause_at: {', '.join(past)} is past the run's {self.run_config.rounds} rounds")
        self.held_before: dict[str, Any] | None = None  # the phase a paused run holds before
        self.events = events or EventHub()
        self.clients = {cid: ClientInfo() for cid in self.client_ids}
        self.counters: Counter[str] = Counter()
        self.reject_reasons: Counter[str] = Counter()  # the rejected messages by why
        self.records: list[dict[str, Any]] = []
        self.state = "pending"
        self.error: str | None = None
        self.round = 0
        self.current: PhaseState | None = None
        self.epoch = 0
        self.seq = 0
        self.connects = 0
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.instance = ""  # set by _resume: the same across restarts of one run, new for a fresh start
        self.config_hash = hashlib.sha256(
            json.dumps([config.run_id, self.run_config.model_dump(mode="json"), self.client_ids, self.public_hash]).encode()
        ).hexdigest()

    # -- lifecycle ---------------------------------------------------------------------------
    def public_url(self) -> str:
        host = self.cfg.api.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.getfqdn()  # a wildcard bind address is not an address agents can reach
        base = self.cfg.api.public_base_url or f"http://{host}:{self.cfg.api.port}"
        return f"{base.rstrip('/')}/api/v1/runs/{self.cfg.run_id}/public"

    def manifest(self) -> RunManifest:
        return RunManifest(
            run_id=self.cfg.run_id,
            strategy=self.run_config.strategy,
            strategy_params=self.run_config.strategy_params.model_dump(mode="json"),
            num_classes=self.cfg.num_classes,
            clients=self.client_ids,
            rounds=self.run_config.rounds,
            eval_every=self.run_config.eval_every,
            public_hash=self.public_hash,
            public_size=None if self.public_bytes is None else self.server.context.public_size,
            public_url=self.public_url() if self.public_bytes is not None else None,
            state=self.state if self.state in ("finished", "stopped") else "running",  # agents need no pause
            round=self.round,
            instance=self.instance,
        )

    def run(self) -> None:
        """Thread target: resume or start, run every round, finish."""
        try:
            start = self._resume()
            self.round = start
            if not self.bus.start(self.stop_event, warn_every_s=5):
                raise Stopped()
            with self.lock:
                self.started_at = self.started_at or time.time()
            self._set_state("running")
            self.bus.publish_manifest(self.manifest().to_json())
            if start < self.run_config.rounds:  # a run found finished in the store just finishes
                self._wait_for_clients(self.cfg.phases.start_timeout_s)
            for r in range(start, self.run_config.rounds):
                with self.lock:
                    self.round = r
                self.bus.publish_manifest(self.manifest().to_json())
                record = self._run_round(r)
                with self.lock:
                    self.records.append(record)
                self.events.publish("round", run_id=self.cfg.run_id, **{k: record.get(k) for k in (
                    "round", "mean_acc", "min_acc", "max_acc", "local_mean_acc", "bytes_up", "bytes_down", "wall_s")})
                self._save(completed=r + 1)
            self._finish("finished")
        except Stopped:
            self._finish("stopped")
        except Exception as exc:  # the API must still report what happened
            log.exception("run failed")
            with self.lock:
                self.state, self.error = "failed", f"{type(exc).__name__}: {exc}"
            self.finished_event.set()

    def stop(self) -> None:
        self.stop_event.set()
        self.resume_event.set()

    def pause(self) -> None:
        """Hold the run before its next phase; open phases finish, agents keep their state."""
        if self.state == "running":
            self.resume_event.clear()
            self._set_state("paused")

    def resume(self) -> None:
        if self.state == "paused":
            self._set_state("running")
            self.resume_event.set()

    def _set_state(self, state: str) -> None:
        with self.lock:
            self.state = state
        self.events.publish("run", run_id=self.cfg.run_id, state=state)

    def _wait_for_clients(self, timeout_s: float) -> None:
        """Let the fleet come online before the first task goes out (up to timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not all(i.online for i in self.clients.values()):
            self._pump()
        offline = sorted(c for c, i in self.clients.items() if not i.online)
        if offline:
            log.info("starting without %s (not online after %.0f s)", offline, timeout_s)

    def run_spec(self) -> dict[str, Any]:
        """What it takes to start this run again (kept by the store)."""
        return {"run_id": self.cfg.run_id, "run": self.cfg.run.model_dump(mode="json"), "client_ids": self.client_ids,
                "num_classes": self.cfg.num_classes, "public_file": str(self.cfg.public_file) if self.cfg.public_file else None,
                "phases": self.cfg.phases.model_dump(mode="json")}

    def _resume(self) -> int:
        stored = self.store.load(self.cfg.run_id)
        self.store.register(self.cfg.run_id, self.run_spec(), self.origin)
        start = 0
        if stored and stored.config_hash == self.config_hash:
            self.server.load_state_dict(self.store.load_server_state(self.cfg.run_id))
            self.records = stored.records[: stored.completed_rounds]
            start = stored.completed_rounds
            self.epoch = stored.epoch + 1
            self.instance = stored.instance or ""
            self.started_at = stored.started_at
            for cid, info in stored.clients.items():
                if cid in self.clients:
                    self.clients[cid] = ClientInfo(**{**info, "online": False})
            log.info("resuming run %s after round %d (epoch %d)", self.cfg.run_id, start, self.epoch)
        elif stored and stored.config_hash is not None:
            log.warning("stored run %s belongs to another config; starting afresh", self.cfg.run_id)
            self.store.reset(self.cfg.run_id)
        if not self.instance:
            self.instance = f"{self.config_hash[:12]}-{uuid.uuid4().hex[:8]}"
        self._save(completed=start, server_state=start == 0)
        return start

    def _save(self, completed: int, server_state: bool = True) -> None:
        with self.lock:
            progress = {"config_hash": self.config_hash, "completed_rounds": completed, "epoch": self.epoch,
                        "instance": self.instance, "started_at": self.started_at, "state": self.state}
            records = list(self.records)
            info = {c: asdict(i) for c, i in self.clients.items()}
        self.store.save(self.cfg.run_id, progress, records, info, self.server.state_dict() if server_state else None)

    def _finish(self, state: str) -> None:
        with self.lock:
            self.current = None
            self.finished_at = time.time()
        self._set_state(state)
        if self.bus.connected.is_set():
            self.bus.publish_manifest(self.manifest().to_json())
        self.store.set_state(self.cfg.run_id, state, self.finished_at)
        if state == "finished":
            path = self.cfg.results_file or (self.cfg.state_dir / "results.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.results(), indent=2) + "\n")
        self.finished_event.set()

    # -- rounds and phases -------------------------------------------------------------------
    def _run_round(self, r: int) -> dict[str, Any]:
        t0 = time.monotonic()
        up0, down0 = self._bytes()
        t = time.monotonic()
        phase = self.server.begin_round(r)
        stats = PhaseStats()
        while phase is not None:
            state = self._run_phase(phase, computed_from=t)
            stats.add(state)
            t = time.monotonic()
            phase = self.server.collect(phase, state.results)
        up1, down1 = self._bytes()
        record: dict[str, Any] = {"round": r + 1, "bytes_up": up1 - up0, "bytes_down": down1 - down0}
        if (r + 1) % self.run_config.eval_every == 0 or r + 1 == self.run_config.rounds:
            record.update(self._evaluate(r, stats))
        record["rejected"] = sum(i.rejected for i in self.clients.values())
        record["server"] = self.server.round_metrics()
        record["phases"] = stats.summary()
        record["wall_s"] = round(time.monotonic() - t0, 4)
        for point in [p for p in self.pause_points if p.round == r + 1]:  # a phase this round never had: a typo
            self.pause_points.remove(point)
            log.warning("phases.pause_at: round %d had no phase matching %s; it never paused the run", r + 1, point.label())
        return record

    def _evaluate(self, r: int, stats: "PhaseStats") -> dict[str, Any]:
        tasks = {cid: Message({"phase": "evaluate", "round": r, "iteration": 0}) for cid in self.client_ids}
        state = self._run_phase(PhaseTasks("evaluate", r, 0, tasks))  # after the round's byte count
        stats.add(state)
        accs = [self._reported(state, c, "acc") for c in self.client_ids]
        local = [self._reported(state, c, "local_acc") for c in self.client_ids]
        for cid, acc, local_acc in zip(self.client_ids, accs, local):
            info = self.clients[cid]
            info.last_acc = acc if acc is not None else info.last_acc
            info.last_local_acc = local_acc if local_acc is not None else info.last_local_acc
        summary = evaluation_summary(accs, local)
        return {**summary, **self._global_model_metrics(summary)}

    @functools.cached_property
    def global_test(self):
        """The run's common test set, derived from its config like the public set; None if this
        machine cannot load it (a file dataset without its files): then no global_acc."""
        try:
            return load_dataset(self.run_config.dataset, self.run_config.data_dir)[1]
        except (ValueError, OSError) as exc:
            log.warning("no global_acc: cannot load the %s test set here: %s", self.run_config.dataset, exc)
            return None

    def _global_model_metrics(self, summary: dict[str, Any]) -> dict[str, Any]:
        """FedAvg-type strategies: the aggregated model, which only the coordinator holds, on the
        dataset's common test set (`global_acc`, computed as `fedal simulate` does)."""
        if not self.spec.global_model:
            return {}
        test = self.global_test
        acc = None if test is None else global_accuracy(self.server, self.run_config.models[0], self.cfg.num_classes,
                                                        test.x, test.y, threads=self.run_config.threads)
        return fedavg_style_metrics(summary, acc)

    @staticmethod
    def _reported(state: "PhaseState", cid: str, key: str) -> float | None:
        """A client's reported accuracy (validated on arrival), None if it did not answer."""
        value = state.results[cid].meta.get(key) if cid in state.results else None
        return None if value is None else float(value)

    def _run_phase(self, phase: PhaseTasks, computed_from: float | None = None) -> PhaseState:
        """computed_from: when the server half started producing `phase` (for its timing)."""
        compute_s = 0.0 if computed_from is None else time.monotonic() - computed_from
        point = next((p for p in self.pause_points if p.matches(phase.round, phase.phase, phase.iteration)), None)
        if point is not None:
            self.pause_points.remove(point)
            log.info("pausing before round %d %s iteration %d (phases.pause_at: %s)", phase.round + 1, phase.phase,
                     phase.iteration, point.label())
            self.pause()
        if not self.resume_event.is_set():
            with self.lock:
                self.held_before = {"round": phase.round + 1, "phase": phase.phase, "iteration": phase.iteration}
            while not self.resume_event.is_set():  # paused: keep handling messages, send nothing new
                self._pump()
                computed_from = None  # a pause is neither compute nor network time
            with self.lock:
                self.held_before = None
        self.seq += 1
        key = (self.epoch, self.seq)
        payloads = {}
        for cid, task in phase.tasks.items():
            meta = {**task.meta, "run": self.cfg.run_id, "client": cid, "instance": self.instance,
                    "epoch": key[0], "seq": key[1]}
            payloads[cid] = encode(Message(meta, task.tensors))
        state = PhaseState(phase, key, payloads, set(phase.tasks), compute_s=compute_s)
        with self.lock:
            self.current = state
        self.events.publish("phase", run_id=self.cfg.run_id, phase=phase.phase, round=phase.round + 1,
                            iteration=phase.iteration, clients=len(phase.tasks))
        for cid, payload in payloads.items():
            self._send(cid, payload)
        train = phase.phase in TRAIN_PHASES
        deadline = state.started + (self.cfg.phases.train_deadline_s if train else self.cfg.phases.deadline_s)
        need = math.ceil(self.cfg.phases.quorum * len(phase.tasks))
        last_resend = time.monotonic()
        while state.pending:
            self._pump()
            now = time.monotonic()
            if now >= deadline and len(state.results) >= need:
                break
            if now - last_resend >= self.cfg.phases.resend_s:
                last_resend = now
                for cid in list(state.pending):
                    if self.clients[cid].online:
                        self._send(cid, payloads[cid])
        state.wall_s = time.monotonic() - (state.started if computed_from is None else computed_from)
        with self.lock:
            for cid in state.pending:
                self.clients[cid].late += 1
            if state.pending:
                log.info("phase %s r%d i%d closed at its deadline without %s", phase.phase, phase.round, phase.iteration,
                         sorted(state.pending))
        return state

    def _pump(self) -> None:
        """Handle the next incoming message, if one arrives within 50 ms."""
        if self.stop_event.is_set():
            raise Stopped()
        try:
            topic, payload = self.inbox.get(timeout=0.05)
        except queue.Empty:
            return
        self._handle(topic, payload)

    def _send(self, cid: str, payload: bytes) -> None:
        self.clients[cid].bytes_down += self.bus.publish_task(cid, payload)

    # -- incoming messages -------------------------------------------------------------------
    def _handle(self, topic: str, payload: bytes) -> None:
        rejected = self.counters["rejected"]
        try:
            self._dispatch(topic, payload)
        except Exception as exc:  # whatever a message holds, it never ends the run
            self._reject(None, f"unusable message on {topic}: {type(exc).__name__}: {exc}", "error")
        if self.counters["rejected"] > rejected and self._device_topic(topic):
            # it may have been published retained: later subscribers must not get it (an empty
            # retained message clears the topic; a status is the only retained message a device sends)
            self.bus.clear_retained(topic)

    def _device_topic(self, topic: str) -> bool:
        """A result or status topic of a client of this run: what a device writes."""
        try:
            t = topics.parse(topic)
        except topics.TopicError:
            return False
        return t.run == self.cfg.run_id and t.client in self.clients and t.kind in ("up", "status")

    def _dispatch(self, topic: str, payload: bytes) -> None:
        if topic == "$connected":
            self.connects += 1
            if self.connects > 1:  # a reconnect: the retained manifest and the open tasks again
                self.bus.publish_manifest(self.manifest().to_json())
                if self.current is not None:
                    for cid in self.current.pending:
                        self._send(cid, self.current.payloads[cid])
            return
        try:
            t = topics.parse(topic)
        except topics.TopicError as exc:
            self._reject(None, f"bad topic: {exc}", "topic")
            return
        if t.run != self.cfg.run_id or t.client not in self.clients:
            self._reject(None, f"message from unknown client {t.client!r} (run {t.run!r})", "topic")
            return
        if not payload and t.kind in ("status", "up"):
            return  # a retained message cleared (by the coordinator itself, or the broker's tooling)
        if t.kind == "status":
            self._on_status(t.client, payload)
        elif t.kind == "up":
            self._on_result(t.client, payload)

    def _on_status(self, cid: str, payload: bytes) -> None:
        try:
            status = json.loads(payload)
            state, ts = status["state"], float(status.get("ts", 0.0))
        except (ValueError, KeyError, TypeError):
            self._reject(cid, "malformed status message", "status")
            return
        info = self.clients[cid]
        was_online = info.online
        with self.lock:
            info.online = state == "online"
            info.last_seen = time.time()
        if info.online != was_online:
            self.events.publish("client", run_id=self.cfg.run_id, client=cid, online=info.online)
        cur = self.current
        if info.online and not was_online and cur is not None and cid in cur.pending and ts >= cur.wall_started:
            self._send(cid, cur.payloads[cid])  # connected after the task went out: send it again

    def _on_result(self, cid: str, payload: bytes) -> None:
        info = self.clients[cid]
        try:
            msg = self.reassembler.feed(cid, payload)
        except EnvelopeError as exc:
            self._reject(cid, f"malformed envelope: {exc}", exc.kind)
            return
        info.bytes_up += len(payload)
        if msg is None:
            return
        meta = msg.meta
        if meta.get("run") != self.cfg.run_id or meta.get("client") != cid:
            self._reject(cid, f"result claims run {meta.get('run')!r} client {meta.get('client')!r}", "identity")
            return
        cur = self.current
        key = (meta.get("epoch"), meta.get("seq"))
        if not all(type(v) is int for v in key):
            self._reject(cid, "result without integer epoch and seq", "sequence")
            return
        if cur is None or key != cur.key:
            self.counters["stale"] += 1
            return
        if cid in cur.results:
            info.duplicates += 1
            self.counters["duplicates"] += 1
            return
        try:
            if cur.phase.phase == "evaluate":
                self._validate_evaluation(cur.phase, cid, msg)
            else:
                self.server.validate(cur.phase, cid, msg)
        except InvalidResult as exc:
            self._reject(cid, str(exc), exc.kind)
            return
        except Exception as exc:  # a validator tripping over odd input is still a rejection
            self._reject(cid, f"unusable result: {type(exc).__name__}: {exc}", "result")
            return
        with self.lock:
            cur.results[cid] = msg
            cur.latencies.append(time.monotonic() - cur.started)
            cur.pending.discard(cid)
            info.answered += 1
            info.last_seen = time.time()
            came_online = not info.online
            info.online = True  # a valid answer proves it, should its retained "online" status have been lost
        if came_online:
            self.events.publish("client", run_id=self.cfg.run_id, client=cid, online=True)

    def _validate_evaluation(self, phase: PhaseTasks, cid: str, msg: Message) -> None:
        for k in ("phase", "round", "iteration"):
            if msg.meta.get(k) != phase.tasks[cid].meta.get(k):
                raise InvalidResult(f"evaluation result has {k}={msg.meta.get(k)!r}")
        for key in ("acc", "local_acc"):
            acc = msg.meta.get(key)
            if acc is not None and (isinstance(acc, bool) or not isinstance(acc, (int, float)) or not 0.0 <= acc <= 1.0):
                raise InvalidResult(f"{key} {acc!r} is not in [0, 1]")

    def _reject(self, cid: str | None, reason: str, kind: str = "result") -> None:
        """kind: the short reason it is counted under (API `rejects`, /metrics `fedal_rejects_total`)."""
        self.counters["rejected"] += 1
        self.reject_reasons[kind] += 1
        if cid is not None:
            self.clients[cid].rejected += 1
        log.warning("rejected%s: %s", f" from {cid}" if cid else "", reason)

    # -- accounting and reporting ------------------------------------------------------------
    def _bytes(self) -> tuple[int, int]:
        return sum(i.bytes_up for i in self.clients.values()), sum(i.bytes_down for i in self.clients.values())

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            cur = self.current
            return {
                "run_id": self.cfg.run_id,
                "strategy": self.run_config.strategy,
                "state": self.state,
                "error": self.error,
                "round": 0 if self.state == "pending" else min(self.round + 1, self.run_config.rounds),
                "rounds": self.run_config.rounds,
                "completed_rounds": len(self.records),
                "phase": cur.phase.phase if cur else None,
                "iteration": cur.phase.iteration if cur else None,
                "held_before": self.held_before,
                "pause_at": [p.model_dump() for p in self.pause_points],
                "started_at": self.started_at,
                "finished_at": self.finished_at,
                "counters": self._counters(),
                "rejects": dict(self.reject_reasons),
                "clients": {c: asdict(i) for c, i in self.clients.items()},
                "config": self.run_config.model_dump(mode="json"),
                "last_round": self.records[-1] if self.records else None,
            }

    def _counters(self) -> dict[str, int]:
        """The run-wide counters, with the unfinished chunked messages the reassembler dropped:
        `evicted` for a sender's newer ones, `expired` after its timeout."""
        out = dict(self.counters)
        evicted, expired = sum(self.reassembler.evicted.values()), self.reassembler.expired
        out.update({k: v for k, v in (("evicted", evicted), ("expired", expired)) if v})
        return out

    def rounds(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.records)

    def results(self) -> dict[str, Any]:
        """The same results contract as `fedal simulate`."""
        with self.lock:
            records = list(self.records)
        last_eval = next((r for r in reversed(records) if "mean_acc" in r), None)
        final = {k: v for k, v in last_eval.items() if k.endswith("_acc")} if last_eval else {}
        return {
            "config": self.run_config.model_dump(mode="json"),
            "data": {"public_hash": self.public_hash, "public_size": self.server.context.public_size},
            "clients": [{"id": cid} for cid in self.client_ids],
            "rounds": records,
            "final": final,
            "deployment": {
                "run_id": self.cfg.run_id,
                "device": self.device,
                "counters": self._counters(),
                "rejects": dict(self.reject_reasons),
                "clients": {c: asdict(i) for c, i in self.clients.items()},
            },
            "environment": {"fedal": __version__, "torch": torch.__version__},
            "timings": {"wall_seconds": round((self.finished_at or time.time()) - (self.started_at or time.time()), 3)},
        }
