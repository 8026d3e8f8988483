"""The runs one coordinator drives: the one its config names, and those created over the API.

Each run is a RoundEngine on its own thread with its own MQTT session; they share the store and
the event hub. Runs created with `POST /api/v1/runs` are kept in the store with their spec, so
a restarted coordinator picks them up again and resumes them like the configured one.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from coordinator.config import CoordinatorConfig, RunSpec
from coordinator.engine import RoundEngine
from coordinator.events import EventHub
from coordinator.store import RunStore, default_store_url
from fedal.sim.config import format_validation_error

log = logging.getLogger("coordinator.runs")
ENDED = ("finished", "stopped", "failed")


class RunConflict(ValueError):
    """A run with that id exists already."""


class InvalidRunSpec(ValueError):
    """A run spec that cannot describe a run; the message says what to change."""


def _inside(path: Path, directory: Path) -> bool:
    """An API client may only point at files the operator put under the state dir."""
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


class RunManager:
    def __init__(self, config: CoordinatorConfig, store: RunStore | None = None, events: EventHub | None = None):
        self.config = config
        self.store = store or RunStore(config.store_url or default_store_url(config.state_dir))
        self.events = events or EventHub()
        self.engines: dict[str, RoundEngine] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.lock = threading.RLock()
        self.started = False
        self.all_done = threading.Event()

    @classmethod
    def of(cls, engine: RoundEngine) -> "RunManager":
        """A manager around one engine built elsewhere (embedding, tests)."""
        manager = cls(engine.cfg, engine.store, engine.events)
        manager.engines[engine.cfg.run_id] = engine
        return manager

    def restore(self) -> None:
        """The configured run, then every run created over the API before a restart."""
        initial = self.config.initial_run()
        if initial is not None:
            self._add(self._engine(initial, "config"))
        for run_id in self.store.run_ids(origin="api"):
            if run_id in self.engines:
                continue
            stored = self.store.load(run_id)
            try:
                spec = RunSpec.model_validate(stored.spec)
                self._add(self._engine(spec, "api"))
            except (ValidationError, ValueError, OSError) as exc:
                log.error("cannot restore run %s from the store: %s", run_id, exc)

    def create(self, body: Any) -> RoundEngine:
        """Validate a run spec, store it and start it (if the coordinator is serving)."""
        try:
            spec = RunSpec.model_validate(body)
        except ValidationError as exc:
            raise InvalidRunSpec(format_validation_error(exc).replace("invalid config", "invalid run")) from None
        if spec.public_file is not None and not _inside(spec.public_file, self.config.state_dir):
            raise InvalidRunSpec(f"invalid run: public_file must lie inside the coordinator's state_dir "
                                 f"({self.config.state_dir}); or leave it out to derive the public set from run.dataset")
        with self.lock:
            if spec.run_id in self.engines:
                raise RunConflict(f"run {spec.run_id!r} exists already")
            try:
                engine = self._engine(spec, "api")
            except (ValueError, OSError) as exc:
                raise InvalidRunSpec(f"invalid run: {exc}") from None
            self.store.register(spec.run_id, engine.run_spec(), "api")
            self._add(engine)
            if self.started:
                self._start(engine)
        log.info("created run %s (%s, %d clients)", spec.run_id, engine.run_config.strategy, len(engine.client_ids))
        return engine

    def _engine(self, spec: RunSpec, origin: str) -> RoundEngine:
        results = None if origin == "config" else self.config.state_dir / "runs" / spec.run_id / "results.json"
        note = spec.run.default_model_note()
        if note:
            log.info("run %s: %s", spec.run_id, note)
        return RoundEngine(self.config.for_run(spec, results), store=self.store, events=self.events, origin=origin)

    def _add(self, engine: RoundEngine) -> None:
        with self.lock:
            self.engines[engine.cfg.run_id] = engine
            self.all_done.clear()

    def start(self) -> None:
        with self.lock:
            self.started = True
            for engine in self.engines.values():
                self._start(engine)

    def _start(self, engine: RoundEngine) -> None:
        run_id = engine.cfg.run_id
        if run_id in self.threads:
            return

        def _run() -> None:
            engine.run()
            with self.lock:
                if all(e.finished_event.is_set() for e in self.engines.values()):
                    self.all_done.set()

        thread = threading.Thread(target=_run, name=f"run-{run_id}", daemon=True)
        self.threads[run_id] = thread
        thread.start()

    def get(self, run_id: str) -> RoundEngine | None:
        with self.lock:
            return self.engines.get(run_id)

    def list(self) -> list[RoundEngine]:
        with self.lock:
            return list(self.engines.values())

    def stop(self, timeout_s: float = 30) -> None:
        for engine in self.list():
            engine.stop()
        for thread in list(self.threads.values()):
            thread.join(timeout=timeout_s)
        for engine in self.list():
            engine.bus.stop()
