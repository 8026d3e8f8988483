"""Prometheus exposition of a run, read from the engine at scrape time (prometheus_client).

A custom collector keeps one source of truth: nothing is counted twice, and a restarted
coordinator reports the totals it resumed with.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.engine import RoundEngine

STATES = ("pending", "running", "finished", "stopped", "failed")


class RunCollector(Collector):
    def __init__(self, engine: RoundEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot()
        run = snap["run_id"]
        state = GaugeMetricFamily("fedal_run_state", "1 for the run's current state", labels=["run", "state"])
        for s in STATES:
            state.add_metric([run, s], 1.0 if snap["state"] == s else 0.0)
        yield state
        yield _gauge("fedal_rounds_completed", "rounds completed", run, snap["completed_rounds"])
        yield _gauge("fedal_rounds_total", "rounds the run will do", run, snap["rounds"])
        clients = snap["clients"]
        yield _gauge("fedal_clients_online", "enrolled clients currently online", run,
                     sum(1 for c in clients.values() if c["online"]))
        yield _gauge("fedal_clients_enrolled", "enrolled clients", run, len(clients))
        for name, help_text in (("answered", "results accepted"), ("late", "phases closed without the client"),
                                ("rejected", "messages rejected"), ("duplicates", "duplicate results dropped"),
                                ("bytes_up", "payload bytes received"), ("bytes_down", "payload bytes sent")):
            fam = CounterMetricFamily(f"fedal_client_{name}", f"per client: {help_text}", labels=["run", "client"])
            for cid, c in clients.items():
                fam.add_metric([run, cid], float(c[name]))
            yield fam
        counters = CounterMetricFamily("fedal_messages", "messages by outcome", labels=["run", "outcome"])
        for outcome in ("rejected", "stale", "duplicates"):
            counters.add_metric([run, outcome], float(snap["counters"].get(outcome, 0)))
        yield counters
        last = snap.get("last_round") or {}
        for key, name in (("mean_acc", "fedal_mean_accuracy"), ("min_acc", "fedal_min_accuracy")):
            if last.get(key) is not None:
                yield _gauge(name, f"last evaluated round: {key}", run, last[key])
        for key in ("disc_loss", "disc_acc", "discrepancy"):
            value = (last.get("server") or {}).get(key)
            if value is not None:
                yield _gauge(f"fedal_{key}", f"last round: {key}", run, value)
        lat = GaugeMetricFamily("fedal_phase_latency_seconds", "last round: response latency quantiles by phase",
                                labels=["run", "phase", "quantile"])
        for phase, stats in (last.get("phases") or {}).items():
            for q, key in (("0.5", "p50_s"), ("0.95", "p95_s")):
                if stats.get(key) is not None:
                    lat.add_metric([run, phase, q], stats[key])
        yield lat


def _gauge(name: str, help_text: str, run: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, help_text, labels=["run"])
    g.add_metric([run], float(value))
    return g


def registry_for(engine: RoundEngine) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RunCollector(engine))
    return registry
