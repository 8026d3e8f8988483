"""One run of the coordinator service: lifecycle, persistence and what the API reads.

The rounds themselves are the one round engine's (fedal/engine), driven over the MQTT
transport (coordinator/transport.py). What is the service's lives here: the public set it
serves, resuming from the run store after a restart (a new epoch, the same instance), the
retained run manifest, pause/resume/stop, events for the dashboard, the results file.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coordinator.config import CoordinatorConfig
from coordinator.events import EventHub
from coordinator.store import RunStore, StoredRun, default_store_url
from coordinator.transport import MqttTransport
from fedal.atomic import write_bytes_atomic
from fedal.data import check_servable, content_hash, load_dataset, public_rows_from_npz, public_set
from fedal.engine import ClientInfo, RoundEngine, Stopped
from fedal.engine.health import health_flags
from fedal.engine.results import build_results, final_summary
from fedal.hosts import is_wildcard, machine_fqdn, url_host
from fedal.owned import ForeignFile, check_replaceable, is_results
from fedal.protocol import RunManifest
from fedal.strategies import ServerContext, get_strategy
from fedal.strategies.global_model import fedavg_style_metrics, global_accuracy, global_weight_layout

log = logging.getLogger("coordinator.run")
ALWAYS_COUNTED = ("rejected", "stale", "duplicates", "quorum_missed")  # docs/api.md: a run's `counters`
FOLLOW_POLL_S = 0.25  # how long an ended run's thread waits for a message before it looks at close()


def pick_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def read_public_file(path: Path) -> tuple[bytes, np.ndarray]:
    """The public set file's bytes (served to agents as they are) and its rows `x` as float32
    (fedal.data.public_rows_from_npz: ValueError for anything else; a file that cannot be read:
    OSError)."""
    data = path.read_bytes()
    x = public_rows_from_npz(data, f"public_file {path}")
    check_servable(data, x, f"public_file {path}")  # one every agent would refuse would stall the run
    return data, x


class Run:
    """One run. `store` and `events` are shared by all runs of a coordinator (RunManager)."""

    def __init__(self, config: CoordinatorConfig, store: RunStore | None = None, events: EventHub | None = None,
                 origin: str = "config"):
        if config.client_ids is None:
            raise ValueError("a run needs client_ids")
        if config.run.dropout or config.run.stragglers:
            raise ValueError("dropout and stragglers are faults of the simulation; a deployment has real ones")
        if config.run.vectorize or config.run.backend != "inprocess":
            raise ValueError("vectorize and backend are how a simulation runs its clients; in a deployment each "
                             "client is a device")
        self.cfg = config
        self.origin = origin
        self.run_config = config.run.model_copy(update={"clients": len(config.client_ids)}).resolved()
        self.spec = get_strategy(self.run_config.strategy)
        self.client_ids = list(config.client_ids)
        self.public_bytes: bytes | None = None
        self.public_hash: str | None = None
        public_size, public_x = 0, None
        if config.public_file is not None:
            self.public_bytes, x = read_public_file(config.public_file)
            self.public_hash, public_size = content_hash(x), len(x)
            public_x = x
        elif self.spec.uses_public_set:
            # the same rows `fedal simulate` holds out for this dataset, size and seed
            rc = self.run_config
            x = public_set(rc.dataset, rc.public_size, rc.seed, rc.data_dir, **rc.dataset_options())
            buf = io.BytesIO()
            np.savez(buf, x=x)
            self.public_bytes, self.public_hash, public_size = buf.getvalue(), content_hash(x), len(x)
            public_x = x
        self.device = pick_device(config.device)
        context = ServerContext(config.num_classes, public_size, self.run_config.seed, self.device, public_x,
                                weight_layout=self._global_weight_layout())
        self.server = self.spec.server(self.run_config.strategy_params, self.client_ids, context)

        self.transport = MqttTransport(config.broker, config.run_id, self.client_ids)
        self.bus, self.inbox = self.transport.bus, self.transport.inbox
        self.engine = RoundEngine(self.server, self.transport, run_id=config.run_id, phases=config.phases,
                                  phase_kinds=self.spec.phases, rounds=self.run_config.rounds,
                                  eval_every=self.run_config.eval_every, global_metrics=self._global_model_metrics,
                                  notify=self._notify, on_reconnect=self._publish_manifest,
                                  on_pause=lambda: self.pause(by_operator=False))
        self.store = store or RunStore(config.store_url or default_store_url(config.state_dir))
        self.lock = self.engine.lock  # one lock for what the API reads
        self.health_limits = config.health.limits()
        self.finished_event = threading.Event()
        self.closing = threading.Event()  # set at the coordinator's shutdown (close)
        self.events = events or EventHub()
        self.records: list[dict[str, Any]] = []
        self.state = "pending"
        self.error: str | None = None
        self.round = 0
        self.round_entered = False  # a round of this instance began (else a stop shows the rounds done)
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.finished_before: float | None = None  # when a run found finished in the store finished
        self.was_paused = False  # the store had it paused: an operator's hold outlives a restart
        self.found_complete = False  # every round of it was in the store when it started
        self.resumed = False  # _resume() went through: the counts are the stored ones and what came since
        self.connected_once = False  # past its broker connection: a resume makes it `running`, else `pending`
        self.operator_paused = False  # paused over the API (a phases.pause_at hold comes back by itself)
        # a state change and its store write as one (pause/resume from the API, the end from the run's
        # thread): the store never ends up with an older state than the run's
        self.state_write = threading.Lock()
        self.transport_before: Counter[str] = Counter()  # the transport's counts of earlier starts of the run
        self.config_hash = hashlib.sha256(
            json.dumps([config.run_id, self.run_config.model_dump(mode="json"), self.client_ids, self.public_hash]).encode()
        ).hexdigest()
        self.stored_state_taken = self._take_stored_state()

    def _take_stored_state(self) -> bool:
        """The stored run's state, taken before the API can act on the run (its thread starts once
        the API is up, and reads the rest): a run found finished is `finished` at once, so a pause
        is refused instead of written over its end; one an operator paused before a restart is
        `paused`, so a resume sticks instead of being undone by the thread's own reading. False
        where the store cannot be read now (the thread then decides, as it reads it)."""
        try:
            stored = self.store.load(self.cfg.run_id)
        except Exception as exc:  # noqa: BLE001 - a store busy now: the thread reads it again and says so
            log.warning("run %s: its stored state is read when it starts (%s: %s)", self.cfg.run_id,
                        type(exc).__name__, exc)
            return False
        if stored is None or stored.config_hash != self.config_hash:
            return True
        if stored.completed_rounds >= self.run_config.rounds:  # (a kill between its last round's save and
            self.state, self.finished_at = "finished", stored.finished_at  # its end left it `running`)
        elif stored.state == "paused" and stored.completed_rounds < self.run_config.rounds:
            log.info("run %s was paused when the coordinator stopped: it stays paused (resume it over the API)",
                     self.cfg.run_id)
            self.engine.pause()
            self.state, self.operator_paused = "paused", True
        return True

    @property
    def instance(self) -> str:
        """The same across restarts of one run, new for a fresh start (set when it starts)."""
        return self.engine.instance

    # -- lifecycle ---------------------------------------------------------------------------
    def public_url(self) -> str:
        host = self.cfg.api.host
        if is_wildcard(host):  # a wildcard bind address is not an address agents can reach
            host = machine_fqdn()  # the name the API answers too (fedal/hosts.py)
        base = self.cfg.api.public_base_url or f"http://{url_host(host)}:{self.cfg.api.port}"
        return f"{base.rstrip('/')}/api/v1/runs/{self.cfg.run_id}/public"

    def manifest(self) -> RunManifest:
        return RunManifest(
            run_id=self.cfg.run_id,
            strategy=self.run_config.strategy,
            strategy_params=self.run_config.strategy_params.manifest_dict(),
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

    def _publish_manifest(self) -> None:
        self.transport.publish_manifest(self.manifest().to_json())

    def run(self) -> None:
        """Thread target: resume or start, run every round, finish."""
        try:
            start = self._resume()
            self.round = min(start, self.run_config.rounds - 1)  # a run found finished: its last round, as at its end
            # every round in the store (its end recorded, or killed between its last save and its end): finished
            self.found_complete = start >= self.run_config.rounds
            if self.found_complete:  # it says so at once, broker or not
                with self.lock:  # (a pause or resume meanwhile is refused: it is not `pending`)
                    self.finished_at = self.finished_before
                if self.state != "finished":
                    self._set_state("finished")
            if self.was_paused and start < self.run_config.rounds and not self.stored_state_taken:
                log.info("run %s was paused when the coordinator stopped: it stays paused (resume it over the API)",
                         self.cfg.run_id)
                self.pause()
            if not self.transport.start(self.engine.stop_event) or self.engine.stop_event.is_set():
                raise Stopped()  # (stopped while it connected: never announced as running)
            with self.lock:
                first_start = self.started_at is None
                started = self.started_at = self.started_at or time.time()
            if first_start:
                self.store.set_started(self.cfg.run_id, started)
            if start >= self.run_config.rounds:  # found finished in the store: it just finishes
                self._finish("finished", at=self.finished_before)  # (again: as it finished then)
                return
            with self.state_write:  # the state and its event together: a pause now comes after both
                with self.lock:  # paused while pending: it stays paused, held before its first phase
                    self.connected_once = True
                    held = self.state == "paused"
                    if not held:
                        self.state = "running"
                if not held:
                    self.events.publish("run", run_id=self.cfg.run_id, state="running")
            self._publish_manifest()
            self.engine.wait_for_clients(self.cfg.phases.start_timeout_s)
            for r in range(start, self.run_config.rounds):
                with self.lock:
                    self.round, self.round_entered = r, True
                self._publish_manifest()
                record = self.engine.run_round(r)
                with self.lock:
                    self.records.append(record)
                self.events.publish("round", run_id=self.cfg.run_id, **{k: record.get(k) for k in (
                    "round", "mean_acc", "min_acc", "max_acc", "local_mean_acc", "bytes_up", "bytes_down", "wall_s")})
                self._save(completed=r + 1)
            self._finish("finished")
        except Stopped:
            # a run found finished stays so, with its end time and results (written now if its end was not recorded)
            self._end("finished" if self.found_complete else "stopped", self.finished_before)
        except Exception as exc:  # the API, the event stream and the store must still say what happened
            log.exception("run failed")
            with self.lock:
                self.error = f"{type(exc).__name__}: {exc}"
            self._end("failed")

    def _end(self, state: str, at: float | None = None) -> None:
        """_finish, and where recording the end fails (the store: a full disk, a lock timed out)
        the run ends all the same: the API says so, and a stop or the coordinator's exit waits no longer."""
        try:
            self._finish(state, at=at)
        except Exception as exc:
            log.exception("run %s: could not record its end (%s)", self.cfg.run_id, state)
            with self.lock:
                self.finished_at = self.finished_at or at or time.time()
                self.error = self.error or f"its end ({state}) not recorded: {type(exc).__name__}: {exc}"
            self._set_state(state)
            self.finished_event.set()

    def stop(self) -> None:
        self.engine.stop()

    def close(self) -> None:
        """The coordinator shuts down: stop the run if it runs, and stop following its clients."""
        self.closing.set()
        self.stop()

    def follow_clients(self) -> None:
        """After the run has ended, until close(): its clients' statuses still come (agents leave
        with a retained `offline`, devices come and go) and keep `online` and `last_seen` true,
        and anything else sent on its topics is handled as for a run (counted, late or refused)
        instead of piling up in the inbox."""
        while not self.closing.is_set():
            arrival = self.transport.receive(FOLLOW_POLL_S)
            if arrival is None:
                continue
            try:
                self.engine.handle(arrival)
            except Exception:  # noqa: BLE001 - a message to an ended run never ends the coordinator
                log.exception("run %s: a message after the run's end could not be handled", self.cfg.run_id)
        self.save_counts()

    def pause(self, by_operator: bool = True) -> None:
        """Hold the run before its next phase (a pending run: before its first); open phases
        finish, agents keep their state. An operator's pause is kept in the store, so the run
        stays held across a restart or a crash of the coordinator; a `phases.pause_at` hold is
        not (the restarted run reaches its point again and holds there)."""
        with self.state_write:
            with self.lock:
                if self.state not in ("pending", "running"):
                    return
            if by_operator:  # the store first: a write that fails changes nothing (the API says so, and a
                self.store.set_state(self.cfg.run_id, "paused")  # second pause writes it); the run's
            with self.lock:  # end cannot come between (it takes state_write too)
                self.engine.pause()
                self.state = "paused"
                self.operator_paused = by_operator
            self.events.publish("run", run_id=self.cfg.run_id, state="paused")

    def resume(self) -> None:
        """The engine is released inside the same lock as the state changes: a pause that comes
        right after holds the run, instead of being undone by a late release."""
        with self.state_write:
            if self.state != "paused":
                return
            if self.operator_paused:  # the store first: a write that fails leaves the run held and paused
                with self.lock:  # (the API says so; a second resume writes it), never `running` and held
                    stored = "running" if self.connected_once else "pending"
                self.store.set_state(self.cfg.run_id, stored)
            self.operator_paused = False
            with self.lock:  # decided with the run thread's check after its connect: one of the two says `running`
                state = "running" if self.connected_once else "pending"  # paused while pending: pending again
                self.state = state
            self.events.publish("run", run_id=self.cfg.run_id, state=state)
            self.engine.resume()

    def _set_state(self, state: str) -> None:
        with self.lock:
            self.state = state
        self.events.publish("run", run_id=self.cfg.run_id, state=state)

    def _notify(self, kind: str, **fields: Any) -> None:
        self.events.publish(kind, run_id=self.cfg.run_id, **fields)

    def run_spec(self) -> dict[str, Any]:
        """What it takes to start this run again (kept by the store)."""
        return {"run_id": self.cfg.run_id, "run": self.cfg.run.model_dump(mode="json"), "client_ids": self.client_ids,
                "num_classes": self.cfg.num_classes, "public_file": str(self.cfg.public_file) if self.cfg.public_file else None,
                "phases": self.cfg.phases.model_dump(mode="json")}

    def _resume(self) -> int:
        stored = self.store.load(self.cfg.run_id)
        self.store.register(self.cfg.run_id, self.run_spec(), self.origin)
        start = 0
        engine = self.engine
        if stored and stored.config_hash == self.config_hash:
            self.was_paused = stored.state == "paused"
            self.server.load_state_dict(self.store.load_server_state(self.cfg.run_id))
            self.records = stored.records[: stored.completed_rounds]
            start = stored.completed_rounds
            engine.epoch = stored.epoch + 1
            engine.instance = stored.instance or ""
            self.started_at = stored.started_at
            self.finished_before = stored.finished_at if stored.state == "finished" else None
            known = {f.name for f in fields(ClientInfo)}  # a field a later version added is left out
            for cid, info in stored.clients.items():
                if cid in engine.clients:
                    engine.clients[cid] = ClientInfo(**{**{k: v for k, v in info.items() if k in known}, "online": False})
            engine.counters.update(stored.counters.get("counters", {}))
            engine.reject_reasons.update(stored.counters.get("rejects", {}))
            self.transport_before = Counter(stored.counters.get("transport", {}))
            log.info("resuming run %s after round %d (epoch %d)", self.cfg.run_id, start, engine.epoch)
        elif stored and stored.config_hash is not None:
            kept = self._keep_replaced(stored)  # before anything is forgotten: raises if it cannot
            log.warning("stored run %s belongs to another config; starting afresh (its %d stored rounds are kept in %s)",
                        self.cfg.run_id, len(stored.records), kept)
            self.store.reset(self.cfg.run_id)
        # the rounds done are not run again: their pause points are behind (the API lists those ahead);
        # the round under way is, and holds at its point again
        engine.pause_points = [p for p in engine.pause_points if p.round > start]
        if not engine.instance:
            engine.instance = f"{self.config_hash[:12]}-{uuid.uuid4().hex[:8]}"
        # the stored state stays until the run changes it: a run found finished (or held) and then
        # stopped or killed before it reached the broker is still that, not `pending`
        kept = stored.state if stored and stored.config_hash == self.config_hash else None
        if kept == "paused" and self.stored_state_taken:  # that hold is the run's own state now: an
            kept = None  # operator's resume since has changed it, and is what the store must keep
        self._save(completed=start, server_state=start == 0, pending_as=kept)
        self.resumed = True  # the store's counts are this run's now: save_counts may write over them
        return start

    def _keep_replaced(self, stored: StoredRun) -> Path:
        """A stored run the config no longer matches, as JSON under state_dir/previous-runs/ (its
        rounds, clients and spec): starting afresh forgets it in the store, never on disk."""
        path = self.cfg.state_dir / "previous-runs" / f"{self.cfg.run_id}-{stored.instance or 'run'}.json"
        record = {"run_id": stored.run_id, "instance": stored.instance, "config_hash": stored.config_hash,
                  "state": stored.state, "completed_rounds": stored.completed_rounds, "started_at": stored.started_at,
                  "finished_at": stored.finished_at, "spec": stored.spec, "rounds": stored.records,
                  "clients": stored.clients}
        write_bytes_atomic(path, (json.dumps(record, indent=2) + "\n").encode())
        return path

    def _save(self, completed: int, server_state: bool = True, pending_as: str | None = None) -> None:
        """Under `state_write`, as pause and resume: the state it writes is still the run's when
        it lands (an operator's pause saved over by a round's save would not outlive a restart).
        pending_as: what to store while the run is still pending (the state the store had)."""
        with self.state_write:
            with self.lock:
                if self.state == "pending" and pending_as is not None:
                    state = pending_as
                else:
                    state = "running" if self.state == "paused" and not self.operator_paused else self.state
                progress = {"config_hash": self.config_hash, "completed_rounds": completed, "epoch": self.engine.epoch,
                            "instance": self.instance, "started_at": self.started_at, "state": state}
                records = list(self.records)
                info, counters = self._counts()
            self.store.save(self.cfg.run_id, progress, records, info,
                            self.server.state_dict() if server_state else None, counters)

    def _counts(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, int]]]:
        """Under the lock: every client's record and the run-wide counters, as the store keeps
        them (a restarted run goes on counting from them)."""
        info = {c: asdict(i) for c, i in self.engine.clients.items()}
        counters = {"counters": dict(self.engine.counters), "rejects": dict(self.engine.reject_reasons),
                    "transport": dict(self._transport_counters())}
        return info, counters

    def save_counts(self) -> None:
        """The counts as they are now, also what came since the last round's save (a round under
        way, messages after the run's end): kept when the coordinator shuts down, so the counters
        it exports do not go back after a restart (Prometheus reads a decrease as a reset)."""
        if not self.resumed:  # a run whose resume failed holds none of the stored counts: those stay
            return
        with self.state_write:
            with self.lock:
                info, counters = self._counts()
            try:
                self.store.save_counts(self.cfg.run_id, info, counters)
            except Exception as exc:  # noqa: BLE001 - a full disk: the counts of the last round's save stay
                log.error("run %s: its counts at shutdown are not recorded in the store (%s: %s)", self.cfg.run_id,
                          type(exc).__name__, exc)

    def _finish(self, state: str, at: float | None = None) -> None:
        """End the run in `state`; `at`: when it ended before a restart (its results, written
        then, stay as they are)."""
        with self.state_write:
            with self.lock:
                self.engine.current = None
                self.finished_at = at or time.time()
                # stopped by the coordinator's shutdown while an operator held it: held again after the restart
                held = state == "stopped" and self.closing.is_set() and self.state == "paused" and self.operator_paused
            self._set_state(state)
            try:
                self.store.set_state(self.cfg.run_id, "paused" if held else state, None if held else self.finished_at)
            except Exception as exc:  # noqa: BLE001 - a full disk, a lock timed out: the run still ends as it did
                log.error("run %s: its end (%s) is not recorded in the store (%s: %s); its rounds are, and the "
                          "coordinator started again records it", self.cfg.run_id, state, type(exc).__name__, exc)
                with self.lock:
                    self.error = self.error or f"its end ({state}) not recorded: {type(exc).__name__}: {exc}"
        if self.bus.connected.is_set():
            self._publish_manifest()
        path = self.cfg.results_file or (self.cfg.state_dir / "results.json")
        if state == "finished" and (at is None or not path.exists()):
            try:  # whole or not at all: a torn file would be refused as someone else's at the next start
                check_replaceable(path, is_results, "results file")  # (a file put there since the run began)
                write_bytes_atomic(path, (json.dumps(self.results(), indent=2) + "\n").encode())
            except ForeignFile as exc:  # never written over: the run's rounds are in the store
                log.error("run %s: its results are not written to %s: %s", self.cfg.run_id, path, exc)
                with self.lock:
                    self.error = f"results not written: {exc}"
            except OSError as exc:  # the run stays finished: its rounds are in the store
                log.error("run %s: cannot write its results to %s (%s); its rounds are kept in the store, and the "
                          "coordinator started again writes them", self.cfg.run_id, path, exc)
                with self.lock:
                    self.error = f"results not written to {path}: {exc.strerror or exc} (a restart writes them)"
        self.finished_event.set()

    # -- evaluation --------------------------------------------------------------------------
    @functools.cached_property
    def global_test(self):
        """The run's common test set, derived from its config like the public set; None if this
        machine cannot load it (a file dataset without its files): then no global_acc."""
        try:
            return load_dataset(self.run_config.dataset, self.run_config.data_dir, **self.run_config.dataset_options())[1]
        except (ValueError, OSError) as exc:
            log.warning("no global_acc: cannot load the %s test set here: %s", self.run_config.dataset, exc)
            return None

    def _global_weight_layout(self) -> dict[str, tuple[tuple[int, ...], str]] | None:
        """The global model's tensors, for a strategy that keeps one: one device's first upload
        of another layout is refused then, not taken for the global model (which would fail the
        run at its evaluation). None where the test set, which gives the input shape, is not here."""
        test = self.global_test if self.spec.global_model else None
        if test is None:
            return None
        return global_weight_layout(self.run_config.models[0], tuple(test.x.shape[1:]), self.cfg.num_classes,
                                    self.run_config.strategy_params.privacy is not None)

    def _global_model_metrics(self, summary: dict[str, Any]) -> dict[str, Any]:
        """FedAvg-type strategies: the aggregated model, which only the coordinator holds, on the
        dataset's common test set (`global_acc`, computed as `fedal simulate` does)."""
        if not self.spec.global_model:
            return {}
        test = self.global_test
        try:
            acc = None if test is None else global_accuracy(self.server, self.run_config.models[0],
                                                            self.cfg.num_classes, test.x, test.y,
                                                            threads=self.run_config.threads)
        except ValueError as exc:  # weights a restarted run kept from before the layout check: said, not fatal
            self.engine.counters["global_eval_failed"] += 1
            log.error("run %s: the global model does not load into %s: %s (no global_acc)", self.cfg.run_id,
                      self.run_config.models[0], exc)
            acc = None
        return fedavg_style_metrics(summary, acc)

    # -- what the API reads ------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """The run-wide counters, with the unfinished chunked messages the transport dropped. The
        always-present ones are 0 until counted (an API reader may index them)."""
        return {**dict.fromkeys(ALWAYS_COUNTED, 0), **self.engine.counters, **self._transport_counters()}

    def _transport_counters(self) -> Counter[str]:
        """The transport's, added to what earlier starts of the run counted (the store keeps them)."""
        return self.transport_before + Counter(self.transport.counters())

    def _round_shown(self) -> int:
        """The round under way (1-based); a run stopped, failed or paused before any round began
        shows the rounds it completed (0 for a new run), not a round it never entered."""
        if self.state == "pending" or (self.state in ("stopped", "failed", "paused") and not self.round_entered):
            return len(self.records)
        return min(self.round + 1, self.run_config.rounds)

    def summary(self) -> dict[str, Any]:
        """What a list of runs shows of this one: a snapshot's first fields, without copying
        every client (a run of 10,000 clients took 0.7 s under the lock for each listing)."""
        with self.lock:
            return self._summary()

    def _summary(self) -> dict[str, Any]:
        cur = self.engine.current
        return {"run_id": self.cfg.run_id, "strategy": self.run_config.strategy, "state": self.state,
                "round": self._round_shown(), "rounds": self.run_config.rounds, "completed_rounds": len(self.records),
                "phase": cur.phase.phase if cur else None, "iteration": cur.phase.iteration if cur else None,
                "started_at": self.started_at, "finished_at": self.finished_at}

    def snapshot(self) -> dict[str, Any]:
        engine = self.engine
        with self.lock:
            return {
                **self._summary(),
                "error": self.error,
                "held_before": engine.held_before,
                "pause_at": [p.model_dump() for p in engine.pause_points],
                "counters": self.counters,
                "rejects": dict(engine.reject_reasons),
                "clients": {c: {**asdict(i), "health_flags": health_flags(i.health, self.health_limits)}
                            for c, i in engine.clients.items()},
                "config": self.run_config.model_dump(mode="json"),
                "last_round": self.records[-1] if self.records else None,
            }

    def rounds(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.records)

    def results(self) -> dict[str, Any]:
        """The same results contract as `fedal simulate` (one builder for both)."""
        with self.lock:
            records = list(self.records)
            deployment = {"run_id": self.cfg.run_id, "device": self.device, "counters": self.counters,
                          "rejects": dict(self.engine.reject_reasons),
                          "clients": {c: asdict(i) for c, i in self.engine.clients.items()}}
        wall = (self.finished_at or time.time()) - (self.started_at or time.time())
        return build_results(self.run_config.model_dump(mode="json"),
                             {"public_hash": self.public_hash, "public_size": self.server.context.public_size},
                             [{"id": cid} for cid in self.client_ids], records, final_summary(records), wall,
                             deployment=deployment)
