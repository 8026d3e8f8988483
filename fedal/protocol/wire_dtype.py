"""Reduced-precision exchange of per-row float tensors (a run's `wire_dtype`), in one place.

What a distillation strategy sends per public row (logits up; fbar and the discriminator's
gradients down) may travel as float32 (as computed), float16, or int8: symmetric quantization
with a float32 scale per row (or one per tensor), sent beside it as `<name>.scale`. Both ends
compute in float32: the sender encodes just before the message is built, the receiver decodes
right after it arrives. Simulation and deployment build and read messages through the same
halves, so both see the same rounding. A receiver takes exactly the form the run declared:
any other dtype, shape, a missing or stray scale is refused, as a float32 tensor is today.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

WIRE_DTYPES = ("float32", "float16", "int8")
INT8_SCALES = ("row", "tensor")
SCALE_SUFFIX = ".scale"
INT8_MAX = 127  # symmetric: -128 is never produced, so it is refused on receipt
FLOAT16_MAX = float(np.finfo(np.float16).max)
_WIRE_NUMPY = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


class WireDtypeError(ValueError):
    """A tensor not in the form the run's wire_dtype declares, or unusable once decoded."""

    def __init__(self, message: str, kind: str = "wire_dtype"):
        super().__init__(message)
        self.kind = kind  # the reject reason receivers count it under


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def encode_tensor(name: str, x: np.ndarray, wire_dtype: str, int8_scale: str = "row") -> dict[str, np.ndarray]:
    """The tensors that carry float32 `x` (rows along axis 0) as `wire_dtype`: {name: x} for
    float32 (the very array, so a float32 run is byte-identical to one without this setting)."""
    x = np.asarray(x)
    if x.dtype != np.float32 or x.ndim < 1:
        raise ValueError(f"{name}: only float32 arrays with rows are encoded, got {x.dtype} of shape {x.shape}")
    if wire_dtype == "float32":
        return {name: x}
    if wire_dtype == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: inf, which the receiver refuses
            return {name: x.astype(np.float16)}
    if wire_dtype != "int8":
        raise ValueError(f"unknown wire_dtype {wire_dtype!r}; expected one of {', '.join(WIRE_DTYPES)}")
    rows = x.reshape(len(x), -1).astype(np.float64)
    if int8_scale == "row":
        peak = np.max(np.abs(rows), axis=1) if rows.shape[1] else np.zeros(len(rows))
    elif int8_scale == "tensor":
        peak = np.array([np.max(np.abs(rows)) if rows.size else 0.0])
    else:
        raise ValueError(f"unknown wire_int8_scale {int8_scale!r}; expected one of {', '.join(INT8_SCALES)}")
    scale = (peak / INT8_MAX).astype(np.float32)
    # the integers are chosen against the float32 scale that is sent, so the receiver's grid is
    # exactly the one rounded to: |x - q * scale| <= scale / 2
    s = scale.astype(np.float64)[:, None] if int8_scale == "row" else scale.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s > 0, np.rint(rows / np.where(s > 0, s, 1.0)), 0.0)
    q = np.clip(q, -INT8_MAX, INT8_MAX).astype(np.int8).reshape(x.shape)
    return {name: q, scale_name(name): scale}


def decode_tensor(tensors: Mapping[str, np.ndarray], name: str, wire_dtype: str, int8_scale: str = "row",
                  shape: tuple[int, ...] | None = None, max_abs_value: float | None = None) -> np.ndarray:
    """The float32 array `name` of `tensors` carries under `wire_dtype`; WireDtypeError unless it
    is exactly that form (dtype, `shape` when given, scale present only for int8, of one
    finite, non-negative value per row or per tensor) and, decoded, finite and within max_abs_value."""
    arr = tensors.get(name)
    if arr is None:
        raise WireDtypeError(f"no {name!r} tensor")
    arr = np.asarray(arr)
    want_dtype = _WIRE_NUMPY.get(wire_dtype)
    if want_dtype is None:
        raise ValueError(f"unknown wire_dtype {wire_dtype!r}; expected one of {', '.join(WIRE_DTYPES)}")
    if arr.dtype != want_dtype:
        raise WireDtypeError(f"{name!r} must travel as {wire_dtype} (the run's wire_dtype), got {arr.dtype}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise WireDtypeError(f"{name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}", kind="result")
    if arr.ndim < 1:
        raise WireDtypeError(f"{name!r} must have rows, got a scalar", kind="result")
    scale = tensors.get(scale_name(name))
    if wire_dtype != "int8":
        if scale is not None:
            raise WireDtypeError(f"{scale_name(name)!r} sent, but the run's wire_dtype is {wire_dtype}, not int8")
        out = arr.astype(np.float32)
    else:
        if scale is None:
            raise WireDtypeError(f"int8 {name!r} without its float32 scale {scale_name(name)!r}")
        scale = np.asarray(scale)
        want_scale = (len(arr),) if int8_scale == "row" else (1,)
        if scale.dtype != np.float32 or tuple(scale.shape) != want_scale:
            raise WireDtypeError(f"{scale_name(name)!r} must be a float32 array of shape {want_scale} "
                                 f"(wire_int8_scale {int8_scale}), got {scale.dtype} of shape {tuple(scale.shape)}")
        if not np.all(np.isfinite(scale)):
            raise WireDtypeError(f"{scale_name(name)!r} contains NaN or infinity", kind="non_finite")
        if np.any(scale < 0):
            raise WireDtypeError(f"{scale_name(name)!r} holds a negative scale")
        if arr.size and int(arr.min()) < -INT8_MAX:
            raise WireDtypeError(f"{name!r} holds -128, outside symmetric int8's [-127, 127]")
        s = scale.reshape((-1,) + (1,) * (arr.ndim - 1))
        out = (arr.astype(np.float64) * s.astype(np.float64)).astype(np.float32)
    if out.size:
        peak = float(np.abs(out).max())  # one pass: NaN propagates through max, infinity is not finite
        if not math.isfinite(peak):
            raise WireDtypeError(f"{name!r} contains NaN or infinity", kind="non_finite")
        if max_abs_value is not None and peak > max_abs_value:
            raise WireDtypeError(f"{name!r} holds a value of magnitude {peak:.4g} once decoded, "
                                 f"above the run's max_abs_value {max_abs_value:g}", kind="magnitude")
    return out


def wire_round(x: np.ndarray, wire_dtype: str, int8_scale: str = "row") -> np.ndarray:
    """What the receiver of float32 `x` will hold: decode(encode(x)); `x` itself for float32."""
    if wire_dtype == "float32":
        return x
    return decode_tensor(encode_tensor("x", x, wire_dtype, int8_scale), "x", wire_dtype, int8_scale)
