"""Seconds per FedAL round in simulation: the per-client path, vectorized clients, and two plain
PyTorch loops doing the same math (the floors: per client, and stacked), measured side by side in
one run.

    python bench/sim_speed.py                       # 10 clients, MNIST-1D, mlp/cnn1d/cnn1d_wide, tau 5
    python bench/sim_speed.py --rounds 10 --clients 20

One process, one torch thread. The three variants start from the same clients (same seeds,
data and weights) and take turns round by round, in rotating order, so load from other
processes falls on all of them alike; each round is timed on its own and the ratios are medians
of the per-round (paired) ratios. No evaluation phase runs in the timed rounds.

The floor is FedAL's round written as a researcher would without the toolkit: the same models,
losses, discriminator step and per-sample gradients, one client after another, with the
less-forgetting references refreshed by copying weights into preallocated modules; no round
engine, no session, no wire envelope. The plain stacked loop is the same loop with the clients of
one architecture stacked as the vectorized path stacks them (fedal/models/stacked.py, a fused
Adam): what vectorizing can reach at best, with nothing around the arithmetic. Writes
docs/results/sim_speed.md and .json.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedal.models.stacked import stacked_function
from fedal.sim import build_run, load_config, simulated_engine
from fedal.strategies import optim
from fedal.strategies.discriminator import Discriminator, discriminator_input, per_sample_adversarial_grad
from fedal.strategies.frozen import frozen_copy
from fedal.strategies.losses import cross_entropy, kl_to_student
from fedal.strategies.public_rows import public_rows
from fedal.strategies.stacked import layout_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402
from report_text import write_results  # noqa: E402

VARIANTS = ("per-client", "vectorized", "plain loop", "plain stacked loop")


class PlainFedAL:
    """FedAL (Algorithm 1) as one loop over plain torch objects: the bench's floor."""

    def __init__(self, clients: dict, num_classes: int, seed: int):
        self.clients = list(clients.values())
        self.p = self.clients[0].params
        torch.manual_seed(seed)
        self.disc = Discriminator(num_classes, len(self.clients), self.p.disc_hidden)
        self.disc_opt = optim.Adam(self.disc.parameters(), lr=self.p.disc_lr)
        self.ref_loc = [frozen_copy(c.model) for c in self.clients]
        self.ref_glo = [frozen_copy(c.model) for c in self.clients]

    @staticmethod
    def _refresh(ref: torch.nn.Module, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for a, b in zip(ref.parameters(), model.parameters()):
                a.copy_(b)

    def round(self, r: int) -> None:
        p, n = self.p, len(self.clients)
        for c, ref in zip(self.clients, self.ref_loc):  # stage 1: tau local steps
            self._refresh(ref, c.model)
            c.model.train()
            for _ in range(p.tau):
                idx = torch.randperm(len(c.y_train), generator=c.generator)[: p.batch_size]
                x = c.x_train[idx]
                logits = c.model(x)
                with torch.no_grad():
                    target = ref(x)
                loss = F.cross_entropy(logits, c.y_train[idx]) + p.lambda_lf_loc * kl_to_student(target, logits, p.temperature_lf)
                c.optimizer.zero_grad()
                loss.backward()
                c.optimizer.step()
        for c, ref in zip(self.clients, self.ref_glo):
            self._refresh(ref, c.model)
        public = self.clients[0].public_x
        for i in range(p.tau):  # stage 2: tau transfer iterations
            idx = torch.from_numpy(public_rows(0, r, i, len(public), p.public_batch_size))
            x = public[idx]
            f = [c.model(x) for c in self.clients]
            rows = torch.cat([fi.detach() for fi in f])
            who = torch.arange(n).repeat_interleave(len(idx))
            out = self.disc(discriminator_input(rows, p.temperature_disc))
            d_loss = F.cross_entropy(out, who)
            self.disc_opt.zero_grad()
            d_loss.backward()
            self.disc_opt.step()
            g = per_sample_adversarial_grad(self.disc, rows, who, p.temperature_disc).view(n, len(idx), -1)
            fbar = rows.view(n, len(idx), -1).mean(dim=0)
            for k, (c, ref) in enumerate(zip(self.clients, self.ref_glo)):
                target = (n * fbar - f[k].detach()) / (n - 1)
                with torch.no_grad():
                    ref_out = ref(x)
                loss = p.lambda_kd * kl_to_student(target, f[k], p.temperature_kd) \
                    + p.lambda_lf_glo * kl_to_student(ref_out, f[k], p.temperature_lf)
                c.optimizer.zero_grad()
                (loss + (f[k] * (p.lambda_adv * g[k] / len(idx))).sum()).backward()
                c.optimizer.step()


class PlainStackedFedAL(PlainFedAL):
    """The same loop with the clients of one architecture stacked (fedal/models/stacked.py, one
    fused Adam per group): the floor of the vectorized path, as PlainFedAL is the per-client one."""

    def __init__(self, clients: dict, num_classes: int, seed: int):
        super().__init__(clients, num_classes, seed)
        by_layout: dict[tuple, list[int]] = {}
        for k, c in enumerate(self.clients):
            by_layout.setdefault(layout_key(c.model), []).append(k)
        self.groups = []
        for members in by_layout.values():
            models = [self.clients[k].model for k in members]
            names = [n for n, _ in models[0].named_parameters()]
            params = {n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]).requires_grad_(True)
                      for n in names}
            self.groups.append({
                "members": members, "params": params, "forward": stacked_function(models[0]),
                "opt": optim.Adam(list(params.values()), lr=self.p.lr, fused=True),
                "ref_loc": {n: v.detach().clone() for n, v in params.items()},
                "ref_glo": {n: v.detach().clone() for n, v in params.items()},
            })

    @staticmethod
    def _step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        opt.zero_grad()
        loss.backward()
        opt.step()

    def round(self, r: int) -> None:
        p, n = self.p, len(self.clients)
        for g in self.groups:  # stage 1: tau local steps, every client of the group at once
            members = [self.clients[k] for k in g["members"]]
            with torch.no_grad():
                for name, v in g["params"].items():
                    g["ref_loc"][name].copy_(v)
            for _ in range(p.tau):
                idx = [torch.randperm(len(c.y_train), generator=c.generator)[: p.batch_size] for c in members]
                x = torch.stack([c.x_train[i] for c, i in zip(members, idx)])
                y = torch.stack([c.y_train[i] for c, i in zip(members, idx)])
                logits = g["forward"](g["params"], x)
                with torch.no_grad():
                    target = g["forward"](g["ref_loc"], x)
                loss = cross_entropy(logits, y) + p.lambda_lf_loc * kl_to_student(target, logits, p.temperature_lf)
                self._step(g["opt"], loss.sum())
            with torch.no_grad():
                for name, v in g["params"].items():
                    g["ref_glo"][name].copy_(v)
        public = self.clients[0].public_x
        order = torch.tensor([k for g in self.groups for k in g["members"]])
        for i in range(p.tau):  # stage 2: tau transfer iterations
            idx = torch.from_numpy(public_rows(0, r, i, len(public), p.public_batch_size))
            x = public[idx]
            f = [g["forward"](g["params"], x.expand(len(g["members"]), *x.shape)) for g in self.groups]
            rows = torch.cat([fg.detach().flatten(0, 1) for fg in f])
            who = order.repeat_interleave(len(idx))
            out = self.disc(discriminator_input(rows, p.temperature_disc))
            self._step(self.disc_opt, F.cross_entropy(out, who))
            grad = per_sample_adversarial_grad(self.disc, rows, who, p.temperature_disc).view(n, len(idx), -1)
            fbar = rows.view(n, len(idx), -1).mean(dim=0)
            start = 0
            for g, fg in zip(self.groups, f):
                k = len(g["members"])
                target = (n * fbar - fg.detach()) / (n - 1)
                with torch.no_grad():
                    ref_out = g["forward"](g["ref_glo"], x.expand(k, *x.shape))
                loss = p.lambda_kd * kl_to_student(target, fg, p.temperature_kd) \
                    + p.lambda_lf_glo * kl_to_student(ref_out, fg, p.temperature_lf)
                adv = p.lambda_adv * grad[start:start + k] / len(idx)
                self._step(g["opt"], loss.sum() + (fg * adv).sum())
                start += k


def build(config: dict, vectorize: bool):
    cfg = load_config(None, {**config, "vectorize": vectorize, "rounds": 10_000, "eval_every": 10_000}).resolved()
    data, clients, server = build_run(cfg)
    return cfg, data, clients, server


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=at_least(2), default=10)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--rounds", type=at_least(2), default=40, help="timed rounds per variant")
    ap.add_argument("--warmup", type=at_least(0), default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default="mlp,cnn1d,cnn1d_wide", help="the zoo's MNIST-1D models, round-robin")
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    config = {"strategy": "fedal", "dataset": "mnist1d", "clients": args.clients, "alpha": 2.0,
              "samples_per_client": 700, "models": args.models.split(","), "seed": args.seed,
              "threads": 1, "strategy_params": {"tau": args.tau}}

    runners = {}
    for variant in VARIANTS:
        cfg, data, clients, server = build(config, vectorize=variant == "vectorized")
        if variant == "plain loop":
            runners[variant] = PlainFedAL(clients, data.num_classes, args.seed).round
        elif variant == "plain stacked loop":
            runners[variant] = PlainStackedFedAL(clients, data.num_classes, args.seed).round
        else:
            runners[variant] = simulated_engine(cfg, data, clients, server).run_round
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.warmup + args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            t0 = time.perf_counter()
            runners[variant](r)
            if r >= args.warmup:
                times[variant].append(time.perf_counter() - t0)
        print(f"round {r}: " + ", ".join(f"{v} {times[v][-1]:.3f}s" for v in VARIANTS if times[v]), file=sys.stderr)

    med = {v: statistics.median(t) for v, t in times.items()}
    pairs = {"per-client / plain loop": ("per-client", "plain loop"),
             "vectorized / per-client": ("vectorized", "per-client"),
             "vectorized / plain loop": ("vectorized", "plain loop"),
             "plain stacked loop / per-client": ("plain stacked loop", "per-client"),
             "vectorized / plain stacked loop": ("vectorized", "plain stacked loop")}
    per_round = {k: [a / b for a, b in zip(times[x], times[y])] for k, (x, y) in pairs.items()}
    ratio = {k: statistics.median(v) for k, v in per_round.items()}
    quartiles = {k: statistics.quantiles(v, n=4)[::2] for k, v in per_round.items()}
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    lines = [
        "# Simulation speed: per-client vs vectorized vs a plain PyTorch loop",
        "",
        f"Written by `python bench/sim_speed.py` ({args.rounds} timed rounds per variant after {args.warmup} warm-up "
        f"rounds, taking turns round by round in one process on one torch thread). FedAL, {args.clients} clients, "
        f"MNIST-1D, models {' / '.join(args.models.split(','))} round-robin, 700 samples per client, tau = {args.tau}, "
        "batch 32, public batch 32; no evaluation in the timed rounds.",
        f"Machine: {platform.machine()}, torch {torch.__version__}; 1-min load average at the end: {load}.",
        "",
        "| variant | median s / round | min s / round |",
        "|---|---:|---:|",
        *[f"| {v} | {med[v]:.4f} | {min(times[v]):.4f} |" for v in VARIANTS],
        "",
        "Ratios (medians of the per-round ratios; in brackets their lower and upper quartiles, how much a ratio "
        "moves from round to round):",
        "",
        *[f"- {k}: {v:.2f} ({quartiles[k][0]:.2f}-{quartiles[k][1]:.2f})" for k, v in ratio.items()],
        "",
        "Goals (issue): the per-client path within 10 % of the plain loop (ratio <= 1.10); vectorized <= 0.4x the "
        "per-client path. The plain stacked loop / per-client ratio is as low as a vectorized path built on "
        "these stacked layers can go, with these models on this machine.",
        "",
    ]
    write_results(args.out, "sim_speed", lines, {  # the hand-written reading is kept
        "config": config, "rounds": args.rounds, "warmup": args.warmup, "seconds": times, "median": med,
        "ratios": ratio, "ratio_quartiles": quartiles, "machine": platform.machine(), "torch": torch.__version__,
        "per_round_mean": {v: float(np.mean(t)) for v, t in times.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
