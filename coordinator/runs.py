"""The runs one coordinator drives: the one its config names, and those created over the API.

Each run is a Run on its own thread with its own MQTT session; they share the store and
the event hub. Runs created with `POST /api/v1/runs` are kept in the store with their spec, so
a restarted coordinator picks them up again and resumes them like the configured one.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.config import CoordinatorConfig, RunSpec
from coordinator.events import EventHub
from coordinator.run import ALWAYS_COUNTED, Run
from coordinator.store import RunStore, default_store_url
from fedal.log_limit import RateLimitedLog
from fedal.owned import ForeignFile, check_replaceable, is_results
from fedal.sim.config import format_validation_error

log = logging.getLogger("coordinator.runs")
ENDED = ("finished", "stopped", "failed")


class RunConflict(ValueError):
    """A run with that id exists already."""


class InvalidRunSpec(ValueError):
    """A run spec that cannot describe a run; the message says what to change."""


class ShuttingDown(RuntimeError):
    """The coordinator is stopping: no run is created any more."""


def _inside(path: Path, directory: Path) -> bool:
    """An API client may only point at files the operator put under the state dir."""
    try:
        return Path(path).resolve().is_relative_to(Path(directory).resolve())
    except (ValueError, OSError):  # a NUL byte in it, a loop of links: no file an API caller may name
        return False


def _table_or_empty(value: Any) -> dict[str, Any]:
    """A stored table's part as the view shows it: a part of another shape (a damaged row) is none."""
    return dict(value) if isinstance(value, dict) else {}


class ConfiguredRunError(ValueError):
    """The config file's run cannot be built; the message says why (the coordinator exits 2)."""


class RunManager:
    def __init__(self, config: CoordinatorConfig, store: RunStore | None = None, events: EventHub | None = None):
        self.config = config
        self.store = store or RunStore(config.store_url or default_store_url(config.state_dir))
        self.events = events or EventHub()
        self.by_id: dict[str, Run] = {}
        # stored runs a restart could not bring back (their spec no longer loads, a file moved):
        # run id -> why. They stay visible as failed and keep their ids; the store keeps their history.
        self.unrestored: dict[str, str] = {}
        self._unrestored_views: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
        self.creating: set[str] = set()  # ids of runs being built by create(), outside the lock
        self.refused_requests: Counter[int] = Counter()  # API requests refused, by HTTP status (400, 401, 403, 413, 422, 503)
        self.refusal_log = RateLimitedLog(log, "refused requests")
        self.threads: dict[str, threading.Thread] = {}
        self.lock = threading.RLock()
        # one run built at a time (building a server seeds torch's global generator), outside `lock`
        self.build_lock = threading.Lock()
        self.started = False
        self.stopping = False
        self.all_done = threading.Event()

    @classmethod
    def of(cls, run: Run) -> RunManager:
        """A manager around one run built elsewhere (embedding, tests)."""
        manager = cls(run.cfg, run.store, run.events)
        manager.by_id[run.cfg.run_id] = run
        return manager

    def restore(self) -> None:
        """The configured run, then every run created over the API before a restart."""
        initial = self.config.initial_run()
        if initial is not None:
            try:
                self._add(self._new_run(initial, "config"))
            except (ValueError, OSError) as exc:  # e.g. phases.pause_at past its rounds, public_size past the data
                raise ConfiguredRunError(f"the configured run cannot start: {exc}") from None
        for run_id in self.store.run_ids(origin="api"):
            if run_id in self.by_id:
                continue
            try:
                stored = self.store.load(run_id)  # (DamagedRow, a ValueError: that run alone is not restored)
                if stored is None:  # (gone since it was listed)
                    continue
                spec = RunSpec.model_validate(_as_stored_then(stored.spec))
                where = self._outside_reach(spec)
                if where:
                    raise ValueError(where)
                self._add(self._new_run(spec, "api"))
            except (ValidationError, ValueError, OSError) as exc:
                reason = format_validation_error(exc, RunSpec) if isinstance(exc, ValidationError) else str(exc)
                log.error("cannot restore run %s from the store: %s (it is shown as failed; its stored "
                          "rounds are kept)", run_id, reason)
                self.unrestored[run_id] = reason

    def create(self, body: Any) -> Run:
        """Validate a run spec, store it and start it (if the coordinator is serving)."""
        try:
            spec = RunSpec.model_validate(body)
        except ValidationError as exc:
            raise InvalidRunSpec(format_validation_error(exc, RunSpec).replace("invalid config", "invalid run")) from None
        where = self._outside_reach(spec)
        if where:
            raise InvalidRunSpec(f"invalid run: {where}")
        try:  # its results go to state_dir/runs/<run_id>/results.json: never over another's file
            check_replaceable(self._results_path(spec.run_id), is_results, "results file")
        except ForeignFile as exc:
            raise InvalidRunSpec(f"invalid run: {exc}") from None
        with self.lock:
            if self.stopping:
                raise ShuttingDown("the coordinator is shutting down")
            self._check_free(spec.run_id)
            self.creating.add(spec.run_id)
        try:  # built outside the lock: deriving a large public set takes a while, and every read waits on the lock
            with self.build_lock:
                run = self._new_run(spec, "api")
        except (ValueError, OSError) as exc:
            with self.lock:
                self.creating.discard(spec.run_id)
            raise InvalidRunSpec(f"invalid run: {exc}") from None
        except BaseException:
            with self.lock:
                self.creating.discard(spec.run_id)
            raise
        with self.lock:  # its id stays claimed (`creating`) until the run is added, in this one block:
            try:  # a second request for the same id, checked in between, would pass and start a run of its own
                if self.stopping:  # stop() has closed the runs it knew: this one is never started
                    run.transport.stop()
                    raise ShuttingDown("the coordinator is shutting down")
                self.store.register(spec.run_id, run.run_spec(), "api")
                self._add(run)
                if self.started:
                    self._start(run)
            finally:
                self.creating.discard(spec.run_id)
        log.info("created run %s (%s, %d clients)", spec.run_id, run.run_config.strategy, len(run.client_ids))
        return run

    def _outside_reach(self, spec: RunSpec) -> str | None:
        """Why a run spec's files lie where an API caller may not point the coordinator, or None.
        Checked at creation and again at restore: a spec an older coordinator stored keeps no
        right the current rules refuse."""
        if spec.public_file is not None and not _inside(spec.public_file, self.config.state_dir):
            return (f"public_file must lie inside the coordinator's state_dir ({self.config.state_dir}); or leave it "
                    "out to derive the public set from run.dataset")
        data_dirs = [self.config.state_dir, *([self.config.run.data_dir] if self.config.run.data_dir else [])]
        if spec.run.data_dir and not any(_inside(spec.run.data_dir, d) for d in data_dirs):
            # its rows would be served without a token as the run's public set, and a cache written there
            return ("run.data_dir must lie inside the coordinator's state_dir or its configured run's data_dir; the "
                    "operator puts datasets there")
        return None

    def refused(self, status: int, method: str, path: str, client: str | None, detail: str) -> None:
        """An API request refused: counted (/metrics) and logged, so that token guessing or a
        misconfigured client leaves a trace."""
        with self.refusal_log.lock:  # (not `lock`: this runs on the server's event loop)
            self.refused_requests[status] += 1
        # the path quoted (repr): a decoded path may hold a newline that would forge a log line
        self.refusal_log.warning("API: refused %s %r from %s: %d %s", method, path, client or "?", status, detail)

    def _check_free(self, run_id: str) -> None:
        """RunConflict unless `run_id` names no run: none running or ended, none being created,
        none the store holds (one a restart could not bring back keeps its id and its history)."""
        if run_id in self.by_id or run_id in self.creating:
            raise RunConflict(f"run {run_id!r} exists already")
        if run_id in self.unrestored:
            raise RunConflict(f"run {run_id!r} exists already (stored; a restart could not bring it back: "
                              f"{self.unrestored[run_id]})")
        if run_id in self.store.run_ids():
            raise RunConflict(f"run {run_id!r} exists already (in the store)")

    def unrestored_snapshot(self, run_id: str) -> dict[str, Any] | None:
        """What the API shows of a stored run a restart could not bring back: failed, and why,
        with what the store kept of it in the shape of a live run's snapshot (read once: such a
        run no longer changes, and the dashboard polls)."""
        view = self._unrestored_view(run_id)
        return None if view is None else view[0]

    def unrestored_rounds(self, run_id: str) -> list[dict[str, Any]] | None:
        """The rounds the store kept of such a run."""
        view = self._unrestored_view(run_id)
        return None if view is None else list(view[1])

    def _unrestored_view(self, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        reason = self.unrestored.get(run_id)
        if reason is None:
            return None
        if run_id not in self._unrestored_views:
            self._unrestored_views[run_id] = self._read_unrestored(run_id, reason)
        return self._unrestored_views[run_id]

    def _read_unrestored(self, run_id: str, reason: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        try:
            stored = self.store.load(run_id)
        except ValueError:  # a damaged row (the reason says which): the run's id and state, nothing more
            stored = None
        spec = stored.spec if stored is not None and isinstance(stored.spec, dict) else {}
        run = spec.get("run") if isinstance(spec.get("run"), dict) else {}  # (a spec that failed to load may be any shape)
        records = stored.records[: stored.completed_rounds] if stored else []
        kept = stored.counters if stored else {}
        counters = {**dict.fromkeys(ALWAYS_COUNTED, 0), **_table_or_empty(kept.get("counters")),
                    **_table_or_empty(kept.get("transport"))}
        clients = {cid: {**info, "online": False, "health_flags": []}
                   for cid, info in (stored.clients if stored else {}).items() if isinstance(info, dict)}
        view = {"run_id": run_id, "strategy": run.get("strategy"), "state": "failed",
                "error": f"cannot restore the run from the store: {reason}", "round": len(records),
                "rounds": run.get("rounds"), "completed_rounds": len(records), "phase": None, "iteration": None,
                "held_before": None, "pause_at": [], "started_at": stored.started_at if stored else None,
                "finished_at": stored.finished_at if stored else None, "counters": counters,
                "rejects": _table_or_empty(kept.get("rejects")), "clients": clients, "config": run,
                "last_round": records[-1] if records else None}
        return view, records

    def _results_path(self, run_id: str) -> Path:
        """Where an API-created run writes its results."""
        return self.config.state_dir / "runs" / run_id / "results.json"

    def _new_run(self, spec: RunSpec, origin: str) -> Run:
        results = None if origin == "config" else self._results_path(spec.run_id)
        for note in spec.run.notes():
            log.info("run %s: %s", spec.run_id, note)
        return Run(self.config.for_run(spec, results), store=self.store, events=self.events, origin=origin)

    def _add(self, run: Run) -> None:
        with self.lock:
            self.by_id[run.cfg.run_id] = run
            self.all_done.clear()

    def start(self) -> None:
        """Start every run; after stop() (a stop signal right as the API came up) none."""
        with self.lock:
            if self.stopping:
                return
            self.started = True
            for run in self.by_id.values():
                self._start(run)

    def _start(self, run: Run) -> None:
        run_id = run.cfg.run_id
        if run_id in self.threads:
            return

        def _run() -> None:
            run.run()
            with self.lock:
                if all(e.finished_event.is_set() for e in self.by_id.values()):
                    self.all_done.set()
            run.follow_clients()  # until the coordinator shuts down

        thread = threading.Thread(target=_run, name=f"run-{run_id}", daemon=True)
        self.threads[run_id] = thread
        thread.start()

    def get(self, run_id: str) -> Run | None:
        with self.lock:
            return self.by_id.get(run_id)

    def list(self) -> list[Run]:
        with self.lock:
            return list(self.by_id.values())

    def stop(self, timeout_s: float = 30) -> None:
        with self.lock:
            self.stopping = True
        for run in self.list():
            run.close()
        for thread in list(self.threads.values()):
            thread.join(timeout=timeout_s)
        for run in self.list():
            run.transport.stop()


def _as_stored_then(spec: Any) -> Any:
    """A stored run spec read as it was accepted when it was stored: `run.models = []` meant the
    dataset's default models before an empty list was refused (the resolved run, and so the
    run's config hash, is the same)."""
    run = spec.get("run") if isinstance(spec, dict) else None
    if isinstance(run, dict) and run.get("models") == []:
        return {**spec, "run": {k: v for k, v in run.items() if k != "models"}}
    return spec
