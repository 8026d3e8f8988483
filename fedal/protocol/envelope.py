"""Wire encoding of a Message (protocol version 2): one MessagePack array.

    [2, {meta}, {name: [dtype, [shape...], bytes]}]      (int8: [..., bytes, float32 scales])

MessagePack is a well-kept, language-neutral, self-describing format that cannot execute code
on load; a logits block at the paper's B = 32 is 1280 bytes, so the envelope must stay a few
dozen bytes: protocol keys travel under one-letter names (SHORT_KEYS), tensors as their dtype
code, shape and raw little-endian bytes. docs/protocol.md is the contract.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np

from fedal.protocol.message import Message
from fedal.protocol.wire_dtype import scale_name

PROTOCOL_VERSION = 2
# the protocol's own keys and their wire names; every other meta key travels as it is
SHORT_KEYS = {"phase": "p", "round": "r", "iteration": "i", "epoch": "e", "seq": "s", "instance": "x"}
LONG_KEYS = {v: k for k, v in SHORT_KEYS.items()}
# tensor dtypes on the wire: numpy's type codes, always little-endian
DTYPES = {code: np.dtype("<" + code) for code in ("f4", "f2", "f8", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8")}
DTYPES["b1"] = np.dtype(bool)
MAX_NDIM = 8
MAX_ELEMENTS = 1 << 31  # per tensor, also counting the axes of an empty one (a payload holds far fewer)
_UNPACK_LIMITS = {"max_str_len": 1 << 16, "max_array_len": 1 << 16, "max_map_len": 1 << 12, "max_ext_len": 0}


class EnvelopeError(ValueError):
    """A payload that is not a valid envelope of this protocol version."""

    kind = "envelope"  # the reject reason receivers count it under


def encode(message: Message) -> bytes:
    return msgpack.packb(_wire_object(message, with_data=True), use_bin_type=True)


def _wire_object(message: Message, with_data: bool, packed: set[str] | None = None) -> list[Any]:
    """The MessagePack object of `message`; without data, each tensor's bytes are left empty
    (what wire_size counts around). `packed`: _packed_scales(message.tensors), if known."""
    meta = _wire_meta(message)
    if packed is None:
        packed = _packed_scales(message.tensors)
    inside = {scale_name(name) for name in packed}  # travel within their tensor's entry
    tensors = {name: _pack_tensor(name, arr, message.tensors[scale_name(name)] if name in packed else None, with_data)
               for name, arr in message.tensors.items() if name not in inside}
    return [PROTOCOL_VERSION, meta, tensors]


def _wire_meta(message: Message) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, value in message.meta.items():
        if key in LONG_KEYS:
            raise ValueError(f"meta key {key!r} is reserved for the wire name of {LONG_KEYS[key]!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"meta {key}={value!r} is not a finite number")
        meta[SHORT_KEYS.get(key, key)] = value
    return meta


def _packed_scales(tensors: dict[str, np.ndarray]) -> set[str]:
    """The int8 tensors whose float32 scales (`<name>.scale`, one per row or one in all) travel
    inside their own entry: at B = 32 a separate entry would cost 25 bytes, 8 % of the tensor."""
    out = set()
    for name, arr in tensors.items():
        scale = tensors.get(scale_name(name))
        if (scale is not None and np.asarray(arr).dtype == np.int8 and np.asarray(arr).ndim >= 1
                and np.asarray(scale).dtype == np.float32 and np.asarray(scale).ndim == 1
                and len(scale) in (1, len(arr))):
            out.add(name)
    return out


def _pack_tensor(name: str, arr: np.ndarray, scale: np.ndarray | None = None, with_data: bool = True) -> list[Any]:
    a = _wire_array(name, arr)
    entry = [a.dtype.str[1:], list(a.shape), np.ascontiguousarray(a).tobytes() if with_data else b""]
    if scale is not None:
        entry.append(np.ascontiguousarray(scale, dtype="<f4").tobytes() if with_data else b"")
    return entry


def _wire_array(name: str, arr: np.ndarray) -> np.ndarray:
    """`arr` as it travels: a dtype with a wire code, little-endian."""
    a = np.asarray(arr)
    if a.dtype.str[1:] not in DTYPES or a.dtype.kind not in "fiub":
        raise ValueError(f"tensor {name!r}: dtype {a.dtype} has no wire code")
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a


def decode(payload: bytes) -> Message:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise EnvelopeError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True,
                              max_bin_len=len(payload), **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack's own errors, ValueError, RecursionError: refused, never fatal
        raise EnvelopeError(f"not a MessagePack envelope: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, list) or len(obj) != 3:
        raise EnvelopeError("an envelope is a 3-element array [version, meta, tensors]")
    version, raw_meta, raw_tensors = obj
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise EnvelopeError(f"protocol version {version!r} is not supported (expected {PROTOCOL_VERSION})")
    if not isinstance(raw_meta, dict) or not isinstance(raw_tensors, dict):
        raise EnvelopeError("meta and tensors must be maps")
    tensors: dict[str, np.ndarray] = {}
    for name, spec in raw_tensors.items():
        if not isinstance(name, str):
            raise EnvelopeError("tensor names must be strings")
        tensors[name] = _tensor(name, spec)
        if isinstance(spec, list) and len(spec) == 4:
            if scale_name(name) in raw_tensors:
                raise EnvelopeError(f"tensor {name!r} carries its scale and {scale_name(name)!r} is sent as well")
            tensors[scale_name(name)] = _scale(name, spec[3], tensors[name])
    return Message(_meta(raw_meta), tensors)


def _scale(name: str, data: Any, arr: np.ndarray) -> np.ndarray:
    """The float32 scales packed as the 4th element of an int8 tensor's entry."""
    if not isinstance(data, bytes) or len(data) % 4 or len(data) // 4 not in (1, len(arr)):
        raise EnvelopeError(f"tensor {name!r}: its scale must be float32 bytes, one per row or one in all")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


def _meta(raw: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, value in raw.items():
        if key in SHORT_KEYS:
            raise EnvelopeError(f"meta key {key!r} must travel as {SHORT_KEYS[key]!r}")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise EnvelopeError(f"meta {key!r} must be a scalar, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise EnvelopeError(f"meta {key!r} holds {value!r}, which is not a finite number")
        meta[LONG_KEYS.get(key, key)] = value
    return meta


def _tensor(name: str, spec: Any) -> np.ndarray:
    if not isinstance(spec, list) or len(spec) not in (3, 4):
        raise EnvelopeError(f"tensor {name!r} must be [dtype, shape, bytes] (int8: [dtype, shape, bytes, scales])")
    code, shape, data = spec[:3]
    if len(spec) == 4 and (code != "i1" or not isinstance(shape, list) or len(shape) < 1):
        raise EnvelopeError(f"tensor {name!r}: only int8 tensors with rows carry a scale")
    dtype = DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise EnvelopeError(f"tensor {name!r}: unknown dtype {code!r}")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise EnvelopeError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} non-negative integers")
    if not isinstance(data, bytes):
        raise EnvelopeError(f"tensor {name!r}: data must be binary")
    if math.prod(max(n, 1) for n in shape) > MAX_ELEMENTS:  # an empty tensor's other axes too: numpy refuses them
        raise EnvelopeError(f"tensor {name!r}: shape {shape} is larger than {MAX_ELEMENTS} elements")
    if math.prod(shape) * dtype.itemsize != len(data):
        raise EnvelopeError(f"tensor {name!r}: {len(data)} bytes do not hold {code} of shape {shape}")
    # a copy: receivers may write to what they get, and the payload's buffer is not theirs
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape)


def wire_size(message: Message) -> int:
    """Bytes `message` occupies on the wire (payload only, before MQTT framing), equal to
    len(encode(message)) without copying a tensor: the envelope around empty tensors, plus each
    tensor's bytes and the longer MessagePack bin header they need."""
    packed = _packed_scales(message.tensors)
    size = len(msgpack.packb(_wire_object(message, False, packed), use_bin_type=True))
    inside = {scale_name(name) for name in packed}
    for name, arr in message.tensors.items():
        n = np.asarray(arr).nbytes if name not in inside else 4 * np.asarray(arr).size  # scales: float32, in the entry
        size += n + _bin_header(n) - 2  # the empty bin's 2-byte header is in the skeleton
    return size


def _bin_header(n: int) -> int:
    return 2 if n < 1 << 8 else 3 if n < 1 << 16 else 5


def carried(message: Message) -> Message:
    """What a receiver decodes from encode(message), without encoding it: the same checks on the
    way out and in (meta through MessagePack itself, which is cheap), the tensors copied in the
    dtype they arrive in. A simulated link passes this and counts wire_size(message)."""
    raw = msgpack.unpackb(msgpack.packb(_wire_meta(message), use_bin_type=True), raw=False, strict_map_key=True,
                          **_UNPACK_LIMITS)
    tensors: dict[str, np.ndarray] = {}
    for name, arr in message.tensors.items():
        a = _wire_array(name, arr)
        if a.ndim > MAX_NDIM:
            raise EnvelopeError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} non-negative integers")
        tensors[name] = a.copy() if a.dtype.isnative else a.astype(a.dtype.newbyteorder("="))
    return Message(_meta(raw), tensors)
