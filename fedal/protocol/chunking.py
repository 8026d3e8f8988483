"""Chunking of envelopes above a size limit, and their bounded reassembly.

Brokers cap packet sizes (Mosquitto's `message_size_limit`, constrained devices' buffers);
model weights exceed them. A large envelope travels as `count` chunk envelopes, each holding a
slice of the original bytes in tensor "data" and meta {chunk_of, index, count, size}. The
receiver reassembles per sender. A peer holding a device's credentials must not be able to make
it hold memory: every chunk is checked on arrival against the layout its message declared, and
a partial message reserves its declared size against a per-sender and a total budget, so what a
receiver keeps for unfinished messages never exceeds those budgets.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from fedal.protocol.envelope import EnvelopeError, decode, encode
from fedal.protocol.message import Message

DEFAULT_MAX_PAYLOAD = 256 * 1024
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # the largest reassembled envelope a receiver takes by default
MIN_CHUNK_BODY = 1024  # split() never cuts smaller slices (but the last one)
CHUNK_HEADER_ROOM = 512  # room left in max_payload for the chunk envelope's own header


class ChunkError(EnvelopeError):
    """A chunk that contradicts its message's declared layout or the protocol's limits."""

    kind = "chunk"


class ReassemblyLimitError(ChunkError):
    """A chunked message that does not fit in what the receiver keeps for unfinished messages."""

    kind = "chunk_budget"


def split(payload: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> list[bytes]:
    """The payloads to publish for one envelope: itself, or chunk envelopes of at most ~max_payload."""
    if len(payload) <= max_payload:
        return [payload]
    body = max(MIN_CHUNK_BODY, max_payload - CHUNK_HEADER_ROOM)
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
    body: int | None = None  # the length of every chunk but the last, once one chunk told it
    wire: int = 0  # bytes of the payloads that carried its chunks (redeliveries too): what it cost on the wire

    def expected_length(self, index: int) -> int:
        assert self.body is not None
        return self.body if index < self.count - 1 else self.size - (self.count - 1) * self.body


def _body_from(count: int, size: int, index: int, length: int) -> int | None:
    """The slice length a sender used, from one chunk of a message; None if no split() layout fits."""
    if count == 1:
        return length if length == size else None
    if index < count - 1:
        body = length
    else:  # the last chunk: the others share what is left
        rest = size - length
        if length <= 0 or rest <= 0 or rest % (count - 1):
            return None
        body = rest // (count - 1)
        if length > body:
            return None
    if body < MIN_CHUNK_BODY or -(-size // body) != count:
        return None
    return body


class Reassembler:
    """Chunked envelopes back into whole ones, per (sender, chunk_of).

    max_size: the largest message taken; max_sender_bytes: declared sizes of one sender's
    unfinished messages, together (default max_size); max_total_bytes: the same over all senders
    (default 4 x max_size); max_open: unfinished messages per sender. A sender's new message that
    would exceed its own count or bytes drops that sender's oldest unfinished ones (`evicted`);
    one that would exceed the total is refused. Memory held is at most max_total_bytes.
    """

    def __init__(self, max_size: int = MAX_MESSAGE_BYTES, max_open: int = 16, timeout_s: float = 300.0,
                 max_sender_bytes: int | None = None, max_total_bytes: int | None = None):
        self.max_size = int(max_size)
        self.max_open = int(max_open)
        self.timeout_s = timeout_s
        self.max_sender_bytes = int(max_sender_bytes or self.max_size)
        self.max_total_bytes = int(max_total_bytes or 4 * self.max_size)
        if min(self.max_size, self.max_open, self.max_sender_bytes, self.max_total_bytes) <= 0:
            raise ValueError("reassembly limits must be positive")
        self._open: dict[tuple[str, str], _Partial] = {}
        self.evicted: Counter[str] = Counter()  # per sender: unfinished messages dropped for its newer ones
        self.expired = 0
        self.last_wire_bytes = 0  # bytes on the wire of the message the last feed() returned

    def feed(self, sender: str, payload: bytes) -> Message | None:
        """Decode one received payload; returns the whole Message when it is complete."""
        self.last_wire_bytes = len(payload)  # what the message completed by this payload cost, all its chunks
        msg = decode(payload)
        if not is_chunk(msg):
            return msg
        self._expire()
        meta = msg.meta
        try:
            key = (sender, str(meta["chunk_of"]))
            index, count, size = _integer(meta["index"]), _integer(meta["count"]), _integer(meta["size"])
            data = msg.tensors["data"]
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ChunkError(f"malformed chunk: {exc!r}") from None
        if not (0 < count <= 1_000_000 and 0 <= index < count and 0 < size <= self.max_size):
            raise ChunkError(f"chunk out of bounds: index {index}, count {count}, size {size} (at most {self.max_size})")
        if data.dtype != np.uint8 or data.ndim != 1:
            raise ChunkError("chunk data must be a 1-D uint8 tensor")
        part = self._open.get(key)
        if part is not None and (part.count, part.size) != (count, size):
            del self._open[key]
            raise ChunkError("chunks of one message disagree on count or size")
        if part is None:
            body = _body_from(count, size, index, len(data))
            if body is None:
                raise ChunkError(f"chunk {index} of {count} holds {len(data)} bytes: no chunk layout of a "
                                 f"{size}-byte message has that (slices of at least {MIN_CHUNK_BODY} bytes)")
            self._admit(sender, size)
            part = self._open[key] = _Partial(count, size, time.monotonic(), body=body)
        want = part.expected_length(index)
        if len(data) != want:
            del self._open[key]
            raise ChunkError(f"chunk {index} of {count} holds {len(data)} bytes, its message's layout says {want}")
        part.parts[index] = data.tobytes()  # a repeated index (QoS 1 redelivery) replaces its copy
        part.wire += len(payload)
        if len(part.parts) < count:
            return None
        del self._open[key]
        self.last_wire_bytes = part.wire  # its own chunks only: an abandoned message's are never charged to it
        whole = b"".join(part.parts[i] for i in range(count))
        inner = decode(whole)
        if is_chunk(inner):
            raise ChunkError("nested chunking is not allowed")
        return inner

    def _admit(self, sender: str, size: int) -> None:
        """Room for a new unfinished message of `size` bytes from `sender`, or ReassemblyLimitError."""
        if size > self.max_sender_bytes:
            raise ReassemblyLimitError(f"a {size}-byte chunked message exceeds the {self.max_sender_bytes} bytes "
                                       "one sender may have in reassembly")
        own = sorted((k for k in self._open if k[0] == sender), key=lambda k: self._open[k].started)
        held = sum(self._open[k].size for k in own)
        while own and (len(own) >= self.max_open or held + size > self.max_sender_bytes):
            oldest = own.pop(0)
            held -= self._open.pop(oldest).size
            self.evicted[sender] += 1
        if self.open_bytes + size > self.max_total_bytes:
            raise ReassemblyLimitError(f"a {size}-byte chunked message does not fit: {self.open_bytes} of the "
                                       f"{self.max_total_bytes} bytes for reassembly are taken")

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, p in self._open.items() if now - p.started > self.timeout_s]:
            del self._open[key]
            self.expired += 1

    @property
    def open_messages(self) -> int:
        return len(self._open)

    @property
    def open_bytes(self) -> int:
        """Declared sizes of the unfinished messages: an upper bound of the bytes held for them."""
        return sum(p.size for p in self._open.values())

    def held_bytes(self, sender: str | None = None) -> int:
        """Chunk bytes actually stored for unfinished messages (of one sender, or all)."""
        return sum(len(b) for (s, _), p in self._open.items() if sender in (None, s) for b in p.parts.values())


def _integer(value: object) -> int:
    """A chunk field as an int: JSON integers only (a float, string or boolean is malformed)."""
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r}")
    return value
