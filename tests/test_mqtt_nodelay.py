"""Nagle's algorithm is off on every MQTT connection the toolkit makes, and in every Mosquitto
configuration it writes: with it on, a few-kB task or result waits for the peer's delayed ACK
(bench/overhead.py; docs/results/overhead.md has the measurement)."""

from __future__ import annotations

import socket

from fedal.protocol import BrokerSettings, parse_broker_url
from fleet.generate import FleetSpec, mosquitto_conf
from hil.mosquitto import Mosquitto
from mqtt_link import new_client
from mqtt_link.client import no_delay


def nodelay(sock) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_the_shared_client_connects_without_nagle(mosquitto):
    addr = parse_broker_url(mosquitto)
    client = new_client(BrokerSettings(url=mosquitto), addr, "nodelay-check", clean_session=True)
    client.connect(addr.host, addr.port)
    try:
        assert nodelay(client.socket()) == 1
        client.reconnect()  # every reconnection gets a new socket: it too
        assert nodelay(client.socket()) == 1
    finally:
        client.disconnect()


def test_no_delay_sets_the_option_and_tolerates_non_tcp_sockets(mosquitto):
    addr = parse_broker_url(mosquitto)
    with socket.create_connection((addr.host, addr.port)) as sock:  # what the emulated fleet's sockets are
        assert nodelay(sock) == 0
        no_delay(sock)
        assert nodelay(sock) == 1
    a, b = socket.socketpair()
    with a, b:
        no_delay(a)  # a Unix socket has no Nagle: left alone, no error
    no_delay(None)


def test_generated_broker_configs_turn_nagle_off_and_mosquitto_takes_them(tmp_path):
    with Mosquitto(tmp_path / "hil") as broker:  # the HIL/bench broker
        assert "set_tcp_nodelay true" in broker.conf.read_text().splitlines()
        assert broker.proc is not None and broker.proc.poll() is None  # Mosquitto took the option
    snippet = mosquitto_conf(FleetSpec(devices=2, broker="mqtt://broker.lan:1883", out=tmp_path / "fleet"), 1883, 1884)
    assert "set_tcp_nodelay true" in snippet.splitlines()
