"""The coordinator's HTTP side (FastAPI): health, runs (status, creation, control), clients,
live events, Prometheus metrics, the dashboard, and the public set for agents."""

from __future__ import annotations

from typing import Any

import asyncio
import queue
import secrets

from fastapi import Body, Depends, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.config import RunSpec
from coordinator.dashboard import STATIC_DIR
from coordinator.engine import RoundEngine
from coordinator.events import sse_format
from coordinator.metrics import registry_for
from coordinator.runs import InvalidRunSpec, RunConflict, RunManager
from fedal import __version__

RUN_SUMMARY = ("run_id", "strategy", "state", "round", "rounds", "completed_rounds", "phase", "iteration",
               "started_at", "finished_at")


def create_app(runs: RunManager | RoundEngine) -> FastAPI:
    if isinstance(runs, RoundEngine):
        runs = RunManager.of(runs)
    app = FastAPI(title="FedAL Edge coordinator", version=__version__,
                  description="Federated runs driven over MQTT: status, control, live events, metrics.")

    registry = registry_for(runs)
    api = runs.config.api
    token = api.token

    def require_token(request: Request) -> None:
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise HTTPException(status_code=401, detail="a bearer token is required",
                                headers={"WWW-Authenticate": "Bearer"})
        if token is None or not secrets.compare_digest(header[7:].strip(), token):
            raise HTTPException(status_code=403, detail="wrong token" if token else "no token is configured: writes are off")

    def require_read(request: Request) -> None:
        if api.read_requires_token:
            require_token(request)

    reads = [Depends(require_read)]
    writes = [Depends(require_token)]

    def _run(run_id: str) -> RoundEngine:
        engine = runs.get(run_id)
        if engine is None:
            raise HTTPException(status_code=404, detail=f"no run {run_id!r}")
        return engine

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        engines = runs.list()
        return {"status": "ok", "broker_connected": all(e.bus.connected.is_set() for e in engines) if engines else None,
                "runs": {e.cfg.run_id: e.state for e in engines}}

    @app.get("/api/v1/runs", dependencies=reads)
    def list_runs() -> list[dict[str, Any]]:
        out = []
        for engine in runs.list():
            snap = engine.snapshot()
            out.append({k: snap[k] for k in RUN_SUMMARY})
        return out

    @app.post("/api/v1/runs", status_code=201, dependencies=writes)
    def create_run(spec: RunSpec = Body(..., examples=[{
            "run_id": "digits-fedal", "client_ids": ["pi-1", "pi-2", "pi-3"],
            "run": {"strategy": "fedal", "dataset": "digits", "rounds": 20, "seed": 0}}])) -> dict[str, Any]:
        """Create a run and start it: its enrolled agents join when they see its manifest. The
        public set is the coordinator's file `public_file`, or derived from `run.dataset`."""
        try:
            engine = runs.create(spec)
        except RunConflict as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except InvalidRunSpec as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        snap = engine.snapshot()
        return {k: snap[k] for k in RUN_SUMMARY}

    @app.get("/api/v1/runs/{run_id}", dependencies=reads)
    def get_run(run_id: str) -> dict[str, Any]:
        return _run(run_id).snapshot()

    @app.get("/api/v1/runs/{run_id}/results", dependencies=reads)
    def get_results(run_id: str) -> dict[str, Any]:
        return _run(run_id).results()

    @app.get("/api/v1/runs/{run_id}/rounds", dependencies=reads)
    def get_rounds(run_id: str) -> list[dict[str, Any]]:
        """Per round: participation and p50/p95 response latency per phase, bytes, the strategy's
        diagnostics (FedAL: discriminator loss and accuracy, output discrepancy), accuracies."""
        return _run(run_id).rounds()

    @app.get("/api/v1/clients", dependencies=reads)
    def list_clients(run_id: str | None = None) -> list[dict[str, Any]]:
        """Every enrolled client of every run (or of `run_id`)."""
        engines = [_run(run_id)] if run_id else runs.list()
        return [{"id": cid, "run_id": e.cfg.run_id, **info} for e in engines for cid, info in e.snapshot()["clients"].items()]

    @app.get("/api/v1/clients/{client_id}", dependencies=reads)
    def get_client(client_id: str) -> dict[str, Any]:
        """The client in the most recently created run that enrols it."""
        for engine in reversed(runs.list()):
            clients = engine.snapshot()["clients"]
            if client_id in clients:
                return {"id": client_id, "run_id": engine.cfg.run_id, **clients[client_id]}
        raise HTTPException(status_code=404, detail=f"no client {client_id!r}")

    @app.post("/api/v1/runs/{run_id}/{action}", dependencies=writes)
    def control(run_id: str, action: str) -> dict[str, Any]:
        """pause (before the next phase), resume, stop (the run can be resumed by restarting)."""
        run = _run(run_id)
        if action not in ("pause", "resume", "stop"):
            raise HTTPException(status_code=404, detail=f"no action {action!r}: pause, resume or stop")
        if run.state in ("finished", "stopped", "failed"):
            raise HTTPException(status_code=409, detail=f"the run is {run.state}")
        getattr(run, action)()
        return {"run_id": run_id, "action": action, "state": run.state}

    @app.get("/api/v1/events", dependencies=reads)
    async def events(request: Request) -> StreamingResponse:
        """Server-Sent Events: run, round, phase and client events as they happen."""
        subscription = runs.events.subscribe()

        async def stream():
            try:
                yield sse_format({"id": 0, "type": "hello", "runs": {e.cfg.run_id: e.state for e in runs.list()}})
                while not await request.is_disconnected():
                    try:
                        event = await asyncio.to_thread(subscription.get, True, 1.0)
                    except queue.Empty:
                        yield ": keep-alive\n\n"
                        continue
                    yield sse_format(event)
            finally:
                runs.events.unsubscribe(subscription)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=reads)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/v1/runs/{run_id}/public", responses={200: {"content": {"application/octet-stream": {}}}})
    def get_public(run_id: str) -> Response:
        run = _run(run_id)
        if run.public_bytes is None:
            raise HTTPException(status_code=404, detail="this run has no public set")
        return Response(run.public_bytes, media_type="application/octet-stream",
                        headers={"X-Content-Hash": run.public_hash or ""})

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    app.mount("/dashboard", StaticFiles(directory=STATIC_DIR, html=True), name="dashboard")
    return app
