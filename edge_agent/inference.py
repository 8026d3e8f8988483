"""The agent's inference backend: onnxruntime for frozen forward passes, torch for training.

Frozen passes are the less-forgetting references and evaluation on the test set; the logits
uploaded to the coordinator keep their autograd graph, so they stay in torch. Every snapshot is
exported once and checked against torch on real rows before it is used. Export is never
required: if it fails on this device (some ARM torch builds have crashed in the exporter), the
agent says so and stays on torch. `auto` also times both on a batch once and keeps the faster.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from fedal.strategies.frozen import Frozen, TorchInference, frozen_copy

log = logging.getLogger("edge_agent.inference")
PARITY_ATOL = 1e-4


class OnnxInference:
    def __init__(self, mode: str, workdir: Path, threads: int, example: np.ndarray):
        if mode not in ("onnx", "auto"):
            raise ValueError(f"inference backend {mode!r}: use torch, onnx or auto")
        self.mode = mode
        self.workdir = Path(workdir)
        self.threads = threads
        self.example = torch.from_numpy(np.ascontiguousarray(example[:32], dtype=np.float32))
        self.torch = TorchInference()
        self.use_onnx: bool | None = None if mode == "auto" else True  # auto: decided by the first calibration
        self.reason = ""
        self.exports = 0

    @property
    def name(self) -> str:
        return "onnxruntime" if self.use_onnx else "torch"

    def snapshot(self, model: torch.nn.Module, reuse: Frozen | None = None) -> Frozen:
        """Exported afresh every time (the weights changed); `reuse` is accepted as TorchInference
        takes it, its module overwritten only while it runs on torch (an onnxruntime snapshot's
        module is the file's source, so it is never written to)."""
        if self.use_onnx is False:
            return self.torch.snapshot(model, reuse)
        frozen = frozen_copy(model)
        return Frozen(frozen, self._onnx_predictor(frozen))

    def predict(self, model: torch.nn.Module, x, batch_size: int = 1024) -> torch.Tensor:
        fast = self._onnx_predictor(frozen_copy(model))
        if fast is None:
            return self.torch.predict(model, x, batch_size)
        xt = torch.as_tensor(x)
        return torch.cat([fast(xt[i : i + batch_size]) for i in range(0, len(xt), batch_size)])

    def _onnx_predictor(self, frozen: torch.nn.Module):
        if self.use_onnx is False:
            return None
        try:
            ort = self._export(frozen)
        except Exception as exc:  # exporter crash, missing onnxruntime, parity failure: stay on torch
            self._decide(False, f"ONNX export or parity check failed on this device ({type(exc).__name__}: {exc})")
            return None
        if self.use_onnx is None:
            self._calibrate(frozen, ort)
            if not self.use_onnx:
                return None
        return lambda x: torch.from_numpy(ort(np.ascontiguousarray(x.detach().numpy(), dtype=np.float32)))

    def _export(self, frozen: torch.nn.Module):
        from export import export_onnx
        from export.session import OrtModel

        self.exports += 1
        path = self.workdir / "snapshots" / f"snapshot-{self.exports % 2}.onnx"
        export_onnx(frozen, self.example, path, mark=False)  # a round's snapshot, read by this agent alone
        ort = OrtModel(path, threads=self.threads)
        with torch.no_grad():
            want = frozen(self.example).numpy()
        diff = float(np.max(np.abs(ort(self.example.numpy()) - want)))
        if not diff <= PARITY_ATOL:
            raise ValueError(f"onnxruntime differs from torch by {diff:.2e} > {PARITY_ATOL}")
        return ort

    def _calibrate(self, frozen: torch.nn.Module, ort, repeats: int = 20) -> None:
        x = self.example
        with torch.no_grad():
            frozen(x)
            t0 = time.perf_counter()
            for _ in range(repeats):
                frozen(x)
            t_torch = (time.perf_counter() - t0) / repeats
        xn = x.numpy()
        ort(xn)
        t0 = time.perf_counter()
        for _ in range(repeats):
            ort(xn)
        t_ort = (time.perf_counter() - t0) / repeats
        faster = t_ort < t_torch
        self._decide(faster, f"calibration on a batch of {len(x)}: torch {t_torch * 1e3:.2f} ms, "
                             f"onnxruntime {t_ort * 1e3:.2f} ms")

    def _decide(self, use_onnx: bool, reason: str) -> None:
        self.use_onnx, self.reason = use_onnx, reason
        log.info("frozen forward passes on %s: %s", self.name, reason)


FINAL_ONNX_FILES = ("model.onnx", "model.int8.onnx")


def write_final_onnx(model: torch.nn.Module, example: np.ndarray, out: Path, int8: bool) -> list[Path]:
    """The deployable artifact: the final model as ONNX (and int8), or nothing if export fails here.
    Each file is whole or absent (written beside and renamed); an earlier run's are removed first,
    so none of another model's stays beside this run's model.pt. OSError (a full card) is raised:
    the caller exits so that a restart writes them."""
    for name in FINAL_ONNX_FILES:
        if (out / name).is_file() or (out / name).is_symlink():
            (out / name).unlink()
    written = []
    try:
        from export import export_onnx

        frozen = frozen_copy(model)
        path = export_onnx(frozen, torch.from_numpy(np.ascontiguousarray(example[:32], dtype=np.float32)), out / "model.onnx")
        written.append(path)
        if int8:
            from export.quantize import quantize_int8

            written.append(quantize_int8(path, out / "model.int8.onnx", mode="static", calibration=example[:256]))
    except OSError:
        raise
    except Exception as exc:
        log.warning("could not write the final model as ONNX on this device (%s: %s); model.pt is the artifact",
                    type(exc).__name__, exc)
    return written
