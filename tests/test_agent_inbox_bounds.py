"""What the agent lets in from the broker: a message above broker.max_message_bytes (a whole
envelope is at most that) is dropped unread and counted, and tasks waiting for a busy worker are
bounded. Before, a 200 MB message was read into memory and journaled on a 1 GB Pi without a word,
and 400 junk messages sent during a training task all waited in memory."""

from __future__ import annotations

import json
import queue
import signal
from types import SimpleNamespace

import paho.mqtt.client as mqtt

from edge_agent.config import AgentConfig
from edge_agent.mqtt_link import INBOX_MESSAGES, MqttLink
from fedal.protocol import parse_broker_url, topics
from fedal.sim import load_config
from fedal_cli.demo import RUN_ID
from tests.deployment import Deployment
from tests.waiting import wait_until

LIMIT = 65536


def test_a_message_larger_than_a_whole_envelope_is_dropped_unread_and_counted(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=60))
    dep = Deployment(config, tmp_path / "dep", mosquitto, agent={"broker": {"max_message_bytes": LIMIT}})
    try:
        agent = dep.start_agent("c00")
        status = dep.agent_path("c00").parent / "agent-status.json"
        sender = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="oversize-sender")
        addr = parse_broker_url(mosquitto)
        sender.connect(addr.host, addr.port)
        sender.loop_start()
        seen: list[bytes] = []
        sender.on_message = lambda c, u, m: seen.append(bytes(m.payload))
        sender.subscribe(topics.status(RUN_ID, "c00"), qos=1)
        wait_until(lambda: any(b'"online"' in p for p in seen), timeout_s=60, what="the agent to come online")
        sender.publish(topics.task(RUN_ID, "c00"), b"x" * (LIMIT + 1), qos=1).wait_for_publish(10)
        logs = lambda: "".join(p.read_text() for p in dep.agent_path("c00").parent.glob("agent-*.log"))  # noqa: E731
        wait_until(lambda: "larger than broker.max_message_bytes" in logs(), timeout_s=30, what="the drop to be said")
        sender.loop_stop()
        sender.disconnect()
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0
        counted = json.loads(status.read_text())
        assert counted["rejects"].get("size") == 1 and "envelope" not in counted["rejects"], counted
    finally:
        dep.close()


def _message(topic: str, size: int):
    return SimpleNamespace(topic=topic, payload=b"t" * size)


def test_tasks_waiting_for_a_busy_worker_are_bounded_and_the_manifest_always_passes(tmp_path):
    cfg = AgentConfig(client_id="pi-1", run_id="r", model="mlp", data_file=tmp_path / "unused.npz",
                      workspace=tmp_path / "ws", broker={"url": "mqtt://127.0.0.1:1", "max_message_bytes": LIMIT})
    inbox: queue.Queue = queue.Queue()
    link = MqttLink(cfg, inbox)
    for _ in range(INBOX_MESSAGES + 3):  # re-sends and junk while the worker trains
        link._on_message(None, None, _message(link.task_topic, LIMIT))
    link._on_message(None, None, _message(link.manifest_topic, 500))
    link._on_message(None, None, _message(link.task_topic, LIMIT + 1))
    assert inbox.qsize() == INBOX_MESSAGES + 1 and link.take_dropped() == {"flood": 3, "size": 1}
    assert link.take_dropped() == {}  # reported once
    topic, payload = inbox.get_nowait()
    link.taken(topic, payload)  # the worker took one: one more may wait
    link._on_message(None, None, _message(link.task_topic, LIMIT))
    assert inbox.qsize() == INBOX_MESSAGES + 1 and link.take_dropped() == {}
