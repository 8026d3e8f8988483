"""`python -m edge_agent --self-check`: does the agent's stack work on this device?

install-agent.sh runs it right after pip: a few training steps of the zoo's MNIST-1D CNN with the
device optimizer, the model written as ONNX and onnxruntime compared with torch. A torch that
cannot train here fails the install instead of the first run. A crashing exporter or an
onnxruntime that does not load is reported (`onnx`: the reason) and warned about, and does not
fail it: the agent never depends on exporting on the device, it keeps torch for inference then
(edge_agent/inference.py). Run as root, it also leaves compiled bytecode for exactly the modules the agent imports:
pip installs without bytecode, which keeps some 100 MB compiled for modules a device never
loads (sympy, torch's compiler) off the SD card.
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

PARITY_ATOL = 1e-4
COMPILER_STACK = ("torch._dynamo", "torch._inductor", "sympy")


class SelfCheckError(RuntimeError):
    """The agent's stack does not work here; the message says which part."""


def self_check(steps: int = 20, seed: int = 0) -> dict[str, Any]:
    from fedal.models import build_model
    from fedal.strategies.optim import Adam

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(64, 40)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, size=64))
    model = build_model("cnn1d", (40,), 10)
    opt = Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if not np.isfinite(losses).all() or not losses[-1] < losses[0]:
        raise SelfCheckError(f"training does not work here: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {steps} steps")
    train_loaded = sorted(m for m in sys.modules if m.startswith(COMPILER_STACK))

    onnx, ort_version, diff = "ok", None, None
    with tempfile.TemporaryDirectory(prefix="fedal-self-check-") as tmp:
        try:
            import onnxruntime

            from export import check_parity, export_onnx

            ort_version = onnxruntime.__version__
            path = export_onnx(model, x[:8], Path(tmp) / "model.onnx")
            diff = check_parity(model, path, x, atol=PARITY_ATOL)
        except Exception as exc:  # exporter crash, broken onnxruntime, parity failure
            onnx = (f"ONNX export or onnxruntime does not work here ({type(exc).__name__}: {exc}); "
                    "the agent keeps torch for inference and writes model.pt only")
    return {
        "status": "ok",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "onnx": onnx,
        "onnxruntime": ort_version,
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
        "onnx_max_abs_diff": diff,
        "compiler_stack_loaded_while_training": train_loaded,
        "seconds": round(time.perf_counter() - t0, 2),
    }
