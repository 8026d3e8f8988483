"""The API answers only its own names in the Host header: a web page that points a name of its
own at the coordinator's address (DNS rebinding) cannot read it. Checked on a real uvicorn
server with raw HTTP requests, whose Host headers a browser would send."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

import numpy as np
import pytest
from fastapi.testclient import TestClient

from coordinator.app import RequestGuard, create_app
from coordinator.config import load_coordinator_config
from coordinator.run import Run
from coordinator.runs import RunManager
from fedal.hosts import AnyHost, BadHost, allowed_hosts, host_allowed, host_name, host_refusal, machine_fqdn
from fedal.settings import SettingsError
from tests.event_streams import serving

REBIND = b"rebind.example"


def ask(port: int, hosts: list[bytes], path: str = "/healthz", method: str = "GET",
        version: str = "1.1") -> tuple[int, bytes]:
    """(status, body) of a request with these Host headers (none, one or several)."""
    lines = [f"{method} {path} HTTP/{version}".encode()] + [b"Host: " + h for h in hosts]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"\r\n".join([*lines, b"Connection: close", b"", b""]))
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def config(tmp_path, **api):
    return load_coordinator_config(None, state_dir=tmp_path / "state", api=api)


def test_the_api_answers_its_own_names_and_addresses(tmp_path):
    runs = RunManager(config(tmp_path, public_base_url="http://coordinator.lab:8080"))
    with serving(runs, []) as port:
        own = [b"127.0.0.1", f"127.0.0.1:{port}".encode(), f"localhost:{port}".encode(), b"LOCALHOST.",
               b"ip6-localhost", b"dash.localhost", f"[::1]:{port}".encode(), b"10.0.0.7", b"coordinator.lab:8080"]
        for host in own:
            assert ask(port, [host])[0] == 200, host
        assert ask(port, [], version="1.0")[0] == 200  # no Host at all: an HTTP/1.0 health check
        status, body = ask(port, [REBIND + f":{port}".encode()], "/api/v1/runs")
        assert status == 400 and b"'rebind.example' is not a name this API answers to" in body


@pytest.mark.parametrize("method, path", [
    ("GET", "/api/v1/runs"), ("GET", "/metrics"), ("GET", "/api/v1/events"), ("GET", "/dashboard/"),
    ("GET", "/docs"), ("GET", "/healthz"), ("HEAD", "/metrics"), ("OPTIONS", "/api/v1/runs"),
    ("POST", "/api/v1/runs/x/stop"), ("GET", "/no/such/route")])
def test_every_route_and_method_refuses_a_foreign_name(tmp_path, method, path):
    runs = RunManager(config(tmp_path))
    with serving(runs, []) as port:
        status, body = ask(port, [REBIND], path, method)
        assert status == 400, (status, body[:200])
        metrics = ask(port, [b"127.0.0.1"], "/metrics")[1].decode()
        assert 'fedal_api_refused_requests_total{status="400"} 1.0' in metrics, metrics[-600:]


def test_malformed_and_repeated_host_headers_are_refused(tmp_path):
    runs = RunManager(config(tmp_path))
    with serving(runs, []) as port:
        for hosts in ([b"[::1"], [b"a:b:c"], [b"localhost:99x"], [b"127.0.0.1", REBIND], [REBIND, b"127.0.0.1"]):
            assert ask(port, hosts)[0] == 400, hosts


def test_allowed_hosts_adds_names_to_its_own(tmp_path):
    runs = RunManager(config(tmp_path, public_base_url="http://coordinator.lab:8080",
                             allowed_hosts=["*.lab.example", "Dashboard.Example."]))
    with serving(runs, []) as port:
        for host, status in ((b"a.lab.example", 200), (b"a.b.lab.example:80", 200), (b"dashboard.example", 200),
                             (b"localhost", 200), (b"coordinator.lab", 200), (b"127.0.0.1", 200),
                             (b"lab.example", 400), (b"xlab.example", 400), (REBIND, 400),
                             (b"*.lab.example", 400)):  # the pattern itself is no name
            assert ask(port, [host])[0] == status, host


def test_agents_fetch_the_public_set_by_the_name_the_run_announces(tmp_path):
    """The public set's URL names public_base_url's host: it passes with allowed_hosts set too
    (which adds names, never takes the API's own away)."""
    state = tmp_path / "state"
    state.mkdir()
    np.savez(state / "public.npz", x=np.arange(40, dtype=np.float32).reshape(4, 10))
    runs = RunManager(config(tmp_path, token="t" * 16, public_base_url="http://coordinator.lab:8080",
                             allowed_hosts=["coordinator.example.org"]))
    with serving(runs, []) as port:
        body = {"run_id": "r", "client_ids": ["a", "b"], "public_file": str(state / "public.npz"),
                "run": {"strategy": "fedmd", "dataset": "digits"}}
        api = TestClient(create_app(runs), base_url="http://coordinator.lab:8080")
        assert api.post("/api/v1/runs", json=body, headers={"Authorization": "Bearer " + "t" * 16}).status_code == 201
        url = urlsplit(runs.get("r").manifest().public_url)
        assert url.netloc == "coordinator.lab:8080"
        status, payload = ask(port, [url.netloc.encode()], url.path)
        assert status == 200 and payload == (state / "public.npz").read_bytes()


def test_an_api_on_every_interface_answers_only_its_names_too(tmp_path):
    """Bound beyond loopback (asked in process here: tests bind loopback only) the same names
    pass: a page in the operator's browser could otherwise read a coordinator on the lab network."""
    cases = (({"host": "0.0.0.0"}, 400), ({"host": "::"}, 400),
             ({"host": "0.0.0.0", "allowed_hosts": ["testserver"]}, 200), ({"host": "0.0.0.0", "allowed_hosts": ["*"]}, 200))
    for i, (api, status) in enumerate(cases):
        runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / f"state{i}", api=api))
        assert TestClient(create_app(runs)).get("/healthz").status_code == status, api  # Host: testserver
        runs.store.close()


@pytest.fixture()
def named_machine(monkeypatch):
    """This machine as `coord-7`, fully qualified `coord-7.lab.example` when first asked and
    another name after that (DNS came up late): the API and the URLs it announces agree all the same."""
    answers = iter(["coord-7.lab.example"])
    monkeypatch.setattr(socket, "gethostname", lambda: "coord-7")
    monkeypatch.setattr(socket, "getfqdn", lambda name="": next(answers, "coord-7.late.example"))
    machine_fqdn.cache_clear()
    yield
    machine_fqdn.cache_clear()


def test_beyond_loopback_the_machine_answers_its_own_names(tmp_path, named_machine):
    """Bound to every interface (asked in process: tests bind loopback only) the machine's names
    pass, as browsers and scrapers reach a coordinator by them; on loopback they reach no socket
    of the API (and a `.local` name can be answered by anyone on the network): refused there."""
    for i, (host, name, status) in enumerate([
            ("0.0.0.0", "coord-7", 200), ("0.0.0.0", "coord-7.lab.example", 200), ("::", "coord-7.local", 200),
            ("0.0.0.0", "coord-8.lab.example", 400), ("127.0.0.1", "coord-7", 400), ("127.0.0.1", "coord-7.local", 400),
            ("127.0.0.1", "coord-7.lab.example", 400)]):
        runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / f"state{i}", api={"host": host}))
        assert TestClient(create_app(runs), base_url=f"http://{name}").get("/healthz").status_code == status, (host, name)
        runs.store.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "::0", "0:0:0:0:0:0:0:0"])
def test_a_wildcard_bind_answers_the_name_it_announces_the_public_set_by(tmp_path, named_machine, host):
    np.savez(tmp_path / "public.npz", x=np.zeros((4, 10), np.float32))
    run = Run(load_coordinator_config(None, run_id="w", client_ids=["a", "b"], public_file=tmp_path / "public.npz",
                                      state_dir=tmp_path / "state", api={"host": host, "port": 8080}))
    url = urlsplit(run.manifest().public_url)
    assert url.netloc == "coord-7.lab.example:8080"
    assert TestClient(create_app(run), base_url=f"http://{url.netloc}").get(url.path).status_code == 200
    run.store.close()


def test_two_host_headers_are_refused_whichever_comes_first():
    """(uvicorn's h11 parser refuses them itself; its httptools parser hands both on.)"""
    for headers in ([(b"host", b"localhost"), (b"Host", b"rebind.example")],
                    [(b"host", b"rebind.example"), (b"host", b"localhost")]):
        assert host_refusal(headers, {"localhost"}) == "a request may carry one Host header"
    assert host_refusal([(b"host", b"localhost")], {"localhost"}) is None and host_refusal([], {"localhost"}) is None


def test_a_websocket_with_a_foreign_name_is_closed_before_any_route_sees_it():
    seen, sent, refused = [], [], []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    async def send(message):
        sent.append(message)

    guard = RequestGuard(app, token=None, max_body_bytes=1024, allowed={"localhost"},
                         on_refused=lambda *args: refused.append(args))
    for host in (REBIND, b"localhost"):
        scope = {"type": "websocket", "path": "/ws", "headers": [(b"host", host)], "client": ("127.0.0.1", 5)}
        asyncio.run(guard(scope, None, send))
    assert seen == ["websocket"] and sent[0]["type"] == "websocket.close"
    assert refused == [(403, "WEBSOCKET", "/ws", "127.0.0.1", "Host 'rebind.example' is not a name this API answers to "
                        "(api.allowed_hosts)")]


@pytest.mark.parametrize("header, name", [
    (b"127.0.0.1:8080", "127.0.0.1"), (b"[::1]:8080", "::1"), (b"[::1]", "::1"), (b"Pi-Coord.Lan.", "pi-coord.lan")])
def test_host_header_parsing(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("header", [b"", b"[::1]x", b"[nope]", b"host:", b"host:8o", b"\xff", b":80", b"[::1",
                                    b"*.lab.example", b"*", b"a b.lan", b"user@coord.lan", b"coord.lan/x"])
def test_malformed_host_headers(header):
    with pytest.raises(BadHost):
        host_name(header)


def test_host_patterns_match_names_and_subdomains_only():
    allowed = {"coord.lan", "*.lab.example"}
    assert host_allowed("coord.lan", allowed) and host_allowed("pi.lab.example", allowed)
    assert host_allowed("192.168.1.4", allowed) and host_allowed("::1", allowed)  # addresses always pass
    assert not host_allowed("lab.example", allowed) and not host_allowed("coord.lan.evil", allowed)
    assert isinstance(allowed_hosts("127.0.0.1", None, ["*"]), AnyHost)
    names = allowed_hosts("coord-1.lan", "http://[fd00::5]:8080", None)
    assert "coord-1.lan" in names and "fd00::5" in names and "localhost" in names
    assert "0.0.0.0" not in allowed_hosts("0.0.0.0", None, None)


@pytest.mark.parametrize("pattern", ["http://coord.lan", "coord.lan:8080", "a b", "", "*.", "a*.lan", "x/y"])
def test_allowed_hosts_refuses_what_is_not_a_host_name(tmp_path, pattern):
    with pytest.raises(SettingsError, match="is not a host name"):
        config(tmp_path, allowed_hosts=[pattern])


@pytest.mark.parametrize("url, why", [
    ("ftp://coord.lan", "is not an http:// or https:// URL with a host"), ("http://", "is not an http"),
    ("http://coord.lan:80x", "is not an http"), ("http://*.lan", "is not an http"), ("http://[fd00::5", "is not an http"),
    ("http://coord.lan/?x=1", "without a query"), ("http://coord.lan/#top", "without a query"),
    ("http://user:pw@coord.lan", "or credentials"), ("http://köln.lab:8080", "punycode")])
def test_public_base_url_must_be_a_url_agents_can_fetch(tmp_path, url, why):
    with pytest.raises(SettingsError, match=why):
        config(tmp_path, public_base_url=url)


@pytest.mark.parametrize("host", ["localhost:8080", "http://0.0.0.0", "*", "*.lan", "a b"])
def test_the_api_host_must_be_a_name_or_address_to_listen_on(tmp_path, host):
    with pytest.raises(SettingsError, match="is not a host name or address to listen on"):
        config(tmp_path, host=host)


def test_ipv6_patterns_are_kept_without_brackets(tmp_path):
    assert config(tmp_path, allowed_hosts=["[FD00::1]", "Coord.Lan"]).api.allowed_hosts == ["fd00::1", "coord.lan"]
    assert config(tmp_path, host="[::1]").api.host == "::1"
