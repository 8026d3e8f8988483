"""Runtime overhead on loopback, measured side by side in one run.

1. Wall time of the rounds of a 10-agent FedAL run over a broker (agents as processes, the
   coordinator as a process) divided by the same rounds in-process (`fedal simulate`'s engine).
2. Bytes per client per FedAL knowledge-transfer iteration, as a passive MQTT observer sees them
   on the wire: up / (K*B*4) and down / (2*K*B*4), i.e. against the raw float32 logits and
   (average logits + discriminator gradient) the algorithm needs.
Both for each wire dtype (float32, float16, int8 with a scale per row or per tensor), in one run.

    python bench/overhead.py                    # Mosquitto if installed, else the embedded broker
    python bench/overhead.py --rounds 5 --wire-dtype float32 --out /tmp/overhead   # quick

Writes docs/results/overhead.md and overhead.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import paho.mqtt.client as mqtt
import torch
from tqdm import tqdm

from fedal import procs
from fedal.protocol import EnvelopeError, decode, parse_broker_url, topics
from fedal.sim import build_run, load_config, simulated_engine
from fedal_cli.demo import run_demo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback_broker import loopback_broker  # noqa: E402
from report_text import write_report  # noqa: E402


class WireObserver:
    """Counts payload bytes per (direction, phase) on every topic of a run."""

    def __init__(self, broker_url: str, run_id: str):
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.messages: dict[tuple[str, str], int] = defaultdict(int)
        self.phase_of: dict[tuple, str] = {}
        addr = parse_broker_url(broker_url)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fedal-bench-observer")
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, *_: c.subscribe(f"{topics.ROOT}/{run_id}/#", qos=1)
        self.client.connect(addr.host, addr.port)
        self.client.loop_start()

    def _on_message(self, _c, _u, msg) -> None:
        kind = msg.topic.split("/")[3]
        if kind not in ("up", "down"):
            return
        try:
            meta = decode(msg.payload).meta
        except EnvelopeError:
            meta = {}
        key = (meta.get("epoch"), meta.get("seq"))
        if kind == "down":  # a result names its task by (epoch, seq): its phase is the task's
            self.phase_of[key] = str(meta.get("phase"))
        phase = self.phase_of.get(key, "?")
        self.bytes[(kind, phase)] += len(msg.payload)
        self.messages[(kind, phase)] += 1

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def in_process_seconds(config) -> float:
    """The same rounds in process on the per-client path: what each agent process runs (stacked
    clients, a simulation's default, would make the baseline about twice as fast)."""
    config = config.model_copy(update={"vectorize": False}).resolved()
    torch.set_num_threads(config.threads)  # as `fedal simulate` runs (and each agent: threads = 1)
    data, clients, server = build_run(config)
    engine = simulated_engine(config, data, clients, server)
    t0 = time.perf_counter()
    for r in range(config.rounds):
        engine.run_round(r)  # evaluates as the deployment does
    return time.perf_counter() - t0


VARIANTS = {  # name: (wire_dtype, wire_int8_scale), with the byte goals (up and down, x raw float32)
    "float32": (("float32", "row"), 1.05),
    "float16": (("float16", "row"), 0.55),
    "int8-row": (("int8", "row"), 0.30),
    "int8-tensor": (("int8", "tensor"), 0.30),
}
WALL_GOAL = 1.3  # the acceptance bound (the goal: 1.15)


def measure(args, variant: str, workdir: Path, broker: str) -> dict:
    """One variant: the same rounds in-process, then over the broker with a passive observer."""
    (dtype, scale), _ = VARIANTS[variant]
    config = load_config(None, dict(strategy="fedal", dataset=args.dataset, clients=args.clients, rounds=args.rounds,
                                    tau=args.tau, seed=0, eval_every=args.rounds, public_batch_size=args.public_batch,
                                    wire_dtype=dtype, wire_int8_scale=scale,
                                    samples_per_client=700 if args.dataset == "mnist1d" else None))
    t_local = in_process_seconds(config)
    observer = WireObserver(broker, "demo")
    results = run_demo(config, workdir / f"demo-{variant}", broker=broker, quiet=True, timeout_s=3600)
    time.sleep(0.5)
    observer.close()
    t_dist = sum(r["wall_s"] for r in results["rounds"])
    k, b = 10, args.public_batch
    iterations = args.rounds * args.tau * args.clients  # client-iterations
    # every byte of the round's training traffic (local_train + transfer), per client-iteration
    up = observer.bytes[("up", "local_train")] + observer.bytes[("up", "transfer")]
    down = observer.bytes[("down", "local_train")] + observer.bytes[("down", "transfer")]
    return {
        "wire_dtype": dtype, "wire_int8_scale": scale,
        "wall_seconds": {"distributed": round(t_dist, 3), "in_process": round(t_local, 3)},
        "wall_ratio": round(t_dist / t_local, 3),
        "bytes_per_client_iteration": {"up": up / iterations, "down": down / iterations,
                                       "raw_up": k * b * 4, "raw_down": 2 * k * b * 4},
        "bytes_ratio": {"up": round(up / iterations / (k * b * 4), 3), "down": round(down / iterations / (2 * k * b * 4), 3)},
        "wire_bytes_by_phase": {f"{d}/{p}": v for (d, p), v in sorted(observer.bytes.items())},
        "messages_by_phase": {f"{d}/{p}": v for (d, p), v in sorted(observer.messages.items())},
        "final_mean_acc": results["final"]["mean_acc"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--dataset", default="mnist1d", choices=["mnist1d", "digits"])
    ap.add_argument("--public-batch", type=int, default=32)
    ap.add_argument("--wire-dtype", default=",".join(VARIANTS),
                    help=f"comma list of {list(VARIANTS)}: what logits, average logits and gradients travel as "
                         "(strategy_params.wire_dtype and wire_int8_scale); all are measured in the same run")
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.wire_dtype.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        ap.error(f"--wire-dtype: unknown {unknown or variants}; choose from {', '.join(VARIANTS)}")

    workdir = Path(procs.pid_dir(tempfile.gettempdir(), "fedal-overhead-"))  # a killed run's: reaped by the next
    measured = {}
    try:
        with procs.stop_signals_interrupt(), loopback_broker(workdir) as (broker, broker_name):
            for variant in tqdm(variants, desc="wire dtypes", unit="variant"):
                measured[variant] = measure(args, variant, workdir, broker)
    except procs.Stopped as exc:
        print(f"stopped by {exc}", file=sys.stderr)
        return exc.exit_status
    finally:  # the demos' workspaces and the broker's files: this run's alone
        shutil.rmtree(workdir, ignore_errors=True)
    k, b, n, tau = 10, args.public_batch, args.clients, args.tau
    report = {
        "broker": broker_name,
        "settings": {"clients": n, "rounds": args.rounds, "tau": tau, "dataset": args.dataset, "K": k, "B": b,
                     "durability": "journal (the agent's default)"},
        "variants": measured,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    rows = []
    for variant, m in measured.items():
        goal = VARIANTS[variant][1]
        w, br, bp = m["wall_seconds"], m["bytes_ratio"], m["bytes_per_client_iteration"]
        rows.append(f"| {variant} | {w['distributed']:.1f} s / {w['in_process']:.1f} s = **{m['wall_ratio']:.3f}** "
                    f"| {bp['up']:.0f} B = **{br['up']:.3f}** | {bp['down']:.0f} B = **{br['down']:.3f}** | <= {goal} |")
    first = next(iter(measured.values()))
    md = f"""# Runtime overhead (bench/overhead.py)

FedAL, {args.dataset}, {n} agents (processes) + coordinator (process) over {broker_name} on loopback,
{args.rounds} rounds, tau = {tau}, public batch B = {b}, K = {k}, agent durability `journal` (the
default); for each wire dtype, the same rounds also run in-process by the simulation engine, in
the same benchmark run. Bytes: every local_train and transfer payload a passive MQTT observer saw,
per client and transfer iteration, against the raw float32 logits (K*B*4 = {k * b * 4} up) and
average logits + discriminator gradient (2*K*B*4 = {2 * k * b * 4} down). Machine: 2 cores.

| wire dtype | wall time over the broker / in-process (goal <= {WALL_GOAL}) | bytes up / raw | bytes down / raw | bytes goal |
|---|---|---|---|---|
""" + "\n".join(rows) + f"""

Wire bytes by direction and phase, {next(iter(measured))} (MQTT payloads as a passive observer received them):

| direction/phase | bytes | messages |
|---|---|---|
""" + "\n".join(f"| {key} | {v} | {first['messages_by_phase'][key]} |" for key, v in first["wire_bytes_by_phase"].items()) + "\n"
    write_report(out / "overhead.md", md)  # the hand-written reading below stays
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
