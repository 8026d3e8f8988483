"""Refused API requests leave a trace: each 401, 403, 413 and 422 is logged with its method, path
and client, and counted on /metrics (token guessing was invisible). A token that can never be
presented (empty, or with spaces at its ends) is a config error."""

from __future__ import annotations

import logging
import time

import pytest

from coordinator.config import load_coordinator_config
from coordinator.runs import RunManager
from fedal.settings import SettingsError
from tests.local_api import local_client

TOKEN = "tok"


def test_refused_requests_are_logged_and_counted(tmp_path, caplog):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state",
                                              api={"token": TOKEN, "max_body_bytes": 2048}))
    api = local_client(runs, raise_server_exceptions=False)
    caplog.set_level(logging.WARNING, logger="coordinator.runs")
    assert api.post("/api/v1/runs/x/stop").status_code == 401
    assert api.post("/api/v1/runs/x/stop", headers={"Authorization": "Bearer guess"}).status_code == 403
    assert api.post("/api/v1/runs", content=b"x" * 4096, headers={"Authorization": f"Bearer {TOKEN}",
                                                                  "Content-Type": "application/json"}).status_code == 413
    assert api.post("/api/v1/runs", json={"run_id": "r"}, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 422
    assert api.post("/api/v1/runs", json={"run_id": "r", "client_ids": ["a", "b"], "run": {"public_size": 10**6}},
                    headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 422  # refused by the run's own checks
    # bodies FastAPI cannot parse at all (not UTF-8; nested past its parser): refused as malformed ones are
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    for body in (b"\xff\xfe{", b"[" * 1000 + b"]" * 1000):
        unread = api.post("/api/v1/runs", content=body, headers=auth)
        assert unread.status_code == 400 and "could not be read as JSON" in unread.json()["detail"], unread.text
    assert api.post("/api/v1/runs/nope/stop", headers=auth).status_code == 404  # other errors as they were
    metrics = api.get("/metrics").text
    for status, count in (("400", 2), ("401", 1), ("403", 1), ("413", 1), ("422", 2)):
        assert f'fedal_api_refused_requests_total{{status="{status}"}} {count}.0' in metrics, metrics[-800:]
    logged = [r.getMessage() for r in caplog.records if "API: refused" in r.getMessage()]
    assert len(logged) == 7
    assert "POST '/api/v1/runs/x/stop' from testclient: 403 wrong token" in logged[1]
    runs.store.close()


@pytest.mark.parametrize("token", ["", " tok", "tok\n"])
def test_a_token_that_can_never_be_presented_is_a_config_error(tmp_path, token):
    with pytest.raises(SettingsError, match="can never be presented"):
        load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": token})


@pytest.mark.parametrize("token", ["s\u00e4tze-1234567890", "tok\u200bzero-width-space", "tab\tinside"])
def test_a_token_a_browser_cannot_send_is_a_config_error(tmp_path, token):
    """A browser sends a header's characters as latin-1 (the coordinator compared UTF-8: `ä` was
    always a wrong token) or refuses to send it at all (above U+00FF): the dashboard could never
    present such a token."""
    with pytest.raises(SettingsError, match="printable ASCII"):
        load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": token})
    load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": "Ab9-._~+/=!#$%&*?@^|"})


def test_a_short_token_is_warned_of_at_start(tmp_path, caplog):
    from coordinator.cli import warn_if_weak_token

    caplog.set_level(logging.WARNING, logger="coordinator")
    warn_if_weak_token(load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": "a"}))
    assert "api.token has 1 characters: use at least 16 random ones" in caplog.text
    caplog.clear()
    warn_if_weak_token(load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": "k" * 16}))
    warn_if_weak_token(load_coordinator_config(None, state_dir=tmp_path / "state"))
    assert "api.token" not in caplog.text


@pytest.mark.parametrize("host, reads_token, warned", [
    ("0.0.0.0", False, True), ("192.168.1.10", False, True), ("::", False, True), ("0.0.0.0", True, False),
    ("127.0.0.1", False, False), ("127.0.1.1", False, False), ("127.1", False, False), ("::1", False, False),
    ("localhost", False, False)])  # numeric hosts and localhost: resolved without asking any DNS server
def test_reads_open_beyond_loopback_are_warned_of_at_start(tmp_path, caplog, host, reads_token, warned):
    from coordinator.cli import warn_if_reads_open

    caplog.set_level(logging.WARNING, logger="coordinator")
    warn_if_reads_open(load_coordinator_config(None, state_dir=tmp_path / "state",
                                               api={"host": host, "port": 8123, "read_requires_token": reads_token,
                                                    **({"token": "a-long-enough-token-0123"} if reads_token else {})}))
    said = f"the API listens on {host} and its reads are open"
    assert (said in caplog.text) is warned, caplog.text
    if warned:
        assert "port 8123" in caplog.text and "read_requires_token = true" in caplog.text


def test_refusal_logs_cannot_be_forged_or_flood_the_log(tmp_path, caplog):
    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": TOKEN}))
    api = local_client(runs, raise_server_exceptions=False)
    caplog.set_level(logging.WARNING, logger="coordinator.runs")
    assert api.post("/api/v1/runs/x%0AINFO%20forged/stop").status_code == 401
    first = next(r.getMessage() for r in caplog.records if "API: refused" in r.getMessage())
    assert "\n" not in first and "\\n" in first  # the decoded newline is quoted, not a new line
    for _ in range(100):
        api.post("/api/v1/runs/x/stop")
    logged = [r.getMessage() for r in caplog.records if "API: refused" in r.getMessage()]
    assert len(logged) <= 25  # a burst, then about one a second
    assert 'fedal_api_refused_requests_total{status="401"} 101.0' in api.get("/metrics").text  # all counted
    runs.store.close()


def one_run(tmp_path, rounds: int | None = None, **api_settings):
    """A coordinator (not serving MQTT) with one API-created run `r` of clients a and b; returns
    its RunManager, a client of its API and the creation's answer."""
    import numpy as np

    state = tmp_path / "state"
    state.mkdir()
    np.savez(state / "public.npz", x=np.zeros((4, 3), np.float32))
    runs = RunManager(load_coordinator_config(None, state_dir=state, api={"token": TOKEN, **api_settings}))
    api = local_client(runs, raise_server_exceptions=False)
    body = {"run_id": "r", "client_ids": ["a", "b"], "public_file": str(state / "public.npz"),
            "run": {"strategy": "fedmd", "dataset": "digits", **({"rounds": rounds} if rounds else {})}}
    created = api.post("/api/v1/runs", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert created.status_code == 201, created.text
    return runs, api, created


def test_head_answers_where_get_does(tmp_path):
    """HEAD on the public set and /metrics was a 405 with `allow: POST` (the control route matched)."""
    runs, api, _ = one_run(tmp_path)
    for path in ("/api/v1/runs/r/public", "/metrics"):
        head, get = api.head(path), api.get(path)
        assert head.status_code == get.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"]
    runs.store.close()


def test_reads_that_need_a_token_need_one_configured(tmp_path):
    """read_requires_token without a token refused every read (the dashboard, /metrics), with a
    message about writes: a config error now."""
    with pytest.raises(SettingsError, match="read_requires_token needs a token"):
        load_coordinator_config(None, state_dir=tmp_path / "state", api={"read_requires_token": True})


def test_listing_runs_copies_no_client(tmp_path, monkeypatch):
    """GET /api/v1/runs took a full snapshot of every run (every client's record and health
    copied under the engine's lock: 0.7 s for a run of 10,000 clients) to show ten fields."""
    from coordinator.app import RUN_SUMMARY
    from coordinator.run import Run

    runs, api, created = one_run(tmp_path)
    assert tuple(created.json()) == RUN_SUMMARY
    snapshot = api.get("/api/v1/runs/r").json()
    monkeypatch.setattr(Run, "snapshot", lambda self: pytest.fail("a listing copied every client"))
    listed = api.get("/api/v1/runs")
    assert listed.status_code == 200 and listed.json() == [{k: snapshot[k] for k in RUN_SUMMARY}]
    runs.store.close()


@pytest.mark.parametrize("per_client", [True, False])
def test_per_client_metrics_can_be_turned_off(tmp_path, per_client):
    """About 20 series per client: a run of 10,000 clients made each scrape 15 MiB (past
    Prometheus's scrape timeout, and every series then vanished). api.client_metrics = false
    keeps the run-wide series only."""
    runs, api, _ = one_run(tmp_path, rounds=7, client_metrics=per_client)
    metrics = api.get("/metrics").text
    assert 'fedal_rounds_planned{run="r"} 7.0' in metrics and "# TYPE fedal_rounds_planned gauge" in metrics
    assert 'fedal_clients_enrolled{run="r"} 2.0' in metrics
    assert ('fedal_client_answered_total{client="a",run="r"} 0.0' in metrics) is per_client, metrics[:2000]
    runs.store.close()


def test_a_control_request_waiting_for_the_run_managers_lock_leaves_the_event_loop_free(tmp_path):
    """The run manager's lock is held across a store write while a run is created (up to 30 s
    behind another run's save on SQLite). A pause, resume or stop waited for it on the event loop:
    every event stream and every other request waited with it."""
    import threading
    import urllib.request

    from tests.local_api import served

    runs, _, _ = one_run(tmp_path)
    holding, answered = threading.Event(), threading.Event()

    def hold_the_lock() -> None:
        with runs.lock:
            holding.set()
            answered.wait(10)  # released once the other request is answered, or after 10 s

    with served(runs) as port:
        base = f"http://127.0.0.1:{port}"
        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        holding.wait(10)
        pause = urllib.request.Request(f"{base}/api/v1/runs/r/pause", method="POST",
                                       headers={"Authorization": f"Bearer {TOKEN}"})
        waiting = threading.Thread(target=lambda: urllib.request.urlopen(pause, timeout=30).read())
        waiting.start()
        try:
            time.sleep(0.3)  # the pause is waiting for the lock
            with urllib.request.urlopen(f"{base}/dashboard/app.js", timeout=30) as page:  # the event loop alone
                served_while_held = holder.is_alive()
                assert page.status == 200 and served_while_held
        finally:
            answered.set()
            holder.join(15)
            waiting.join(15)
    runs.store.close()
