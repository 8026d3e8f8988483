"""The FedAL paper's black-box baselines on MNIST-1D: FedAL, FedMD, FedProto (the original and the
paper's public-set adaptation), CFD and MHAT, FCCL, FCCL+, FD and Local-only, at per-client
Dirichlet alpha 5, 2 and 1 (bench/accuracy.py's settings), with the same number of local SGD
steps on the private data per client for every method (fedal.txt section VI, Tables IV-VII).

The paper has no MNIST-1D numbers, so the comparison is of the ORDERING of the methods: its
CINIC-10 (Table V), SVHN and CIFAR-10 (Tables VI, VII: FD) columns at the same alpha, and its
CelebA columns (Table IV, N = 20 / 50 / 100) against our mean over the alphas, stand beside our
rows, with the pairs of methods whose order agrees counted. Writes
docs/results/accuracy_baselines.md, .json and .png.

    python bench/accuracy.py --suite baselines                 # 3 seeds x 3 alphas x 10 methods
    python bench/accuracy_baselines.py --steps 30 --seeds 1 --settings alpha5 --out /tmp/quick   # smoke run

Each run's results JSON (its resolved config included) is kept in --cache, so an interrupted
benchmark resumes; a cached run whose config no longer matches this file's is refused.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy  # noqa: E402  (the FedAL suite: its settings, tau and helpers)
from accuracy import acc_at, mean_std  # noqa: E402
from cli_args import at_least  # noqa: E402
from sim_runs import mean_curve, run_simulations, save_figure  # noqa: E402

from fedal.sim.config import SAME_WIDTH_MODELS  # noqa: E402
from fedal.strategies import get_strategy  # noqa: E402

STRATEGIES = ("fedal", "fedmd", "fedproto", "fedproto-public", "cfd", "mhat", "fccl", "fccl-plus", "fd", "local")
SETTINGS: dict[str, dict[str, Any]] = {s: accuracy.SETTINGS[s] for s in ("alpha5", "alpha2", "alpha1")}
# strategy_params each method runs with: its preset's values written out, except where noted
PARAMS: dict[str, dict[str, int]] = {
    "fedal": {"tau": accuracy.TAU["fedal"]},
    "fedmd": {"tau": accuracy.TAU["fedmd"]},
    "fedproto": {"local_epochs": 1},  # the preset: one pass over the private data per round
    "fedproto-public": {"tau": 1},  # the preset: the paper runs its FedProto with tau = 1
    "cfd": {"tau": 5},
    "mhat": {"tau": 5},
    "fccl": {"tau": 5, "local_epochs": 0},  # fccl_pretrain_epochs: from the budget (pretrain_epochs)
    "fccl-plus": {"tau": 5, "local_epochs": 0},
    "fd": {},  # tau: FD_TAU, overriding the preset's 250
    "local": {"tau": accuracy.TAU["local"]},
}
# What is overridden against the strategy's preset, and why (printed in the report).
OVERRIDES = {
    "fccl": "fccl_pretrain_epochs (preset 40, = 880 steps at 700 samples, more than the whole budget) set so that "
            "pretraining takes about {share} of the budget",
    "fd": "tau = min({fd_tau}, budget) instead of the preset's 250 (the FD paper's n = 250 iterations per global "
          "round): 600 steps then hold 12 exchanges, as many as the FedAL paper's 3000-iteration FD runs had",
}
FD_TAU = 50
FCCL_PRETRAIN_SHARE = 1 / 6
POINTS = 30  # evaluations per run, as bench/accuracy.py

# The FedAL paper's numbers (fedal.txt), final accuracy mean and std, by the paper's method names.
PAPER_NAMES = {"FedAL": "fedal", "FedMD": "fedmd", "FedProto": "fedproto-public", "CFD": "cfd", "FCCL": "fccl",
               "FCCL+": "fccl-plus", "FD": "fd"}
PAPER_TABLES: list[dict[str, Any]] = [
    {"table": "V", "dataset": "CINIC-10", "iterations": "10,000 iterations", "columns": {
        "alpha5": {"FedProto": (0.43, 0.02), "FedMD": (0.54, 0.02), "CFD": (0.49, 0.04), "FCCL": (0.37, 0.05),
                   "FCCL+": (0.41, 0.05), "FedAL": (0.56, 0.02)},
        "alpha2": {"FedProto": (0.34, 0.03), "FedMD": (0.43, 0.02), "CFD": (0.38, 0.03), "FCCL": (0.29, 0.04),
                   "FCCL+": (0.31, 0.03), "FedAL": (0.45, 0.03)},
        "alpha1": {"FedProto": (0.25, 0.02), "FedMD": (0.31, 0.04), "CFD": (0.29, 0.01), "FCCL": (0.25, 0.03),
                   "FCCL+": (0.27, 0.01), "FedAL": (0.35, 0.05)}}},
    {"table": "VI", "dataset": "SVHN", "iterations": "3000 / 5000 / 7000 iterations at alpha 5 / 2 / 1", "columns": {
        "alpha5": {"FD": (0.16, 0.01), "FedMD": (0.76, 0.006), "FedAL": (0.78, 0.003)},
        "alpha2": {"FD": (0.14, 0.005), "FedMD": (0.73, 0.0009), "FedAL": (0.75, 0.0003)},
        "alpha1": {"FD": (0.12, 0.004), "FedMD": (0.71, 0.0008), "FedAL": (0.75, 0.0009)}}},
    {"table": "VII", "dataset": "CIFAR-10", "iterations": "3000 / 5000 / 7000 iterations at alpha 5 / 2 / 1",
     "columns": {
        "alpha5": {"FD": (0.15, 0.02), "FedProto": (0.38, 0.009), "FedMD": (0.49, 0.02), "FedAL": (0.51, 0.008)},
        "alpha2": {"FD": (0.17, 0.007), "FedProto": (0.28, 0.01), "FedMD": (0.40, 0.02), "FedAL": (0.44, 0.01)},
        "alpha1": {"FD": (0.17, 0.02), "FedProto": (0.22, 0.02), "FedMD": (0.35, 0.01), "FedAL": (0.41, 0.01)}}},
    {"table": "IV", "dataset": "CelebA", "iterations": "10,000 iterations, LEAF's partition by identity", "columns": {
        "N = 20": {"FedProto": (0.51, 0.005), "FedMD": (0.51, 0.02), "CFD": (0.49, 0.09), "FCCL": (0.49, 0.08),
                   "FCCL+": (0.53, 0.10), "FedAL": (0.56, 0.03)},
        "N = 50": {"FedProto": (0.53, 0.02), "FedMD": (0.64, 0.01), "CFD": (0.53, 0.15), "FCCL": (0.57, 0.13),
                   "FCCL+": (0.54, 0.13), "FedAL": (0.69, 0.02)},
        "N = 100": {"FedProto": (0.52, 0.008), "FedMD": (0.66, 0.01), "CFD": (0.55, 0.17), "FCCL": (0.56, 0.15),
                    "FCCL+": (0.54, 0.13), "FedAL": (0.70, 0.01)}}},
]
OUR_MEAN = "mean over our settings"  # what Table IV's columns (not indexed by alpha) are compared with


# -- the budget -----------------------------------------------------------------------------------

def steps_per_epoch(n: int, batch_size: int) -> int:
    """Minibatches of one pass over n rows, as fedal.strategies.local.local_batches cuts them (a
    last batch of one row joins the one before)."""
    chunks = -(-n // batch_size)
    return chunks - 1 if chunks > 1 and n % batch_size == 1 else chunks


def counted(strategy: str, params: dict, rounds: int, n: int) -> dict:
    """Optimizer steps one client of n private rows takes, from a (resolved) strategy_params:
    `local` ones on the private data (pretraining included), the budget every method gets, and
    `public` ones on public rows (transfer / distillation / collaboration), which are not."""
    b = int(params.get("batch_size") or 32)
    tau = int(params.get("tau") or 1)
    epochs = int(params.get("local_epochs") or 0)
    per_round = epochs * steps_per_epoch(n, b) if epochs > 0 else tau
    pretrain = int(params.get("fccl_pretrain_epochs") or 0) * steps_per_epoch(n, b) if strategy == "fccl" else 0
    public = tau if get_strategy(strategy).uses_public_set else 0
    return {"pretrain": pretrain, "per_round": per_round, "rounds": rounds, "local": pretrain + rounds * per_round,
            "public_per_round": public, "public": rounds * public}


def plan(strategy: str, steps: int, samples: int) -> tuple[dict, int]:
    """(strategy_params, rounds) giving each client `steps` local steps, or as close below as a
    whole number of rounds allows (at least one round)."""
    params = dict(PARAMS[strategy])
    if strategy == "fd":
        params["tau"] = min(FD_TAU, steps)
    if strategy == "fccl":
        spe = steps_per_epoch(samples, 32)
        params["fccl_pretrain_epochs"] = max(1, round(steps * FCCL_PRETRAIN_SHARE / spe))
    c = counted(strategy, params, 0, samples)
    return params, max(1, (steps - c["pretrain"]) // c["per_round"])


def models_of(strategy: str, setting: str) -> list[str]:
    """The setting's heterogeneous models where the method allows them; one feature width
    (FedProto) or one model (parameter averaging) where it does not."""
    spec, models = get_strategy(strategy), list(SETTINGS[setting]["models"])
    if spec.homogeneous_models:
        return models[:1]
    if spec.same_feature_dim:
        return list(SAME_WIDTH_MODELS["mnist1d"])
    return models


def run_config(setting: str, strategy: str, seed: int, steps: int) -> dict:
    params, rounds = plan(strategy, steps, SETTINGS[setting]["samples_per_client"])
    return {"strategy": strategy, "dataset": "mnist1d", "partition": "dirichlet-client", "public_size": 1000,
            "rounds": rounds, "seed": seed, "eval_every": max(1, rounds // POINTS), "threads": 1,
            **SETTINGS[setting], "models": models_of(strategy, setting), "strategy_params": params}


def budget_of(res: dict) -> dict:
    """The steps a finished run took, read from its resolved config and its clients' data sizes."""
    cfg, sizes = res["config"], res["data"]["client_sizes"]
    per_client = [counted(cfg["strategy"], cfg["strategy_params"], cfg["rounds"], n) for n in sizes]
    low, high = min(per_client, key=lambda c: c["local"]), max(per_client, key=lambda c: c["local"])
    return {**high, "local_min": low["local"]}


def steps_curve(res: dict) -> list[tuple[int, float]]:
    """(local steps per client, mean client accuracy) at each evaluation; pretraining counts."""
    b = budget_of(res)
    return [(b["pretrain"] + r["round"] * b["per_round"], r["mean_acc"]) for r in res["rounds"] if "mean_acc" in r]


def stale(res: dict, config: dict) -> list[str]:
    """The fields of `config` a cached result was not run with (a cache from other settings)."""
    got = res["config"]
    out = [k for k in ("strategy", "rounds", "seed", "alpha", "clients", "samples_per_client", "models")
           if got.get(k) != config[k]]
    return out + [f"strategy_params.{k}" for k, v in config["strategy_params"].items()
                  if got["strategy_params"].get(k) != v]


# -- the comparison with the paper ----------------------------------------------------------------

def ordering(scores: dict[str, float]) -> list[str]:
    return sorted(scores, key=lambda k: -scores[k])


def compare(ours: dict[str, float], paper: dict[str, tuple[float, float]], names: dict[str, str]) -> dict:
    """Pairwise agreement of our order with the paper's over the methods both have (paper name ->
    our strategy in `names`); pairs the paper ties are left out, pairs we tie count as ties."""
    both = [p for p in paper if names.get(p) in ours]
    agree, disagree, ties, paper_ties = [], [], [], []
    for a, b in itertools.combinations(both, 2):
        dp = paper[a][0] - paper[b][0]
        do = ours[names[a]] - ours[names[b]]
        pair = (a, b) if dp > 0 else (b, a)  # (the paper's better, the paper's worse)
        if dp == 0:
            paper_ties.append((a, b))
        elif do == 0:
            ties.append(pair)
        elif (dp > 0) == (do > 0):
            agree.append(pair)
        else:
            disagree.append(pair)
    n = len(agree) + len(disagree) + len(ties)
    return {"methods": both, "paper_order": ordering({p: paper[p][0] for p in both}),
            "our_order": ordering({p: ours[names[p]] for p in both}), "agree": agree, "disagree": disagree,
            "our_ties": ties, "paper_ties": paper_ties, "pairs": n,
            "kendall_tau": (len(agree) - len(disagree)) / n if n else None}


def comparisons(summary: dict) -> list[dict]:
    """Every paper column against our final means: alpha-indexed columns against our run at that
    alpha, Table IV's (N clients on CelebA) against our mean over the settings run; each also with
    MHAT in CFD's place where the column has CFD (the paper: "CFD is the same as MHAT")."""
    finals = {s: {st: statistics.mean(v["final"]) for st, v in per.items()} for s, per in summary.items()}
    everywhere = [st for st in STRATEGIES if finals and all(st in f for f in finals.values())]
    mean_all = {st: statistics.mean(f[st] for f in finals.values()) for st in everywhere}
    out = []
    for table in PAPER_TABLES:
        for column, paper in table["columns"].items():
            ours = finals.get(column) if column in SETTINGS else (mean_all if len(finals) else None)
            if not ours:
                continue
            variants = [("cfd", PAPER_NAMES)]
            if "CFD" in paper and "mhat" in ours:
                variants.append(("mhat", {**PAPER_NAMES, "CFD": "mhat"}))
            for cfd_as, names in variants:
                c = compare(ours, paper, names)
                if c["pairs"] or c["paper_ties"]:
                    out.append({"table": table["table"], "dataset": table["dataset"], "column": column,
                                "ours": column if column in SETTINGS else OUR_MEAN, "cfd_as": cfd_as, **c})
    return out


def cfd_note(c: dict) -> str:
    return " (MHAT in CFD's place)" if c["cfd_as"] == "mhat" else ""


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


# -- the report -----------------------------------------------------------------------------------

def summarise(results: dict, steps: int, seeds: list[int]) -> tuple[str, dict, list[dict]]:
    lines = [
        "# Accuracy: the FedAL paper's black-box baselines on MNIST-1D",
        "",
        f"Generated by `python bench/accuracy.py --suite baselines` ({len(seeds)} seeds: {seeds}; a budget of {steps}",
        "local SGD steps on the private data per client for every method).",
        "",
        "Settings: bench/accuracy.py's alpha5, alpha2 and alpha1 (generated MNIST-1D, 9,600 train / 2,400 test,",
        "public set |P| = 1000 held out from train, N = 10 clients, per-client Dirichlet, 700 samples per client),",
        "Adam lr 1e-3, batch 32, public batch 32 for every method; each method's own hyperparameters are its",
        "preset's (docs/algorithms.md) except where the budget table says otherwise. Models are assigned",
        "round-robin: mlp, cnn1d, cnn1d_wide where the method allows different models; FedProto and",
        "FedProto-public need one feature width on every client (StrategySpec.same_feature_dim) and run "
        f"{' and '.join(SAME_WIDTH_MODELS['mnist1d'])}",
        "(100 features each), the toolkit's default for them. No method here needs identical models.",
        "Accuracy = each client's model on the common test set, mean over clients; mean ± std over seeds.",
        "",
        "## Budget: how each method's local steps are counted",
        "",
        "A local step is one optimizer step on a minibatch of the client's private data; pretraining counts.",
        "Steps on public rows (FedAL's and FedMD's transfer, FedProto-public's feature matching, CFD's and",
        "MHAT's distillation, FCCL's collaboration) come on top and are not counted, as bench/accuracy.py",
        "counts them. Rounds = (budget − pretraining) // local steps per round, at least 1.",
        "",
        "| method | models | local steps per round | pretraining | rounds | local steps / client | "
        "public steps / round | overrides of the preset |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fmt = {"share": f"1/{round(1 / FCCL_PRETRAIN_SHARE)}", "fd_tau": FD_TAU}
    budgets: dict[str, dict] = {}
    for strategy in STRATEGIES:
        runs = [r for (setting, st), per in results.items() if st == strategy for r in per.values()]
        if not runs:
            continue
        b = budget_of(runs[0])
        p = runs[0]["config"]["strategy_params"]
        how = f"{p['local_epochs']} pass(es) over 700 rows = {b['per_round']}" if (p.get("local_epochs") or 0) > 0 \
            else f"tau = {b['per_round']}"
        pre = f"{p['fccl_pretrain_epochs']} passes = {b['pretrain']}" if b["pretrain"] else "—"
        spent = str(b["local"]) if b["local"] == b["local_min"] else f"{b['local_min']}–{b['local']}"
        note = OVERRIDES.get(strategy, "none").format(**fmt)
        lines.append(f"| {strategy} | {', '.join(runs[0]['config']['models'])} | {how} | {pre} | {b['rounds']} | {spent} | "
                     f"{b['public_per_round']} | {note} |")
        budgets[strategy] = {**b, "models": runs[0]["config"]["models"], "override": note}
    off = {s: b["local"] for s, b in budgets.items() if b["local"] != steps}
    lines.append("")
    if off:
        lines.append("Budget not met exactly (a whole number of rounds): "
                     + ", ".join(f"{s} {n} steps" for s, n in off.items()) + f", against {steps}.")
        lines.append("")

    summary: dict = {}
    for setting, cfg in SETTINGS.items():
        if not any((setting, s) in results for s in STRATEGIES):
            continue
        lines += [
            f"## {setting}: N = {cfg['clients']}, alpha = {cfg['alpha']}",
            "",
            f"| method | final mean acc | final min acc | acc @ {steps // 2} steps | rank | wall s / run |",
            "|---|---|---|---|---|---|",
        ]
        summary[setting] = {}
        for strategy in STRATEGIES:
            runs = results.get((setting, strategy), {})
            if not runs:
                continue
            order = sorted(runs)
            finals = [runs[s]["final"]["mean_acc"] for s in order]
            summary[setting][strategy] = {
                "seeds": order, "final": finals, "min": [runs[s]["final"]["min_acc"] for s in order],
                "half": [acc_at(steps_curve(runs[s]), steps // 2) for s in order],
                "wall_s": [runs[s]["timings"]["wall_seconds"] for s in order], "budget": budget_of(runs[order[0]])}
        means = {st: statistics.mean(v["final"]) for st, v in summary[setting].items()}
        rank = {st: i + 1 for i, st in enumerate(ordering(means))}
        for strategy, v in summary[setting].items():
            v["rank"] = rank[strategy]
            lines.append(f"| {strategy} | {mean_std(v['final'])} | {mean_std(v['min'])} | {mean_std(v['half'])} | "
                         f"{rank[strategy]} of {len(rank)} | {statistics.mean(v['wall_s']):.0f} |")
        lines.append("")

    comps = comparisons(summary)
    lines += paper_section(summary, comps)
    lines += reading(summary, comps)
    return "\n".join(lines), summary, comps


def paper_section(summary: dict, comps: list[dict]) -> list[str]:
    """Our final accuracy beside the paper's, then each column's order and agreement."""
    if not summary:
        return []
    lines = [
        "## Beside the paper (fedal.txt Tables IV–VII)",
        "",
        "The paper has no MNIST-1D: its numbers are other data sets and models (CINIC-10: ResNet18/34;",
        "SVHN: WResNets; CIFAR-10: ResNet18/34; CelebA: a CNN; " + ", ".join(
            f"Table {t['table']} {t['dataset']}: {t['iterations']}" for t in PAPER_TABLES) + "),",
        "so only the ORDER of the methods is compared. Paper names: FedProto is its public-set adaptation",
        "(our fedproto-public; our fedproto, the original, and local have no paper row), CFD is MHAT",
        "(\"CFD is the same as MHAT\"; compared as cfd, and again with mhat in its place). Accuracy in %.",
        "",
    ]
    alpha_tables = [t for t in PAPER_TABLES if set(t["columns"]) <= set(SETTINGS)]
    by_ours = {v: p for p, v in PAPER_NAMES.items()}
    for setting in summary:
        head = " | ".join(f"{t['dataset']} (T. {t['table']})" for t in alpha_tables)
        lines += [f"### {setting}", "", f"| method | ours, MNIST-1D | {head} |",
                  "|---|---" + "|---" * len(alpha_tables) + "|"]
        for strategy, v in summary[setting].items():
            name = "CFD" if strategy == "mhat" else by_ours.get(strategy)
            cells = []
            for t in alpha_tables:
                row = t["columns"][setting].get(name) if name else None
                cells.append(f"{pct(row[0])} ± {pct(row[1])}" if row else "—")
            lines.append(f"| {strategy} | {mean_std(v['final'])} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Order of the methods, column by column", "",
              "Pairs: the pairs of methods both the column and our run have; the paper's ties are left out.",
              "Kendall tau = (agreeing − disagreeing pairs) / pairs.", "",
              "| paper column | ours | paper's order | our order of the same methods | pairs agreeing | Kendall tau |"
              " pairs in the other order (paper's better first) |",
              "|---|---|---|---|---|---|---|"]
    for c in comps:
        ties = f"; paper ties left out: {', '.join('–'.join(p) for p in c['paper_ties'])}" if c["paper_ties"] else ""
        tau = "—" if c["kendall_tau"] is None else f"{c['kendall_tau']:+.2f}"
        lines.append(f"| T. {c['table']} {c['dataset']}, {c['column']}{cfd_note(c)} | {c['ours']} | "
                     f"{' > '.join(c['paper_order'])} | {' > '.join(c['our_order'])} | {len(c['agree'])} of "
                     f"{c['pairs']} | {tau} | {', '.join(' > '.join(p) for p in c['disagree']) or '—'}{ties} |")
    lines += ["", "Table IV (CelebA, N = 20 / 50 / 100 clients, LEAF's natural partition) has no alpha: its columns",
              "are set against our mean final accuracy over the settings run.", ""]
    return lines


def reading(summary: dict, comps: list[dict]) -> list[str]:
    """Computed facts only; what they mean is written by hand after a full run."""
    lines = ["## Reading", "", "Computed from this run (the interpretation is written by hand below it after a full",
             "3-seed run):", ""]
    for setting, per in summary.items():
        means = {st: statistics.mean(v["final"]) for st, v in per.items()}
        order = ordering(means)
        line = f"- {setting}: " + " > ".join(f"{st} {pct(means[st])}" for st in order)
        if "fedal" in per:
            line += f"; FedAL ranks {per['fedal']['rank']} of {len(order)}"
        if "local" in means:
            above = [st for st in order if st != "local" and means[st] > means["local"]]
            line += f"; above Local-only: {', '.join(above) or 'none'}"
        lines.append(line + ".")
    main = [c for c in comps if c["cfd_as"] == "cfd"]
    agree = sum(len(c["agree"]) for c in main)
    pairs = sum(c["pairs"] for c in main)
    if pairs:
        lines.append(f"- Pairs of methods in the paper's order, over all {len(main)} paper columns (CFD as cfd): "
                     f"{agree} of {pairs}.")
        top = [c for c in main if c["our_order"] and c["paper_order"] and c["our_order"][0] == c["paper_order"][0]]
        best = sorted({c["paper_order"][0] for c in main if c["paper_order"]})
        lines.append(f"- The paper's best method of a column is also ours in {len(top)} of {len(main)} columns "
                     f"(the paper's best: {', '.join(best)}).")
        flipped: dict[tuple[str, str], list[str]] = {}
        for c in main:
            for p in c["disagree"]:
                flipped.setdefault(p, []).append(f"T. {c['table']} {c['column']}")
        if flipped:
            lines.append("- Pairs in the other order than the paper's (paper's better first): "
                         + "; ".join(f"{a} > {b} ({', '.join(where)})" for (a, b), where in flipped.items()) + ".")
    if max((len(v["seeds"]) for per in summary.values() for v in per.values()), default=0) < 2:
        lines.append("- One seed only: no spread, so no difference here can be told from seed noise.")
    return lines


# What follows this line in the report is written by hand and kept when the benchmark rewrites it.
MARKER = "<!-- hand-written below this line; kept when bench/accuracy_baselines.py rewrites the file -->"


def plot(results: dict, seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in SETTINGS if any((s, st) in results for st in STRATEGIES)]
    fig, axes = plt.subplots(1, len(settings), figsize=(4.8 * len(settings), 4.0), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, setting in zip(axes[0], settings):
        for i, strategy in enumerate(STRATEGIES):
            runs = results.get((setting, strategy), {})
            if runs:
                curves = [[(float(x), y) for x, y in steps_curve(runs[s])] for s in sorted(runs)]
                ax.plot(*mean_curve(curves), label=strategy, color=colours(i),
                        linestyle="-" if i < 5 else "--", linewidth=1.2, marker=".", markersize=3)
        ax.set_title(setting)
        ax.set_xlabel("local SGD steps per client (pretraining included)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"mean client test accuracy ({len(seeds)} seeds)")
    axes[0][-1].legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="local SGD steps per client (all methods)")
    ap.add_argument("--seeds", type=at_least(1), default=3)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of {list(SETTINGS)}")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma list of {list(STRATEGIES)}")
    ap.add_argument("--workers", type=at_least(1), default=os.cpu_count() or 1)
    ap.add_argument("--cache", default="runs/bench-accuracy-baselines")
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    settings = [s for s in args.settings.split(",") if s]
    strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in settings if s not in SETTINGS] + [s for s in strategies if s not in STRATEGIES]
    if bad:
        ap.error(f"unknown setting/strategy {bad}; settings: {list(SETTINGS)}, strategies: {list(STRATEGIES)}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    seeds = list(range(args.seeds))
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    jobs = [(st, s, seed) for seed in seeds for st in settings for s in strategies]
    # seed by seed (a partial run already compares every method), the many short rounds of
    # FedMD and FedProto-public (tau 1) first so that the workers stay busy to the end
    jobs.sort(key=lambda j: (j[2], PARAMS[j[1]].get("tau") != 1))
    configs = {(st, s, seed): run_config(st, s, seed, args.steps) for st, s, seed in jobs}
    started = time.perf_counter()
    results = run_simulations([((st, s), seed, configs[st, s, seed], Path(args.cache) / f"{st}-{s}-s{seed}-{args.steps}.json")
                               for st, s, seed in jobs], args.workers)
    wrong = {f"{st}-{s}-s{seed}": stale(results[st, s][seed], configs[st, s, seed]) for st, s, seed in jobs}
    wrong = {k: v for k, v in wrong.items() if v}
    if wrong:
        raise SystemExit(f"cached runs in {args.cache} were made with other settings ({wrong}); move them away "
                         "or choose another --cache")
    text, summary, comps = summarise(results, args.steps, seeds)
    run_s = sum(res["timings"]["wall_seconds"] for per in results.values() for res in per.values())
    text += (f"\nWall time of this benchmark run: {time.perf_counter() - started:.0f} s with {args.workers} workers; the "
             f"{len(jobs)} runs' own wall times (cached ones included) add up to {run_s:.0f} s.\n")
    report = out / "accuracy_baselines.md"
    kept = report.read_text().split(MARKER, 1)[1] if report.exists() and MARKER in report.read_text() \
        else "\n\nInterpretation: not yet written (this report's numbers come first).\n"
    report.write_text(text + "\n" + MARKER + kept)
    (out / "accuracy_baselines.json").write_text(json.dumps(
        {"steps": args.steps, "seeds": seeds, "settings": SETTINGS, "params": PARAMS, "fd_tau": FD_TAU,
         "fccl_pretrain_share": FCCL_PRETRAIN_SHARE, "paper_names": PAPER_NAMES, "paper": PAPER_TABLES,
         "summary": summary, "comparison": comps}, indent=2))
    plot(results, seeds, out / "accuracy_baselines.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
