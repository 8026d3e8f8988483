"""Wire encoding of a Message: safetensors with the metadata as one JSON string.

safetensors is a well-kept, language-neutral format that cannot execute code on load
(unlike pickle); its header holds string metadata, so the envelope is one self-describing blob.
"""

from __future__ import annotations

import json
from typing import NoReturn

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from fedal.protocol.message import Message

PROTOCOL_VERSION = 1
_META_KEY = "fedal"


class EnvelopeError(ValueError):
    """A payload that is not a valid envelope of this protocol version."""

    kind = "envelope"  # the reject reason receivers count it under


def encode(message: Message) -> bytes:
    meta = {**message.meta, "v": PROTOCOL_VERSION}
    arrays = {k: np.ascontiguousarray(v) for k, v in message.tensors.items()}
    return st_save(arrays, metadata={_META_KEY: json.dumps(meta, sort_keys=True, allow_nan=False)})


def decode(payload: bytes) -> Message:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise EnvelopeError(f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) < 8:
        raise EnvelopeError(f"payload too short ({len(payload)} bytes)")
    header_len = int.from_bytes(payload[:8], "little")
    if header_len > len(payload) - 8:
        raise EnvelopeError("header length exceeds payload size")
    try:
        header = json.loads(payload[8 : 8 + header_len])
        tensors = st_load(payload)
    except (SafetensorError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise EnvelopeError(f"not a safetensors envelope: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # e.g. a dtype numpy cannot hold (BF16, F8): refused, never fatal
        raise EnvelopeError(f"unsupported envelope content: {type(exc).__name__}: {exc}") from exc
    if not isinstance(header, dict):
        raise EnvelopeError("envelope header is not a JSON object")
    raw_meta = (header.get("__metadata__") or {}).get(_META_KEY)
    if raw_meta is None:
        raise EnvelopeError("envelope has no fedal metadata")
    try:
        meta = json.loads(raw_meta, parse_constant=_refuse_constant)
    except (ValueError, TypeError, RecursionError) as exc:
        raise EnvelopeError(f"metadata is not JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise EnvelopeError("metadata must be a JSON object")
    version = meta.pop("v", None)
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise EnvelopeError(f"protocol version {version!r} is not supported (expected {PROTOCOL_VERSION})")
    return Message(meta, dict(tensors))


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"metadata holds {name}, which is not JSON")


def wire_size(message: Message) -> int:
    """Bytes this message would occupy on the wire (payload only, before MQTT framing)."""
    return len(encode(message))
