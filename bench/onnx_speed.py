"""Inference speed of the small zoo models: torch eager vs onnxruntime fp32 vs onnxruntime int8.

Why: agents run public-set inference every round (FedAL logits on the shared public set), so
this measures exactly that workload, side by side in one run: 1000 samples in batches of 32
and as one batch of 1000. Each model is first trained briefly (200 Adam steps) so the int8
accuracy delta on the dataset's test split means something.

* torch: eval mode, `torch.no_grad()`, torch.set_num_threads(1).
* onnxruntime fp32 / int8: `export.session.OrtModel(threads=1)` (like-for-like with torch).
* onnxruntime fp32, 1-D graph (models with Conv1d only): the same model exported with
  `conv1d_as_2d=False`, i.e. as `export_onnx` wrote it before 1-D stacks were lifted to 2-D,
  so the effect of that rewrite is measured in the same run, not against an old file.
* int8: static QDQ quantisation calibrated on the train split (what `fedal export
  --dataset ... --quantize int8` writes).
* Times: the variants are timed in turn within each of REPEATS rounds (rotating which goes
  first), so a burst of load from other processes hits all of them alike; the median per
  variant is reported. `--cpu N` pins the process to one core (like `taskset -c N`).
* Per-node profiles (onnxruntime's session profiler, `export.session.node_times`) of both fp32
  graphs of the 1-D models say where the time goes.

    python bench/onnx_speed.py                       # writes docs/results/onnx_speed.{md,json}
    taskset -c 1 python bench/onnx_speed.py          # pinned; or --cpu 1
    python bench/onnx_speed.py --json /tmp/s.json --out /tmp/results

A hand-written section after the HAND_WRITTEN marker in onnx_speed.md and the "history" key of
onnx_speed.json (earlier runs kept for comparison) survive a rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export import export_onnx  # noqa: E402
from export.layout import has_1d_layers  # noqa: E402
from export.quantize import accuracy_delta, quantize_int8  # noqa: E402
from export.session import OrtModel, node_times  # noqa: E402
from fedal.data import load_dataset  # noqa: E402
from fedal.models import build_model  # noqa: E402

CASES = [("mnist1d", "mlp"), ("mnist1d", "cnn1d"), ("mnist1d", "cnn1d_wide"),
         ("digits", "lenet5"), ("digits", "smallcnn")]
SAMPLES = 1000
BATCHES = (32, 1000)
REPEATS = 31
PROFILE_RUNS = 10
PROFILE_TOP = 6
HAND_WRITTEN = "<!-- hand-written below this line; kept when bench/onnx_speed.py rewrites the file -->"
TRAIN_STEPS = 200
TRAIN_BATCH = 64
INT8_MODE = "static"
THREADS = 1


def _train(name: str, train) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(name, train.x.shape[1:], train.num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(TRAIN_STEPS):
        idx = torch.randint(0, len(x), (TRAIN_BATCH,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _interleaved(fns: dict) -> dict[str, list[float]]:
    """Seconds per call of each variant, REPEATS rounds; each round runs every variant once,
    starting with a different one, so a burst of load from other processes hits all alike."""
    for fn in fns.values():  # warm-up
        fn()
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(REPEATS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def _paired_ratio(base: list[float], other: list[float]) -> float:
    """Median over rounds of base/other: each round's two timings saw the same load."""
    return statistics.median(b / o for b, o in zip(base, other))


def _profile(path: Path, x, batch: int) -> list[dict]:
    """The slowest nodes of one run on `batch` rows (onnxruntime's profiler, OrtModel settings)."""
    rows = node_times(path, x[:batch], threads=THREADS, runs=PROFILE_RUNS)
    return [{k: r[k] for k in ("op", "domain", "ms", "share", "inputs")} for r in rows[:PROFILE_TOP]]


def _torch_infer(model: torch.nn.Module, x: torch.Tensor, batch: int) -> None:
    with torch.no_grad():
        for i in range(0, len(x), batch):
            model(x[i:i + batch])


def run(tmp: Path) -> tuple[list[dict], dict]:
    torch.set_num_threads(THREADS)
    rows, profiles = [], {}
    for dataset, name in CASES:
        train, test = load_dataset(dataset)
        model = _train(name, train)
        example = torch.from_numpy(train.x[:2])
        fp32_path = export_onnx(model, example, tmp / f"{name}.onnx")
        int8_path = quantize_int8(fp32_path, tmp / f"{name}.int8.onnx", INT8_MODE, train.x)
        acc = accuracy_delta(fp32_path, int8_path, test.x, test.y, threads=THREADS)
        fp32, int8 = OrtModel(fp32_path, THREADS), OrtModel(int8_path, THREADS)
        one_d = has_1d_layers(model)
        if one_d:
            path_1d = export_onnx(model, example, tmp / f"{name}.1d.onnx", conv1d_as_2d=False)
            fp32_1d = OrtModel(path_1d, THREADS)
        x = train.x[:SAMPLES]  # public-set style: unlabelled samples the agent sees every round
        xt = torch.from_numpy(x)
        for batch in BATCHES:
            # loop variables bound as defaults: each lambda keeps this iteration's values
            fns = {"torch": lambda model=model, xt=xt, batch=batch: _torch_infer(model, xt, batch),
                   "ort": lambda fp32=fp32, x=x, batch=batch: fp32(x, batch_size=batch),
                   "int8": lambda int8=int8, x=x, batch=batch: int8(x, batch_size=batch)}
            if one_d:
                fns["ort_1d"] = lambda fp32_1d=fp32_1d, x=x, batch=batch: fp32_1d(x, batch_size=batch)
            times = _interleaved(fns)
            ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
            ratio = {k: _paired_ratio(times["torch"], v) for k, v in times.items()}
            row = {"model": name, "dataset": dataset, "batch": batch,
                   "torch_ms": round(ms["torch"], 3), "ort_ms": round(ms["ort"], 3),
                   "ort_int8_ms": round(ms["int8"], 3),
                   "ort_1d_ms": round(ms["ort_1d"], 3) if one_d else None,
                   "ratio": round(ratio["ort"], 3), "int8_ratio": round(ratio["int8"], 3),
                   "ratio_1d": round(ratio["ort_1d"], 3) if one_d else None,
                   # fastest round per variant: the least disturbed by other processes
                   "min_ms": {k: round(1000 * min(v), 3) for k, v in times.items()},
                   "int8_acc_delta": round(acc["delta_points"], 3),
                   "fp32_acc": round(acc["fp32_acc"], 4), "int8_acc": round(acc["int8_acc"], 4),
                   "fp32_bytes": fp32_path.stat().st_size, "int8_bytes": int8_path.stat().st_size}
            rows.append(row)
            before = f"  (1-D graph {ms['ort_1d']:8.2f} ms x{row['ratio_1d']:.2f})" if one_d else ""
            print(f"{name:11s} b={batch:<5d} torch {ms['torch']:8.2f} ms  ort {ms['ort']:8.2f} ms  "
                  f"int8 {ms['int8']:8.2f} ms  x{row['ratio']:.2f} / x{row['int8_ratio']:.2f}  "
                  f"int8 acc {acc['delta_points']:+.2f} pts{before}", flush=True)
        if one_d:
            profiles[name] = {str(batch): {"1d_graph": _profile(path_1d, x, batch), "2d_graph": _profile(fp32_path, x, batch)}
                              for batch in BATCHES}
    return rows, profiles


def settings() -> dict:
    return {"samples": SAMPLES, "batches": list(BATCHES), "repeats": REPEATS, "train_steps": TRAIN_STEPS,
            "int8_mode": INT8_MODE, "torch_threads": torch.get_num_threads(), "ort_threads": THREADS,
            "torch": torch.__version__, "onnxruntime": ort.__version__,
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "cpus_allowed": sorted(os.sched_getaffinity(0)),
            "cpus_total": os.cpu_count(), "load_avg_1min_at_end": round(os.getloadavg()[0], 2),
            "timing": f"{REPEATS} interleaved rounds"}


def summary(rows: list[dict]) -> dict:
    out = {}
    for batch in BATCHES:
        sel = [r for r in rows if r["batch"] == batch]
        out[str(batch)] = {"median_ratio": statistics.median(r["ratio"] for r in sel),
                           "min_ratio": min(r["ratio"] for r in sel),
                           "median_ratio_fastest_rounds": statistics.median(
                               r["min_ms"]["torch"] / r["min_ms"]["ort"] for r in sel),
                           "median_int8_ratio": statistics.median(r["int8_ratio"] for r in sel)}
    return out


def markdown(rows: list[dict], conf: dict, summ: dict, profiles: dict) -> str:
    pinned = ",".join(map(str, conf["cpus_allowed"]))
    lines = [
        "# ONNX Runtime vs torch eager: public-set inference on the small zoo models",
        "",
        "Written by `python bench/onnx_speed.py`. Workload: 1000 samples of the dataset's train split, "
        "in batches of 32 and as one batch of 1000 (what an agent does each round on the public set). "
        f"Timing: {conf['timing']} after warm-up; within each round every variant runs once, in rotating "
        "order, so load from other processes falls on all of them alike; ms columns are medians per "
        "variant, ratios are medians of the per-round (paired) ratios. Models trained for "
        f"{conf['train_steps']} Adam steps first; int8 accuracy delta is on the test split (points, int8 minus fp32).",
        "",
        f"Settings: torch {conf['torch']} eager, eval + no_grad, torch threads = {conf['torch_threads']}; "
        f"onnxruntime {conf['onnxruntime']} via `OrtModel(threads={conf['ort_threads']})` "
        "(sequential, inter-op 1, all graph optimisations); int8 = "
        f"{conf['int8_mode']} QDQ (S8S8, per-channel, MinMax calibration on the train split). "
        f"Machine: {conf['machine']} ({conf['processor']}), "
        + (f"process pinned to CPU(s) {pinned} of {conf['cpus_total']}"
           if len(conf["cpus_allowed"]) < (conf["cpus_total"] or 0) else f"{conf['cpus_total']} CPUs")
        + f" (1-min load average at the end: {conf['load_avg_1min_at_end']}).",
        "",
        "`ort fp32` is today's export (1-D conv stacks lifted to unit-height 2-D, see docs/export.md); "
        "`1-D graph` is the same model exported with `conv1d_as_2d=False` (the previous export), "
        "measured in the same rounds.",
        "",
        *([f"**This is {conf['machine']}, not a Raspberry Pi.** Ratios on ARM (NEON, different int8 kernels) will "
           "differ; rerun this script on the board before relying on them."]
          if conf["machine"] not in ("aarch64", "arm64", "armv7l", "armv6l") else
          [f"Measured on {conf['machine']}: a board's numbers, for this board's CPU."]),
        "",
        "| model | dataset | batch | torch ms | ort fp32 ms | 1-D graph ms | ort int8 ms | torch/ort | "
        "torch/1-D graph | torch/int8 | int8 acc delta (pts) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms_1d = f"{r['ort_1d_ms']:.2f}" if r["ort_1d_ms"] is not None else "="
        ratio_1d = f"{r['ratio_1d']:.2f}" if r["ratio_1d"] is not None else "="
        lines.append(f"| {r['model']} | {r['dataset']} | {r['batch']} | {r['torch_ms']:.2f} | {r['ort_ms']:.2f} | "
                     f"{ms_1d} | {r['ort_int8_ms']:.2f} | {r['ratio']:.2f} | {ratio_1d} | "
                     f"{r['int8_ratio']:.2f} | {r['int8_acc_delta']:+.2f} |")
    lines += ["", "(`=`: no 1-D layers, the export is unchanged.)", "",
              "Median speedups over torch eager (ratio > 1 means faster than torch):", ""]
    for batch, s in summ.items():
        lines.append(f"* batch {batch}: onnxruntime fp32 x{s['median_ratio']:.2f} (slowest model "
                     f"x{s['min_ratio']:.2f}; from each variant's fastest round "
                     f"x{s['median_ratio_fastest_rounds']:.2f}), onnxruntime int8 x{s['median_int8_ratio']:.2f}")
    lines += ["", "## Where the time goes (onnxruntime per-node profile, fp32)", "",
              f"`export.session.node_times`: onnxruntime's session profiler on the optimised graph, mean of "
              f"{PROFILE_RUNS} runs of one batch, slowest {PROFILE_TOP} nodes. Op `FusedConv` (domain "
              "com.microsoft) is the generic per-sample im2col + GEMM convolution; `Conv` in domain "
              "com.microsoft.nchwc is the blocked NCHWc kernel (bias and ReLU fused).", ""]
    for name, by_batch in profiles.items():
        for batch, graphs in by_batch.items():
            lines += [f"**{name}, batch {batch}**", "", "| graph | op (domain) | input shape | ms/run | share |",
                      "|---|---|---|---:|---:|"]
            for graph, label in (("1d_graph", "1-D"), ("2d_graph", "2-D")):
                for n in graphs[graph]:
                    domain = f" ({n['domain']})" if n["domain"] else ""
                    shape = "x".join(map(str, n["inputs"][0])) if n["inputs"] else ""
                    lines.append(f"| {label} | {n['op']}{domain} | {shape} | {n['ms']:.3f} | {100 * n['share']:.0f}% |")
            lines.append("")
    return "\n".join(lines)


def _kept_tail(path: Path) -> str:
    """The hand-written part of an existing onnx_speed.md (after HAND_WRITTEN), if any."""
    if not path.exists():
        return ""
    text = path.read_text()
    return text[text.index(HAND_WRITTEN):] if HAND_WRITTEN in text else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="Also write the rows to this JSON file.")
    parser.add_argument("--out", default="docs/results", help="Directory for onnx_speed.md / .json.")
    parser.add_argument("--cpu", type=int, help="Pin this process to one CPU (like taskset -c N).")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        usable = sorted(os.sched_getaffinity(0))
        if args.cpu not in usable:
            parser.error(f"argument --cpu: {args.cpu} is not one of this process's CPUs {usable}")
        os.sched_setaffinity(0, {args.cpu})
    with tempfile.TemporaryDirectory() as tmp:
        rows, profiles = run(Path(tmp))
    conf, summ = settings(), summary(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "onnx_speed.json", out / "onnx_speed.md"
    history = json.loads(json_path.read_text()).get("history", []) if json_path.exists() else []
    payload = {"rows": rows, "settings": conf, "summary": summ, "profiles": profiles, "history": history}
    tail = _kept_tail(md_path)
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text(markdown(rows, conf, summ, profiles) + ("\n" + tail if tail else ""))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    for batch, s in summ.items():
        print(f"median speedup batch {batch}: ort fp32 x{s['median_ratio']:.2f} (min x{s['min_ratio']:.2f}), "
              f"int8 x{s['median_int8_ratio']:.2f}")


if __name__ == "__main__":
    main()
