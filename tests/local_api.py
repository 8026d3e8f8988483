"""The coordinator's API in process, asked as a browser on the coordinator's machine asks it,
or served by uvicorn in a thread on a loopback port."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi.testclient import TestClient

from coordinator.app import create_app
from tests.waiting import free_port, wait_until


def local_client(runs: Any, **kwargs: Any) -> TestClient:
    """A TestClient of `runs`' API whose requests carry `Host: 127.0.0.1` (TestClient's own
    `testserver` is not one of the API's names: fedal/hosts.py)."""
    return TestClient(create_app(runs), base_url="http://127.0.0.1", **kwargs)


@contextlib.contextmanager
def served(runs: Any, host: str = "127.0.0.1", port: int | None = None) -> Iterator[int]:
    """The API of `runs` listening on `host` (its port, a free one unless given) until the
    block ends; then the server is stopped."""
    port = free_port() if port is None else port
    server = uvicorn.Server(uvicorn.Config(create_app(runs), host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout_s=30, what=f"the API to listen on {host}")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
