"""The broker `fedal fleet init` provisions refuses what FedAL never sends: a publish above the
protocol's MAX_PAYLOAD. Without a limit a device's 120 MiB publish was relayed to the coordinator.
Genuine large messages (FedAvg weights of a ResNet-18, 43 MiB) travel in chunks within
broker.max_payload <= MAX_PAYLOAD and still go through."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
from pydantic import ValidationError

from edge_agent.mqtt_link import MqttLink
from fedal.protocol import DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD, BrokerSettings, Message, Reassembler, decode, encode, split, topics
from tests.fleet_broker import RawClient, provision, start_broker, wait_for

RUN = "r" * 64  # the longest run id: the longest topic a device may publish on


@pytest.mark.parametrize("max_payload", [4096, DEFAULT_MAX_PAYLOAD, MAX_PAYLOAD])
def test_chunks_stay_within_max_payload_up_to_the_protocol_limit(max_payload):
    for size in (max_payload - 1, max_payload + 1, 3 * max_payload + 17, 40 * 1024 * 1024 + 5):
        parts = split(bytes(size), max_payload)
        assert max(len(p) for p in parts) <= max_payload <= MAX_PAYLOAD, (max_payload, size)


def test_max_payload_above_the_protocol_limit_is_a_config_error(tmp_path):
    assert BrokerSettings(max_payload=MAX_PAYLOAD).max_payload == MAX_PAYLOAD
    with pytest.raises(ValidationError, match="max_payload"):
        BrokerSettings(max_payload=MAX_PAYLOAD + 1)
    conf = (provision(tmp_path).out / "broker" / "fedal.conf").read_text().splitlines()
    assert f"message_size_limit {MAX_PAYLOAD}" in conf
    assert any(line.startswith("max_packet_size ") and MAX_PAYLOAD < int(line.split()[1]) <= MAX_PAYLOAD + 4096
               for line in conf)


def resnet18_weights() -> Message:
    """A FedAvg `train` result as the agent sends it: a ResNet-18's state dict, 43 MiB."""
    from fedal.models import build_model
    from fedal.strategies.fedavg import model_to_numpy

    weights = model_to_numpy(build_model("resnet18", (3, 32, 32), 10))
    meta = {"run": RUN, "client": "pi-1", "epoch": 0, "seq": 2, "phase": "train", "round": 0, "iteration": 0,
            "loss": 1.5, "num_samples": 100}
    return Message(meta, weights)


def test_oversized_publishes_are_refused_and_chunked_weights_go_through(tmp_path):
    files = provision(tmp_path, 2, run_id=RUN)
    broker = start_broker(files, tmp_path / "mosquitto")
    coord = RawClient(files.coordinator_port, "coordinator", files.account()["password"])
    topic = topics.result(RUN, "pi-1")
    wire = encode(resnet18_weights())
    assert len(wire) > 40 * MAX_PAYLOAD
    link = None
    try:
        assert coord.accepted
        coord.subscribe(topics.results_filter(RUN))
        pi1 = RawClient(files.port, "pi-1", files.password("pi-1"))
        assert pi1.accepted

        # a payload of exactly MAX_PAYLOAD on the longest topic is relayed
        pi1.c.publish(topic, b"a" * MAX_PAYLOAD, qos=1).wait_for_publish(20)
        got = wait_for(coord.messages, lambda m: m[1][:1] == b"a")
        assert [len(p) for _, p in got] == [MAX_PAYLOAD]
        # one byte more is dropped by the broker; pi-1 stays connected, its next message arrives
        pi1.c.publish(topic, b"b" * (MAX_PAYLOAD + 1), qos=1).wait_for_publish(20)
        pi1.c.publish(topic, b"marker", qos=1).wait_for_publish(20)
        assert wait_for(coord.messages, lambda m: m[1] == b"marker") == [(topic, b"marker")]
        assert pi1.disconnects == []
        # the weights in one publish: the broker disconnects pi-1 before it reads the packet
        pi1.c.publish(topic, wire, qos=1)
        deadline = time.monotonic() + 30
        while not pi1.disconnects and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pi1.disconnects, "the broker kept a client that sent an oversized packet"
        pi1.close()
        assert "oversize packet" in broker.log_file.read_text()

        # the agent's own path chunks them (broker.max_payload, default 256 KiB): they go through
        inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        link = MqttLink(files.agent_config("pi-1"), inbox)
        link.start()
        assert link.connected.wait(15)
        sent = link.publish_result(wire)
        assert sent > len(wire)
        reassembler = Reassembler()
        whole = None
        deadline = time.monotonic() + 120
        while whole is None and time.monotonic() < deadline:
            try:
                t, payload = coord.messages.get(timeout=0.5)
            except queue.Empty:
                continue
            assert t == topic and len(payload) <= DEFAULT_MAX_PAYLOAD  # nothing else came: not the oversized ones
            whole = reassembler.feed("pi-1", payload)
        assert whole is not None, "the chunked weights never completed"
        back = decode(encode(whole))
        original = decode(wire)
        assert back.meta == original.meta and set(back.tensors) == set(original.tensors)
        assert all(np.array_equal(back.tensors[k], original.tensors[k]) for k in original.tensors)
    finally:
        if link is not None:
            link.stop()
        coord.close()
        broker.stop()
