"""What the coordinator can tell about the clients' private samples from what it receives, without
differential privacy and at several epsilons: a membership-inference attack against FedAL and
FedMD on MNIST-1D, and the clients' accuracy, side by side (the privacy-utility curve).

Which attack: an honest-but-curious coordinator that keeps every client's logits on the public
set rebuilds each client's model from them (the model-reconstruction threat against federated
distillation) and runs the loss-threshold membership attack of Yeom et al. (2018) on the
rebuilt model. This is not a reimplementation of a specific published attack on federated
distillation, such as Shi et al.'s (arXiv 2502.08001). It is the simplest attack of that family,
built from what FedAL's coordinator receives. The coordinator distils a surrogate of each
client's private model from the (public rows, logits) pairs that client uploaded over the last
rounds of the run, then scores candidate samples by the surrogate's loss on them (lower loss:
"member"). Adapted to FedAL's protocol:
the rows of each upload are known to the coordinator (it names them, docs/protocol.md), the
client's architecture is not (the surrogate is a fixed MLP). Candidates per client: its private
training samples (members) and as many held-out test samples with the same label counts
(non-members; otherwise the client's label skew alone would pass for membership). As a reference, the
same loss attack on the client's own final model (an adversary holding the weights, which FedAL
never sends) bounds what any attack on the shared logits could reach.

Reported per (strategy, noise): the attack's AUC, its advantage over guessing AUC - 0.5 (what the
goal compares: unbiased, where max TPR - FPR is not), the membership advantage max TPR - FPR
(Yeom et al.) beside what it reaches by chance at this sample size (membership labels shuffled),
its TPR at 1 % FPR (candidates of all clients pooled), the clients' final mean accuracy, and the
largest epsilon a client reached (delta 1e-5). Writes docs/results/privacy.md,
.json and .png.

    python bench/privacy.py                    # the full run (a few minutes on 2 cores)
    python bench/privacy.py --rounds 5 --seeds 1 --sigmas 1.0 --out /tmp/quick   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402

STRATEGIES = ("fedal", "fedmd")
SIGMAS = (0.0, 0.8, 1.5, 2.5, 4.0)  # 0: no differential privacy
SURROGATE_ROUNDS = 10  # the coordinator distils each surrogate from the uploads of the last rounds
ADVANTAGE_SHARE = 1 / 3  # the goal: at the recommended epsilon, at most this share of the no-DP advantage
CHANCE_SHUFFLES = 20  # label permutations that measure what max(TPR - FPR) reaches by chance at this sample size


def config_for(strategy: str, sigma: float, seed: int, rounds: int) -> dict:
    config = {"strategy": strategy, "dataset": "mnist1d", "clients": 10, "alpha": 2.0, "samples_per_client": 150,
              "public_size": 1000, "rounds": rounds, "seed": seed, "models": ["mlp", "cnn1d", "cnn1d_wide"],
              "threads": 1, "eval_every": rounds, "strategy_params": {"tau": 5}}
    if sigma > 0:
        config["strategy_params"]["privacy"] = {"noise_multiplier": sigma, "max_grad_norm": 1.0, "delta": 1e-5}
    return config


def run_one(job: tuple[str, float, int, int]) -> dict:
    """One federated run with the coordinator recording every upload, then the attack."""
    import torch

    from fedal.sim import build_run, load_config, simulated_engine
    from fedal.strategies.fedal import rows_key
    from fedal.strategies.public_rows import public_rows

    strategy, sigma, seed, rounds = job
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    config = load_config(None, config_for(strategy, sigma, seed, rounds)).resolved()
    data, clients, server = build_run(config)
    p = config.strategy_params
    uploads: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {cid: [] for cid in clients}
    collect = server.collect

    def recording_collect(phase, results):  # what the coordinator receives, with the rows it named
        nxt = server.logits_iteration(phase.phase, phase.iteration)
        if nxt is not None:
            rows = public_rows(rows_key(p), phase.round, nxt, len(data.public_x), p.public_batch_size)
            for cid, result in results.items():
                uploads[cid].append((phase.round, rows, server.received_logits(result)))
        return collect(phase, results)

    server.collect = recording_collect
    engine = simulated_engine(config, data, clients, server)
    records = [engine.run_round(r) for r in range(rounds)]
    per_client, pooled, pooled_ref = [], ([], []), ([], [])
    rng = np.random.default_rng(seed)
    for i, (cid, client) in enumerate(clients.items()):
        members = data.clients[i]
        pick = same_labels(data.test.y, members.y, rng)
        x = np.concatenate([members.x, data.test.x[pick]])
        y = np.concatenate([members.y, data.test.y[pick]])
        is_member = np.r_[np.ones(len(members)), np.zeros(len(members))]
        recent = [u for u in uploads[cid] if u[0] >= rounds - SURROGATE_ROUNDS]
        surrogate = distil_surrogate(data.public_x, recent, data.num_classes, seed * 1000 + i)
        scores = -losses(surrogate, x, y)
        reference = -losses(client.model, x, y)
        chance = np.mean([advantage(rng.permutation(is_member), scores) for _ in range(CHANCE_SHUFFLES)])
        per_client.append({"client": cid, "auc": auc(is_member, scores), "advantage": advantage(is_member, scores),
                           "chance_advantage": float(chance),
                           "ref_auc": auc(is_member, reference), "ref_advantage": advantage(is_member, reference)})
        for (labels, values), s in ((pooled, scores), (pooled_ref, reference)):
            labels.extend(is_member)
            values.extend(s)
    final = records[-1]
    privacy = final.get("privacy") or {}
    eps = [e for e in privacy.get("epsilon", []) if e is not None]
    return {
        "strategy": strategy, "sigma": sigma, "seed": seed, "mean_acc": final["mean_acc"],
        "max_epsilon": max(eps) if eps else None, "mean_epsilon": float(np.mean(eps)) if eps else None,
        "auc": float(np.mean([c["auc"] for c in per_client])),
        "advantage": float(np.mean([c["advantage"] for c in per_client])),
        "chance_advantage": float(np.mean([c["chance_advantage"] for c in per_client])),
        "tpr_at_1pct_fpr": tpr_at(np.array(pooled[0]), np.array(pooled[1]), 0.01),
        "ref_auc": float(np.mean([c["ref_auc"] for c in per_client])),
        "ref_advantage": float(np.mean([c["ref_advantage"] for c in per_client])),
        "ref_tpr_at_1pct_fpr": tpr_at(np.array(pooled_ref[0]), np.array(pooled_ref[1]), 0.01),
        "uploads_per_client": len(uploads[next(iter(uploads))]), "clients": per_client,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def same_labels(pool_y: np.ndarray, member_y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Held-out samples with the members' label counts: otherwise a client's label skew alone
    (members are mostly its frequent classes) would pass for membership."""
    picks = [rng.choice(np.flatnonzero(pool_y == c), size=int(n), replace=False)
             for c, n in zip(*np.unique(member_y, return_counts=True))]
    return np.concatenate(picks)


def distil_surrogate(public_x: np.ndarray, uploads: list, num_classes: int, seed: int):
    """An MLP fitted to the client's uploaded logits on the rows they name (KL to its softmax);
    rows seen more than once keep their latest logits."""
    import torch
    import torch.nn.functional as F

    latest: dict[int, np.ndarray] = {}
    for _, rows, logits in uploads:
        for r, row_logits in zip(rows.tolist(), logits):
            latest[r] = row_logits
    idx = np.array(sorted(latest))
    x = torch.from_numpy(public_x[idx].reshape(len(idx), -1))
    target = torch.softmax(torch.from_numpy(np.stack([latest[r] for r in idx])), dim=1)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                torch.nn.ReLU(), torch.nn.Linear(128, num_classes))
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(400):
        opt.zero_grad()
        F.kl_div(F.log_softmax(model(x), dim=1), target, reduction="batchmean").backward()
        opt.step()
    return model


def losses(model, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    import torch
    import torch.nn.functional as F

    was = model.training
    model.eval()
    with torch.no_grad():
        xt = torch.from_numpy(x)
        if isinstance(model, torch.nn.Sequential):
            xt = xt.reshape(len(xt), -1)
        out = F.cross_entropy(model(xt), torch.from_numpy(y), reduction="none").numpy()
    model.train(was)
    return out


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(labels, scores))


def advantage(labels: np.ndarray, scores: np.ndarray) -> float:
    """Membership advantage: the best threshold's TPR - FPR (Yeom et al. 2018)."""
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(labels, scores)
    return float(np.max(tpr - fpr))


def tpr_at(labels: np.ndarray, scores: np.ndarray, fpr_max: float) -> float:
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(labels, scores)
    return float(np.max(tpr[fpr <= fpr_max]))


def summarise(runs: list[dict], args) -> tuple[list[str], dict]:
    table: dict = {}
    for s in STRATEGIES:
        for sigma in args.sigmas:
            got = [r for r in runs if r["strategy"] == s and r["sigma"] == sigma]
            if got:
                table[(s, sigma)] = {k: statistics.mean(r[k] for r in got) if all(r[k] is not None for r in got) else None
                                     for k in ("mean_acc", "max_epsilon", "auc", "advantage", "chance_advantage",
                                               "tpr_at_1pct_fpr",
                                               "ref_auc", "ref_advantage", "ref_tpr_at_1pct_fpr")}
    # the recommended default: the least noise at which the attack's advantage over guessing
    # (AUC - 0.5) is at most a third of the no-DP one for both strategies
    recommended = None
    for sigma in sorted(x for x in args.sigmas if x > 0):
        if all((s, sigma) in table and (s, 0.0) in table
               and table[(s, sigma)]["auc"] - 0.5 <= ADVANTAGE_SHARE * (table[(s, 0.0)]["auc"] - 0.5)
               for s in STRATEGIES):
            recommended = sigma
            break
    lines = [
        "# Privacy: a membership-inference attack by the coordinator, without DP and at several epsilons",
        "",
        f"Written by `python bench/privacy.py` ({len(args.seeds)} seeds: {args.seeds}; {args.rounds} rounds). MNIST-1D, "
        "10 clients, 150 private samples each, alpha 2, models mlp / cnn1d / cnn1d_wide, tau 5 (both), public set "
        "1000 rows; DP-SGD with C = 1.0 at delta 1e-5 (docs/privacy.md). The attack: the "
        f"coordinator distils an MLP surrogate of each client from the logits that client uploaded in the last "
        f"{SURROGATE_ROUNDS} rounds and scores each candidate by the surrogate's loss; candidates are the client's "
        "private samples and as many held-out ones with the same label counts. Reference: the same loss attack on the client's own final model "
        "(weights FedAL never sends). Means over seeds; AUC and advantage are per-client means, TPR at 1 % FPR pools "
        "all clients' candidates.",
        "",
        "| strategy | noise sigma | max epsilon | mean final acc | attack AUC | AUC - 0.5 | max TPR - FPR (chance) | "
        "TPR @ 1 % FPR | reference AUC | reference max TPR - FPR |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (s, sigma), row in table.items():
        eps = "no DP" if sigma == 0 else f"{row['max_epsilon']:.2f}"
        lines.append(f"| {s} | {sigma:g} | {eps} | {100 * row['mean_acc']:.2f} | {row['auc']:.3f} | "
                     f"{row['auc'] - 0.5:.3f} | {row['advantage']:.3f} ({row['chance_advantage']:.3f}) | "
                     f"{row['tpr_at_1pct_fpr']:.3f} | {row['ref_auc']:.3f} | {row['ref_advantage']:.3f} |")
    lines += ["", "Against no DP, per strategy:", ""]
    for s in STRATEGIES:
        if (s, 0.0) not in table:
            continue
        base = table[(s, 0.0)]
        for sigma in args.sigmas:
            if sigma == 0 or (s, sigma) not in table:
                continue
            row = table[(s, sigma)]
            share = (row["auc"] - 0.5) / (base["auc"] - 0.5) if base["auc"] > 0.5 else float("nan")
            lines.append(f"- {s}, sigma {sigma:g} (epsilon {row['max_epsilon']:.2f}): the attack's advantage over "
                         f"guessing (AUC - 0.5) is {share:.2f}x the no-DP one; accuracy "
                         f"{100 * (row['mean_acc'] - base['mean_acc']):+.2f} points")
    lines.append("")
    if recommended is None:
        lines.append(f"No noise level here brings the attack's advantage over guessing to {ADVANTAGE_SHARE:.2f}x the "
                     "no-DP one for both strategies.")
    else:
        eps = max(table[(s, recommended)]["max_epsilon"] for s in STRATEGIES)
        lines.append(f"Recommended default for MNIST-1D: noise sigma {recommended:g} (epsilon up to {eps:.2f} at delta "
                     f"1e-5 over this run), the least noise at which the attack's advantage over guessing (AUC - 0.5) "
                     f"is at most {ADVANTAGE_SHARE:.2f}x the no-DP one for both strategies.")
    lines.append("")
    return lines, {"table": {f"{s}/{sigma:g}": row for (s, sigma), row in table.items()}, "recommended_sigma": recommended}


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for s in STRATEGIES:
        rows = sorted((row["max_epsilon"], row) for key, row in table.items()
                      if key.startswith(s + "/") and row["max_epsilon"] is not None)
        base = table.get(f"{s}/0")
        line = left.plot([e for e, _ in rows], [100 * r["mean_acc"] for _, r in rows], "o-", label=s)[0]
        right.plot([e for e, _ in rows], [r["auc"] for _, r in rows], "o-", color=line.get_color(), label=s)
        if base:
            left.axhline(100 * base["mean_acc"], ls="--", color=line.get_color(), label=f"{s}, no DP")
            right.axhline(base["auc"], ls="--", color=line.get_color(), label=f"{s}, no DP")
    right.axhline(0.5, color="grey", lw=0.8)
    for ax, label in ((left, "mean final accuracy (%)"), (right, "attack AUC (coordinator)")):
        ax.set_xscale("log")
        ax.set_xlabel("epsilon (delta 1e-5)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("MNIST-1D: privacy-utility")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--sigmas", type=float, nargs="+", default=list(SIGMAS))
    ap.add_argument("--workers", type=at_least(1), default=2)
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    if 0.0 not in args.sigmas:
        args.sigmas = [0.0, *args.sigmas]
    jobs = [(s, sigma, seed, args.rounds) for s in STRATEGIES for sigma in args.sigmas for seed in args.seeds]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        runs = []
        for run in pool.map(run_one, jobs):
            runs.append(run)
            print(f"{run['strategy']} sigma {run['sigma']:g} seed {run['seed']}: acc {run['mean_acc']:.4f} "
                  f"eps {run['max_epsilon']} auc {run['auc']:.3f} ref {run['ref_auc']:.3f} ({run['seconds']} s)",
                  file=sys.stderr)
    lines, summary = summarise(runs, args)
    lines.insert(3, f"Took {time.perf_counter() - t0:.0f} s with {args.workers} worker processes.\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hand = out / "privacy.md"
    marker = "<!-- hand-written below this line; kept when bench/privacy.py rewrites the file -->"
    kept = hand.read_text().split(marker, 1)[1] if hand.exists() and marker in hand.read_text() else "\n"
    hand.write_text("\n".join(lines) + "\n![privacy-utility](privacy.png)\n\n" + marker + kept)
    (out / "privacy.json").write_text(json.dumps({"args": vars(args), "runs": runs, **summary}, indent=2))
    plot(summary["table"], out / "privacy.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
