"""Int8 quantisation of an exported fp32 ONNX model, and the accuracy it costs.

Two modes, both with onnxruntime.quantization and int8 (QInt8) weights:

* "dynamic" (the default of `quantize_int8`): needs no data. Weights are int8; activations
  are quantised on the fly per batch. Only MatMul/Gemm are quantised: onnxruntime's dynamic
  Conv (ConvInteger) has no fast CPU kernel and is usually *slower* than fp32, so conv
  layers stay fp32 in this mode. Right for MLPs and for classifier heads.
* "static": needs calibration rows (real inputs). Activation ranges are fixed from them
  (MinMax) and the graph is written in QDQ format (S8S8, per-channel weights), which
  onnxruntime fuses into int8 Conv/MatMul kernels. This is what can make conv-heavy
  models faster; the `fedal export` CLI uses it whenever a dataset supplies calibration data.

`quant_pre_process` (shape inference + graph optimisation) runs first, as onnxruntime
recommends: the quantiser needs tensor shapes to choose what to quantise.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    quant_pre_process,
    quantize_dynamic,
    quantize_static,
)

from fedal.atomic import write_bytes_atomic

from .onnx_export import mark_onnx
from .session import OrtModel

__all__ = ["MODES", "accuracy_delta", "quantize_int8"]

MODES = ("dynamic", "static")
CALIBRATION_BATCH = 32
MAX_CALIBRATION_ROWS = 512  # enough for MinMax ranges on small models; keeps calibration fast

_log = logging.getLogger(__name__)


class _RowsReader(CalibrationDataReader):
    """Feeds calibration rows to the calibrator in small batches."""

    def __init__(self, input_name: str, rows: np.ndarray, batch: int = CALIBRATION_BATCH) -> None:
        self._batches = iter([{input_name: rows[i:i + batch]} for i in range(0, len(rows), batch)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def quantize_int8(
    fp32_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    mode: str = "dynamic",
    calibration: np.ndarray | None = None,
) -> Path:
    """Write an int8 version of `fp32_path` to `out_path` and return it as a Path.

    mode="static" requires `calibration` ([n, *input_shape] real samples; at most
    MAX_CALIBRATION_ROWS are used). Raises ValueError for an unknown mode or missing data.
    """
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of: {', '.join(MODES)}")
    if mode == "static" and (calibration is None or len(calibration) == 0):
        raise ValueError("static quantization needs calibration samples (e.g. from --dataset)")
    fp32_path, out_path = Path(fp32_path), Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "int8.onnx"  # `out_path` is replaced only by a whole, marked file
        prepped = Path(tmp) / "prepped.onnx"
        try:
            quant_pre_process(str(fp32_path), str(prepped), skip_symbolic_shape=True)
            source = prepped
        except Exception as exc:  # pre-processing is an optimisation, not a requirement
            _log.warning("quant_pre_process failed (%s); quantising the raw model", exc)
            source = fp32_path
        if mode == "dynamic":
            quantize_dynamic(str(source), str(written), weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul", "Gemm"])
        else:
            rows = np.ascontiguousarray(calibration[:MAX_CALIBRATION_ROWS], dtype=np.float32)
            input_name = OrtModel(source, threads=1).input_name
            quantize_static(
                str(source), str(written), _RowsReader(input_name, rows),
                quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                per_channel=True,
                calibrate_method=CalibrationMethod.MinMax,
            )
        mark_onnx(written)
        write_bytes_atomic(out_path, written.read_bytes())
    return out_path


def accuracy_delta(
    fp32_path: str | os.PathLike[str],
    int8_path: str | os.PathLike[str],
    x: np.ndarray,
    y: np.ndarray,
    threads: int | None = None,
) -> dict[str, float]:
    """Top-1 accuracy of both models on (x, y): {fp32_acc, int8_acc, delta_points}.

    delta_points = 100 * (int8_acc - fp32_acc): negative means int8 lost accuracy.
    """
    y = np.asarray(y)
    fp32 = float((OrtModel(fp32_path, threads)(x).argmax(1) == y).mean())
    int8 = float((OrtModel(int8_path, threads)(x).argmax(1) == y).mean())
    return {"fp32_acc": fp32, "int8_acc": int8, "delta_points": 100.0 * (int8 - fp32)}
