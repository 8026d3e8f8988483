"""The coordinator's HTTP side (FastAPI): health, run status, and the public set for agents."""

from __future__ import annotations

from typing import Any

import asyncio
import queue
import secrets

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.engine import RoundEngine
from coordinator.events import sse_format
from coordinator.metrics import registry_for
from fedal import __version__


def create_app(engine: RoundEngine) -> FastAPI:
    app = FastAPI(title="FedAL Edge coordinator", version=__version__,
                  description="Status of federated runs driven over MQTT.")

    registry = registry_for(engine)
    token = engine.cfg.api.token

    def require_token(request: Request) -> None:
        header = request.headers.get("authorization", "")
        if not header.lower().startswith("bearer "):
            raise HTTPException(status_code=401, detail="a bearer token is required",
                                headers={"WWW-Authenticate": "Bearer"})
        if token is None or not secrets.compare_digest(header[7:].strip(), token):
            raise HTTPException(status_code=403, detail="wrong token" if token else "no token is configured: writes are off")

    def require_read(request: Request) -> None:
        if engine.cfg.api.read_requires_token:
            require_token(request)

    reads = [Depends(require_read)]
    writes = [Depends(require_token)]

    def _run(run_id: str) -> RoundEngine:
        if run_id != engine.cfg.run_id:
            raise HTTPException(status_code=404, detail=f"no run {run_id!r}")
        return engine

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "broker_connected": engine.bus.connected.is_set(), "run_state": engine.state}

    @app.get("/api/v1/runs", dependencies=reads)
    def list_runs() -> list[dict[str, Any]]:
        snap = engine.snapshot()
        keys = ("run_id", "strategy", "state", "round", "rounds", "completed_rounds", "phase", "started_at", "finished_at")
        return [{k: snap[k] for k in keys}]

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
    def list_clients() -> list[dict[str, Any]]:
        return [{"id": cid, **info} for cid, info in engine.snapshot()["clients"].items()]

    @app.get("/api/v1/clients/{client_id}", dependencies=reads)
    def get_client(client_id: str) -> dict[str, Any]:
        clients = engine.snapshot()["clients"]
        if client_id not in clients:
            raise HTTPException(status_code=404, detail=f"no client {client_id!r}")
        return {"id": client_id, "run_id": engine.cfg.run_id, **clients[client_id]}

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
        subscription = engine.events.subscribe()

        async def stream():
            try:
                yield sse_format({"id": 0, "type": "hello", **{k: engine.snapshot()[k] for k in ("run_id", "state", "round")}})
                while not await request.is_disconnected():
                    try:
                        event = await asyncio.to_thread(subscription.get, True, 1.0)
                    except queue.Empty:
                        yield ": keep-alive\n\n"
                        continue
                    yield sse_format(event)
            finally:
                engine.events.unsubscribe(subscription)

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

    return app
