"""Check that an exported ONNX file computes what the torch model computes.

An agent runs the ONNX file, the server reasons about the torch model; a silent mismatch
(wrong BatchNorm mode, a baked-in batch size, an exporter bug) would corrupt distillation.
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import torch

from .session import session_options

__all__ = ["ParityError", "check_parity"]

_ORT_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
}


class ParityError(RuntimeError):
    """The ONNX model's outputs differ from the torch model's by more than the tolerance."""


def check_parity(
    model: torch.nn.Module,
    onnx_path: str | os.PathLike[str],
    inputs: torch.Tensor,
    atol: float = 1e-4,
    threads: int | None = None,
) -> float:
    """Run `model` (eval, no_grad) and onnxruntime (CPU) on `inputs`; return the max abs diff.

    Raises ParityError if the outputs differ in shape, are not finite, or differ by more
    than `atol`. The model's train/eval mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            expected = model(inputs).detach().cpu().numpy()
    finally:
        model.train(was_training)

    options = session_options(threads or 0)  # errors only in the log; `threads` intra-op threads (0: all cores)
    session = ort.InferenceSession(
        os.fspath(onnx_path), sess_options=options, providers=["CPUExecutionProvider"]
    )
    (feed,) = session.get_inputs()
    array = inputs.detach().cpu().numpy()
    array = array.astype(_ORT_TO_NUMPY.get(feed.type, array.dtype), copy=False)
    actual = session.run(None, {feed.name: array})[0]

    if actual.shape != expected.shape:
        raise ParityError(
            f"ONNX output shape {actual.shape} != torch output shape {expected.shape} "
            f"for input shape {tuple(inputs.shape)} ({os.fspath(onnx_path)})"
        )
    if not (np.isfinite(expected).all() and np.isfinite(actual).all()):
        raise ParityError(f"non-finite outputs in torch or ONNX ({os.fspath(onnx_path)})")
    delta = actual.astype(np.float64) - expected.astype(np.float64)
    diff = float(np.max(np.abs(delta), initial=0.0))
    if diff > atol:
        raise ParityError(
            f"ONNX and torch outputs differ by up to {diff:.3g} > atol={atol:g} "
            f"for input shape {tuple(inputs.shape)} ({os.fspath(onnx_path)})"
        )
    return diff
