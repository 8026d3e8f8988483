"""Seconds per round of `fedal simulate` for this checkout against an earlier commit, measured
side by side in one run (alternating, each in a fresh process on one thread).

    python bench/engine_speed.py --baseline a0b5733          # FedAL, 10 clients, MNIST-1D, tau 5
    python bench/engine_speed.py --baseline a0b5733 --repeats 5 --rounds 10 --path vectorized

A baseline must know the `vectorize` key (from 2026-11-26 on; docs/results/engine_speed.md compared
against an earlier commit, with the whole run's time).

The baseline is checked out into a temporary git worktree (removed afterwards); both run the
same config through their own `fedal simulate`. Prints each run's s/round, the medians and the
ratio after / before. Writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fedal import procs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROBE = r"""
import json, sys, time, torch
from fedal.sim import load_config, simulate

torch.set_num_threads(1)
cfg = load_config(None, json.loads(sys.argv[1]))
simulate(load_config(None, {**json.loads(sys.argv[1]), "rounds": 1}))  # warm-up: data cache, imports
t0 = time.perf_counter()
res = simulate(cfg)  # the rounds' own wall time: building the clients and the results are not a round's
walls = [r.get("wall_s") for r in res["rounds"]]
whole = all(w is not None for w in walls)  # (older code: the whole run's time, its build included)
print(json.dumps({"s_per_round": (sum(walls) if whole else time.perf_counter() - t0) / len(walls)}))
"""


def timed(tree: Path, config: dict) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(config)], cwd=tree, env=env, capture_output=True,
                         text=True, timeout=3600, preexec_fn=procs.dies_with_this_process())  # ends with the bench
    if out.returncode != 0:  # say why (e.g. the baseline needs a package this venv lacks), not just that it failed
        tail = "\n".join(out.stderr.strip().splitlines()[-8:])
        raise SystemExit(f"engine_speed: the run in {tree} failed (exit {out.returncode}):\n{tail}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["s_per_round"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git commit to compare against")
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--path", choices=("per-client", "vectorized"), default="per-client",
                    help="the simulation path both sides run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    # evaluated once, with the last round (its time counts); the path pinned, as a simulation's default changed (per
    # client before 2026-11-26, stacked since): a baseline must know the `vectorize` key
    config = {"strategy": "fedal", "dataset": "mnist1d", "clients": args.clients, "rounds": args.rounds, "tau": 5,
              "seed": 0, "models": ["mlp", "cnn1d", "cnn1d_wide"], "threads": 1, "eval_every": args.rounds,
              "vectorize": args.path == "vectorized"}
    # SIGTERM/SIGHUP as Ctrl-C: the worktree is removed and the temporary folder with it
    with procs.stop_signals_interrupt(), tempfile.TemporaryDirectory(prefix="fedal-baseline-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.baseline], cwd=REPO, check=True)
        try:
            runs: dict[str, list[float]] = {"before": [], "after": []}
            for i in range(args.repeats):
                for label, tree in (("before", base), ("after", REPO)) if i % 2 == 0 else (("after", REPO), ("before", base)):
                    runs[label].append(timed(tree, config))
                    print(f"{label:6s} {runs[label][-1]:.4f} s/round", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=False)
    before, after = statistics.median(runs["before"]), statistics.median(runs["after"])
    summary = {"config": config, "baseline": args.baseline, "runs": runs, "median_before_s": before,
               "median_after_s": after, "ratio_after_over_before": after / before}
    print(f"median s/round: before {before:.4f}, after {after:.4f}, after/before {after / before:.3f}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
