"""Bytes an edge agent writes to its workspace (SD-card wear), per round and per phase, for each
zoo model: durability `phase` (a checkpoint after every task, the behaviour before the journal)
and `journal` (a checkpoint per round + an fsync'd journal record per task), side by side.

One federation per (dataset, model), in process on the round engine, every client running that
model; client c00 runs inside two agents at once, one per durability, each on its own workspace
and built identically: every task envelope the engine sends c00 goes through both agents' task
path (decode, session, durable writes) and both must answer it with the very same bytes. The
bytes are counted twice: by the agent (what it hands to write(2) for each file) and by the
kernel (/proc/self/io `wchar` around each agent's call; this process writes nothing else then).
Rounds after the first are reported (the first also holds the join's checkpoint).

The datasets: mnist1d and digits are the real ones; the other image datasets are their input
shapes with random pixels (their files are not needed: what is written depends only on shapes:
model, optimizer and references in the checkpoint, the public batch's indices and logits in the
tasks). Goal (journal): bytes per FedAL round <= 1.2 x one checkpoint + the round's task bytes.

    python bench/agent_io.py                     # writes docs/results/agent_io.{md,json}
    python bench/agent_io.py --only mnist1d:mlp --out /tmp/io
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable from a checkout without an install, like the other benchmarks
    sys.path.insert(0, str(REPO))

from edge_agent.agent import Agent  # noqa: E402
from edge_agent.config import AgentConfig  # noqa: E402
from fedal.data import ArrayDataset, build_federated  # noqa: E402
from fedal.engine.inprocess import in_process_engine  # noqa: E402
from fedal.models import build_model, count_parameters, models_for_input  # noqa: E402
from fedal.protocol import encode  # noqa: E402
from fedal.sim.runner import client_ids, client_seed  # noqa: E402
from fedal.strategies import ServerContext, StrategyParams, get_strategy  # noqa: E402

GOAL = 1.2
# per dataset: input shape, classes, whether the real data is used (else random pixels of that shape)
DATASETS = {"mnist1d": ((40,), 10, True), "digits": ((1, 8, 8), 10, True),
            "mnist": ((1, 28, 28), 10, False), "cifar10": ((3, 32, 32), 10, False)}
MAX_PUBLIC = {"digits": 500}  # 1797 samples in all: room left for the clients
HOSTED = "c00"


def wchar() -> int:
    """Bytes this process has passed to write(2) and the like, as the kernel counts them."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("wchar:"))


def federation(strategy: str, dataset: str, model: str, clients: int, samples: int, public_size: int, tau: int,
               seed: int):
    """(server, client halves, per-client test sets) as `fedal simulate` builds them."""
    public_size = min(public_size, MAX_PUBLIC.get(dataset, public_size))
    spec = get_strategy(strategy)
    params = StrategyParams(tau=tau).resolve(spec.preset)  # what a run config with only tau set resolves to
    shape, k, real = DATASETS[dataset]
    if real:
        data = build_federated(dataset, clients, samples_per_client=samples, public_size=public_size, seed=seed)
        trains, public_x, test = data.clients, data.public_x, data.test
    else:
        rng = np.random.default_rng(seed)

        def synth(n: int, name: str) -> ArrayDataset:
            return ArrayDataset(rng.normal(size=(n, *shape)).astype(np.float32),
                                rng.integers(0, k, n).astype(np.int64), k, name)

        trains = [synth(samples, f"c{i}") for i in range(clients)]
        public_x, test = synth(public_size, "public").x, synth(200, "test")
    ids = client_ids(clients)
    halves = {}
    for i, cid in enumerate(ids):
        torch.manual_seed(client_seed(seed, i))
        net = build_model(model, shape, k)
        halves[cid] = spec.client(cid, net, trains[i], public_x if spec.uses_public_set else None, params,
                                  seed=client_seed(seed, i))
    server = spec.server(params, ids, ServerContext(num_classes=k, public_size=len(public_x), seed=seed))
    return spec, server, halves, {cid: (test, None) for cid in ids}


class SideBySide:
    """The engine's session for the hosted client: each task through both agents."""

    def __init__(self, agents: dict[str, Agent]):
        self.agents = agents
        self.kernel: Counter[tuple[str, int, str]] = Counter()  # (durability, round, phase) -> wchar delta
        self.task_bytes: Counter[tuple[int, str]] = Counter()
        self.tasks: Counter[int] = Counter()  # per round

    def on_task(self, task):
        payload = encode(task)
        rnd, phase = task.meta.get("round"), task.phase
        self.task_bytes[(rnd, phase)] += len(payload)
        self.tasks[rnd] += 1
        wires = {}
        for name, agent in self.agents.items():
            before = wchar()
            wires[name] = agent.apply_task(payload)
            self.kernel[(name, rnd, phase)] += wchar() - before
        first, *rest = wires.values()
        if any((w and w.payload) != (first and first.payload) for w in rest):
            raise AssertionError(f"the agents answered task {phase} r{rnd} differently")
        return first


def measure(strategy: str, dataset: str, model: str, args, workdir: Path) -> dict:
    spec, server, halves, tests = federation(strategy, dataset, model, args.clients, args.samples, args.public_size,
                                             args.tau, args.seed)
    twin = federation(strategy, dataset, model, args.clients, args.samples, args.public_size, args.tau,
                      args.seed)[2][HOSTED]
    agents = {}
    for durability, client in (("phase", twin), ("journal", halves[HOSTED])):
        ws = workdir / f"{dataset}-{model}-{durability}"
        ws.mkdir(parents=True)
        agents[durability] = Agent(AgentConfig(client_id=HOSTED, run_id="sim", model=model, data_file=ws / "unused.npz",
                                               workspace=ws, durability=durability))
        agents[durability].test = tests[HOSTED][0]  # evaluation tasks are part of its rounds
        agents[durability].host(client, "sim")
    engine = in_process_engine(server, halves, phase_kinds=spec.phases, rounds=args.rounds, eval_every=1, tests=tests)
    side = SideBySide(agents)
    engine.transport.sessions[HOSTED] = side
    t0 = time.perf_counter()
    for r in range(args.rounds):
        engine.run_round(r)
    wall = time.perf_counter() - t0
    measured = list(range(1, args.rounds))  # round 0 also holds the join's checkpoint
    ckpt = agents["journal"].ckpt_path.stat().st_size
    per_round: dict[str, dict] = {}
    for name, agent in agents.items():
        by_round = defaultdict(int)
        by_phase: Counter[str] = Counter()
        by_kind: Counter[str] = Counter()
        for (rnd, phase, kind), n in agent.written.items():
            if rnd in measured:
                by_round[rnd] += n
                by_phase[phase] += n
                by_kind[kind] += n
        kernel = sum(n for (d, rnd, _), n in side.kernel.items() if d == name and rnd in measured)
        per_round[name] = {
            "bytes_per_round": max(by_round[r] for r in measured),
            "mean_bytes_per_round": sum(by_round.values()) / len(measured),
            "kernel_wchar_per_round": kernel / len(measured),
            "by_phase_per_round": {p: n / len(measured) for p, n in sorted(by_phase.items())},
            "by_file_per_round": {f: n / len(measured) for f, n in sorted(by_kind.items())},
        }
    task_bytes = max(sum(n for (rnd, _), n in side.task_bytes.items() if rnd == r) for r in measured)
    journal = per_round["journal"]["bytes_per_round"]
    return {
        "dataset": dataset, "model": model, "parameters": count_parameters(halves[HOSTED].model),
        "checkpoint_bytes": ckpt, "task_bytes_per_round": task_bytes,
        "tasks_per_round": max(side.tasks[r] for r in measured),
        "phase": per_round["phase"], "journal": per_round["journal"],
        "journal_over_goal_base": journal / (ckpt + task_bytes),
        "phase_over_journal": per_round["phase"]["bytes_per_round"] / journal,
        "within_goal": journal <= GOAL * ckpt + task_bytes,
        "wall_s": round(wall, 2),
    }


def fmt(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Bytes an agent writes to its workspace (bench/agent_io.py)",
        "",
        f"{s['strategy']}, {s['clients']} clients, tau = {s['tau']}, public set {s['public_size']} (digits: at most "
        f"{MAX_PUBLIC['digits']}), "
        f"{s['samples']} samples per client, evaluation every round; rounds 2..{s['rounds']} measured (the first "
        "also holds the join's checkpoint), the largest round reported. Both durabilities host the same client "
        "in the same run and answered every task with identical bytes. Per round, by the agent's count "
        "(the kernel's wchar in brackets). Goal (journal): <= "
        f"{GOAL} x one checkpoint + the round's task bytes. mnist1d and digits are the real data; "
        f"{', '.join(d for d, (_s, _k, real) in DATASETS.items() if not real)}: their input shapes with random pixels "
        "(the bytes depend only on shapes).",
        "",
        "| dataset | model | params | one checkpoint | tasks / round (bytes) | phase: bytes / round | "
        "journal: bytes / round | journal / (checkpoint + tasks) | phase / journal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['dataset']} | {r['model']} | {r['parameters']:,} | {fmt(r['checkpoint_bytes'])} | "
            f"{r['tasks_per_round']} ({fmt(r['task_bytes_per_round'])}) | {fmt(r['phase']['bytes_per_round'])} "
            f"({fmt(r['phase']['kernel_wchar_per_round'])}) | {fmt(r['journal']['bytes_per_round'])} "
            f"({fmt(r['journal']['kernel_wchar_per_round'])}) | **{r['journal_over_goal_base']:.3f}** "
            f"{'ok' if r['within_goal'] else 'OVER'} | {r['phase_over_journal']:.1f}x |")
    phases = sorted({p for r in report["results"] for d in ("phase", "journal") for p in r[d]["by_phase_per_round"]})
    lines += ["", "Per phase (bytes per round; phase / journal):", "",
              "| dataset | model | " + " | ".join(phases) + " |", "|---|---|" + "---|" * len(phases)]
    for r in report["results"]:
        cells = [f"{fmt(r['phase']['by_phase_per_round'].get(p, 0))} / {fmt(r['journal']['by_phase_per_round'].get(p, 0))}"
                 for p in phases]
        lines.append(f"| {r['dataset']} | {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", f"Machine: {report['machine']}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="fedal")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--samples", type=int, default=200, help="private samples per client")
    ap.add_argument("--public-size", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", action="append", default=[], metavar="DATASET:MODEL", help="measure only these (repeatable)")
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first round is not measured)")
    torch.set_num_threads(1)
    pairs = [(d, m) for d, (shape, _k, _real) in DATASETS.items() for m in models_for_input(shape)]
    if args.only:
        wanted = {tuple(o.split(":", 1)) for o in args.only}
        unknown = wanted - set(pairs)
        if unknown:
            ap.error(f"not in the zoo list: {sorted(unknown)}; choose from {[f'{d}:{m}' for d, m in pairs]}")
        pairs = [p for p in pairs if p in wanted]
    results = []
    with tempfile.TemporaryDirectory(prefix="fedal-agent-io-") as tmp:
        for dataset, model in pairs:
            r = measure(args.strategy, dataset, model, args, Path(tmp))
            results.append(r)
            print(f"{dataset:8s} {model:11s} checkpoint {fmt(r['checkpoint_bytes']):>9s}  phase "
                  f"{fmt(r['phase']['bytes_per_round']):>9s}/round  journal {fmt(r['journal']['bytes_per_round']):>9s}"
                  f"/round  journal/(ckpt+tasks) {r['journal_over_goal_base']:.3f}  ({r['wall_s']} s)", flush=True)
    report = {"settings": {k: getattr(args, k) for k in ("strategy", "clients", "rounds", "tau", "samples",
                                                          "public_size", "seed")},
              "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}",
              "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent_io.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "agent_io.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(r["within_goal"] for r in results) or args.strategy != "fedal" else 1


if __name__ == "__main__":
    sys.exit(main())
