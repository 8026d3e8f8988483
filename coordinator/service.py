"""Runs the round engines (one thread per run) next to the uvicorn server in the main thread."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

import torch
import uvicorn

from coordinator.app import create_app
from coordinator.config import CoordinatorConfig
from coordinator.runs import ENDED, RunManager
from fedal.hosts import url_host

log = logging.getLogger("coordinator")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# Backstop for the requests still open when the server stops (a client that stopped reading an
# event stream, a slow download of the public set): uvicorn waits this long for them, then cancels them.
GRACEFUL_SHUTDOWN_S = 3


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT/SIGTERM once the server is down, which kills the
    process (status 143) or raises KeyboardInterrupt before serve() has stopped the runs: no
    `stopped` published, no state saved. Here a stop signal only stops the server; serve() then
    shuts down in order and returns 0. SIGHUP (a closed terminal) stops it the same way.

    uvicorn's shutdown waits for every open response to end, and an event stream (the
    dashboard's GET /api/v1/events) never ends by itself: `on_shutdown` (the event hub's close)
    runs first, so open streams end at once, and GRACEFUL_SHUTDOWN_S bounds the rest."""

    def __init__(self, config: uvicorn.Config, on_shutdown=None):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets=None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(config: CoordinatorConfig) -> int:
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    runs = RunManager(config)
    runs.restore()
    server = _Server(
        uvicorn.Config(create_app(runs), host=config.api.host, port=config.api.port, log_level="warning", lifespan="off",
                       timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
        on_shutdown=runs.events.close,
    )

    def _start_when_api_is_up() -> None:
        # agents fetch the public set from the API as soon as they see the manifest
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            runs.start()

    threading.Thread(target=_start_when_api_is_up, name="run-starter", daemon=True).start()

    def _exit_when_done() -> None:
        while not server.should_exit:
            if runs.all_done.wait(0.5) and runs.list():
                server.should_exit = True

    if config.exit_on_finish:
        threading.Thread(target=_exit_when_done, daemon=True).start()
    for engine in runs.list():
        log.info("run %s (%s)", engine.cfg.run_id, engine.run_config.strategy)
    log.info("API on http://%s:%d", url_host(config.api.host), config.api.port)
    server.run()  # returns on SIGINT/SIGTERM/SIGHUP or when should_exit is set
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):  # a repeated stop must not cut the orderly stop short
            signal.signal(sig, signal.SIG_IGN)  # (a second Ctrl-C still aborts it, as asked)
    runs.stop()
    runs.store.close()
    # a run ended as asked, or never started (stopped right as the API came up); results unwritten: 1
    return 0 if all(e.state in (*ENDED[:2], "pending") and e.error is None for e in runs.list()) else 1
