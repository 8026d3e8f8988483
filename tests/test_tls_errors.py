"""A broker certificate the agent or the coordinator does not trust: the log says why (certificate
verify failed: not signed by the configured CA, or the broker's name is not in it), not only
"cannot connect ... retrying". Against a real Mosquitto on TLS with `fedal fleet init --tls`'s
certificate for 127.0.0.1."""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from coordinator.bus import CoordinatorBus
from edge_agent.mqtt_link import MqttLink
from fleet import tls
from tests.fleet_broker import provision, start_broker

# OpenSSL words an untrusted chain either way, depending on whether the broker sends its CA along
UNKNOWN_CA = ("unable to get local issuer certificate", "self-signed certificate in certificate chain")
WRONG_NAME = "Hostname mismatch"


def foreign_ca(tmp_path):
    pem, _key, _cert = tls.make_ca("someone else's CA")
    path = tmp_path / "foreign-ca.crt"
    path.write_bytes(pem.cert)
    return path


def names(line: str, want: str | tuple[str, ...]) -> bool:
    return any(w in line for w in ((want,) if isinstance(want, str) else want))


def warning_of(caplog, logger: str, want: str | tuple[str, ...], timeout_s: float = 20) -> str:
    """The first WARNING of `logger` naming `want` (one of them, for a tuple)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in list(caplog.records):
            if r.name == logger and r.levelno == logging.WARNING and names(r.getMessage(), want):
                return r.getMessage()
        time.sleep(0.1)
    raise AssertionError(f"no warning naming {want!r} from {logger}: {[r.getMessage() for r in caplog.records]}")


def test_agent_and_coordinator_log_why_the_broker_certificate_is_refused(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    files = provision(tmp_path, 2, tls=True)  # the certificate names 127.0.0.1 only
    broker = start_broker(files, tmp_path / "mosquitto")
    links: list[MqttLink] = []
    stop = threading.Event()
    try:
        # a CA that did not sign the broker's certificate
        links.append(MqttLink(files.agent_config("pi-1", ca_file=foreign_ca(tmp_path)), queue.Queue()))
        links[-1].start()
        line = warning_of(caplog, "edge_agent.mqtt", UNKNOWN_CA)
        assert "certificate verify failed" in line and "retrying" in line and "ca_file" in line, line
        links[-1].stop()

        # the right CA, but a host name the certificate does not name
        url = f"mqtts://localhost:{files.port}"
        links.append(MqttLink(files.agent_config("pi-2", url=url), queue.Queue()))
        links[-1].start()
        line = warning_of(caplog, "edge_agent.mqtt", WRONG_NAME)
        assert "'localhost'" in line and "--server-name" in line, line
        assert not links[-1].connected.is_set()

        # the coordinator's connection goes through the same client
        bus = CoordinatorBus(files.coordinator_settings(url=f"mqtts://localhost:{files.coordinator_port}"), "fleet",
                             queue.Queue())
        threading.Thread(target=bus.start, args=(stop, 60), daemon=True).start()
        line = warning_of(caplog, "coordinator.mqtt", WRONG_NAME)
        assert "certificate verify failed" in line, line
        stop.set()
        bus.stop()

        # with the right CA and name it connects (the broker was fine all along)
        links.append(MqttLink(files.agent_config("pi-1"), queue.Queue()))
        links[-1].start()
        assert links[-1].connected.wait(20)
    finally:
        stop.set()
        for link in links:
            link.stop()
        broker.stop()


def test_agent_process_logs_the_certificate_error(tmp_path):
    files = provision(tmp_path, 1, tls=True)
    broker = start_broker(files, tmp_path / "mosquitto")
    log_path = tmp_path / "agent.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FEDAL_AGENT_BROKER__CA_FILE": str(foreign_ca(tmp_path)),
           "FEDAL_AGENT_WORKSPACE": str(tmp_path / "ws"), "FEDAL_AGENT_DATA_FILE": str(tmp_path / "ws" / "train.npz")}
    (tmp_path / "ws").mkdir(exist_ok=True)
    np.savez(tmp_path / "ws" / "train.npz", x=np.zeros((4, 40), np.float32), y=np.zeros(4, np.int64))  # read at start
    with open(log_path, "wb") as log:
        agent = subprocess.Popen([sys.executable, "-m", "edge_agent", "--config",
                                  str(files.out / "devices" / "pi-1" / "agent.toml")],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120  # importing torch takes a while on a loaded machine
        while not names(log_path.read_text(), UNKNOWN_CA) and time.monotonic() < deadline:
            assert agent.poll() is None, log_path.read_text()
            time.sleep(0.3)
        text = log_path.read_text()
        assert names(text, UNKNOWN_CA) and "certificate verify failed" in text, text
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        broker.stop()
