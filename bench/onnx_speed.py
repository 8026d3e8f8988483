"""Inference speed of the small zoo models: torch eager vs onnxruntime fp32 vs onnxruntime int8.

Why: agents run public-set inference every round (FedAL logits on the shared public set), so
this measures exactly that workload, side by side in one run: 1000 samples in batches of 32
and as one batch of 1000. Each model is first trained briefly (200 Adam steps) so the int8
accuracy delta on the dataset's test split means something.

* torch: eval mode, `torch.no_grad()`, torch.set_num_threads(1).
* onnxruntime fp32 / int8: `export.session.OrtModel(threads=1)` (like-for-like with torch).
* int8: static QDQ quantisation calibrated on the train split (what `fedal export
  --dataset ... --quantize int8` writes).
* Times are the median of REPEATS runs after a warm-up.

    python bench/onnx_speed.py                       # writes docs/results/onnx_speed.{md,json}
    python bench/onnx_speed.py --json /tmp/s.json --out /tmp/results
"""

from __future__ import annotations

import argparse
import json
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
from export.quantize import accuracy_delta, quantize_int8  # noqa: E402
from export.session import OrtModel  # noqa: E402
from fedal.data import load_dataset  # noqa: E402
from fedal.models import build_model  # noqa: E402

CASES = [("mnist1d", "mlp"), ("mnist1d", "cnn1d"), ("mnist1d", "cnn1d_wide"),
         ("digits", "lenet5"), ("digits", "smallcnn")]
SAMPLES = 1000
BATCHES = (32, 1000)
REPEATS = 9
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


def _median_ms(fn) -> float:
    fn()  # warm-up
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _torch_infer(model: torch.nn.Module, x: torch.Tensor, batch: int) -> None:
    with torch.no_grad():
        for i in range(0, len(x), batch):
            model(x[i:i + batch])


def run(tmp: Path) -> list[dict]:
    torch.set_num_threads(THREADS)
    rows = []
    for dataset, name in CASES:
        train, test = load_dataset(dataset)
        model = _train(name, train)
        fp32_path = export_onnx(model, torch.from_numpy(train.x[:2]), tmp / f"{name}.onnx")
        int8_path = quantize_int8(fp32_path, tmp / f"{name}.int8.onnx", INT8_MODE, train.x)
        acc = accuracy_delta(fp32_path, int8_path, test.x, test.y, threads=THREADS)
        fp32, int8 = OrtModel(fp32_path, THREADS), OrtModel(int8_path, THREADS)
        x = train.x[:SAMPLES]  # public-set style: unlabelled samples the agent sees every round
        xt = torch.from_numpy(x)
        for batch in BATCHES:
            torch_ms = _median_ms(lambda: _torch_infer(model, xt, batch))
            ort_ms = _median_ms(lambda: fp32(x, batch_size=batch))
            int8_ms = _median_ms(lambda: int8(x, batch_size=batch))
            rows.append({"model": name, "dataset": dataset, "batch": batch,
                         "torch_ms": round(torch_ms, 3), "ort_ms": round(ort_ms, 3),
                         "ort_int8_ms": round(int8_ms, 3),
                         "ratio": round(torch_ms / ort_ms, 3), "int8_ratio": round(torch_ms / int8_ms, 3),
                         "int8_acc_delta": round(acc["delta_points"], 3),
                         "fp32_acc": round(acc["fp32_acc"], 4), "int8_acc": round(acc["int8_acc"], 4),
                         "fp32_bytes": fp32_path.stat().st_size, "int8_bytes": int8_path.stat().st_size})
            print(f"{name:11s} b={batch:<5d} torch {torch_ms:8.2f} ms  ort {ort_ms:8.2f} ms  "
                  f"int8 {int8_ms:8.2f} ms  x{rows[-1]['ratio']:.2f} / x{rows[-1]['int8_ratio']:.2f}  "
                  f"int8 acc {acc['delta_points']:+.2f} pts", flush=True)
    return rows


def settings() -> dict:
    return {"samples": SAMPLES, "batches": list(BATCHES), "repeats": REPEATS, "train_steps": TRAIN_STEPS,
            "int8_mode": INT8_MODE, "torch_threads": torch.get_num_threads(), "ort_threads": THREADS,
            "torch": torch.__version__, "onnxruntime": ort.__version__,
            "machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version()}


def summary(rows: list[dict]) -> dict:
    out = {}
    for batch in BATCHES:
        sel = [r for r in rows if r["batch"] == batch]
        out[str(batch)] = {"median_ratio": statistics.median(r["ratio"] for r in sel),
                           "median_int8_ratio": statistics.median(r["int8_ratio"] for r in sel)}
    return out


def markdown(rows: list[dict], conf: dict, summ: dict) -> str:
    lines = [
        "# ONNX Runtime vs torch eager: public-set inference on the small zoo models",
        "",
        "Written by `python bench/onnx_speed.py`. Workload: 1000 samples of the dataset's train split, "
        "in batches of 32 and as one batch of 1000 (what an agent does each round on the public set). "
        f"Median of {conf['repeats']} runs after warm-up. Models trained for {conf['train_steps']} Adam "
        "steps first; int8 accuracy delta is on the test split (points, int8 minus fp32).",
        "",
        f"Settings: torch {conf['torch']} eager, eval + no_grad, torch threads = {conf['torch_threads']}; "
        f"onnxruntime {conf['onnxruntime']} via `OrtModel(threads={conf['ort_threads']})` "
        "(sequential, inter-op 1, all graph optimisations); int8 = "
        f"{conf['int8_mode']} QDQ (S8S8, per-channel, MinMax calibration on the train split). "
        f"Machine: {conf['machine']} ({conf['processor']}), 2 shared cores, other work running.",
        "",
        "**This is x86-64, not a Raspberry Pi.** Ratios on ARM (NEON, different int8 kernels) will differ; "
        "rerun this script on the board before relying on them.",
        "",
        "| model | dataset | batch | torch ms | ort fp32 ms | ort int8 ms | torch/ort | torch/int8 | int8 acc delta (pts) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['dataset']} | {r['batch']} | {r['torch_ms']:.2f} | {r['ort_ms']:.2f} | "
                     f"{r['ort_int8_ms']:.2f} | {r['ratio']:.2f} | {r['int8_ratio']:.2f} | {r['int8_acc_delta']:+.2f} |")
    lines += ["", "Median speedups over torch eager (ratio > 1 means faster than torch):", ""]
    for batch, s in summ.items():
        lines.append(f"* batch {batch}: onnxruntime fp32 x{s['median_ratio']:.2f}, "
                     f"onnxruntime int8 x{s['median_int8_ratio']:.2f}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="Also write the rows to this JSON file.")
    parser.add_argument("--out", default="docs/results", help="Directory for onnx_speed.md / .json.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(tmp))
    conf, summ = settings(), summary(rows)
    payload = {"rows": rows, "settings": conf, "summary": summ}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "onnx_speed.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out / "onnx_speed.md").write_text(markdown(rows, conf, summ))
    if args.json:
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    for batch, s in summ.items():
        print(f"median speedup batch {batch}: ort fp32 x{s['median_ratio']:.2f}, int8 x{s['median_int8_ratio']:.2f}")


if __name__ == "__main__":
    main()
