"""`fedal demo --api-port P --linger S` keeps the API up S seconds after the run, then leaves nothing behind."""

from __future__ import annotations

import threading
import time
import urllib.request

from coordinator.demo import free_port, run_demo
from fedal.sim import load_config
from tests.deployment import get, poll_run


def test_api_lingers_after_the_run_then_goes(mosquitto, tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=60, seed=0))
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(run_demo(config, tmp_path / "demo", broker=mosquitto, api_port=port,
                                                                   linger_s=4, quiet=True, timeout_s=180)))
    runner.start()
    deadline = time.monotonic() + 180
    seen_finished = False
    while time.monotonic() < deadline and runner.is_alive():
        run = poll_run(api)
        if run is not None and run["state"] == "finished":
            seen_finished = True
            break
        time.sleep(0.2)
    assert seen_finished
    time.sleep(1.5)
    assert runner.is_alive()  # lingering
    assert get(f"{api}/healthz")["status"] == "ok"
    runner.join(timeout=60)
    assert out["final"]["client_acc"]
    try:
        urllib.request.urlopen(f"{api}/healthz", timeout=2)
        reachable = True
    except OSError:
        reachable = False
    assert not reachable  # the coordinator is gone with the demo
