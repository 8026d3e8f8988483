"""The emulated broker's control API (FastAPI): read the counters, change faults during a run.

It runs in the proxy's event loop (uvicorn as a task) and every endpoint is `async def`, so
FastAPI runs none of them on a worker thread: a request and a packet never see the fault state
half-changed. Bind it to loopback: it has no authentication. It answers only its own names and
IP addresses in the Host header (fedal/hosts.py), so that no web page can change a run's faults
through DNS rebinding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, ConfigDict, Field

from fedal.hosts import allowed_hosts, host_refusal
from fedal.json_values import json_safe
from fedal.log_limit import RateLimitedLog
from hil.faults import resolve
from hil.profiles import Faults
from hil.proxy import Proxy

log = logging.getLogger("hil.control")


class PartitionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    client: str = Field("*", description="client id or glob pattern")
    duration_s: float = Field(gt=0, le=86_400)
    start_in_s: float = Field(0.0, ge=0, le=86_400, description="begin this many seconds from now (within a day)")


class ResetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    client: str = Field("*", description="client id or glob pattern")


def build_app(proxy: Proxy, host: str = "127.0.0.1") -> FastAPI:
    """The control API of `proxy`, served on `host` (whose name it answers besides loopback's)."""
    engine = proxy.engine
    app = FastAPIOffline(title="FedAL Edge emulated broker", description="Fault injection control for `fedal hil broker`.")
    own_names = allowed_hosts(host, None, None)
    refusals = RateLimitedLog(log, "refused requests")
    refused_requests = {"count": 0}  # requests refused for their Host name: /healthz and /stats say how many

    @app.middleware("http")
    async def own_names_only(request: Request, call_next):
        refused = host_refusal(request.scope.get("headers") or [], own_names)
        if refused is not None:
            refused_requests["count"] += 1
            client = request.client.host if request.client else "?"
            refusals.warning("control API: refused %s %r from %s: 400 %s", request.method, request.url.path, client, refused)
            return JSONResponse(status_code=400, content={"detail": refused})
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422, its quoted values made JSON (a NaN in a body made the default answer a 500)."""
        return JSONResponse(status_code=422, content={"detail": json_safe(jsonable_encoder(exc.errors()))})

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "connections": len(proxy.sessions), "elapsed_s": round(engine.elapsed(), 3),
                "refused_requests": refused_requests["count"]}

    @app.get("/faults")
    async def get_faults() -> dict:
        return {"profile": engine.profile_name, "seed": engine.seed,
                **engine.faults.model_dump(mode="json", exclude_none=True),
                "partitions": [p.model_dump(mode="json") for p in engine.partitions]}

    @app.put("/faults")
    async def put_faults(faults: Faults) -> dict:
        """Replace the default and per-client rules (partitions are kept); live connections too."""
        engine.set_faults(faults)
        return await get_faults()

    @app.get("/faults/{client_id}")
    async def client_faults(client_id: str) -> dict:
        """The faults in force for one client id, every field resolved, per direction."""
        return {d: resolve(engine.faults, client_id, d).__dict__ for d in ("up", "down")} | {
            "partitioned": engine.partitioned(client_id)}

    @app.post("/partition")
    async def partition(req: PartitionRequest) -> dict:
        try:
            return engine.add_partition(req.client, req.duration_s, req.start_in_s).model_dump(mode="json")
        except ValueError as exc:  # a window the clock cannot tell apart: a bad request, not a crash
            raise HTTPException(422, str(exc)) from None

    @app.post("/reset")
    async def reset(req: ResetRequest) -> dict:
        return {"reset": proxy.reset_clients(req.client)}

    @app.get("/stats")
    async def stats() -> dict:
        return {**engine.snapshot(), "connections": sorted(s.client_id for s in proxy.sessions),
                "refused_requests": refused_requests["count"]}

    @app.get("/events")
    async def events(limit: int = 100, fault: str | None = None, client: str | None = None) -> list[dict]:
        if limit < 1:
            raise HTTPException(422, "limit must be >= 1")
        chosen = [e for e in engine.events
                  if (fault is None or e["fault"] == fault) and (client is None or e["client"] == client)]
        return chosen[-limit:]

    return app


async def serve_control(proxy: Proxy, host: str, port: int) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Start the control API in this loop: the server, its task and the bound port.

    The socket is bound here, so a busy port is an OSError for the caller rather than uvicorn's
    exit, and uvicorn leaves the process's signals to the proxy's CLI.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # --control [::1]:PORT as --listen takes it
    sock = socket.create_server((host, port), family=family)
    config = uvicorn.Config(build_app(proxy, host), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("control API stopped before it started")
        await asyncio.sleep(0.02)
    return server, task, sock.getsockname()[1]
