"""Runtime overhead on loopback, measured side by side in one run.

1. Wall time of the rounds of a 10-agent FedAL run over a broker (agents as processes, the
   coordinator as a process) divided by the same rounds in-process (`fedal simulate`'s engine).
2. Bytes per client per FedAL knowledge-transfer iteration, as a passive MQTT observer sees them
   on the wire: up / (K*B*4) and down / (2*K*B*4), i.e. against the raw float32 logits and
   (average logits + discriminator gradient) the algorithm needs.

    python bench/overhead.py                    # Mosquitto if installed, else the embedded broker
    python bench/overhead.py --rounds 5 --out /tmp/overhead   # quick

Writes docs/results/overhead.md and overhead.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import paho.mqtt.client as mqtt

from fedal.protocol import EnvelopeError, decode, parse_broker_url, topics
from fedal.sim import build_run, load_config, simulated_engine
from fedal_cli.demo import run_demo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback_broker import loopback_broker  # noqa: E402


class WireObserver:
    """Counts payload bytes per (direction, phase) on every topic of a run."""

    def __init__(self, broker_url: str, run_id: str):
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.messages: dict[tuple[str, str], int] = defaultdict(int)
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
            phase = str(decode(msg.payload).meta.get("phase"))
        except EnvelopeError:
            phase = "?"
        self.bytes[(kind, phase)] += len(msg.payload)
        self.messages[(kind, phase)] += 1

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def in_process_seconds(config) -> float:
    config = config.resolved()
    data, clients, server = build_run(config)
    engine = simulated_engine(config, data, clients, server)
    t0 = time.perf_counter()
    for r in range(config.rounds):
        engine.run_round(r)  # evaluates as the deployment does
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--dataset", default="mnist1d", choices=["mnist1d", "digits"])
    ap.add_argument("--public-batch", type=int, default=32)
    ap.add_argument("--wire-dtype", default="float32", choices=["float32", "float16", "int8"],
                    help="what logits, average logits and gradients travel as (strategy_params.wire_dtype)")
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)

    config = load_config(None, dict(strategy="fedal", dataset=args.dataset, clients=args.clients, rounds=args.rounds,
                                    tau=args.tau, seed=0, eval_every=args.rounds, public_batch_size=args.public_batch,
                                    wire_dtype=args.wire_dtype,
                                    samples_per_client=700 if args.dataset == "mnist1d" else None))
    workdir = Path(tempfile.mkdtemp(prefix="fedal-overhead-"))
    with loopback_broker(workdir) as (broker, broker_name):
        t_local = in_process_seconds(config)
        observer = WireObserver(broker, "demo")
        results = run_demo(config, workdir / "demo", broker=broker, quiet=False, timeout_s=3600)
        time.sleep(0.5)
        observer.close()
    t_dist = sum(r["wall_s"] for r in results["rounds"])
    k, b, n, tau = 10, args.public_batch, args.clients, args.tau
    iterations = args.rounds * tau * n  # client-iterations
    # every byte of the round's training traffic (local_train + transfer), per client-iteration
    up = observer.bytes[("up", "local_train")] + observer.bytes[("up", "transfer")]
    down = observer.bytes[("down", "local_train")] + observer.bytes[("down", "transfer")]
    per_up, per_down = up / iterations, down / iterations
    report = {
        "broker": broker_name,
        "settings": {"clients": n, "rounds": args.rounds, "tau": tau, "dataset": args.dataset, "K": k, "B": b,
                     "wire_dtype": args.wire_dtype},
        "wall_seconds": {"distributed": round(t_dist, 3), "in_process": round(t_local, 3)},
        "wall_ratio": round(t_dist / t_local, 3),
        "bytes_per_client_iteration": {"up": per_up, "down": per_down, "raw_up": k * b * 4, "raw_down": 2 * k * b * 4},
        "bytes_ratio": {"up": round(per_up / (k * b * 4), 3), "down": round(per_down / (2 * k * b * 4), 3)},
        "wire_bytes_by_phase": {f"{d}/{p}": v for (d, p), v in sorted(observer.bytes.items())},
        "messages_by_phase": {f"{d}/{p}": v for (d, p), v in sorted(observer.messages.items())},
        "final_mean_acc": results["final"]["mean_acc"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(report, indent=2) + "\n")
    md = f"""# Runtime overhead (bench/overhead.py)

FedAL ({args.wire_dtype} on the wire), {args.dataset}, {n} agents (processes) + coordinator (process) over {broker_name} on loopback,
{args.rounds} rounds, tau = {tau}, public batch B = {b}, K = {k}; the same rounds run in-process by the
simulation engine in the same benchmark run. Machine: 2 cores.

| measure | value | goal |
|---|---|---|
| wall time of the rounds over the broker / in-process | {t_dist:.1f} s / {t_local:.1f} s = **{t_dist / t_local:.3f}** | <= 1.15 |
| bytes up per client per transfer iteration / (K*B*4 = {k * b * 4}) | {per_up:.0f} / {k * b * 4} = **{per_up / (k * b * 4):.3f}** | <= 1.05 |
| bytes down per client per transfer iteration / (2*K*B*4 = {2 * k * b * 4}) | {per_down:.0f} / {2 * k * b * 4} = **{per_down / (2 * k * b * 4):.3f}** | <= 1.05 |

Wire bytes by direction and phase (MQTT payloads as a passive observer received them):

| direction/phase | bytes | messages |
|---|---|---|
""" + "\n".join(f"| {key} | {v} | {report['messages_by_phase'][key]} |" for key, v in report["wire_bytes_by_phase"].items()) + "\n"
    (out / "overhead.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
