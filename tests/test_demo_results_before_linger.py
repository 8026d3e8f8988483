"""`fedal demo --linger S` writes the results JSON, the plot and the table the moment the run has
finished, then keeps the coordinator up: nobody waits S seconds for the results."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from tests.deployment import get, poll_run
from tests.waiting import free_port, wait_until


def test_results_are_written_before_the_linger(mosquitto, tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    out, plot, log = tmp_path / "results.json", tmp_path / "acc.png", tmp_path / "demo.out"
    exe = Path(sys.executable).with_name("fedal")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fedal_cli.main"]
    with open(log, "wb") as stdout:
        demo = subprocess.Popen([*cmd, "demo", "--dataset", "digits", "--clients", "2", "--strategy", "fedmd",
                                 "--rounds", "2", "--public-size", "60", "--broker", mosquitto, "--api-port", str(port),
                                 "--linger", "600", "--workdir", str(tmp_path / "ws"), "--out", str(out),
                                 "--plot", str(plot), "--quiet"],
                                stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: (poll_run(api) or {}).get("state") == "finished" or demo.poll() is not None,
                   timeout_s=300, what="the run to finish", interval_s=0.3)
        assert demo.poll() is None, log.read_text()[-3000:]
        # within the 600 s linger: the files are there while the coordinator still answers
        wait_until(lambda: out.exists() and plot.exists() and "results ->" in log.read_text(), timeout_s=120,
                   what="the results while the demo lingers", interval_s=0.3)
        assert demo.poll() is None
        assert get(f"{api}/healthz")["status"] == "ok"
        results = json.loads(out.read_text())
        assert len(results["rounds"]) == 2 and results["final"]["client_acc"]
        assert "mean acc" in log.read_text()  # the table, too
    finally:
        demo.send_signal(signal.SIGTERM)  # ends the linger early, in order
        demo.wait(timeout=120)
    assert poll_run(api) is None
