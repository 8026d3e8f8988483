"""A message on its way to the other side, encoded only where bytes are needed.

A real link (MQTT) sends `payload`, encoded once and kept for re-sends and the agent's
journal. A simulated link hands the receiver `received()` (what decoding the payload would
give: the same checks, copied tensors) and counts `size`, computed from the tensor sizes the
envelope carries, so a simulation pays no encode and no decode per message and still counts
the bytes a deployment sends.
"""

from __future__ import annotations

from fedal.protocol.envelope import carried, decode, encode, wire_size
from fedal.protocol.message import Message


class Packet:
    __slots__ = ("_message", "_payload", "_size")

    def __init__(self, message: Message | None = None, payload: bytes | None = None):
        if (message is None) == (payload is None):
            raise ValueError("a packet is made of a message or of its payload")
        self._message = message
        self._payload = payload
        self._size: int | None = None

    @classmethod
    def of(cls, message: Message) -> Packet:
        """A packet of `message`, checked as encoding checks it (ValueError, TypeError)."""
        packet = cls(message=message)
        packet._size = wire_size(message)
        return packet

    @property
    def message(self) -> Message:
        """The message as the sender made it (not a copy: a receiver takes `received()`)."""
        if self._message is None:
            assert self._payload is not None
            self._message = decode(self._payload)
        return self._message

    @property
    def payload(self) -> bytes:
        if self._payload is None:
            assert self._message is not None
            self._payload = encode(self._message)
        return self._payload

    @property
    def size(self) -> int:
        """Bytes on the wire (payload only, before MQTT framing)."""
        if self._payload is not None:
            return len(self._payload)
        if self._size is None:
            assert self._message is not None
            self._size = wire_size(self._message)
        return self._size

    def received(self) -> Message:
        """What the receiver decodes: its own copy, never the sender's arrays."""
        if self._payload is not None:
            return decode(self._payload)
        assert self._message is not None
        return carried(self._message)

    def __getstate__(self) -> tuple:  # __slots__ without __dict__: pickled explicitly (Ray ships packets)
        return self._message, self._payload, self._size

    def __setstate__(self, state: tuple) -> None:
        self._message, self._payload, self._size = state
