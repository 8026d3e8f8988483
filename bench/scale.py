"""Coordinator scale: one transfer iteration with 100, 300 and 1000 emulated clients.

A real coordinator process, a private Mosquitto on loopback and N emulated agents (hil/fleet.py:
one MQTT connection each, synthetic logits, one process) run a short FedAL run with B = 32,
K = 10. The coordinator times every phase itself (round records, /api/v1/runs/<id>/rounds):

- compute: the server half producing a transfer iteration's tasks (FedAL: the discriminator step
  on all N*B received logits and the per-client adversarial gradients);
- end-to-end: from that compute starting to the iteration's last result accepted, i.e. compute,
  encoding and publishing N tasks, the clients answering, and receiving and validating N results.

Reported per N: the mean over the transfer iterations of the last (warm) round. A FedMD run
(the same transfer without the discriminator: the server half only averages) separates what the
algorithm costs from what the runtime costs.

    python bench/scale.py                        # N = 100, 300, 1000; FedAL and FedMD
    python bench/scale.py --clients 100 --out /tmp/scale --no-fedmd   # quick

Writes docs/results/scale.md and scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cli_args import at_least  # noqa: E402
from report_text import kept_reading  # noqa: E402

from fedal import procs  # noqa: E402
from hil.coordinator_setup import get_json, start_coordinator, stop_process, wait_for_run, write_coordinator_config  # noqa: E402
from hil.fleet import Fleet, client_ids  # noqa: E402
from hil.mosquitto import Mosquitto, free_port, raise_open_files_limit  # noqa: E402

B, K = 32, 10
COMPUTE_GOAL_S, E2E_GOAL_S = 0.100, 2.0


def one_run(workdir: Path, strategy: str, n: int, rounds: int, tau: int, timeout_s: float, threads: int | None) -> dict:
    """A run of `strategy` with n emulated clients; the coordinator's own phase timings."""
    run_id = f"scale-{strategy}-{n}"
    broker = Mosquitto(workdir / f"mosquitto-{run_id}", max_connections=n + 64).start()
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    ids = client_ids(n)
    config = write_coordinator_config(workdir / run_id, broker.url, run_id, ids, api_port=port, strategy=strategy,
                                      rounds=rounds, tau=tau, num_classes=K, public_batch_size=B, eval_every=rounds,
                                      phases={"quorum": 1.0, "deadline_s": 600, "train_deadline_s": 600,
                                              "resend_s": 600, "start_timeout_s": 600})
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else None  # torch's intra-op
    coordinator = start_coordinator(config, workdir / f"{run_id}.log", env=env)
    fleet = Fleet(broker.url, run_id, ids, seed=0)
    t0 = time.monotonic()
    try:
        fleet.start()
        if not fleet.wait_online(timeout_s=300):
            raise RuntimeError(f"only {fleet.online()} of {n} emulated agents connected")
        online_s = time.monotonic() - t0
        # CPU is counted over the warm rounds: from the end of the first to the end of the run
        wait_for_run(api, run_id, lambda r: r["completed_rounds"] >= 1 or r["state"] != "running", timeout_s,
                     coordinator, every_s=0.2)
        cpu0 = {"coordinator": cpu_seconds(coordinator.pid), "mosquitto": cpu_seconds(broker.proc.pid),
                "fleet": time.process_time()}
        final = wait_for_run(api, run_id, lambda r: r["state"] in ("finished", "failed"), timeout_s, coordinator,
                             every_s=1.0)
        if final["state"] != "finished":
            raise RuntimeError(f"run {run_id} {final['state']}: {final.get('error')}")
        cpu1 = {"coordinator": cpu_seconds(coordinator.pid), "mosquitto": cpu_seconds(broker.proc.pid),
                "fleet": time.process_time()}
        records = get_json(f"{api}/api/v1/runs/{run_id}/rounds", timeout=30)
        fleet.wait_finished(60)
        summary = fleet.summary()
    finally:
        fleet.stop()
        stop_process(coordinator)
        broker.stop()
    last = records[-1]["phases"]
    transfer = last["transfer"]
    warm = records[1:]  # client-tasks and server-half compute of the rounds the CPU was counted over
    tasks = sum(ph["count"] for r in warm for ph in r["phases"].values())
    compute = sum(ph["compute_s"] * (tau if name == "transfer" else 1) for r in warm for name, ph in r["phases"].items())
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    return {
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()}, "client_tasks": tasks, "compute_s_total": round(compute, 2),
        "strategy": strategy, "clients": n, "tau": tau, "rounds": rounds,
        "transfer_compute_s": transfer["compute_s"], "transfer_end_to_end_s": transfer["wall_s"],
        "transfer_p50_s": transfer["p50_s"], "transfer_p95_s": transfer["p95_s"],
        "local_train_end_to_end_s": last["local_train"]["wall_s"],
        "participation": transfer["participation"],
        "connect_all_s": round(online_s, 2),
        "fleet_feedback_applied_twice": len(summary["feedback_applied_twice"]),
        "fleet_rejected": summary["counters"].get("rejected", 0),
        "rounds_records": records,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_process_compute(n: int, threads: int | None, repeats: int = 3) -> float:
    """FedAL's server half alone on n*B random logits (no MQTT): the algorithm's own cost."""
    import numpy as np
    import torch

    from fedal.protocol import Message
    from fedal.strategies import ServerContext, StrategyParams, get_strategy

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    spec = get_strategy("fedal")
    ids = client_ids(n)
    server = spec.server(StrategyParams(public_batch_size=B).resolve(spec.preset), ids, ServerContext(K, 1000, 0))
    phase = server.begin_round(0)
    rng = np.random.default_rng(0)
    results = {c: Message({"phase": "local_train", "round": 0, "iteration": 0},
                          {"logits": rng.standard_normal((B, K), dtype=np.float32)}) for c in ids}
    server.collect(phase, results)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        server.collect(phase, results)
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(before)
    return best


def growth(rows: list[dict], key: str) -> str:
    """How key grows from the smallest to the largest N, against N itself."""
    a, b = rows[0], rows[-1]
    if not a[key]:
        return "n/a"
    return f"x{b[key] / a[key]:.1f} for x{b['clients'] / a['clients']:.0f} clients"


def client_counts(text: str) -> list[int]:
    """--clients: comma-separated counts, each at least 2 (a federation)."""
    parse = at_least(2)
    return [parse(part.strip()) for part in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=client_counts, default="100,300,1000", help="comma-separated N")
    ap.add_argument("--tau", type=at_least(1), default=3, help="transfer iterations per round")
    ap.add_argument("--rounds", type=at_least(2), default=2, help="the last round is reported (the first warms up: at least 2)")
    ap.add_argument("--no-fedmd", action="store_true", help="skip the FedMD reference runs")
    ap.add_argument("--coordinator-threads", type=int, default=1,
                    help="torch threads of the coordinator (0: torch's default, one per core)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--render", metavar="JSON", help="only rewrite scale.md from a saved scale.json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        try:
            md = render(json.loads(Path(args.render).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            ap.error(f"argument --render: {args.render} is not a readable scale.json ({type(exc).__name__}: {exc})")
        out.mkdir(parents=True, exist_ok=True)
        write_report(out / "scale.md", md)  # the hand-written reading the file holds stays below
        print(md)
        return 0
    sizes = args.clients
    raise_open_files_limit(max(sizes) * 3 + 1024)
    # a pid_dir: one a killed run (SIGKILL) leaves is removed by the next
    workdir = Path(procs.pid_dir(tempfile.gettempdir(), "fedal-scale-"))
    load_before = os.getloadavg()
    rows: dict[str, list[dict]] = {"fedal": [], "fedmd": []}
    try:
        with procs.stop_signals_interrupt():  # SIGTERM/SIGHUP as Ctrl-C: through the clean-up below
            for strategy in ["fedal"] + ([] if args.no_fedmd else ["fedmd"]):
                for n in sizes:
                    print(f"{strategy}: {n} emulated clients ...", file=sys.stderr, flush=True)
                    row = one_run(workdir, strategy, n, args.rounds, args.tau, args.timeout,
                                  args.coordinator_threads or None)
                    if strategy == "fedal":
                        row["in_process_compute_s"] = round(in_process_compute(n, args.coordinator_threads or None), 4)
                    rows[strategy].append(row)
                    print(f"  compute {row['transfer_compute_s'] * 1000:.0f} ms, end-to-end "
                          f"{row['transfer_end_to_end_s'] * 1000:.0f} ms", file=sys.stderr, flush=True)
    except procs.Stopped as exc:
        print(f"stopped by {exc}", file=sys.stderr)
        return exc.exit_status
    finally:  # the runs' configs, logs and stores: this benchmark's alone
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()
    report = {
        "settings": {"B": B, "K": K, "tau": args.tau, "rounds": args.rounds, "broker": "mosquitto (loopback)",
                     "clients": sizes, "coordinator_threads": args.coordinator_threads or "torch default"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_before": [round(x, 2) for x in load_before],
                    "load_avg_after": [round(x, 2) for x in load_after]},
        "goals": {"compute_s_at_1000": COMPUTE_GOAL_S, "end_to_end_s_at_1000": E2E_GOAL_S},
        "runs": {k: [{kk: vv for kk, vv in r.items() if kk != "rounds_records"} for r in v] for k, v in rows.items()},
        "round_records": {k: {r["clients"]: r["rounds_records"] for r in v} for k, v in rows.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(report, indent=1) + "\n")
    md = render(report)
    write_report(out / "scale.md", md)
    print(md)
    return 0


def render(report: dict) -> str:
    s, m, rows = report["settings"], report["machine"], report["runs"]
    lines = [
        "# Coordinator scale (bench/scale.py)",
        "",
        f"One transfer iteration (B = {s['B']}, K = {s['K']}) with N emulated clients (hil/fleet.py: one MQTT",
        "connection each, all in the benchmark's process) against a real coordinator process through Mosquitto",
        "on loopback. Times are the coordinator's own phase timings (round records: `compute_s` = the server",
        "half producing the iteration's tasks, `wall_s` = from that compute starting to the iteration's last",
        f"result accepted), the mean over the {s['tau']} transfer iterations of the last of {s['rounds']} rounds.",
        f"Coordinator torch threads: {s['coordinator_threads']}. Machine: {m['cpus']} cores shared with other work",
        f"(load average {m['load_avg_before'][0]:.1f} before, {m['load_avg_after'][0]:.1f} after), and the coordinator,",
        "Mosquitto and the emulated fleet share those cores: the absolute wall times are noisy and pessimistic.",
        "",
        "| strategy | N | compute (ms) | end-to-end (ms) | end-to-end - compute (ms) | per client (ms) | "
        "FedAL server half alone, in-process (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for strategy, rs in rows.items():
        for r in rs:
            rest = r["transfer_end_to_end_s"] - r["transfer_compute_s"]
            inproc = f"{r['in_process_compute_s'] * 1000:.0f}" if "in_process_compute_s" in r else "-"
            lines.append(f"| {strategy} | {r['clients']} | {r['transfer_compute_s'] * 1000:.0f} | "
                         f"{r['transfer_end_to_end_s'] * 1000:.0f} | {rest * 1000:.0f} | "
                         f"{rest / r['clients'] * 1000:.2f} | {inproc} |")
    lines += [
        "",
        "CPU time per client-task (one task out, one result in) over the warm rounds, all phases, less",
        "sensitive to the load than wall times; the coordinator's includes its server half (for FedAL",
        "mostly the discriminator, for FedMD almost nothing: there it is the runtime's own cost):",
        "",
        "| strategy | N | coordinator (ms) | Mosquitto (ms) | emulated fleet (ms) |",
        "|---|---|---|---|---|",
    ]
    for strategy, rs in rows.items():
        for r in rs:
            per = {k: v / r["client_tasks"] * 1000 for k, v in r["cpu_s"].items()}
            lines.append(f"| {strategy} | {r['clients']} | {per['coordinator']:.2f} | {per['mosquitto']:.2f} | "
                         f"{per['fleet']:.2f} |")
    lines.append("")
    for strategy, rs in rows.items():
        if not rs:
            continue
        big = rs[-1]
        c_ok = big["transfer_compute_s"] <= COMPUTE_GOAL_S
        e_ok = big["transfer_end_to_end_s"] <= E2E_GOAL_S
        lines += [
            f"- {strategy}, goals at N = {big['clients']}: compute <= {COMPUTE_GOAL_S * 1000:.0f} ms "
            f"**{'met' if c_ok else 'not met'}** ({big['transfer_compute_s'] * 1000:.0f} ms); end-to-end <= "
            f"{E2E_GOAL_S:.0f} s **{'met' if e_ok else 'not met'}** ({big['transfer_end_to_end_s']:.2f} s). "
            f"From N = {rs[0]['clients']} to {big['clients']}: compute {growth(rs, 'transfer_compute_s')}, "
            f"end-to-end {growth(rs, 'transfer_end_to_end_s')}."
        ]
    return "\n".join(lines) + "\n"


# the reading written with the first record: a report written where none is yet starts with it
# (a rerun keeps the one its file holds, edited by hand for that run's numbers)
FIRST_READING = """
## Reading

- **FedAL's server half does not scale linearly, by construction.** Its discriminator maps each of
  the N*B received logit rows to N client scores (hidden widths 32 and 256, then an N-wide output
  layer), and every transfer iteration makes one training step and one per-sample gradient pass over
  all rows: about 3 * N*B * 256*N multiply-adds in the last layer alone, i.e. O(N^2). At N = 1000
  and B = 32 that is some 25 G multiply-adds per iteration, seconds on two shared CPU cores (the
  in-process column: the same server half without MQTT). 100 ms at 1000 clients is out of reach on
  this machine's CPU; the coordinator can run the server half on a GPU (`device = "cuda"`, the
  default `auto` picks one when present), or a deployment can keep N per coordinator in the hundreds.
  The runtime adds nothing to it: the coordinator's `compute_s` is the in-process time, inflated by
  the machine's load at the moment of the run (the two columns were measured minutes apart).
- **The runtime scales linearly.** End-to-end minus compute (encoding and publishing N tasks, the
  clients' answers, receiving and validating N results) stays at a constant few milliseconds per
  client from 100 to 1000 clients, and the CPU per client-task is flat: the coordinator well under a
  millisecond (paho's packet handling, envelope decode/encode, validation; no hotspot stands out in
  a profile), Mosquitto a tenth of one. FedMD, the same protocol and transfer without the
  discriminator (the server half only averages), shows the runtime alone: at N = 1000 its
  iteration meets both goals. (Its compute, a few milliseconds at N = 100, is too small to read a
  growth rate from.)
- The emulated fleet is part of the measurement: its one thread answers every client and takes
  about as much CPU per message as the coordinator, on the same two cores.
"""


def write_report(path: Path, generated: str) -> None:
    """`generated` at `path`, then the reading the file holds (FIRST_READING where it holds none)."""
    path.write_text(generated + (kept_reading(path) or FIRST_READING))


if __name__ == "__main__":
    sys.exit(main())
