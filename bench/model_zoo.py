"""The MNIST-1D zoo against reference architectures, trained alone on one client's worth of data.

What the zoo's models reach on their own decides how far any federated method can take them, so
the zoo is measured against small pooled 1-D CNNs and an MLP that are known to do well on
MNIST-1D: conv 16 k5 + max-pool, conv 32 k3 + max-pool, linear ("ref_cnn"); the same with 32/64
channels and a 64-unit hidden layer ("ref_cnn_wide"); a 40-128-128-10 MLP ("ref_mlp"). Each model
trains with Adam (lr 1e-3, batch 32) on a random 700-row subset of generated MNIST-1D (the
per-client size of bench/accuracy.py) for 600 steps, and is scored on the 2,400-row test split;
mean over seeds, side by side in one run on one thread. Writes docs/results/model_zoo.md and .json.

    python bench/model_zoo.py               # 5 seeds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedal.data.embedded import load_mnist1d
from fedal.models import build_model, count_parameters

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_args import at_least  # noqa: E402


class _AsChannels(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1).unsqueeze(1)


def reference_cnn(c1: int, c2: int, hidden: int | None) -> nn.Module:
    layers: list[nn.Module] = [_AsChannels(), nn.Conv1d(1, c1, 5, padding=2), nn.ReLU(), nn.MaxPool1d(2),
                               nn.Conv1d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool1d(2), nn.Flatten(1)]
    width = c2 * 10
    if hidden:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


def reference_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(1), nn.Linear(40, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


MODELS = {
    "mlp": lambda: build_model("mlp", (40,), 10),
    "cnn1d": lambda: build_model("cnn1d", (40,), 10),
    "cnn1d_wide": lambda: build_model("cnn1d_wide", (40,), 10),
    "ref_mlp": reference_mlp,
    "ref_cnn": lambda: reference_cnn(16, 32, None),
    "ref_cnn_wide": lambda: reference_cnn(32, 64, 64),
}
PAIRS = [("mlp", "ref_mlp"), ("cnn1d", "ref_cnn"), ("cnn1d_wide", "ref_cnn_wide")]


def train_once(make, x, y, xt, yt, seed: int, rows: int, steps: int) -> float:
    g = torch.Generator().manual_seed(seed)
    subset = torch.randperm(len(x), generator=g)[:rows]
    torch.manual_seed(seed)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        idx = subset[torch.randperm(rows, generator=g)[:32]]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return float((model(xt).argmax(1) == yt).float().mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=at_least(1), default=5)
    ap.add_argument("--rows", type=at_least(1), default=700, help="training rows (at most the generated training set)")
    ap.add_argument("--steps", type=at_least(1), default=600)
    ap.add_argument("--out", default="docs/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    train, test = load_mnist1d()
    if args.rows > len(train.x):
        ap.error(f"argument --rows: at most {len(train.x)} (the training set), got {args.rows}")
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y).long()
    xt, yt = torch.from_numpy(test.x), torch.from_numpy(test.y).long()
    started = time.perf_counter()
    acc = {name: [train_once(make, x, y, xt, yt, s, args.rows, args.steps) for s in range(args.seeds)]
           for name, make in MODELS.items()}
    params = {name: count_parameters(make()) for name, make in MODELS.items()}
    lines = [
        "# The MNIST-1D zoo against reference architectures (one client, trained alone)",
        "",
        f"Written by `python bench/model_zoo.py` in {time.perf_counter() - started:.0f} s: Adam lr 1e-3, batch 32, "
        f"{args.steps} steps on a random {args.rows}-row subset of generated MNIST-1D (12,000 samples), scored on "
        f"the 2,400-row test split; mean ± std over {args.seeds} seeds (the subset and the initial weights change "
        "with the seed). References: ref_mlp 40-128-128-10; ref_cnn conv 16 k5 + max-pool 2, conv 32 k3 + max-pool 2, "
        "linear; ref_cnn_wide the same with 32/64 channels and a 64-unit hidden layer.",
        "",
        "| zoo model | parameters | accuracy % | reference | parameters | accuracy % | zoo − reference (points) |",
        "|---|---:|---|---|---:|---|---:|",
    ]
    for zoo, ref in PAIRS:
        def fmt(v: list[float]) -> str:
            return f"{100 * statistics.mean(v):.1f} ± {100 * statistics.stdev(v):.1f}" if len(v) > 1 else f"{100 * v[0]:.1f}"
        diff = 100 * (statistics.mean(acc[zoo]) - statistics.mean(acc[ref]))
        lines.append(f"| {zoo} | {params[zoo]:,} | {fmt(acc[zoo])} | {ref} | {params[ref]:,} | {fmt(acc[ref])} | {diff:+.1f} |")
    mean_zoo = statistics.mean(statistics.mean(acc[z]) for z, _ in PAIRS)
    mean_ref = statistics.mean(statistics.mean(acc[r]) for _, r in PAIRS)
    lines += ["", f"Mean over the three: zoo {100 * mean_zoo:.1f} %, references {100 * mean_ref:.1f} % "
              f"({100 * (mean_zoo - mean_ref):+.1f} points).", ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_zoo.md").write_text("\n".join(lines))
    (out / "model_zoo.json").write_text(json.dumps({"args": vars(args), "accuracy": acc, "parameters": params}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
