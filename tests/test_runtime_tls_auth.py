"""An external broker over TLS with per-client credentials (mqtts:// with a CA file), and the
agent's clean shutdown on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import paho.mqtt.client as mqtt
import pytest

from fedal.protocol import topics
from fedal.sim import load_config, simulate
from tests.deployment import Deployment
from tests.helpers import per_client
from tests.waiting import free_port, wait_for_port, wait_until


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture()
def tls_broker(tmp_path):
    """Mosquitto on a free port with TLS (a CA made here) and a password file."""
    d = tmp_path / "tls"
    d.mkdir()
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=fedal-test-ca", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
            cwd=d)
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "server.crt",
            "-days", "2", "-extfile", "san.cnf", cwd=d)
    users = {"coordinator": "s3cret-c", "c00": "pw0", "c01": "pw1", "c02": "pw2"}
    passwd = d / "passwd"
    passwd.write_text("".join(f"{u}:{p}\n" for u, p in users.items()))
    subprocess.run(["mosquitto_passwd", "-U", str(passwd)], check=True, capture_output=True)
    port = free_port()
    conf = d / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\ncafile {d / 'ca.crt'}\ncertfile {d / 'server.crt'}\nkeyfile {d / 'server.key'}\n"
        f"allow_anonymous false\npassword_file {passwd}\npersistence false\nlog_dest file {d / 'mosquitto.log'}\n"
        + ("user root\n" if os.geteuid() == 0 else "")  # as root it would drop to a user that cannot read tmp
    )
    proc = subprocess.Popen(["mosquitto", "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_for_port(port):
        proc.kill()
        log = d / "mosquitto.log"
        pytest.fail(f"mosquitto with TLS did not start: {log.read_text() if log.exists() else ''}")
    yield {"url": f"mqtts://127.0.0.1:{port}", "ca": str(d / "ca.crt"), "users": users}
    proc.terminate()
    proc.wait(timeout=10)


def test_run_over_tls_with_credentials(tls_broker, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=2, tau=2, public_size=100, seed=6))
    b = tls_broker
    dep = Deployment(config, tmp_path / "dep", b["url"],
                     coordinator={"broker": {"ca_file": b["ca"], "username": "coordinator",
                                             "password": b["users"]["coordinator"]}},
                     agent={"broker": {"ca_file": b["ca"]}})
    for path in dep.agent_paths:  # per-device credentials, here through the environment-free TOML
        cid = path.parent.name
        path.write_text(path.read_text().replace("[broker]", f'[broker]\nusername = "{cid}"\npassword = "{b["users"][cid]}"'))
    try:
        dep.start_coordinator()
        for cid in ("c00", "c01", "c02"):
            dep.start_agent(cid)
        final = dep.wait_for(lambda r: r["state"] == "finished", timeout_s=180, what="the run over TLS")
        results = dep.results()
    finally:
        dep.close()
    assert final["completed_rounds"] == 2
    assert results["final"]["client_acc"] == simulate(per_client(config))["final"]["client_acc"]


def test_wrong_password_is_refused_and_retried_without_crashing(tls_broker, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=50, seed=0))
    b = tls_broker
    dep = Deployment(config, tmp_path / "dep", b["url"], agent={"broker": {"ca_file": b["ca"], "username": "c00",
                                                                           "password": "wrong"}})
    def refusals(log_path) -> int:
        text = log_path.read_text().lower() if log_path.exists() else ""
        return sum(text.count(w) for w in ("refused", "not authorised", "disconnected"))

    try:
        agent = dep.start_agent("c00")
        log_path = next(dep.agent_path("c00").parent.glob("agent-*.log"))
        deadline = time.monotonic() + 120  # importing torch takes a while on a loaded machine
        while refusals(log_path) < 2 and time.monotonic() < deadline:
            assert agent.poll() is None, "the agent died on a refused connection"
            time.sleep(0.5)
        assert refusals(log_path) >= 2  # refused, and tried again
        assert agent.poll() is None  # still alive, retrying with backoff
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        dep.close()


def test_agent_shuts_down_cleanly_on_sigterm(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=50, seed=0))
    dep = Deployment(config, tmp_path / "dep", mosquitto)
    seen: list[str] = []
    host, port = mosquitto.removeprefix("mqtt://").split(":")
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="status-watcher")
    watcher.on_message = lambda c, u, m: seen.append(json.loads(m.payload)["state"])
    subscribed = threading.Event()
    watcher.on_subscribe = lambda *_: subscribed.set()
    watcher.connect(host, int(port))
    watcher.subscribe(topics.status("demo", "c00"), qos=1)
    watcher.loop_start()
    try:
        assert subscribed.wait(30), "the broker did not acknowledge the watcher's subscription"
        agent = dep.start_agent("c00")
        deadline = time.monotonic() + 60
        while "online" not in seen and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "online" in seen
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
        # said goodbye itself (a killed agent's Last Will says the same); delivered, however late
        wait_until(lambda: seen[-1] == "offline", timeout_s=30, what="the agent's offline status")
        status = json.loads((dep.agent_path("c00").parent / "agent-status.json").read_text())
        assert status["client_id"] == "c00"
    finally:
        watcher.loop_stop()
        watcher.disconnect()
        dep.close()
