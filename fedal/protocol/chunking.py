"""Chunking of envelopes above a size limit, and their bounded reassembly.

Brokers cap packet sizes (Mosquitto's `message_size_limit`, constrained devices' buffers);
model weights exceed them. A large envelope travels as `count` chunk envelopes, each holding a
slice of the original bytes in tensor "data" and meta {chunk_of, index, count, size}. The
receiver reassembles per sender, with limits on total size, open messages and age so that a
flood of partial messages cannot exhaust memory.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from fedal.protocol.envelope import EnvelopeError, decode, encode
from fedal.protocol.message import Message

DEFAULT_MAX_PAYLOAD = 256 * 1024


def split(payload: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> list[bytes]:
    """The payloads to publish for one envelope: itself, or chunk envelopes of at most ~max_payload."""
    if len(payload) <= max_payload:
        return [payload]
    body = max(1024, max_payload - 512)  # room for the chunk envelope's own header
    msg_id = uuid.uuid4().hex
    count = -(-len(payload) // body)
    view = np.frombuffer(payload, dtype=np.uint8)
    return [
        encode(
            Message(
                {"chunk_of": msg_id, "index": i, "count": count, "size": len(payload)},
                {"data": view[i * body : (i + 1) * body]},
            )
        )
        for i in range(count)
    ]


def is_chunk(message: Message) -> bool:
    return "chunk_of" in message.meta


@dataclass
class _Partial:
    count: int
    size: int
    started: float
    parts: dict[int, bytes] = field(default_factory=dict)


class Reassembler:
    def __init__(self, max_size: int = 512 * 1024 * 1024, max_open: int = 64, timeout_s: float = 300.0):
        self.max_size = max_size
        self.max_open = max_open
        self.timeout_s = timeout_s
        self._open: dict[tuple[str, str], _Partial] = {}

    def feed(self, sender: str, payload: bytes) -> Message | None:
        """Decode one received payload; returns the whole Message when it is complete."""
        msg = decode(payload)
        if not is_chunk(msg):
            return msg
        self._expire()
        meta = msg.meta
        try:
            key = (sender, str(meta["chunk_of"]))
            index, count, size = int(meta["index"]), int(meta["count"]), int(meta["size"])
            data = msg.tensors["data"]
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise EnvelopeError(f"malformed chunk: {exc!r}") from None
        if not (0 < count <= 1_000_000 and 0 <= index < count and 0 < size <= self.max_size):
            raise EnvelopeError(f"chunk out of bounds: index {index}, count {count}, size {size}")
        if data.dtype != np.uint8 or data.ndim != 1:
            raise EnvelopeError("chunk data must be a 1-D uint8 tensor")
        part = self._open.get(key)
        if part is None:
            if len(self._open) >= self.max_open:
                oldest = min(self._open, key=lambda k: self._open[k].started)
                del self._open[oldest]
            part = self._open[key] = _Partial(count, size, time.monotonic())
        if (part.count, part.size) != (count, size):
            del self._open[key]
            raise EnvelopeError("chunks of one message disagree on count or size")
        part.parts[index] = data.tobytes()
        if len(part.parts) < count:
            return None
        del self._open[key]
        whole = b"".join(part.parts[i] for i in range(count))
        if len(whole) != size:
            raise EnvelopeError(f"reassembled {len(whole)} bytes, expected {size}")
        inner = decode(whole)
        if is_chunk(inner):
            raise EnvelopeError("nested chunking is not allowed")
        return inner

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self._open.items() if now - p.started > self.timeout_s]:
            del self._open[key]

    @property
    def open_messages(self) -> int:
        return len(self._open)
