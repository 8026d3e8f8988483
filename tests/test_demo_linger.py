"""`fedal demo --api-port P --linger S` keeps the API up S seconds after the run, then leaves nothing behind."""

from __future__ import annotations

import threading
import urllib.request

from fedal.sim import load_config
from fedal_cli.demo import run_demo
from tests.deployment import get, poll_run
from tests.waiting import free_port, wait_until

LINGER_S = 10


def test_api_lingers_after_the_run_then_goes(mosquitto, tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=60, seed=0))
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(run_demo(config, tmp_path / "demo", broker=mosquitto, api_port=port,
                                                                   linger_s=LINGER_S, quiet=True, timeout_s=180)))
    runner.start()
    run = wait_until(lambda: (r := poll_run(api)) is not None and r["state"] == "finished" and r, timeout_s=180, interval_s=0.2,
                     what="the demo's run to finish")
    # lingering: the run is over and the API still answers (LINGER_S leaves room for a loaded machine)
    assert run["completed_rounds"] == 1
    assert get(f"{api}/healthz")["status"] == "ok"
    assert runner.is_alive()
    runner.join(timeout=60 + LINGER_S)
    assert out["final"]["client_acc"]
    try:
        urllib.request.urlopen(f"{api}/healthz", timeout=2)
        reachable = True
    except OSError:
        reachable = False
    assert not reachable  # the coordinator is gone with the demo
