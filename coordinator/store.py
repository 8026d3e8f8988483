"""Run persistence: runs, rounds, clients, metrics and the strategy's server state in SQL.

SQLite (one file under the state dir) by default; any SQLAlchemy URL otherwise, e.g.
`postgresql+psycopg://user:pw@host/db`. Everything a round changes is written in one
transaction after the round completes, so a coordinator killed at any moment restarts from the
last completed round and no round is ever recorded twice (rounds are keyed by run and number).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import (
    Column,
    Float,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    exc,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Engine, make_url

from fedal.protocol.broker_url import without_password

metadata = MetaData()

runs = Table(
    "runs", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("origin", String(16), nullable=False),  # "config" (the coordinator's file) or "api" (POST /api/v1/runs)
    Column("spec", Text, nullable=False),  # JSON: what it takes to start the run again
    Column("config_hash", String(64)),
    Column("instance", String(64)),
    Column("epoch", Integer, nullable=False, default=0),
    Column("completed_rounds", Integer, nullable=False, default=0),
    Column("state", String(16), nullable=False, default="pending"),
    Column("created_at", Float),
    Column("started_at", Float),
    Column("finished_at", Float),
)
rounds = Table(
    "rounds", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("round", Integer, primary_key=True),
    Column("record", Text, nullable=False),  # JSON: the round's full record, as the API serves it
)
clients = Table(
    "clients", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("client_id", String(128), primary_key=True),
    Column("info", Text, nullable=False),  # JSON: counters, last seen, last accuracies
)
metrics = Table(
    "metrics", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("round", Integer, primary_key=True),
    Column("name", String(128), primary_key=True),
    Column("value", Float, nullable=False),
)
run_counters = Table(  # (a table of its own: an existing store gains it at open, no migration)
    "run_counters", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("counters", Text, nullable=False),  # JSON: {"counters": run-wide, "rejects": by reason, "transport": the link's}
)
server_states = Table(
    "server_state", metadata,
    Column("run_id", String(128), primary_key=True),
    Column("state", LargeBinary, nullable=False),  # torch.save of the server half's state_dict
)


@dataclass
class StoredRun:
    run_id: str
    origin: str
    spec: dict[str, Any]
    config_hash: str | None
    instance: str | None
    epoch: int
    completed_rounds: int
    state: str
    started_at: float | None
    finished_at: float | None
    records: list[dict[str, Any]] = field(default_factory=list)
    clients: dict[str, dict[str, Any]] = field(default_factory=dict)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # as of its last save: counters, rejects, transport


class DamagedRow(ValueError):
    """A stored row that is not the JSON table it must be (damage on disk, a hand edit): that run
    cannot be read back, the others can."""


def _table(text: Any, run_id: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:
        raise DamagedRow(f"run {run_id}: its stored {what} is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise DamagedRow(f"run {run_id}: its stored {what} is not a table (a {type(value).__name__})")
    return value


def default_store_url(state_dir: Path) -> str:
    return f"sqlite:///{Path(state_dir).resolve() / 'coordinator.db'}"


def flat_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a round record worth querying across runs, one row each."""
    out = {}
    for key, value in record.items():
        if key != "round" and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    for key, value in (record.get("server") or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"server.{key}"] = float(value)
    return out


def _shown_url(url: str) -> str:
    """The store URL as a message may quote it: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (exc.ArgumentError, ValueError):
        return without_password(url)  # one SQLAlchemy's parser refuses


class StoreError(RuntimeError):
    """The run store cannot be used (a damaged database file, a database that refuses us)."""


class RunStore:
    """The coordinator's persistence; one instance is shared by every run of a coordinator."""

    def __init__(self, url: str):
        self.url = url
        try:
            self.engine: Engine = _make_engine(url)
        except (exc.ArgumentError, exc.NoSuchModuleError, ImportError, OSError) as error:  # a URL no driver takes,
            # a missing driver, a sqlite file's folder that cannot be made
            reason = str(getattr(error, "strerror", None) or error).splitlines()[0]
            raise StoreError(f"the run store {_shown_url(url)} cannot be opened: {reason}") from None
        try:
            metadata.create_all(self.engine)
        except exc.SQLAlchemyError as error:  # e.g. a coordinator.db that is no database (damaged, foreign)
            reason = str(getattr(error, "orig", None) or error).splitlines()[0]
            raise StoreError(f"the run store {_shown_url(url)} cannot be opened: {reason}") from None

    # -- runs --------------------------------------------------------------------------------
    def register(self, run_id: str, spec: dict[str, Any], origin: str) -> None:
        """Remember how to start `run_id` (kept across restarts); replaces an older spec."""
        with self.engine.begin() as conn:
            exists = conn.execute(select(runs.c.run_id).where(runs.c.run_id == run_id)).first()
            if exists:
                conn.execute(update(runs).where(runs.c.run_id == run_id).values(spec=json.dumps(spec), origin=origin))
            else:
                conn.execute(insert(runs).values(run_id=run_id, origin=origin, spec=json.dumps(spec), epoch=0,
                                                 completed_rounds=0, state="pending", created_at=time.time()))

    def run_ids(self, origin: str | None = None) -> list[str]:
        query = select(runs.c.run_id).order_by(runs.c.created_at, runs.c.run_id)
        if origin is not None:
            query = query.where(runs.c.origin == origin)
        with self.engine.connect() as conn:
            return [row.run_id for row in conn.execute(query)]

    def load(self, run_id: str) -> StoredRun | None:
        """DamagedRow where a row of the run is not a JSON table."""
        with self.engine.connect() as conn:
            row = conn.execute(select(runs).where(runs.c.run_id == run_id)).first()
            if row is None:
                return None
            recs = conn.execute(select(rounds.c.record).where(rounds.c.run_id == run_id).order_by(rounds.c.round))
            infos = conn.execute(select(clients.c.client_id, clients.c.info).where(clients.c.run_id == run_id))
            counted = conn.execute(select(run_counters.c.counters).where(run_counters.c.run_id == run_id)).scalar()
            return StoredRun(
                run_id=row.run_id, origin=row.origin, spec=_table(row.spec, run_id, "spec"),
                config_hash=row.config_hash, instance=row.instance, epoch=row.epoch,
                completed_rounds=row.completed_rounds, state=row.state, started_at=row.started_at,
                finished_at=row.finished_at, records=[_table(r.record, run_id, "round record") for r in recs],
                clients={c.client_id: _table(c.info, run_id, f"client {c.client_id}") for c in infos},
                counters=_table(counted, run_id, "counters") if counted else {},
            )

    def load_server_state(self, run_id: str) -> dict[str, Any]:
        with self.engine.connect() as conn:
            blob = conn.execute(select(server_states.c.state).where(server_states.c.run_id == run_id)).scalar()
        return {} if blob is None else torch.load(io.BytesIO(blob), weights_only=True)

    def reset(self, run_id: str) -> None:
        """Forget a run's progress (its config changed: it starts afresh)."""
        with self.engine.begin() as conn:
            for table in (rounds, clients, metrics, server_states, run_counters):
                conn.execute(delete(table).where(table.c.run_id == run_id))
            conn.execute(update(runs).where(runs.c.run_id == run_id).values(
                completed_rounds=0, epoch=0, instance=None, config_hash=None, state="pending",
                started_at=None, finished_at=None))

    def save(self, run_id: str, progress: dict[str, Any], records: list[dict[str, Any]],
             client_info: dict[str, dict[str, Any]], server_state: dict[str, Any] | None = None,
             counters: dict[str, dict[str, int]] | None = None) -> None:
        """One transaction: the run row, rounds not stored yet, every client, the server state, the
        run-wide counters."""
        blob = None
        if server_state is not None:
            buf = io.BytesIO()
            torch.save(server_state, buf)
            blob = buf.getvalue()
        with self.engine.begin() as conn:
            conn.execute(update(runs).where(runs.c.run_id == run_id).values(**progress))
            stored = conn.execute(select(rounds.c.round).where(rounds.c.run_id == run_id)).scalars().all()
            for rec in records:
                if rec["round"] in stored:
                    continue
                conn.execute(insert(rounds).values(run_id=run_id, round=rec["round"], record=json.dumps(rec)))
                values = flat_metrics(rec)
                if values:
                    conn.execute(insert(metrics), [{"run_id": run_id, "round": rec["round"], "name": k, "value": v}
                                                   for k, v in values.items()])
            if blob is not None:
                conn.execute(delete(server_states).where(server_states.c.run_id == run_id))
                conn.execute(insert(server_states).values(run_id=run_id, state=blob))
            _put_counts(conn, run_id, client_info, counters)

    def save_counts(self, run_id: str, client_info: dict[str, dict[str, Any]],
                    counters: dict[str, dict[str, int]]) -> None:
        """One transaction: every client and the run-wide counters (nothing of the rounds)."""
        with self.engine.begin() as conn:
            _put_counts(conn, run_id, client_info, counters)

    def set_started(self, run_id: str, started_at: float) -> None:
        """When the run first reached the broker: stored at once, not with its first round (a
        restart before that round would take a new start time)."""
        with self.engine.begin() as conn:
            conn.execute(update(runs).where(runs.c.run_id == run_id, runs.c.started_at.is_(None))
                         .values(started_at=started_at))

    def set_state(self, run_id: str, state: str, finished_at: float | None = None) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(runs).where(runs.c.run_id == run_id).values(state=state, finished_at=finished_at))

    def metric_series(self, run_id: str, name: str) -> list[tuple[int, float]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(metrics.c.round, metrics.c.value)
                                .where(metrics.c.run_id == run_id, metrics.c.name == name).order_by(metrics.c.round))
            return [(r.round, r.value) for r in rows]

    def close(self) -> None:
        self.engine.dispose()


def _put_counts(conn: Any, run_id: str, client_info: dict[str, dict[str, Any]],
                counters: dict[str, dict[str, int]] | None) -> None:
    """Every client's record (replacing the stored ones) and, if given, the run-wide counters."""
    conn.execute(delete(clients).where(clients.c.run_id == run_id))
    if client_info:
        conn.execute(insert(clients), [{"run_id": run_id, "client_id": c, "info": json.dumps(i)}
                                       for c, i in client_info.items()])
    if counters is not None:
        conn.execute(delete(run_counters).where(run_counters.c.run_id == run_id))
        conn.execute(insert(run_counters).values(run_id=run_id, counters=json.dumps(counters)))


def _own_database_file(path: Path) -> None:
    """A database file made here is the owner's alone (mode 0600; SQLite gives its WAL files the
    same mode): it lists the runs' clients, their health and specs, which other accounts of the
    machine have no need to read (with `read_requires_token` the API does not show them either).
    An existing file, and folders the toolkit did not make, are left as they are."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileExistsError):  # (an empty file is an empty database)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        database = make_url(url).database  # (the path alone: a URL may carry a query, ?timeout=20)
        if database and database != ":memory:":
            _own_database_file(Path(database))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers (the API) never block the round engine
            cur.execute("PRAGMA synchronous=FULL")  # a completed round survives a power cut
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)
