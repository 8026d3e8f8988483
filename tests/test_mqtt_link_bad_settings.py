"""Broker settings that can never work are refused where they are read, and a connection attempt
that fails in an unexpected way is retried and said, not the end of paho's network thread."""

from __future__ import annotations

import time

import paho.mqtt.client as mqtt
import pytest
from pydantic import ValidationError

from fedal.protocol import BrokerSettings, parse_broker_url
from fleet.generate import QUEUED_BYTES
from mqtt_link.client import Client, connect_failure


@pytest.mark.parametrize("url", ["mqtt://broker..local:1883", f"mqtt://{'a' * 64}.lan"])
def test_a_host_no_resolver_takes_is_a_config_error(url):
    """`broker..local` passed the URL check; the resolver then raised UnicodeError, which ended
    paho's network thread without a log line: the agent never connected and said nothing."""
    with pytest.raises(ValueError, match="is not a host name"):
        parse_broker_url(url)
    assert parse_broker_url("mqtt://[::1]:1883").host == "::1" and parse_broker_url("mqtts://b.lan").tls


def test_a_connection_attempt_failing_with_a_non_os_error_is_retried_and_said():
    failures: list[str] = []
    client = Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bad-host", protocol=mqtt.MQTTv311)
    client.reconnect_delay_set(min_delay=1, max_delay=1)
    client.on_connect_fail = lambda c, _u: failures.append(connect_failure(c.last_connect_error))
    client.connect_async("broker..local", 1883)
    client.loop_start()
    try:
        deadline = time.monotonic() + 10
        while len(failures) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(failures) >= 2, failures  # said, and tried again
        assert "UnicodeError" in failures[0]
        thread = client._thread
        assert thread is not None and thread.is_alive()
    finally:
        client.loop_stop()
    assert not thread.is_alive()  # and it ends when asked


def test_a_ca_file_with_plain_mqtt_is_refused():
    """The CA file was ignored for mqtt://: the user asked for TLS and the password crossed the
    network in the clear, without a word."""
    with pytest.raises(ValidationError, match="plain mqtt://"):
        BrokerSettings(url="mqtt://broker.lan", ca_file="/etc/fedal-agent/ca.crt")
    assert BrokerSettings(url="mqtts://broker.lan", ca_file="/etc/fedal-agent/ca.crt").ca_file is not None


def test_the_fleets_broker_bounds_what_it_queues_for_a_device_that_is_off(tmp_path):
    """A dead device's persistent session grew by every phase's task, without a byte limit and
    for ever (the broker started with these settings: tests/test_security_broker_limits.py)."""
    from click.testing import CliRunner

    from fedal_cli.main import cli

    out = tmp_path / "fleet"
    assert CliRunner().invoke(cli, ["fleet", "init", "--devices", "2", "--broker", "mqtt://h", "--out", str(out)]).exit_code == 0
    conf = (out / "broker" / "fedal.conf").read_text().splitlines()
    assert f"max_queued_bytes {QUEUED_BYTES}" in conf and "persistent_client_expiration 2w" in conf
