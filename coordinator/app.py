"""The coordinator's HTTP side (FastAPI): health, runs (status, creation, control), clients,
live events, Prometheus metrics, the dashboard, and the public set for agents."""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import time
from collections.abc import Callable
from typing import Any

from fastapi import Body, Depends, FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.config import RunSpec
from coordinator.dashboard import dashboard_files
from coordinator.events import CLOSED, TooManySubscribers, sse_format
from coordinator.metrics import registry_for
from coordinator.run import Run
from coordinator.runs import InvalidRunSpec, RunConflict, RunManager, ShuttingDown
from fedal import __version__
from fedal.hosts import AnyHost, allowed_hosts, host_refusal
from fedal.json_values import json_safe

RUN_SUMMARY = ("run_id", "strategy", "state", "round", "rounds", "completed_rounds", "phase", "iteration",
               "started_at", "finished_at")


READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
BODY_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's 400 for a body it cannot parse at all


def auth_failure(header: str | bytes | None, token: str | None) -> tuple[int, str] | None:
    """(status, detail) unless `header` is "Bearer <token>"; compared in constant time, as bytes
    (a header may hold any latin-1 character, which compare_digest refuses in a str)."""
    if token is None:  # no token could be right: a 401's challenge would send the client looking for one
        return 403, "no token is configured: writes are off"
    raw = header.encode("latin-1") if isinstance(header, str) else (header or b"")
    if raw[:7].lower() != b"bearer ":
        return 401, "a bearer token is required"
    if not secrets.compare_digest(raw[7:].strip(), token.encode()):
        return 403, "wrong token"
    return None


class RequestGuard:
    """Pure ASGI middleware in front of every route, so nothing reads a body it should not.

    A request whose Host header names none of `allowed` is answered 400 (fedal/hosts.py:
    a page of another site reading the API through DNS rebinding). A write (any
    method but GET, HEAD, OPTIONS) without the right bearer token is answered
    401/403 from its headers alone: its body is never received. A body above max_body_bytes is
    answered 413: at once when Content-Length says so, else as soon as the bytes counted while
    receiving pass it (a chunked body has no Content-Length). A body within the limit is
    received here and handed on whole."""

    def __init__(self, app, token: str | None, max_body_bytes: int, allowed: set[str] | AnyHost, on_refused=None):
        self.app = app
        self.token = token
        self.allowed = allowed
        self.max_body_bytes = max_body_bytes
        self.on_refused = on_refused or (lambda *_args: None)  # (status, method, path, client, detail)

    def _refuse(self, scope, status: int, detail: str) -> None:
        client = scope.get("client")
        method = scope.get("method", "WEBSOCKET")  # a websocket's scope has no method
        self.on_refused(status, method, scope.get("path", ""), client[0] if client else None, detail)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refused = host_refusal(scope.get("headers") or [], self.allowed)
        if refused is not None:
            refused += " (api.allowed_hosts)" if refused.startswith("Host ") else ""
            if scope["type"] == "websocket":  # closed before it is accepted: the server answers 403
                self._refuse(scope, 403, refused)
                await send({"type": "websocket.close", "code": 1008, "reason": refused[:120]})
            else:
                self._refuse(scope, 400, refused)
                await _answer(send, 400, refused)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope["method"] not in READ_METHODS:
            failure = auth_failure(headers.get(b"authorization"), self.token)
            if failure is not None:
                extra = [(b"www-authenticate", b"Bearer")] if failure[0] == 401 else []
                self._refuse(scope, *failure)
                await _answer(send, *failure, extra)
                return
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body (a GET, or the SSE stream listening for a disconnect)
            return
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            self._refuse(scope, 413, self._too_large())
            await _answer(send, 413, self._too_large())
            return
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                self._refuse(scope, 413, self._too_large())
                await _answer(send, 413, self._too_large())
                return
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay():
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> str:
        return f"request body larger than {self.max_body_bytes} bytes (api.max_body_bytes)"


async def _answer(send, status: int, detail: str, extra_headers: list | None = None) -> None:
    payload = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close"), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _client_host(request: Request) -> str | None:
    return request.client.host if request.client else None


def get_and_head(app: FastAPI, path: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A GET route that answers HEAD too; the schema lists the GET alone (one route with both
    methods gives both operations one operationId, which OpenAPI forbids)."""
    def register(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        app.add_api_route(path, endpoint, methods=["GET"], **options)
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False, **options)
        return endpoint

    return register


def create_app(runs: RunManager | Run) -> FastAPI:
    if isinstance(runs, Run):
        runs = RunManager.of(runs)
    # /docs and /redoc from files fastapi-offline ships: FastAPI's own load Swagger UI from a CDN,
    # which a coordinator on a lab network without internet cannot reach
    app = FastAPIOffline(title="FedAL Edge coordinator", version=__version__,
                         description="Federated runs driven over MQTT: status, control, live events, metrics.")

    registry = registry_for(runs)
    api = runs.config.api
    token = api.token

    def require_token(request: Request) -> None:
        failure = auth_failure(request.headers.get("authorization"), token)
        if failure is not None:
            runs.refused(failure[0], request.method, request.url.path, _client_host(request),
                         failure[1])
            raise HTTPException(status_code=failure[0], detail=failure[1],
                                headers={"WWW-Authenticate": "Bearer"} if failure[0] == 401 else None)

    def require_read(request: Request) -> None:
        if api.read_requires_token:
            require_token(request)

    reads = [Depends(require_read)]
    writes = [Depends(require_token)]

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """A body FastAPI could not even parse (bytes that are not UTF-8, JSON nested past what the
        parser takes) is refused as a malformed one is: counted and logged, and said."""
        if exc.status_code == 400 and exc.detail == BODY_PARSE_ERROR:
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else "an error"
            detail = f"the body could not be read as JSON ({cause})"
            runs.refused(400, request.method, request.url.path, _client_host(request), detail)
            return JSONResponse(status_code=400, content={"detail": detail})
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own 422, except that the values it quotes back are made JSON: a body's NaN,
        Infinity or 1e400 (Python's json reads them as floats) made the default answer a 500."""
        runs.refused(422, request.method, request.url.path, _client_host(request),
                     f"{len(exc.errors())} invalid field(s)")
        return JSONResponse(status_code=422, content={"detail": json_safe(jsonable_encoder(exc.errors()))})

    def _run(run_id: str) -> Run:
        engine = runs.get(run_id)
        if engine is None:
            if run_id in runs.unrestored:
                raise HTTPException(status_code=409, detail=f"run {run_id!r} failed: a restart could not bring it back "
                                                            f"from the store: {runs.unrestored[run_id]}")
            raise HTTPException(status_code=404, detail=f"no run {run_id!r}")
        return engine

    def _snapshot(run_id: str) -> dict[str, Any]:
        """A run's snapshot, or what the store kept of one a restart could not bring back."""
        unrestored = runs.unrestored_snapshot(run_id) if runs.get(run_id) is None else None
        return unrestored if unrestored is not None else _run(run_id).snapshot()

    def _unrestored() -> list[dict[str, Any]]:
        return [snap for run_id in list(runs.unrestored) if (snap := runs.unrestored_snapshot(run_id)) is not None]

    @get_and_head(app, "/healthz")  # HEAD: what many uptime checkers send
    def healthz() -> dict[str, Any]:
        engines = runs.list()
        return {"status": "ok", "broker_connected": all(e.bus.connected.is_set() for e in engines) if engines else None,
                "runs": {**{e.cfg.run_id: e.state for e in engines}, **dict.fromkeys(runs.unrestored, "failed")}}

    @app.get("/api/v1/runs", dependencies=reads)
    def list_runs() -> list[dict[str, Any]]:
        return [engine.summary() for engine in runs.list()] + [{k: snap[k] for k in RUN_SUMMARY}
                                                               for snap in _unrestored()]

    @app.post("/api/v1/runs", status_code=201, dependencies=writes)
    def create_run(request: Request, spec: RunSpec = Body(..., examples=[{
            "run_id": "digits-fedal", "client_ids": ["pi-1", "pi-2", "pi-3"],
            "run": {"strategy": "fedal", "dataset": "digits", "rounds": 20, "seed": 0}}])) -> dict[str, Any]:
        """Create a run and start it: its enrolled agents join when they see its manifest. The
        public set is the coordinator's file `public_file`, or derived from `run.dataset`."""
        try:
            engine = runs.create(spec)
        except RunConflict as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except ShuttingDown as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from None
        except InvalidRunSpec as exc:
            runs.refused(422, request.method, request.url.path, _client_host(request), str(exc))
            raise HTTPException(status_code=422, detail=str(exc)) from None
        return engine.summary()

    @app.get("/api/v1/runs/{run_id}", dependencies=reads)
    def get_run(run_id: str) -> dict[str, Any]:
        return _snapshot(run_id)

    @app.get("/api/v1/runs/{run_id}/results", dependencies=reads)
    def get_results(run_id: str) -> dict[str, Any]:
        return _run(run_id).results()

    @app.get("/api/v1/runs/{run_id}/rounds", dependencies=reads)
    def get_rounds(run_id: str) -> list[dict[str, Any]]:
        """Per round: participation and p50/p95 response latency per phase, bytes, the strategy's
        diagnostics (FedAL: discriminator loss and accuracy, output discrepancy), accuracies."""
        kept = runs.unrestored_rounds(run_id) if runs.get(run_id) is None else None
        return kept if kept is not None else _run(run_id).rounds()

    @app.get("/api/v1/clients", dependencies=reads)
    def list_clients(run_id: str | None = None) -> list[dict[str, Any]]:
        """Every enrolled client of every run (or of `run_id`)."""
        snaps = [_snapshot(run_id)] if run_id else [e.snapshot() for e in runs.list()]
        return [{"id": cid, "run_id": snap["run_id"], **info} for snap in snaps for cid, info in snap["clients"].items()]

    @app.get("/api/v1/clients/{client_id}", dependencies=reads)
    def get_client(client_id: str) -> dict[str, Any]:
        """The client in the most recently created run that enrols it."""
        for engine in reversed(runs.list()):
            clients = engine.snapshot()["clients"]
            if client_id in clients:
                return {"id": client_id, "run_id": engine.cfg.run_id, **clients[client_id]}
        raise HTTPException(status_code=404, detail=f"no client {client_id!r}")

    @app.post("/api/v1/runs/{run_id}/{action}", dependencies=writes)
    async def control(run_id: str, action: str) -> dict[str, Any]:
        """pause (before the next phase), resume, stop (the run can be resumed by restarting).
        A stop's wait for the run to reach `stopped` polls on the event loop: a worker thread held
        for it by each of a few dozen stops at once would leave none for the reads."""
        # the run manager's lock is held across a store write while a run is created: waited for in a
        # worker thread, never on the event loop (every event stream and request would wait with it)
        run = await run_in_threadpool(_run, run_id)
        if action not in ("pause", "resume", "stop"):
            raise HTTPException(status_code=404, detail=f"no action {action!r}: pause, resume or stop")
        if run.state in ("finished", "stopped", "failed"):
            raise HTTPException(status_code=409, detail=f"the run is {run.state}")
        await run_in_threadpool(getattr(run, action))  # (it may wait for a round's save in progress)
        if action == "stop" and (run_id in runs.threads or run.started_at is not None):  # its thread stops between two steps:
            deadline = time.monotonic() + STOP_WAIT_S  # answer with the state it reaches
            while not run.finished_event.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(EVENT_POLL_S)
        return {"run_id": run_id, "action": action, "state": run.state}

    @app.get("/api/v1/events", dependencies=reads)
    async def events(request: Request) -> StreamingResponse:
        """Server-Sent Events: run, round, phase and client events as they happen. The stream
        ends when the client leaves or when the coordinator shuts down (the event hub is closed).
        At most api.max_event_streams at once: each holds a queue and a task for as long as it is
        open, so an unbounded number of idle connections would cost without limit."""
        try:
            subscription = runs.events.subscribe(limit=api.max_event_streams)
        except TooManySubscribers as exc:
            detail = (f"{exc.args[0]} event streams are open, as many as api.max_event_streams allows: "
                      "poll the read endpoints, or try again later")
            runs.refused(503, request.method, request.url.path, _client_host(request), detail)
            raise HTTPException(status_code=503, detail=detail, headers={"Retry-After": str(STREAM_RETRY_AFTER_S)}) from None

        def states() -> dict[str, str]:
            return {**{e.cfg.run_id: e.state for e in runs.list()}, **dict.fromkeys(runs.unrestored, "failed")}

        async def stream():
            try:  # hello carries no id: a reconnecting browser's Last-Event-ID stays the last real event's
                yield sse_format({"type": "hello", "runs": await run_in_threadpool(states)})  # (the lock, as above)
                while not await request.is_disconnected():
                    event = await next_event(subscription, KEEP_ALIVE_S)
                    if event is None:
                        yield ": keep-alive\n\n"
                        continue
                    if event is CLOSED:  # shutting down: end the response, so the server can stop
                        return
                    yield sse_format(event)
            finally:
                runs.events.unsubscribe(subscription)

        return SlotStream(stream(), lambda: runs.events.unsubscribe(subscription), media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @get_and_head(app, "/metrics", response_class=PlainTextResponse, dependencies=reads)
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @get_and_head(app, "/api/v1/runs/{run_id}/public",  # HEAD: a probe of the download
                  responses={200: {"content": {"application/octet-stream": {}}}})
    def get_public(run_id: str) -> Response:
        run = _run(run_id)
        if run.public_bytes is None:
            raise HTTPException(status_code=404, detail="this run has no public set")
        return Response(run.public_bytes, media_type="application/octet-stream",
                        headers={"X-Content-Hash": run.public_hash or ""})

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    app.mount("/dashboard", dashboard_files(), name="dashboard")
    app.add_middleware(RequestGuard, token=token, max_body_bytes=api.max_body_bytes,
                       allowed=allowed_hosts(api.host, api.public_base_url, api.allowed_hosts), on_refused=runs.refused)
    return app


class SlotStream(StreamingResponse):
    """An event stream that gives its slot back however the response ends. The generator's own
    `finally` does not run when the client leaves while a send is blocked (a full socket buffer:
    Starlette cancels the send and the paused generator waits for the garbage collector), and
    ~100 such peers filled every slot (503 for every new dashboard) until a full collection."""

    def __init__(self, content: Any, release: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


STOP_WAIT_S = 10.0  # how long a stop request waits for the run to reach `stopped` before it answers
KEEP_ALIVE_S = 1.0  # an event stream with nothing to say sends a comment this often
EVENT_POLL_S = 0.05
STREAM_RETRY_AFTER_S = 30  # a refused event stream's Retry-After


async def next_event(subscription: queue.Queue, timeout_s: float) -> dict[str, Any] | None:
    """The subscription's next event, or None after timeout_s. Polled on the event loop: a
    blocking get in a worker thread per stream shared the loop's few threads among every open
    stream, and with a few dozen dashboards open each stream's keep-alive came seconds late."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return subscription.get_nowait()
        except queue.Empty:
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(EVENT_POLL_S)
