"""An API on loopback answers only its own names in the Host header: a web page that points a
name of its own at 127.0.0.1 (DNS rebinding) cannot read it. Checked on a real uvicorn server
with raw HTTP requests, whose Host headers a browser would send."""

from __future__ import annotations

import socket

import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.config import load_coordinator_config
from coordinator.hosts import AnyHost, allowed_hosts, host_allowed, host_name
from coordinator.runs import RunManager
from fedal.settings import SettingsError
from tests.event_streams import serving


def ask(port: int, host: bytes | None, path: str = "/healthz", version: str = "1.1") -> tuple[int, bytes]:
    """(status, body) of a GET whose Host header is `host` (None: none at all)."""
    lines = [f"GET {path} HTTP/{version}".encode()] + ([b"Host: " + host] if host is not None else [])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\r\n".join([*lines, b"Connection: close", b"", b""]))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_an_api_on_loopback_refuses_names_that_are_not_its_own(tmp_path):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state",
                                              api={"public_base_url": "http://coordinator.lab:8080"}))
    with serving(runs, []) as port:
        for host in (b"127.0.0.1", f"127.0.0.1:{port}".encode(), f"localhost:{port}".encode(), b"LOCALHOST.",
                     f"[::1]:{port}".encode(), b"10.0.0.7", b"coordinator.lab:8080"):
            assert ask(port, host)[0] == 200, host
        status, body = ask(port, f"rebind.example:{port}".encode(), "/api/v1/runs")
        assert status == 400 and b"'rebind.example' is not a name this API answers to" in body
        for bad in (b"localhost.rebind.example", b"[::1", b"a:b:c", b"evil.example:99999"):
            assert ask(port, bad)[0] == 400, bad
        assert ask(port, None, version="1.0")[0] == 400  # HTTP/1.0 may leave Host out; a browser never does
        metrics = ask(port, b"127.0.0.1", "/metrics")[1].decode()
        assert 'fedal_api_refused_requests_total{status="400"} 6.0' in metrics, metrics[-600:]


def test_allowed_hosts_names_them_where_set(tmp_path):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state",
                                              api={"allowed_hosts": ["*.lab.example", "Dashboard.Example."]}))
    with serving(runs, []) as port:
        for host, status in ((b"a.lab.example", 200), (b"a.b.lab.example:80", 200), (b"dashboard.example", 200),
                             (b"127.0.0.1", 200), (b"lab.example", 400), (b"localhost", 400),
                             (b"xlab.example", 400)):
            assert ask(port, host)[0] == status, host


def test_beyond_loopback_any_name_passes_unless_allowed_hosts_is_set(tmp_path):
    """Bound to every interface (not bound here: the app is asked in process) any name passes,
    as devices reach it by names the coordinator does not know; its reads are warned of at start."""
    assert isinstance(allowed_hosts("0.0.0.0", None, None), AnyHost)
    assert isinstance(allowed_hosts("127.0.0.1", None, ["*"]), AnyHost)
    for api, status in (({"host": "0.0.0.0"}, 200), ({"host": "0.0.0.0", "allowed_hosts": ["coord.lan"]}, 400),
                        ({"host": "127.0.0.1"}, 400)):
        runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / f"state{status}{len(api)}", api=api))
        assert TestClient(create_app(runs)).get("/healthz").status_code == status, api  # Host: testserver
        runs.store.close()


@pytest.mark.parametrize("header, name", [
    (b"127.0.0.1:8080", "127.0.0.1"), (b"[::1]:8080", "::1"), (b"[::1]", "::1"), (b"Pi-Coord.Lan.", "pi-coord.lan"),
    (b"", None), (None, None), (b"[::1]x", None), (b"[nope]", None), (b"host:", None), (b"host:8o", None),
    (b"\xff", None), (b":80", None)])
def test_host_header_parsing(header, name):
    assert host_name(header) == name


def test_host_patterns_match_names_and_subdomains_only():
    allowed = {"coord.lan", "*.lab.example"}
    assert host_allowed("coord.lan", allowed) and host_allowed("pi.lab.example", allowed)
    assert host_allowed("192.168.1.4", allowed) and host_allowed("::1", allowed)  # addresses always pass
    assert not host_allowed("lab.example", allowed) and not host_allowed("coord.lan.evil", allowed)
    assert not host_allowed(None, allowed) and host_allowed(None, AnyHost())


@pytest.mark.parametrize("pattern", ["http://coord.lan", "coord.lan:8080", "a b", "", "*.", "a*.lan", "x/y"])
def test_allowed_hosts_refuses_what_is_not_a_host_name(tmp_path, pattern):
    with pytest.raises(SettingsError, match="is not a host name"):
        load_coordinator_config(None, state_dir=tmp_path / "state", api={"allowed_hosts": [pattern]})


def test_ipv6_patterns_are_kept_without_brackets(tmp_path):
    cfg = load_coordinator_config(None, state_dir=tmp_path / "state", api={"allowed_hosts": ["[FD00::1]", "Coord.Lan"]})
    assert cfg.api.allowed_hosts == ["fd00::1", "coord.lan"]
