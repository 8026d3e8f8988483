"""The dashboard in a real headless Chromium (Debian's chromium + chromium-driver, driven by
Selenium) against a live coordinator during a real run: the round counter advances and the
client list shows every agent, with the health each reports (from fake sysfs/procfs trees: one
under-volted and throttled Pi is flagged); in a run with differential privacy, the privacy each
has spent."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import urllib.request

import pytest

from fedal.sim import load_config
from tests.deployment import Deployment
from tests.health_trees import pi_tree, set_agent_options
from tests.waiting import wait_until

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


def chromium(user_data_dir: str, extra: tuple[str, ...] = ()):
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not browser or not driver:
        pytest.fail("Debian's chromium and chromium-driver are needed (scripts/install-test-tools.sh installs them)")
    options = Options()
    options.binary_location = browser
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: CSP violations land there
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-dev-shm-usage", f"--user-data-dir={user_data_dir}", "--window-size=1280,1400", *extra):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def client_rows(driver) -> list[dict]:
    """The client table read in one go by the page itself (each refresh rebuilds its rows: an
    element found before a refresh is stale after it): per row its client and its cells' text,
    and the last (health) cell's class and title."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#clients tbody tr')].map(r => ({client: r.dataset.client,"
        " cells: [...r.cells].map(td => td.textContent), cls: r.cells[r.cells.length - 1].className,"
        " title: r.cells[r.cells.length - 1].title}))")


def test_dashboard_follows_a_live_run(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=10, tau=1, public_size=100,
                                    seed=3, local_test_fraction=0.2))
    # the browser (slow to start on a loaded machine) looks while the run holds before round 3 with
    # every agent online, then sees it go on: no race with how fast the run is
    dep = Deployment(config, tmp_path / "dep", mosquitto, phases={"pause_at": [{"round": 3}]})
    for cid, throttled in (("c00", "0"), ("c01", "50005"), ("c02", "50000")):  # c02: throttled before, not now
        set_agent_options(dep.agent_path(cid), health_root=pi_tree(tmp_path / f"{cid}-root", throttled=throttled))
    profile = tempfile.mkdtemp(prefix="fedal-chromium-")  # a fresh user-data dir
    driver = None
    try:
        dep.start_all()
        dep.wait_held(3)
        driver = chromium(profile)
        driver.set_page_load_timeout(60)
        driver.get(f"{dep.api}/")  # redirects to the dashboard

        def round_counter() -> int:
            text = driver.find_element(By.ID, "round-counter").text.strip()
            return int(text) if text.isdigit() else 0

        wait_until(lambda: round_counter() == 3, 120, "the round counter to show round 3")
        rows = wait_until(lambda: [r["client"] for r in client_rows(driver)] or None, 60, "the client list")
        assert sorted(rows) == ["c00", "c01", "c02"]
        assert driver.find_element(By.ID, "run-id").text == "demo"
        assert driver.find_element(By.ID, "run-strategy").text == "fedal"
        wait_until(lambda: "%" in driver.find_element(By.ID, "local-acc").text, 120, "a local accuracy")
        assert len(driver.find_elements(By.CSS_SELECTOR, "#acc-chart canvas")) == 1
        assert len(driver.find_elements(By.CSS_SELECTOR, "#disc-chart canvas")) == 1
        # the round axis of a run of a few rounds is marked at whole rounds (it read 1, 1.2, 1.4, ...)
        ticks = wait_until(lambda: driver.execute_script("return state.charts['acc-chart'].axes[0]._splits"),
                           60, "the accuracy chart's round axis")
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert [r["cells"][1] for r in client_rows(driver)] == ["online"] * 3
        health = wait_until(lambda: {r["client"]: r for r in client_rows(driver)} or None, 60, "health")
        assert {cid: r["cells"][-1] for cid, r in health.items()} == {
            "c00": "ok", "c01": "under_voltage, throttled", "c02": "ok"}
        assert health["c01"]["cls"] == "flagged" and health["c00"]["cls"] == "healthy"
        assert "get_throttled 0x50005" in health["c01"]["title"]
        assert "board Raspberry Pi 4 Model B Rev 1.4" in health["c01"]["title"]
        assert driver.find_element(By.ID, "client-count").text == "(3 of 3 online, 1 flagged)"
        assert [r["cells"][9] for r in client_rows(driver)] == ["52.6 °C"] * 3
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot))
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        # from here on, count the refreshes the event stream asks for (the 2 s poll asks with delay 0)
        driver.execute_script("window.fromEvents = 0; const asked = window.scheduleRefresh;"
                              "window.scheduleRefresh = (delayMs) => {"
                              " if (delayMs === undefined) window.fromEvents += 1; return asked(delayMs); };")
        dep.control("resume")
        wait_until(lambda: round_counter() > 3, 180, "the round counter to advance past 3")
        wait_until(lambda: driver.execute_script("return window.fromEvents") > 0, 60, "a refresh on a server-sent event")
        blocked = [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
        assert not blocked, blocked  # the dashboard's own policy lets everything it does through
    finally:
        if driver is not None:
            driver.quit()
        dep.close()
        shutil.rmtree(profile, ignore_errors=True)


def test_dashboard_shows_the_privacy_each_client_spent(mosquitto, tmp_path):
    """A run with differential privacy: the API, Prometheus and the dashboard's client list show
    every client's epsilon, and the accuracy on the devices' own (private) test splits is not shown."""
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=4, tau=1, public_size=100,
                                    seed=3, local_test_fraction=0.2, dp_noise_multiplier=1.0))
    dep = Deployment(config, tmp_path / "dep", mosquitto, phases={"pause_at": [{"round": 3}]})
    profile = tempfile.mkdtemp(prefix="fedal-chromium-")
    driver = None
    try:
        dep.start_all()
        dep.wait_held(3)  # held: the numbers stay put while they are compared
        with urllib.request.urlopen(f"{dep.api}/api/v1/clients", timeout=10) as resp:
            eps = {c["id"]: c["epsilon"] for c in json.load(resp)}
        assert sorted(eps) == ["c00", "c01", "c02"] and all(e > 0 for e in eps.values())
        with urllib.request.urlopen(f"{dep.api}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert metrics.count("fedal_client_privacy_epsilon{") == 3
        driver = chromium(profile)
        driver.set_page_load_timeout(60)
        driver.get(f"{dep.api}/")
        shown = wait_until(lambda: [r["cells"][8] for r in client_rows(driver)] or None, 60, "the client list")
        assert shown == [f"{eps[c]:.2f}" for c in ("c00", "c01", "c02")]
        assert driver.find_element(By.ID, "local-acc").text == "–"
    finally:
        if driver is not None:
            driver.quit()
        dep.close()
        shutil.rmtree(profile, ignore_errors=True)


@contextlib.contextmanager
def served_api(tmp_path, **api):
    """A coordinator's API with no run, served on a free loopback port (tests/local_api.py); yields
    its RunManager, base URL and a fresh browser profile folder (removed after)."""
    from coordinator.config import load_coordinator_config
    from coordinator.runs import RunManager
    from tests.local_api import served

    runs = RunManager(load_coordinator_config(None, state_dir=tmp_path / "state", api=api))
    profile = tempfile.mkdtemp(prefix="fedal-chromium-")
    try:
        with served(runs) as port:
            yield runs, f"http://127.0.0.1:{port}", profile
    finally:
        shutil.rmtree(profile, ignore_errors=True)
        runs.store.close()


def test_the_api_pages_render_with_no_network_but_the_coordinators(tmp_path):
    """/docs and /redoc loaded Swagger UI and ReDoc from a CDN: on a lab network without internet
    the page stayed blank. The browser here resolves no name at all, and the page still renders
    every operation."""
    driver = None
    with served_api(tmp_path) as (_runs, base, profile):
        try:
            for page in ("/docs", "/redoc"):
                html = urllib.request.urlopen(base + page, timeout=10).read().decode()
                assert "cdn." not in html and "https://" not in html.split("<body>")[0], html[:500]
            options_flag = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
            driver = chromium(profile, extra=(options_flag,))
            driver.set_page_load_timeout(60)
            driver.get(f"{base}/docs")
            wait_until(lambda: len(driver.find_elements(By.CSS_SELECTOR, ".opblock")) >= 10, 60,
                       "Swagger UI to list the API's operations")
            paths = {e.text for e in driver.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
            assert {"/api/v1/runs", "/metrics"} <= paths, paths
        finally:
            if driver is not None:
                driver.quit()


def test_a_dashboard_waiting_for_a_token_sends_nothing_and_a_live_one_does_not_poll(tmp_path):
    """Waiting for a token, the dashboard went on polling every 2 s: 30 refused requests a minute,
    each counted and logged as a guess. Live on the event stream it polled all the same (three
    reads of every run each time, a full snapshot of each under its engine's lock)."""
    import time

    driver = None
    with served_api(tmp_path, token="s3cret", read_requires_token=True) as (runs, base, profile):
        try:
            with urllib.request.urlopen(f"{base}/dashboard/app.js", timeout=10) as resp:
                headers = resp.headers  # revalidated on every load (no stale app.js after an upgrade), no framing
                assert headers["Cache-Control"] == "no-cache" and "frame-ancestors 'none'" in headers[
                    "Content-Security-Policy"] and headers["X-Content-Type-Options"] == "nosniff"
            driver = chromium(profile)
            driver.set_page_load_timeout(60)
            driver.get(f"{base}/dashboard/")
            wait_until(lambda: driver.find_element(By.ID, "token-form").is_displayed(), 60, "the token form")
            settled = sum(runs.refused_requests.values())
            time.sleep(6.5)  # three polls' worth
            assert sum(runs.refused_requests.values()) == settled, dict(runs.refused_requests)
            assert settled <= 3  # the first read, the event stream's 401 (and at most one read already under way)

            runs.config.api.read_requires_token = False  # reads open: the event stream connects and stays
            driver.find_element(By.ID, "token").send_keys("s3cret")
            driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
            wait_until(lambda: "none yet" in driver.find_element(By.ID, "run-id").text, 60, "the dashboard to read")
            driver.refresh()  # a new page: its event stream opens (reads need no token now)
            wait_until(lambda: driver.find_element(By.ID, "live").text == "live", 60, "the event stream")
            count = "return performance.getEntriesByType('resource').filter(e => e.name.endsWith('/api/v1/runs')).length"
            seen = [-1]

            def settled() -> bool:  # the refresh the stream's opening asks for is done: no new read for 1.5 s
                before, seen[0] = seen[0], driver.execute_script(count)
                time.sleep(1.5)
                return seen[0] >= 1 and seen[0] == before == driver.execute_script(count)

            wait_until(settled, 60, "the reads to settle")
            reads = driver.execute_script(count)
            time.sleep(6.5)
            assert driver.execute_script(count) == reads  # live: nothing happened, nothing read
        finally:
            if driver is not None:
                driver.quit()
