"""Request bodies against a real coordinator process (uvicorn on a real socket): a write without
the token is answered 401 from its headers, before its body is sent, and the server's memory
does not grow with it; a body above api.max_body_bytes is answered 413, with or without a
Content-Length (chunked); ordinary creates still work.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from tests.waiting import free_port, wait_for_port

MiB = 1024 * 1024
TOKEN = "body-token"
SPEC = {"run_id": "body-run", "client_ids": ["pi-1", "pi-2"],
        "run": {"strategy": "fedmd", "dataset": "digits", "rounds": 1, "public_size": 50, "seed": 2}}


@pytest.fixture()
def coordinator(mosquitto, tmp_path):
    port = free_port()
    config = {"state_dir": str(tmp_path / "state"), "broker": {"url": mosquitto},
              "api": {"host": "127.0.0.1", "port": port, "token": TOKEN}}
    path = tmp_path / "coordinator.toml"
    path.write_text(tomli_w.dumps(config))
    log = open(tmp_path / "coordinator.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator", "--config", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        assert wait_for_port(port, 60), (tmp_path / "coordinator.log").read_text()
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def send_body(port: int, head: bytes, pieces, total: int) -> tuple[int, int, bytes]:
    """Send `head`, then body pieces until the server answers or closes; returns (status, body
    bytes sent, response). A server that does not read the body answers while it is still coming."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        # the server may answer and close without reading the rest
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for piece in pieces:
                if select.select([s], [], [], 0)[0]:
                    break  # the answer is there: stop sending
                s.sendall(piece)
                sent += len(piece)
        response = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):  # the answer is what came
            while b"\r\n\r\n" not in response or len(response) < response.index(b"\r\n\r\n") + 4 + _length(response):
                chunk = s.recv(65536)
                if not chunk:
                    break
                response += chunk
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split()[1]), sent, response


def _length(response: bytes) -> int:
    head = response.split(b"\r\n\r\n", 1)[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def request_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


def test_unauthenticated_big_body_is_refused_unread(coordinator):
    port, proc = coordinator
    total = 150 * MiB
    before = peak_rss_kib(proc.pid)
    head = request_head("/api/v1/runs", {"Content-Type": "application/json", "Content-Length": str(total)})
    filler = b" " * MiB
    status, sent, response = send_body(port, head, (filler for _ in range(total // MiB)), total)
    assert status == 401 and b"bearer token is required" in response
    assert sent < 32 * MiB, sent  # it answered long before the body was through: it never waited for it
    assert (peak_rss_kib(proc.pid) - before) < 32 * 1024  # and held none of it

    wrong = request_head("/api/v1/runs", {"Authorization": "Bearer nope", "Content-Length": str(total)})
    status, sent, _ = send_body(port, wrong, (filler for _ in range(total // MiB)), total)
    assert status == 403 and sent < 32 * MiB
    odd = request_head("/api/v1/runs/x/pause", {"Authorization": "Bearer t\u00f6ken", "Content-Length": "0"})
    assert send_body(port, odd, [], 0)[0] == 403  # a non-ASCII token is a wrong one, not a server error


def test_oversized_bodies_get_413_with_or_without_a_length(coordinator):
    port, proc = coordinator
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    total = 150 * MiB
    filler = b" " * MiB
    before = peak_rss_kib(proc.pid)
    status, sent, response = send_body(port, request_head("/api/v1/runs", {**auth, "Content-Length": str(total)}),
                                       (filler for _ in range(total // MiB)), total)
    assert status == 413 and b"api.max_body_bytes" in response and sent < 32 * MiB

    def chunked():  # no Content-Length: only counting the bytes as they come can stop it
        for _ in range(total // (256 * 1024)):
            yield b"40000\r\n" + b" " * (256 * 1024) + b"\r\n"
        yield b"0\r\n\r\n"

    status, sent, response = send_body(port, request_head("/api/v1/runs", {**auth, "Transfer-Encoding": "chunked"}),
                                       chunked(), total)
    assert status == 413 and b"api.max_body_bytes" in response and sent < 32 * MiB
    assert (peak_rss_kib(proc.pid) - before) < 32 * 1024

    # a create within the limit goes through, chunked or not
    body = json.dumps(SPEC).encode()
    status, _, response = send_body(port, request_head("/api/v1/runs", {**auth, "Content-Length": str(len(body))}),
                                    [body], len(body))
    assert status == 201, response
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["run_id"] == "body-run"
    again = dict(SPEC, run_id="body-run-2")
    body = json.dumps(again).encode()
    status, _, response = send_body(port, request_head("/api/v1/runs", {**auth, "Transfer-Encoding": "chunked"}),
                                    [f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"], len(body))
    assert status == 201, response
    head = b"GET /api/v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        listing = b""
        while chunk := s.recv(65536):
            listing += chunk
    assert {r["run_id"] for r in json.loads(listing.split(b"\r\n\r\n", 1)[1])} == {"body-run", "body-run-2"}
    assert proc.poll() is None
