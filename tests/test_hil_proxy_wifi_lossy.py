"""Acceptance: a run whose agents sit behind the `wifi-lossy` emulated broker reaches the same
final accuracy as the same run without faults.

The agents (real processes) connect through the proxy, the coordinator straight to Mosquitto, as
Pis on Wi-Fi and a wired server would. The fault-free reference is `fedal simulate` of the same
config, which a fault-free deployment matches exactly (tests/test_strategy_contract.py). The
protocol is exactly-once, so lost, repeated and late messages may cost time but never change a
number: the accuracies must agree to the last digit, well inside the 1-point acceptance bound.
"""

from __future__ import annotations

import pytest

from fedal.protocol import parse_broker_url
from fedal.sim import load_config, simulate
from hil.broker import EmulatedBroker
from hil.profiles import load_profile
from tests.deployment import Deployment
from tests.helpers import per_client


@pytest.mark.slow
def test_wifi_lossy_run_reaches_the_fault_free_accuracy(mosquitto, tmp_path, one_torch_thread):
    # small enough for the suite, long enough to learn: about 53 % from 10 % (chance) in 3 rounds
    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=3, tau=3, public_size=200,
                                    models=["mlp"], lr=0.01, seed=4, eval_every=1))
    reference = simulate(per_client(config))
    assert reference["final"]["mean_acc"] > 0.4
    addr = parse_broker_url(mosquitto)
    with EmulatedBroker(load_profile("wifi-lossy"), (addr.host, addr.port), seed=1) as proxy:
        dep = Deployment(config, tmp_path / "dep", mosquitto, phases={"resend_s": 2.0},
                         agent={"broker": {"url": proxy.url}})
        try:
            dep.start_all()
            results = dep.finish(timeout_s=300)
        finally:
            dep.close()
        snap = proxy.run(proxy.engine.snapshot)

    agents = {cid: s for cid, s in snap["clients"].items() if cid.startswith("fedal-agent-")}
    assert len(agents) == 3, snap  # every agent went through the proxy
    faults = snap["faults"]
    assert faults.get("dropped", 0) >= 1, faults
    assert all(s["up"]["delayed"] > 0 and s["down"]["delayed"] > 0 for s in agents.values())
    # a dropped message takes its connection down with it and the agent reconnects, except after
    # the farewell `offline` status of an agent that is leaving (at most one per agent)
    reconnects = sum(s["connections"] for s in agents.values()) - 3
    assert faults["dropped"] - 3 <= reconnects <= faults["dropped"] + faults.get("reset", 0)

    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    # nobody was left out: every phase closed with all three answers, not at a deadline
    assert all(p["participation"] == 1.0 for r in results["rounds"] for p in r["phases"].values())
    assert abs(results["final"]["mean_acc"] - reference["final"]["mean_acc"]) <= 0.01
    assert results["final"]["client_acc"] == reference["final"]["client_acc"]
