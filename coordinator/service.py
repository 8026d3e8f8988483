"""Runs the round engine in its own thread next to the uvicorn server in the main thread."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from coordinator.app import create_app
from coordinator.config import CoordinatorConfig
from coordinator.engine import RoundEngine

log = logging.getLogger("coordinator")


def serve(config: CoordinatorConfig) -> int:
    engine = RoundEngine(config)
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine), host=config.api.host, port=config.api.port, log_level="warning", lifespan="off")
    )
    def _run_when_api_is_up() -> None:
        # agents fetch the public set from the API as soon as they see the manifest
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started:
            engine.run()

    worker = threading.Thread(target=_run_when_api_is_up, name="round-engine", daemon=True)
    worker.start()

    def _exit_when_done() -> None:
        engine.finished_event.wait()
        if config.exit_on_finish:
            server.should_exit = True

    threading.Thread(target=_exit_when_done, daemon=True).start()
    log.info("API on http://%s:%d  run %s (%s)", config.api.host, config.api.port, config.run_id, engine.run_config.strategy)
    server.run()  # returns on SIGINT/SIGTERM or when should_exit is set
    engine.stop()
    worker.join(timeout=30)
    engine.bus.stop()
    return 0 if engine.state in ("finished", "stopped") else 1
