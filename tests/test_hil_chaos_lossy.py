"""Chaos: 5 % dropped and 5 % duplicated publishes with 20-80 ms jitter, for 20 rounds with 50 agents.

50 emulated agents (hil/fleet.py, one MQTT connection each) sit behind the emulated broker with
the `chaos` profile; the real coordinator (its own process) talks to Mosquitto directly. Drops
are "lost": the proxy acknowledges them, so no MQTT retransmission can help, and only the
protocol (the coordinator's re-sends, the agents' (epoch, seq) cache) can recover. The run must
finish with every round recorded once, every client in every phase, and no feedback applied twice.
"""

from __future__ import annotations

import uuid

import pytest

from fedal.protocol import parse_broker_url
from hil.broker import EmulatedBroker
from hil.coordinator_setup import get_json, start_coordinator, stop_process, wait_for_run, write_coordinator_config
from hil.fleet import Fleet, client_ids
from hil.mosquitto import free_port
from hil.profiles import load_profile

N, ROUNDS, TAU, EVAL_EVERY = 50, 20, 1, 10


@pytest.mark.slow
def test_lossy_duplicating_jittery_links_lose_nothing(mosquitto, tmp_path):
    run_id = f"chaos-{uuid.uuid4().hex[:8]}"
    ids = client_ids(N)
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    addr = parse_broker_url(mosquitto)
    profile = load_profile("chaos")
    assert (profile.default.drop, profile.default.duplicate, profile.default.latency_ms, profile.default.jitter_ms) == \
        (0.05, 0.05, 20, 60)
    with EmulatedBroker(profile, (addr.host, addr.port), seed=0) as proxy:
        fleet = Fleet(proxy.url, run_id, ids, seed=0).start()
        coordinator = None
        try:
            assert fleet.wait_online(timeout_s=60), fleet.summary()["transport"]
            config = write_coordinator_config(
                tmp_path / "coordinator", mosquitto, run_id, ids, api_port=port, rounds=ROUNDS, tau=TAU,
                eval_every=EVAL_EVERY,
                # quorum 1: a phase closes only when every client answered, however many re-sends it took
                phases={"quorum": 1.0, "deadline_s": 120, "train_deadline_s": 120, "resend_s": 0.2,
                        "start_timeout_s": 30})
            coordinator = start_coordinator(config, tmp_path / "coordinator.log")
            final = wait_for_run(api, run_id, lambda r: r["state"] in ("finished", "failed"), 300, coordinator)
            records = get_json(f"{api}/api/v1/runs/{run_id}/rounds")
            assert fleet.wait_finished(30)
        finally:
            fleet.stop()
            if coordinator is not None:
                stop_process(coordinator)
        snap = proxy.run(proxy.engine.snapshot)
    summary = fleet.summary()

    # the faults happened, on both legs, to (nearly) everyone
    agents = {c: s for c, s in snap["clients"].items() if c.startswith(f"fedal-agent-{run_id}-")}
    assert len(agents) == N
    for leg in ("up", "down"):
        eligible = sum(s[leg].get("eligible", 0) for s in agents.values())  # tasks or results
        dropped = sum(s[leg].get("dropped", 0) for s in agents.values())
        duplicated = sum(s[leg].get("duplicated", 0) for s in agents.values())
        assert eligible >= N * (ROUNDS * (TAU + 1) + ROUNDS // EVAL_EVERY)
        assert 0.03 < dropped / eligible < 0.07 and 0.03 < duplicated / eligible < 0.07, (leg, eligible, dropped,
                                                                                            duplicated)
        assert sum(s[leg]["delayed"] for s in agents.values()) >= 0.9 * sum(s[leg]["packets"] for s in agents.values())

    # the run completed, every round recorded once, every client in every phase
    assert final["state"] == "finished", final.get("error")
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    evaluations = ROUNDS // EVAL_EVERY
    for r in records:
        evaluated = r["round"] % EVAL_EVERY == 0
        assert set(r["phases"]) == {"local_train", "transfer"} | ({"evaluate"} if evaluated else set())
        for name, stats in r["phases"].items():
            assert stats["participation"] == 1.0, (r["round"], name, stats)
        assert r["phases"]["local_train"]["count"] == N and r["phases"]["transfer"]["count"] == N * TAU
        assert ("mean_acc" in r) == evaluated
    assert final["counters"].get("rejected", 0) == 0
    assert final["counters"].get("duplicates", 0) > 0  # duplicated results reached the coordinator and were dropped
    per_client = ROUNDS * (TAU + 1) + evaluations
    assert all(c["answered"] == per_client and c["late"] == 0 for c in final["clients"].values())

    # each agent computed each task once and applied each feedback exactly once
    assert summary["error"] is None and summary["finished"] == N
    assert summary["counters"]["tasks"] == N * per_client
    assert summary["counters"].get("duplicates", 0) > 0  # repeated tasks answered from the cache
    assert summary["counters"].get("rejected", 0) == 0
    assert summary["feedback_applied"] == N * ROUNDS * TAU
    assert summary["feedback_applied_twice"] == {} and summary["iterations_applied_twice"] == {}
