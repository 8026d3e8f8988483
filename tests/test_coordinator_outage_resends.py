"""A broker outage while tasks are pending: the coordinator cannot tell (no Will reaches it), so
its periodic re-send went on into the MQTT client's unbounded queue, and at the reconnect every
copy went out at once: each agent got one task tens of times and uploaded its whole result once
per copy. Now a task is not queued while the broker is away; the reconnect re-sends each open
task once. Real Mosquitto (killed and restarted on its port), a real coordinator process, and
two silent stand-in agents that only count the task copies they receive."""

from __future__ import annotations

import json
import time

import paho.mqtt.client as mqtt
import pytest

from fedal.protocol import topics
from hil.coordinator_setup import get_json, start_coordinator, stop_process, write_coordinator_config
from hil.fleet import client_ids
from hil.mosquitto import Mosquitto
from tests.waiting import free_port, wait_until

RUN_ID = "outage"
RESEND_S = 0.5


@pytest.fixture()
def broker(tmp_path):
    mq = Mosquitto(tmp_path / "mosquitto", free_port(), persistence=False).start()
    yield mq
    mq.kill()


def silent_agent(port: int, cid: str, arrivals: list[float]) -> mqtt.Client:
    """Announces itself online (retained, as an agent does on every connect) and never answers."""
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fedal-agent-{RUN_ID}-{cid}", clean_session=False)
    c.will_set(topics.status(RUN_ID, cid), json.dumps({"state": "offline", "ts": time.time()}), 1, True)

    def on_connect(client, *_args) -> None:
        client.subscribe(topics.task(RUN_ID, cid), 1)
        client.publish(topics.status(RUN_ID, cid), json.dumps({"state": "online", "ts": time.time()}), 1, True)

    c.on_connect = on_connect
    c.on_message = lambda *_args: arrivals.append(time.monotonic())
    c.reconnect_delay_set(0.2, 1)
    c.connect_async("127.0.0.1", port)
    c.loop_start()
    return c


def test_tasks_are_not_piled_up_while_the_broker_is_away(broker, tmp_path):
    ids = client_ids(2)
    api_port = free_port()
    cfg = write_coordinator_config(tmp_path / "coord", broker.url, RUN_ID, ids, api_port=api_port, rounds=2, tau=1,
                                   public_size=100, phases={"resend_s": RESEND_S, "deadline_s": 600.0,
                                                            "train_deadline_s": 600.0, "start_timeout_s": 30.0})
    coordinator = start_coordinator(cfg, tmp_path / "coordinator.log")
    got: dict[str, list[float]] = {cid: [] for cid in ids}
    agents = [silent_agent(broker.port, cid, got[cid]) for cid in ids]
    try:
        wait_until(lambda: all(len(v) >= 2 for v in got.values()), timeout_s=120, what="tasks and their re-sends")
        broker.kill()
        time.sleep(8 * RESEND_S)  # eight re-send periods with no broker
        restarted = time.monotonic()
        broker.start()
        wait_until(lambda: all(any(t > restarted for t in v) for v in got.values()), timeout_s=60,
                   what="tasks after the broker came back")
        time.sleep(1.0)
        for cid, times in got.items():
            after = [t for t in times if t > restarted]
            burst = [t for t in after if t - after[0] < 0.3]  # what came with the reconnect
            assert len(burst) <= 2, (cid, [round(t - restarted, 2) for t in after])
        assert coordinator.poll() is None
        counters = get_json(f"http://127.0.0.1:{api_port}/api/v1/runs/{RUN_ID}")["counters"]
        assert counters["held_offline"] >= 2 * 4, counters  # both clients, several re-send periods
    finally:
        for a in agents:
            a.disconnect()
            a.loop_stop()
        stop_process(coordinator)
