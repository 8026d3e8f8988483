"""The coordinator's HTTP side (FastAPI): health, run status, and the public set for agents."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.engine import RoundEngine
from coordinator.metrics import registry_for
from fedal import __version__


def create_app(engine: RoundEngine) -> FastAPI:
    app = FastAPI(title="FedAL Edge coordinator", version=__version__,
                  description="Status of federated runs driven over MQTT.")

    registry = registry_for(engine)

    def _run(run_id: str) -> RoundEngine:
        if run_id != engine.cfg.run_id:
            raise HTTPException(status_code=404, detail=f"no run {run_id!r}")
        return engine

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "broker_connected": engine.bus.connected.is_set(), "run_state": engine.state}

    @app.get("/api/v1/runs")
    def list_runs() -> list[dict[str, Any]]:
        snap = engine.snapshot()
        keys = ("run_id", "strategy", "state", "round", "rounds", "completed_rounds", "phase", "started_at", "finished_at")
        return [{k: snap[k] for k in keys}]

    @app.get("/api/v1/runs/{run_id}")
    def get_run(run_id: str) -> dict[str, Any]:
        return _run(run_id).snapshot()

    @app.get("/api/v1/runs/{run_id}/results")
    def get_results(run_id: str) -> dict[str, Any]:
        return _run(run_id).results()

    @app.get("/api/v1/runs/{run_id}/rounds")
    def get_rounds(run_id: str) -> list[dict[str, Any]]:
        """Per round: participation and p50/p95 response latency per phase, bytes, the strategy's
        diagnostics (FedAL: discriminator loss and accuracy, output discrepancy), accuracies."""
        return _run(run_id).rounds()

    @app.get("/api/v1/clients")
    def list_clients() -> list[dict[str, Any]]:
        return [{"id": cid, **info} for cid, info in engine.snapshot()["clients"].items()]

    @app.get("/api/v1/clients/{client_id}")
    def get_client(client_id: str) -> dict[str, Any]:
        clients = engine.snapshot()["clients"]
        if client_id not in clients:
            raise HTTPException(status_code=404, detail=f"no client {client_id!r}")
        return {"id": client_id, "run_id": engine.cfg.run_id, **clients[client_id]}

    @app.get("/metrics", response_class=PlainTextResponse)
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
