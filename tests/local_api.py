"""The coordinator's API in process, asked as a browser on the coordinator's machine asks it."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from coordinator.app import create_app


def local_client(runs: Any, **kwargs: Any) -> TestClient:
    """A TestClient of `runs`' API whose requests carry `Host: 127.0.0.1` (TestClient's own
    `testserver` is refused by an API on loopback: fedal/hosts.py)."""
    return TestClient(create_app(runs), base_url="http://127.0.0.1", **kwargs)
