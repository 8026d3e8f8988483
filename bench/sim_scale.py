"""Seconds per FedAL round as the number of clients grows: in-process per-client, in-process
vectorized, and the Ray backend on a local instance with 2 CPUs (its actors' clients per-client
or vectorized), side by side in one run; with the peak memory of the driver and of the Ray workers.

    python bench/sim_scale.py                        # N = 10, 100, 1000
    python bench/sim_scale.py --clients 10,100 --rounds 3 --repeats 3

Each (N, variant) runs in its own process (so its peak RSS is its own): one warm-up round, then
the timed rounds, no evaluation. Below N = 1000 every variant runs `--repeats` times, the
variants taking turns, so a ratio is reported per repeat (how much it moves from run to run). MNIST-1D with `samples_per_client` rows per client (generated
as large as N needs), models mlp / cnn1d / cnn1d_wide round-robin, tau 5. Writes
docs/results/sim_scale.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fedal import procs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("in-process per-client", "in-process vectorized", "ray, 2 CPUs, per-client", "ray, 2 CPUs, vectorized")

PROBE = r"""
import json, os, resource, sys, time
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import torch
torch.set_num_threads(1)
from fedal.sim import load_config, build_run, simulated_engine
from fedal.sim.runner import global_metrics_of

spec = json.loads(sys.argv[1])
config = load_config(None, spec["config"]).resolved()
workers = 0.0
if spec["variant"] == "ray":
    import ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,  # a new instance, as
             _node_ip_address="127.0.0.1", logging_level="ERROR")  # `fedal simulate --backend ray` starts
    from fedal.sim.ray_backend import ray_run
    data, server, engine, close = ray_run(config, global_metrics_of)
else:
    data, clients, server = build_run(config)
    engine = simulated_engine(config, data, clients, server)
engine.run_round(0)  # warm-up
times = []
for r in range(1, 1 + spec["rounds"]):
    t0 = time.perf_counter()
    engine.run_round(r)
    times.append(time.perf_counter() - t0)
if spec["variant"] == "ray":
    handles = engine.transport.actors.values()
    workers = sum(x["max_rss_mb"] for x in ray.get([h.ready.remote(engine.transport.public) for h in set(handles)]))
    close()
    ray.shutdown()
print(json.dumps({"seconds": times, "driver_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "workers_mb": workers}))
"""


def config_for(n: int, per_client: int, tau: int, vectorize: bool, backend: str) -> dict:
    samples = max(12_000, int((n * per_client + 1000) / 0.8) + 10)  # train is 80 % of what is generated
    samples = -(-samples // 10) * 10
    return {"strategy": "fedal", "dataset": "mnist1d", "clients": n, "samples_per_client": per_client,
            "mnist1d_samples": samples, "public_size": 1000, "alpha": 2.0, "models": ["mlp", "cnn1d", "cnn1d_wide"],
            "seed": 0, "threads": 1, "rounds": 10_000, "eval_every": 10_000, "vectorize": vectorize,
            "backend": backend, "ray_actors": 2 if backend == "ray" else None, "strategy_params": {"tau": tau}}


def measure(n: int, variant: str, args) -> dict:
    backend = "ray" if variant.startswith("ray") else "inprocess"
    spec = {"variant": "ray" if backend == "ray" else "inprocess", "rounds": args.rounds if n < 1000 else 1,
            "config": config_for(n, args.samples_per_client, args.tau, variant.endswith("vectorized"), backend)}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(spec)], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=3600, preexec_fn=procs.dies_with_this_process())  # (and its Ray instance)
    if out.returncode != 0:
        raise SystemExit(f"{variant} at N = {n} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="10,100,1000")
    ap.add_argument("--rounds", type=at_least(1), default=3, help="timed rounds (N >= 1000: one)")
    ap.add_argument("--samples-per-client", type=int, default=60)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--repeats", type=at_least(1), default=3, help="runs of each variant below N = 1000")
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.clients.split(",") if x]
    rows = []
    started = time.perf_counter()
    for n in sizes:
        runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for rep in range(args.repeats if n < 1000 else 1):
            for variant in VARIANTS[rep % len(VARIANTS):] + VARIANTS[: rep % len(VARIANTS)]:
                res = measure(n, variant, args)
                runs[variant].append(res)
                print(f"N = {n}, {variant}, repeat {rep + 1}: {statistics.median(res['seconds']):.2f} s/round, "
                      f"driver {res['driver_mb']:.0f} MB, workers {res['workers_mb']:.0f} MB", file=sys.stderr)
        base = [statistics.median(r["seconds"]) for r in runs[VARIANTS[0]]]
        for variant, results in runs.items():
            per_repeat = [statistics.median(r["seconds"]) for r in results]
            rows.append({"clients": n, "variant": variant, "s_per_round": statistics.median(per_repeat),
                         "s_per_round_per_repeat": per_repeat,
                         "speedup_per_repeat": [b / v for b, v in zip(base, per_repeat)],
                         "seconds": [s for r in results for s in r["seconds"]],
                         "driver_mb": max(r["driver_mb"] for r in results),
                         "workers_mb": max(r["workers_mb"] for r in results)})
    by = {(r["clients"], r["variant"]): r for r in rows}
    lines = [
        "# Simulation at scale: seconds per FedAL round as N grows",
        "",
        f"Written by `python bench/sim_scale.py` in {time.perf_counter() - started:.0f} s. FedAL, MNIST-1D, "
        f"{args.samples_per_client} samples per client, models mlp / cnn1d / cnn1d_wide round-robin, tau = "
        f"{args.tau}, batch 32, public batch 32; each (N, variant) in its own process, one warm-up round, then the "
        f"median of {args.rounds} timed rounds (one at N >= 1000), no evaluation; below N = 1000 each variant ran "
        f"{args.repeats} times, taking turns (s / round: the median over repeats). Ray: a local instance with 2 CPUs, "
        "2 actors (each hosting half of the clients), one torch thread each. Peak memory: the process's maximum "
        f"resident set (driver) and the sum over the Ray actors' (workers). Machine: {platform.machine()}, "
        f"{os.cpu_count()} cores.",
        "",
        "| N | variant | s / round | vs per-client | vs per-client, each repeat | driver peak MB | workers peak MB |",
        "|---:|---|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        base = by[(r["clients"], VARIANTS[0])]["s_per_round"]
        each = ", ".join(f"{x:.2f}x" for x in r["speedup_per_repeat"])
        lines.append(f"| {r['clients']} | {r['variant']} | {r['s_per_round']:.3f} | {base / r['s_per_round']:.2f}x | "
                     f"{each} | {r['driver_mb']:.0f} | {r['workers_mb']:.0f} |")
    lines += ["", "Growth with N (s / round, per-client path): " + ", ".join(
        f"N = {n}: {by[(n, VARIANTS[0])]['s_per_round']:.3f}" for n in sizes if (n, VARIANTS[0]) in by), ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    marker = "<!-- hand-written below this line; kept when bench/sim_scale.py rewrites the file -->"
    md = out / "sim_scale.md"
    kept = md.read_text().split(marker, 1)[1] if md.exists() and marker in md.read_text() else ""
    md.write_text("\n".join(lines) + "\n" + marker + kept)
    (out / "sim_scale.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
