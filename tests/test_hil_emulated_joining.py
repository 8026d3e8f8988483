"""An emulated agent joining a run as the reference agent does: a public-set download cut short
or damaged is one failed join for the whole fleet (one fetch), retried with backoff, never the
end of the fleet's loop; tasks that come before the join are held within the agent's bound."""

from __future__ import annotations

import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest

from fedal.data.public import content_hash
from fedal.protocol import RunManifest
from fedal.session import MAX_HELD
from hil.emulated_agent import EmulatedAgent, PublicSetSource

X = np.zeros((100, 8), np.float32)


def npz(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=x)
    return buf.getvalue()


class Served:
    """The coordinator's public-set endpoint, answering as `mode` says."""

    def __init__(self) -> None:
        full = npz(X)
        self.mode, self.hits = "ok", 0
        served = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:
                """Quiet."""

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                served.hits += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(full)))
                self.end_headers()
                if served.mode == "truncated":  # the connection drops halfway through the body
                    self.wfile.write(full[: len(full) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                elif served.mode == "corrupt":
                    self.wfile.write(full[: len(full) // 2] + b"\0" * (len(full) - len(full) // 2))
                else:
                    self.wfile.write(full)

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/public.npz"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def served():
    s = Served()
    yield s
    s.close()


def manifest(agents, url: str) -> bytes:
    return RunManifest(run_id="lab", strategy="fedal", strategy_params={}, num_classes=10,
                       clients=[a.client_id for a in agents], rounds=2, public_hash=content_hash(X), public_size=len(X),
                       public_url=url, instance="i1").to_json()


@pytest.mark.parametrize("mode", ["truncated", "corrupt"])
def test_a_bad_public_set_download_is_a_join_retried_with_backoff(served, mode):
    """Before: http.client.IncompleteRead (a body cut short) and zipfile.BadZipFile escaped the
    join: the first join counted an `error` and was never tried again, every agent fetched on its
    own, and a retry from the fleet's loop ended that loop (every agent with it)."""
    served.mode = mode
    public = PublicSetSource(retry_s=3.0)  # the five joins below fit in it, on a busy machine too
    agents = [EmulatedAgent("lab", f"e{i}", index=i, public=public) for i in range(5)]
    for agent in agents:
        agent.on_message(agent.manifest_topic, manifest(agents, served.url))
    assert served.hits == 1  # one fetch for the fleet
    for agent in agents:
        assert agent.session is None and agent.retry_at is not None
        assert dict(agent.counters) == {"setup_failures": 1}
    served.mode = "ok"
    time.sleep(3.1)
    for agent in agents:  # the fleet loop's retries, once the server is mended
        agent.tick(time.monotonic() + 100)
    assert all(agent.session is not None for agent in agents)


def test_tasks_before_the_join_are_held_within_the_agents_bound():
    agent = EmulatedAgent("lab", "e0", index=0, public=PublicSetSource())
    for i in range(MAX_HELD + 10):
        agent.on_message(agent.task_topic, bytes([i]) * 100)
    assert len(agent.deferred) == MAX_HELD and agent.counters["rejected"] == 10
    assert agent.deferred[0] == bytes([10]) * 100  # the oldest went
