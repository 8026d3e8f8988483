"""Prometheus exposition of every run, read from the engines at scrape time (prometheus_client).

A custom collector keeps one source of truth: nothing is counted twice, and a restarted
coordinator reports the totals it resumed with.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.runs import RunManager
from fedal.engine.health import FLAGS, VERSION_KEYS

STATES = ("pending", "running", "paused", "finished", "stopped", "failed")
HEALTH_GAUGES = (  # (field of the health report, gauge, help)
    ("ts", "fedal_client_health_timestamp_seconds", "when the device measured it (its clock)"),
    ("cpu_temp_c", "fedal_client_cpu_temperature_celsius", "CPU temperature"),
    ("throttled", "fedal_client_throttled_bits", "the Raspberry Pi firmware's get_throttled value"),
    ("load1", "fedal_client_load1", "1-minute load average"),
    ("mem_available_bytes", "fedal_client_memory_available_bytes", "available memory"),
    ("mem_total_bytes", "fedal_client_memory_total_bytes", "total memory"),
    ("disk_free_bytes", "fedal_client_disk_free_bytes", "free space on the workspace's filesystem"),
    ("disk_total_bytes", "fedal_client_disk_total_bytes", "size of the workspace's filesystem"),
    ("rss_bytes", "fedal_client_agent_rss_bytes", "the agent process's resident memory"),
)


class RunCollector(Collector):
    def __init__(self, runs: RunManager):
        self.runs = runs

    def collect(self) -> Iterator[Metric]:
        engines = self.runs.list()
        snaps = [engine.snapshot() for engine in engines]
        evaluated = [last_evaluated(engine.rounds()) for engine in engines]
        state = GaugeMetricFamily("fedal_run_state", "1 for the run's current state", labels=["run", "state"])
        gauges = {name: GaugeMetricFamily(name, help_text, labels=["run"]) for name, help_text in (
            ("fedal_rounds_completed", "rounds completed"), ("fedal_rounds_planned", "rounds the run will do"),
            ("fedal_clients_online", "enrolled clients currently online"), ("fedal_clients_enrolled", "enrolled clients"),
            ("fedal_mean_accuracy", "last evaluated round: mean_acc"), ("fedal_min_accuracy", "last evaluated round: min_acc"),
            ("fedal_local_mean_accuracy", "last evaluated round: mean accuracy on the clients' own test splits"),
            ("fedal_disc_loss", "last round: disc_loss"), ("fedal_disc_acc", "last round: disc_acc"),
            ("fedal_discrepancy", "last round: discrepancy"))}
        per_client = {name: CounterMetricFamily(f"fedal_client_{name}", f"per client: {help_text}", labels=["run", "client"])
                      for name, help_text in (("answered", "results accepted"), ("late", "phases closed without the client"),
                                              ("rejected", "messages rejected"), ("duplicates", "duplicate results dropped"),
                                              ("declined", "tasks it declined (a round or a step of it it lost)"),
                                              ("bytes_up", "payload bytes received"), ("bytes_down", "payload bytes sent"))}
        counters = CounterMetricFamily("fedal_messages", "messages by outcome (evicted, expired: unfinished chunked "
                                       "messages dropped)", labels=["run", "outcome"])
        rejects = CounterMetricFamily("fedal_rejects", "rejected messages by reason", labels=["run", "reason"])
        lat = GaugeMetricFamily("fedal_phase_latency_seconds", "last round: response latency quantiles by phase",
                                labels=["run", "phase", "quantile"])
        health = {key: GaugeMetricFamily(name, f"per client, its last health report: {help_text}", labels=["run", "client"])
                  for key, name, help_text in HEALTH_GAUGES}
        flags = GaugeMetricFamily("fedal_client_health_flag", "per client: 1 while its last health report is flagged "
                                  "(under_voltage, throttled: now; hot, low_memory, low_disk: the coordinator's "
                                  "health settings)", labels=["run", "client", "flag"])
        epsilon = GaugeMetricFamily("fedal_client_privacy_epsilon", "per client: the differential-privacy epsilon it "
                                    "last reported, at the run's delta (runs with privacy)", labels=["run", "client"])
        exhausted = GaugeMetricFamily("fedal_client_privacy_exhausted", "per client: 1 once it stopped training on its "
                                      "private data at the run's epsilon_budget", labels=["run", "client"])
        versions = InfoMetricFamily("fedal_client_software", "per client: the software versions and board it reports",
                                    labels=["run", "client"])
        for snap, scored in zip(snaps, evaluated):
            run = snap["run_id"]
            for s in STATES:
                state.add_metric([run, s], 1.0 if snap["state"] == s else 0.0)
            clients = snap["clients"]
            last = snap.get("last_round") or {}
            values = {"fedal_rounds_completed": snap["completed_rounds"], "fedal_rounds_planned": snap["rounds"],
                      "fedal_clients_online": sum(1 for c in clients.values() if c["online"]),
                      "fedal_clients_enrolled": len(clients), "fedal_mean_accuracy": scored.get("mean_acc"),
                      "fedal_min_accuracy": scored.get("min_acc"), "fedal_local_mean_accuracy": scored.get("local_mean_acc")}
            values.update({f"fedal_{k}": (last.get("server") or {}).get(k) for k in ("disc_loss", "disc_acc", "discrepancy")})
            for name, value in values.items():
                if value is not None:
                    gauges[name].add_metric([run], float(value))
            listed = clients if self.runs.config.api.client_metrics else {}  # api.client_metrics = false: none
            for name, fam in per_client.items():
                for cid, c in listed.items():
                    fam.add_metric([run, cid], float(c[name]))
            for cid, c in listed.items():
                if c.get("epsilon") is not None:
                    epsilon.add_metric([run, cid], float(c["epsilon"]))
                    exhausted.add_metric([run, cid], 1.0 if c.get("dp_exhausted") else 0.0)
            for cid, c in listed.items():
                reported = c.get("health") or {}
                if not reported:
                    continue
                for key, gauge in health.items():
                    if reported.get(key) is not None:
                        gauge.add_metric([run, cid], float(reported[key]))
                for flag in FLAGS:
                    flags.add_metric([run, cid, flag], 1.0 if flag in c["health_flags"] else 0.0)
                if reported.get("versions"):
                    versions.add_metric([run, cid], {k: reported["versions"].get(k, "") for k in VERSION_KEYS})
            for outcome in ("rejected", "stale", "duplicates", "declined", "evicted", "expired", "health_ignored"):
                counters.add_metric([run, outcome], float(snap["counters"].get(outcome, 0)))
            for reason, count in sorted((snap.get("rejects") or {}).items()):
                rejects.add_metric([run, reason], float(count))
            for phase, stats in (last.get("phases") or {}).items():
                for q, key in (("0.5", "p50_s"), ("0.95", "p95_s")):
                    if stats.get(key) is not None:
                        lat.add_metric([run, phase, q], stats[key])
        for run in sorted(self.runs.unrestored):  # stored runs a restart could not bring back
            for s in STATES:
                state.add_metric([run, s], 1.0 if s == "failed" else 0.0)
        yield state
        yield from (g for g in gauges.values() if g.samples)
        yield from per_client.values()
        yield counters
        yield rejects
        yield lat
        yield from (g for g in health.values() if g.samples)
        yield flags
        yield from (g for g in (epsilon, exhausted) if g.samples)
        yield versions
        refused = CounterMetricFamily("fedal_api_refused_requests", "API requests refused, by HTTP status (400: a Host "
                                      "name it does not answer to; 401, 403: no or a wrong token; "
                                      "413: body too large; 422: invalid; 503: too many event streams)",
                                      labels=["status"])
        for status, count in sorted(dict(self.runs.refused_requests).items()):
            refused.add_metric([str(status)], count)
        yield refused


def registry_for(runs: RunManager) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RunCollector(runs))
    return registry


def last_evaluated(records: list[dict]) -> dict:
    """The last round that evaluated (with eval_every > 1 the rounds between carry no accuracy)."""
    return next((r for r in reversed(records) if r.get("mean_acc") is not None), {})
