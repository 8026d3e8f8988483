"""What `fedal simulate --checkpoint` costs: seconds per FedAL round with a checkpoint after every
round against none, measured side by side in one run, for each client count; the checkpoint's
size, and the seconds to read it back and restore a run from it.

    python bench/sim_checkpoint.py                    # N = 10, 100; MNIST-1D, mlp/cnn1d/cnn1d_wide
    python bench/sim_checkpoint.py --clients 10,100,1000 --rounds 4

One process, one torch thread, vectorized (the default path). The two runs of a client count are
built alike and take turns round by round, so load from other processes falls on both; the ratio
is the median of the per-round ratios. The checkpoint goes to a temporary folder (removed after).
Writes docs/results/sim_checkpoint.md and .json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedal.sim import build_run, load_config, simulated_engine
from fedal.sim.checkpoint import CheckpointFile, read, restore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402
from report_text import write_results  # noqa: E402


def counts(text: str) -> list[int]:
    parse = at_least(2)
    return [parse(part) for part in text.split(",")]


def engine_of(config):
    cfg = config.resolved()
    cfg = cfg.model_copy(update={"vectorize": cfg.vectorized})
    data, clients, server = build_run(cfg)
    return cfg, data, simulated_engine(cfg, data, clients, server)


def measure(n: int, rounds: int, warmup: int, folder: Path) -> dict:
    config = load_config(None, {"strategy": "fedal", "dataset": "mnist1d", "clients": n, "alpha": 2.0,
                                "samples_per_client": 100,
                                "mnist1d_samples": max(12_000, 130 * n + 3000), "models": ["mlp", "cnn1d", "cnn1d_wide"],
                                "rounds": warmup + rounds + 1, "eval_every": 10_000, "threads": 1,  # the last (evaluated) is not run
                                "strategy_params": {"tau": 5}})
    cfg, data, plain = engine_of(config)
    _, _, saving = engine_of(config)
    path = folder / f"n{n}.ckpt"
    ckpt = CheckpointFile(path, resume=False)
    times: dict[str, list[float]] = {"no checkpoint": [], "checkpoint every round": []}
    save_s: list[float] = []
    done: list[dict] = []
    def plain_round(r: int) -> float:
        t0 = time.perf_counter()
        plain.run_round(r)
        return time.perf_counter() - t0

    def saving_round(r: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        done.append(saving.run_round(r))
        t1 = time.perf_counter()
        if not ckpt.save(cfg, data.public_hash, saving, done, 0.0):  # (a full disk: timed as a fast save)
            raise SystemExit(f"the checkpoint after round {r + 1} could not be written (see the warning)")
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    for r in range(warmup + rounds):
        if r % 2 == 0:  # taking turns: which goes first alternates, so neither always runs on a warmer cache
            without = plain_round(r)
            with_ckpt, saved = saving_round(r)
        else:
            with_ckpt, saved = saving_round(r)
            without = plain_round(r)
        if r >= warmup:
            times["no checkpoint"].append(without)
            times["checkpoint every round"].append(with_ckpt)
            save_s.append(saved)
        print(f"N={n} round {r}: {without:.3f}s, with checkpoint {with_ckpt:.3f}s", file=sys.stderr)
    t0 = time.perf_counter()
    state = read(path)
    t1 = time.perf_counter()
    _, _, fresh = engine_of(config)
    t2 = time.perf_counter()
    assert state is not None
    restore(path, fresh, state)
    t3 = time.perf_counter()
    ratios = [b / a for a, b in zip(times["no checkpoint"], times["checkpoint every round"])]
    return {"clients": n, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": statistics.median(ratios), "save_s": statistics.median(save_s),
            "bytes": path.stat().st_size, "read_s": t1 - t0, "build_s": t2 - t1, "restore_s": t3 - t2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=counts, default=[10, 100], help="client counts, comma-separated")
    ap.add_argument("--rounds", type=at_least(1), default=8, help="timed rounds per client count")
    ap.add_argument("--warmup", type=at_least(0), default=1)
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fedal-bench-ckpt-") as tmp:
        rows = [measure(n, args.rounds, args.warmup, Path(tmp)) for n in args.clients]
    lines = [
        "# Simulation checkpoints: what a checkpoint after every round costs",
        "",
        f"Written by `python bench/sim_checkpoint.py` ({args.rounds} timed rounds per client count after "
        f"{args.warmup} warm-up, the two runs taking turns round by round in one process on one torch thread). "
        "FedAL, MNIST-1D, models mlp / cnn1d / cnn1d_wide round-robin, 100 samples per client, tau = 5, "
        "vectorized; no evaluation in the timed rounds.",
        f"Machine: {platform.machine()}, torch {torch.__version__}.",
        "",
        "| clients | s / round, no checkpoint | s / round, checkpoint every round | ratio | of it writing | file MB "
        "| read s | restore s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[f"| {r['clients']} | {r['median_s']['no checkpoint']:.4f} | {r['median_s']['checkpoint every round']:.4f} "
          f"| {r['ratio']:.2f} | {r['save_s']:.4f} | {r['bytes'] / 1e6:.1f} | {r['read_s']:.2f} | {r['restore_s']:.2f} |"
          for r in rows],
        "",
        "The ratio is the median of the per-round ratios (with / without); `--checkpoint-every K` divides "
        "the writing's share by K. Read and restore: one checkpoint read back (`torch.load`, weights only) and "
        "loaded into a run built afresh (`--resume`).",
        "",
    ]
    write_results(args.out, "sim_checkpoint", lines, {  # the hand-written reading is kept
        "rounds": args.rounds, "warmup": args.warmup, "rows": rows, "machine": platform.machine(),
        "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
