"""Device health end to end: a coordinator and two agents as real processes over a real Mosquitto,
each agent reading a fake sysfs/procfs tree (a Pi under-volted, throttled, hot and short of
memory; a healthy PC). Their reports show in /api/v1/clients and /metrics with the flags the
coordinator's `health` settings give, and a junk report from a device is counted, never taken."""

from __future__ import annotations

import json
import urllib.request
import uuid

import paho.mqtt.client as mqtt
from prometheus_client.parser import text_string_to_metric_families

from fedal.protocol import parse_broker_url, topics
from fedal.sim import load_config
from tests.deployment import Deployment, get
from tests.health_trees import PI_MODEL, common_tree, pi_tree, set_agent_options, write
from tests.waiting import wait_until


def metrics(api: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"{api}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_health_reaches_the_api_and_metrics(mosquitto, tmp_path):
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=2, rounds=2, tau=1, public_size=60,
                                    seed=5))
    # every device is short of disk by this coordinator's measure: the setting reaches the flags
    dep = Deployment(config, tmp_path / "dep", mosquitto, phases={"pause_at": [{"round": 1}]},
                     coordinator={"health": {"min_disk_free_mb": 1e9}})
    pi = pi_tree(tmp_path / "pi", temp_mc=85_100, throttled="50005", mem_available_kb=50_000)
    pc = common_tree(tmp_path / "pc")
    write(pc, "sys/class/thermal/thermal_zone0/type", "x86_pkg_temp\n")
    write(pc, "sys/class/thermal/thermal_zone0/temp", "41000\n")
    set_agent_options(dep.agent_path("c00"), health_root=pi)
    set_agent_options(dep.agent_path("c01"), health_root=pc)
    try:
        dep.start_all()
        dep.wait_held(1)
        clients = {c["id"]: c for c in get(f"{dep.api}/api/v1/clients?run_id=demo")}
        c00, c01 = clients["c00"], clients["c01"]
        assert c00["online"] and c01["online"]
        assert c00["health"]["throttled"] == 0x50005 and c00["health"]["cpu_temp_c"] == 85.1
        assert c00["health"]["mem_available_bytes"] == 50_000 * 1024
        assert c00["health"]["versions"]["board"] == PI_MODEL
        assert c00["health_flags"] == ["under_voltage", "throttled", "hot", "low_memory", "low_disk"]
        assert c01["health"]["cpu_temp_c"] == 41.0 and "throttled" not in c01["health"]
        assert "board" not in c01["health"]["versions"] and c01["health"]["versions"]["torch"]
        assert c01["health_flags"] == ["low_disk"]
        assert get(f"{dep.api}/api/v1/clients/c00")["health_flags"] == c00["health_flags"]

        m = metrics(dep.api)
        assert m[("fedal_client_cpu_temperature_celsius", (("client", "c00"), ("run", "demo")))] == 85.1
        assert m[("fedal_client_memory_available_bytes", (("client", "c00"), ("run", "demo")))] == 50_000 * 1024
        assert m[("fedal_client_agent_rss_bytes", (("client", "c01"), ("run", "demo")))] > 0
        assert m[("fedal_client_disk_free_bytes", (("client", "c01"), ("run", "demo")))] > 0
        flag = {(dict(labels)["client"], dict(labels)["flag"]): v for (name, labels), v in m.items()
                if name == "fedal_client_health_flag"}
        assert flag[("c00", "under_voltage")] == 1 and flag[("c00", "throttled")] == 1 and flag[("c00", "hot")] == 1
        assert flag[("c01", "throttled")] == 0 and flag[("c01", "low_disk")] == 1
        info = [dict(labels) for (name, labels), v in m.items() if name == "fedal_client_software_info" and v == 1]
        assert {i["client"]: i["board"] for i in info} == {"c00": PI_MODEL, "c01": ""}

        # a device sends junk as its health: counted, its online status and last good report kept
        addr = parse_broker_url(mosquitto)
        raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"junk-{uuid.uuid4().hex[:6]}")
        raw.connect(addr.host, addr.port)
        raw.loop_start()
        junk = {"state": "online", "ts": 1.0, "health": {"cpu_temp_c": "melting", "rss_bytes": -5, "x" * 30: 1}}
        raw.publish(topics.status("demo", "c01"), json.dumps(junk).encode(), qos=1).wait_for_publish(10)
        raw.loop_stop()
        raw.disconnect()
        run = wait_until(lambda: (r := get(f"{dep.api}/api/v1/runs/demo"))["counters"].get("health_ignored") and r,
                         60, "the junk report to be counted")
        assert run["counters"]["health_ignored"] == 1 and not run["counters"].get("rejected")
        assert run["clients"]["c01"]["online"] and run["clients"]["c01"]["health"] == c01["health"]
        assert metrics(dep.api)[("fedal_messages_total", (("outcome", "health_ignored"), ("run", "demo")))] == 1

        dep.control("resume")
        dep.finish()
    finally:
        dep.close()
