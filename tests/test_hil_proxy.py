"""The emulated broker's pieces without a network: profiles, fault decisions, packet codec, link model."""

from __future__ import annotations

import asyncio
import json

import pytest
from amqtt.mqtt import PubackPacket, PublishPacket
from amqtt.mqtt.connect import ConnectPacket, ConnectPayload, ConnectVariableHeader

from hil.faults import FaultEngine, LinkFaults, resolve
from hil.profiles import Faults, ProfileError, builtin_profiles, load_profile, parse_profile
from hil.proxy import Link, Malformed, parse_bytes, with_dup_flag


def test_builtin_profiles_load_and_describe_themselves():
    names = builtin_profiles()
    assert {"clean", "wifi-lossy", "wifi-flaky", "congested", "chaos", "outage"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.name == name and p.description
    lossy = load_profile("wifi-lossy")
    assert lossy.default.latency_ms == 20 and lossy.default.jitter_ms == 60 and lossy.default.drop_mode == "reset"
    assert load_profile("outage").partitions[0].matches("fedal-agent-run-c01")
    assert not load_profile("outage").partitions[0].matches("fedal-coordinator-run")


@pytest.mark.parametrize("text, complaint", [
    ("[default]\ndrop = 1.5", "default.drop"),
    ("[default]\ndrop_mode = 'vanish'", "default.drop_mode"),
    ("[default]\nlatency = 5", "default.latency"),  # misspelt field: refused, not ignored
    ("[[partitions]]\nclient = 'x'\nstart_s = 5\nend_s = 2", "ends (2.0) before it starts"),
    ("[default]\ntopics = ['a/#/b']", "not an MQTT topic filter"),
    ("[clients.x.up]\njitter_ms = -1", "clients.x.up.jitter_ms"),
    ("default = [", "not valid TOML"),
    ("[default]\nbandwidth_kbps = 1e-9", "0 (unlimited) or at least 1 kbit/s"),  # a packet due in years wedged its link
])
def test_bad_profiles_are_refused_with_the_field_named(text, complaint):
    with pytest.raises(ProfileError) as info:
        parse_profile(text, "bad.toml")
    assert complaint in str(info.value)


def test_unknown_profile_names_the_builtin_ones(tmp_path):
    with pytest.raises(ProfileError, match="wifi-lossy"):
        load_profile("no-such-profile")
    with pytest.raises(ProfileError, match="not found"):
        load_profile(str(tmp_path / "missing.toml"))
    f = tmp_path / "mine.toml"
    f.write_text("[default]\nduplicate = 0.5\n")
    assert load_profile(str(f)).name == "mine" and load_profile(str(f)).default.duplicate == 0.5
    binary = tmp_path / "binary.toml"  # was "'utf-8' codec can't decode byte 0xff", naming no file
    binary.write_bytes(b"\xff\xfe[default]\n")
    with pytest.raises(ProfileError, match=rf"profile file {binary} cannot be read as TOML text"):
        load_profile(str(binary))


def test_layers_resolve_field_by_field():
    faults = parse_profile("""
[default]
latency_ms = 10
drop = 0.1
[default.down]
latency_ms = 50
[clients."fedal-agent-*"]
drop = 0.3
[clients."fedal-agent-*".up]
bandwidth_kbps = 100
[clients."fedal-agent-run-c01"]
duplicate = 0.5
""")
    assert resolve(faults, "coord", "up") == LinkFaults(latency_ms=10, drop=0.1)
    assert resolve(faults, "coord", "down") == LinkFaults(latency_ms=50, drop=0.1)
    assert resolve(faults, "fedal-agent-run-c02", "up") == LinkFaults(latency_ms=10, drop=0.3, bandwidth_kbps=100)
    assert resolve(faults, "fedal-agent-run-c02", "down") == LinkFaults(latency_ms=50, drop=0.3)
    # an exact id wins over a pattern, and only adds its own fields on top of the default
    assert resolve(faults, "fedal-agent-run-c01", "up") == LinkFaults(latency_ms=10, drop=0.1, duplicate=0.5)


def engine_for(text: str, seed: int = 0, clock=None) -> FaultEngine:
    return FaultEngine(parse_profile(text), seed=seed, **({"clock": clock} if clock else {}))


def decisions(engine, client="c", direction="up", n=2000, topic="t/x", qos=1):
    return [engine.decide(client, direction, topic, qos) for _ in range(n)]


def test_decisions_are_deterministic_per_seed_and_client():
    text = "[default]\ndrop = 0.1\nduplicate = 0.1\nreset = 0.01\njitter_ms = 40"
    a, b, c = engine_for(text, 7), engine_for(text, 7), engine_for(text, 8)
    assert decisions(a) == decisions(b)
    assert decisions(engine_for(text, 7)) != decisions(c)
    # another client's traffic in between does not shift this client's stream
    d = engine_for(text, 7)
    mixed = []
    for _ in range(2000):
        d.decide("other", "up", "t/x", 1)
        d.decide("c", "down", "t/x", 1)
        mixed.append(d.decide("c", "up", "t/x", 1))
    assert mixed == decisions(engine_for(text, 7))


def test_rates_match_the_profile_and_only_on_matching_topics():
    e = engine_for("[default]\ndrop = 0.1\nduplicate = 0.2\ntopics = ['fedal/v1/+/up/#']")
    ds = decisions(e, topic="fedal/v1/run/up/c01", n=10000)
    drop = sum(d.drop for d in ds) / len(ds)
    dup = sum(d.duplicate for d in ds) / len(ds)
    assert 0.09 < drop < 0.11
    assert 0.17 < dup < 0.19  # 0.2 of the publishes that were not dropped
    assert not any(d.drop and d.duplicate for d in ds)
    others = decisions(e, topic="fedal/v1/run/status/c01") + decisions(e, topic=None, qos=None)
    assert not any(d.drop or d.duplicate for d in others)


def test_qos2_is_never_duplicated_and_resets_hit_any_packet():
    e = engine_for("[default]\nduplicate = 1\nreset = 0.5")
    assert not any(d.duplicate for d in decisions(e, qos=2, n=200))
    pings = decisions(e, topic=None, qos=None, n=1000)
    assert 400 < sum(d.reset for d in pings) < 600


def test_delay_is_latency_plus_uniform_jitter():
    e = engine_for("[default]\nlatency_ms = 20\njitter_ms = 60")
    delays = [d.delay_s for d in decisions(e, n=5000)]
    assert min(delays) >= 0.020 and max(delays) <= 0.080
    assert 0.045 < sum(delays) / len(delays) < 0.055
    assert {d.delay_s for d in decisions(engine_for(""), n=10)} == {0.0}


def test_partitions_follow_the_clock_and_the_control_api_adds_them():
    now = [100.0]
    e = engine_for("[[partitions]]\nclient = 'fedal-agent-*'\nstart_s = 5\nend_s = 8", clock=lambda: now[0])
    assert not e.partitioned("fedal-agent-run-c01")
    now[0] = 105.0
    assert e.partitioned("fedal-agent-run-c01") and not e.partitioned("fedal-coordinator-run")
    now[0] = 108.0
    assert not e.partitioned("fedal-agent-run-c01")
    p = e.add_partition("solo", duration_s=2, start_in_s=1)
    assert (p.start_s, p.end_s) == (9.0, 11.0)
    now[0] = 109.5
    assert e.partitioned("solo") and not e.partitioned("solo2")


def test_faults_are_counted_and_logged_per_client(caplog):
    e = engine_for("")
    with caplog.at_level("INFO", logger="hil.faults"):
        e.fault("dropped", "c1", "up", topic="t")
        e.fault("dropped", "c1", "down", topic="t")
        e.fault("refused", "c2")
        e.fault("malformed", "c2", "up", reason="junk")
    snap = e.snapshot()
    assert snap["faults"] == {"dropped": 2, "refused": 1, "malformed": 1}
    assert snap["clients"]["c1"]["up"]["dropped"] == 1 and snap["clients"]["c1"]["down"]["dropped"] == 1
    assert snap["clients"]["c2"]["refused"] == 1 and snap["clients"]["c2"]["malformed"] == 1
    assert [ev["fault"] for ev in e.events] == ["dropped", "dropped", "refused", "malformed"]
    assert sum("fault dropped client=c1" in r.getMessage() for r in caplog.records) == 2


def test_set_faults_applies_to_later_decisions():
    e = engine_for("")
    assert not any(d.drop for d in decisions(e, n=100))
    e.set_faults(Faults.model_validate({"default": {"drop": 1.0}}))
    assert all(d.drop for d in decisions(e, n=100))


# -- codec -----------------------------------------------------------------------------------

def connect_bytes(client_id: str, level: int = 4, name: str = "MQTT") -> bytes:
    vh = ConnectVariableHeader(proto_name=name, proto_level=level, keep_alive=30)
    vh.clean_session_flag = True
    return ConnectPacket(variable_header=vh, payload=ConnectPayload(client_id=client_id)).to_bytes()


def test_packets_round_trip_through_the_codec_byte_for_byte():
    pub = PublishPacket.build("fedal/v1/run/up/c01", b"\x00" * 300 + b"payload", 17, False, 1, False).to_bytes()
    stream = connect_bytes("fedal-agent-run-c01") + pub + PubackPacket.build(17).to_bytes() + b"\xc0\x00"  # + PINGREQ
    packets = asyncio.run(parse_bytes(stream))
    assert [type(p.parsed).__name__ for p in packets] == ["ConnectPacket", "PublishPacket", "PubackPacket", "PingReqPacket"]
    assert b"".join(p.raw for p in packets) == stream
    assert packets[0].parsed.client_id == "fedal-agent-run-c01"
    assert (packets[1].topic, packets[1].qos, packets[1].packet_id) == ("fedal/v1/run/up/c01", 1, 17)
    assert packets[2].packet_id == 17
    dup = asyncio.run(parse_bytes(with_dup_flag(packets[1].raw)))[0]
    assert dup.parsed.dup_flag and dup.parsed.data == packets[1].parsed.data


@pytest.mark.parametrize("data, reason", [
    (b"\x30\xff\xff\xff\xff\x01", "bad fixed header"),  # remaining length longer than 4 bytes
    (b"\x30\x10\x00\x03abc", "stream ended inside a packet"),
    (b"\x00\x00", "Unexpected packet Type"),  # reserved type 0
    (b"\x40\x03\x00\x01\x02", "trailing bytes"),  # PUBACK with a spare byte
    (b"\x36\x05\x00\x01t\x00\x01", "QoS 3"),
    (b"\x32\x03\x00\x01t", "undecodable"),  # QoS 1 without the packet id
    (b"\x30\x05\x00\x03a/#", "undecodable"),  # wildcard in a topic name
])
def test_malformed_bytes_are_refused_with_a_reason(data, reason):
    with pytest.raises(Malformed, match=reason):
        asyncio.run(parse_bytes(data))


def test_only_mqtt_311_and_31_connects_are_accepted():
    assert asyncio.run(parse_bytes(connect_bytes("a", 3, "MQIsdp")))[0].parsed.client_id == "a"
    with pytest.raises(Malformed, match="unsupported protocol"):
        asyncio.run(parse_bytes(connect_bytes("a", 5)))


def test_a_real_mqtt5_connect_is_named_as_such_not_misread():
    """An MQTT 5 CONNECT carries properties after its keep-alive; read as 3.1.1 they became the
    client id and the rest 'trailing bytes'."""
    props = b"\x11\x00\x00\x00\x3c"  # session expiry interval 60 s
    vh = b"\x00\x04MQTT\x05\x02\x00\x3c" + bytes([len(props)]) + props
    body = vh + b"\x00\x05dev-1"
    with pytest.raises(Malformed, match=r"unsupported protocol 'MQTT' level 5 \(MQTT 5\)"):
        asyncio.run(parse_bytes(b"\x10" + bytes([len(body)]) + body))
    for short in (b"\x10\x01\x00", b"\x10\x05\x00\x04MQT"):
        with pytest.raises(Malformed, match="too short"):
            asyncio.run(parse_bytes(short))


def test_closing_the_proxy_drops_connections_that_never_sent_connect_at_once():
    """They were left to the 5 s grace the proxy gives its sessions, then cancelled."""
    import time

    from hil.proxy import Proxy

    async def scenario():
        proxy = await Proxy(engine_for("[default]\ndrop = 0.0"), ("127.0.0.1", 1)).start()
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        for _ in range(100):  # accepted: its handler waits for the CONNECT
            if proxy._tasks:
                break
            await asyncio.sleep(0.01)
        assert proxy._tasks
        t0 = time.monotonic()
        await proxy.close()
        writer.close()
        return time.monotonic() - t0, proxy.engine

    took, engine = asyncio.run(scenario())
    assert took < 4.0  # was >= 5 s
    assert not engine.fault_counts.get("malformed")  # a cut at shutdown is not the client's fault


# -- link model ------------------------------------------------------------------------------

class NullWriter:
    """A stream writer that discards what the link model hands it (only timing is under test)."""

    def write(self, data):
        return None

    async def drain(self):
        return None


def test_bandwidth_serialises_packets_and_jitter_never_reorders():
    async def scenario():
        loop = asyncio.get_running_loop()
        loop.time = lambda: 1000.0  # type: ignore[method-assign]  # one instant: the sends' math alone
        try:
            link = Link(session=None, direction="up", writer=NullWriter())
            capped = LinkFaults(bandwidth_kbps=80)  # 10 kB/s
            delays = [link.send(b"x" * 1000, capped, 0.0) for _ in range(3)]
            assert [round(d, 6) for d in delays] == [0.1, 0.2, 0.3]
            link2 = Link(session=None, direction="up", writer=NullWriter())
            due = [link2.send(b"y", LinkFaults(), d) for d in (0.5, 0.1, 0.3, 0.05)]
            assert due == [0.5, 0.5, 0.5, 0.5]  # each held behind the first, as TCP would
        finally:
            del loop.time  # back to the class's clock before asyncio.run closes the loop
    asyncio.run(scenario())


@pytest.mark.parametrize("args, message", [
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--listen", "1884"], "--listen '1884' must be HOST:PORT"),
    (["--upstream", "mqtts://broker:8883"], "plain MQTT"),
    (["--upstream", "http://x"], "must start with mqtt://"),
    (["--upstream", "mqtt://127.0.0.1:0"], "has an invalid port: 0"),  # (it became 1883)
    (["--control", "localhost"], "--control 'localhost' must be HOST:PORT"),
])
def test_broker_command_usage_errors_exit_2(args, message):
    from click.testing import CliRunner

    from hil.cli import hil_cmd

    result = CliRunner().invoke(hil_cmd, ["broker", *args])
    assert result.exit_code == 2 and message in result.output


def test_broker_command_lists_the_profiles():
    from click.testing import CliRunner

    from hil.cli import hil_cmd

    result = CliRunner().invoke(hil_cmd, ["broker", "--list-profiles"])
    assert result.exit_code == 0
    assert [line.split()[0] for line in result.output.splitlines()] == builtin_profiles()


def test_fleet_refuses_a_public_file_that_does_not_exist(tmp_path):
    """It was ignored: the fleet downloaded the public set instead, without a word."""
    from click.testing import CliRunner

    from hil.cli import hil_cmd

    result = CliRunner().invoke(hil_cmd, ["fleet", "--clients", "2", "--run-id", "r", "--public-file",
                                          str(tmp_path / "missing.npz")])
    assert result.exit_code == 2 and "missing.npz" in result.output and "does not exist" in result.output


def test_fleet_refuses_a_status_file_it_did_not_write_or_cannot_write_before_it_starts(tmp_path):
    """It overwrote any file (and `<name>.tmp` beside it) at the end of the run, and an unwritable
    path ended the whole run in a traceback."""
    from click.testing import CliRunner

    from hil.cli import hil_cmd

    mine = tmp_path / "mine.json"
    mine.write_text("mine")
    (tmp_path / "mine.tmp").write_text("also mine")
    base = ["fleet", "--clients", "2", "--run-id", "r", "--broker", "mqtt://127.0.0.1:1", "--timeout", "1", "--quiet"]
    result = CliRunner().invoke(hil_cmd, [*base, "--status-file", str(mine)])
    assert result.exit_code == 2 and "is not a fleet status file this toolkit wrote" in result.output, result.output
    result = CliRunner().invoke(hil_cmd, [*base, "--status-file", str(tmp_path / "mine.json" / "x.json")])
    assert result.exit_code == 2 and "is not a directory" in result.output
    assert mine.read_text() == "mine" and (tmp_path / "mine.tmp").read_text() == "also mine"
    ours = tmp_path / "status.json"
    result = CliRunner().invoke(hil_cmd, [*base, "--status-file", str(ours)])  # ends at its timeout, writes it
    first = json.loads(ours.read_text())
    assert first["run_id"] == "r"
    result = CliRunner().invoke(hil_cmd, [*base, "--status-file", str(ours)])  # its own: replaced
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output  # (1: timed out, not refused)
    assert json.loads(ours.read_text())["ts"] > first["ts"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json", "mine.tmp", "status.json"]


def test_fleet_says_why_the_coordinator_it_started_exited(tmp_path):
    """It said only `"outcome": "coordinator exited"`; the reason was in coordinator.log alone."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fedal_cli.main", "hil", "fleet", "--clients", "2", "--run-id", "r",
                        "--broker", "mqtt://127.0.0.1:1", "--start-coordinator", "--num-classes", "100000",
                        "--workdir", str(tmp_path / "wd"), "--quiet", "--timeout", "120"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 1 and '"outcome": "coordinator exited"' in r.stdout, r.stdout + r.stderr
    assert "the coordinator exited with status 2: Error: invalid config" in r.stderr and "num_classes" in r.stderr


def test_fleet_refuses_credentials_of_a_fleet_pinned_to_another_run_id(tmp_path):
    """The broker ACL names the fleet's run id: with another --run-id every connection was refused
    and, without --timeout, the fleet waited for ever."""
    from click.testing import CliRunner

    from fedal_cli.main import cli

    out = tmp_path / "fleet"
    assert CliRunner().invoke(cli, ["fleet", "init", "--devices", "2", "--broker", "mqtt://127.0.0.1:1",
                                    "--run-id", "lab", "--out", str(out)]).exit_code == 0
    result = CliRunner().invoke(cli, ["hil", "fleet", "--clients", "2", "--run-id", "other", "--ids", "pi-1,pi-2",
                                      "--credentials-dir", str(out / "devices"), "--broker", "mqtt://127.0.0.1:1"])
    assert result.exit_code == 2 and "only under run id 'lab'" in result.output, result.output
    # moved to another run id as docs/deploy-raspberry-pi.md says (the ACL and the configs edited):
    # the ACL's run id is the one asked for, not fleet.json's first one
    acl = out / "broker" / "acl"
    acl.write_text(acl.read_text().replace("fedal/v1/lab/", "fedal/v1/moved/"))
    result = CliRunner().invoke(cli, ["hil", "fleet", "--clients", "2", "--run-id", "lab", "--ids", "pi-1,pi-2",
                                      "--credentials-dir", str(out / "devices"), "--broker", "mqtt://127.0.0.1:1"])
    assert result.exit_code == 2 and "only under run id 'moved'" in result.output, result.output


def test_fleet_files_that_cannot_give_credentials_are_usage_errors(tmp_path):
    """A damaged coordinator/broker.toml (with --start-coordinator) or a device config whose
    [broker] is not a table ended `hil fleet` in a traceback."""
    from click.testing import CliRunner

    from fedal_cli.main import cli

    out = tmp_path / "fleet"
    assert CliRunner().invoke(cli, ["fleet", "init", "--devices", "2", "--broker", "mqtt://127.0.0.1:1",
                                    "--out", str(out)]).exit_code == 0
    args = ["hil", "fleet", "--clients", "2", "--run-id", "fleet", "--ids", "pi-1,pi-2", "--credentials-dir",
            str(out / "devices"), "--broker", "mqtt://127.0.0.1:1", "--timeout", "5"]
    account = out / "coordinator" / "broker.toml"
    account.write_text(account.read_text() + "broken = [\n")
    result = CliRunner().invoke(cli, [*args, "--start-coordinator", "--workdir", str(tmp_path / "wd")])
    assert result.exit_code == 2 and "cannot give the coordinator its broker account" in result.output, result.output
    (out / "devices" / "pi-2" / "agent.toml").write_text('client_id = "pi-2"\nbroker = "x"\n')
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "has no [broker] username" in result.output, result.output
