"""One round numbering for people: a real 2-round run over Mosquitto, where the run list, the run,
its round records, the live events, the results (API and file) and the dashboard in headless
Chromium all count rounds from 1 and agree; only the MQTT wire counts from 0."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading

import httpx
import pytest

from fedal.sim import load_config
from tests.deployment import Deployment, get
from tests.waiting import wait_for_port, wait_until

ROUNDS = 2


def follow_events(url: str, events: list, subscribed: threading.Event, done: threading.Event) -> None:
    """Collects the SSE stream until the run ends (or `done` is set by the test)."""
    try:
        with httpx.stream("GET", url, timeout=httpx.Timeout(5.0, read=30.0)) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    if done.is_set():
                        return
                    continue
                event = json.loads(line[6:])
                events.append(event)
                if event["type"] == "hello":
                    subscribed.set()
                if (event["type"] == "run" and event.get("state") in ("finished", "stopped", "failed")) or done.is_set():
                    return
    except httpx.HTTPError:
        subscribed.set()  # the test's own assertions report the missing events


def test_api_events_results_and_dashboard_agree_on_round_numbers(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=ROUNDS, tau=1, public_size=100,
                                    seed=4))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    events: list[dict] = []
    seen: list[dict] = []
    subscribed, done = threading.Event(), threading.Event()
    try:
        dep.start_coordinator()
        assert wait_until(lambda: wait_for_port(dep.port, timeout_s=1), timeout_s=60, what="the coordinator's API")
        listener = threading.Thread(target=follow_events, args=(f"{dep.api}/api/v1/events", events, subscribed, done),
                                    daemon=True)
        listener.start()
        assert subscribed.wait(30)
        for path in dep.agent_paths:
            dep.start_agent(path.parent.name)

        def finished(run: dict) -> bool:
            seen.append(run)
            return run["state"] == "finished"

        dep.wait_for(finished, timeout_s=240, what="the run to finish")
        listing = get(f"{dep.api}/api/v1/runs")
        run = dep.run()
        rounds = get(f"{dep.api}/api/v1/runs/demo/rounds")
        results = dep.results()
        listener.join(30)
        dashboard = read_dashboard(dep.api)
    finally:
        done.set()
        dep.close()

    summary = next(r for r in listing if r["run_id"] == "demo")
    assert summary["round"] == run["round"] == ROUNDS
    assert summary["completed_rounds"] == run["completed_rounds"] == ROUNDS
    assert run["last_round"]["round"] == ROUNDS
    assert [r["round"] for r in rounds] == [r["round"] for r in results["rounds"]] == list(range(1, ROUNDS + 1))
    on_disk = json.loads((dep.workdir / "coordinator" / "state" / "results.json").read_text())
    assert [r["round"] for r in on_disk["rounds"]] == list(range(1, ROUNDS + 1))

    for snap in seen:  # while it runs: the round in progress, never ahead of the records by more than one
        if snap["state"] == "running":
            assert 1 <= snap["round"] <= ROUNDS and snap["round"] - 1 <= snap["completed_rounds"] <= snap["round"], snap
        elif snap["state"] == "pending":
            assert snap["round"] == 0, snap

    assert [e["round"] for e in events if e["type"] == "round"] == list(range(1, ROUNDS + 1))
    phase_rounds = [e["round"] for e in events if e["type"] == "phase"]
    assert phase_rounds == sorted(phase_rounds) and set(phase_rounds) == set(range(1, ROUNDS + 1))

    assert dashboard == {"round": str(ROUNDS), "total": str(ROUNDS), "completed": str(ROUNDS),
                         "runs_row": f"{ROUNDS} / {ROUNDS}"}


def read_dashboard(api: str) -> dict:
    """What the dashboard shows for the finished run, in Debian's headless chromium."""
    pytest.importorskip("selenium.webdriver")

    from tests.test_dashboard_browser import chromium

    profile = tempfile.mkdtemp(prefix="fedal-chromium-")
    driver = None
    try:
        driver = chromium(profile)
        driver.set_page_load_timeout(60)
        driver.get(f"{api}/dashboard/")

        def shown() -> dict | None:  # read in one go by the page: a refresh rebuilds the runs table
            seen = driver.execute_script(
                "return {cells: [...document.querySelectorAll('#runs tbody tr td')].map(td => td.textContent),"
                " total: document.getElementById('rounds-total').textContent.trim(),"
                " round: document.getElementById('round-counter').textContent.trim(),"
                " completed: document.getElementById('completed-rounds').textContent.trim()}")
            if len(seen["cells"]) < 4 or not seen["total"].isdigit():
                return None
            return {"round": seen["round"], "total": seen["total"], "completed": seen["completed"],
                    "runs_row": seen["cells"][3]}

        return wait_until(shown, 60, "the dashboard to show the run")
    finally:
        if driver is not None:
            driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
