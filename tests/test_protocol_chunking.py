"""Chunking: large envelopes split under the packet limit and reassembled, with bounds."""

from __future__ import annotations

import numpy as np
import pytest

from fedal.protocol import EnvelopeError, Message, Reassembler, decode, encode, split
from fedal.protocol.chunking import is_chunk


def big_message(n: int = 100_000) -> Message:
    return Message({"phase": "train", "round": 2}, {"w": np.arange(n, dtype=np.float32), "b": np.ones(3, np.int64)})


def test_small_payload_is_not_chunked():
    payload = encode(Message({"phase": "x"}, {"a": np.ones(4, np.float32)}))
    assert split(payload, 4096) == [payload]


def test_round_trip_in_any_order_and_interleaved_senders():
    payload = encode(big_message())
    parts = split(payload, 16 * 1024)
    assert len(parts) > 20 and all(len(p) <= 16 * 1024 for p in parts)
    assert all(is_chunk(decode(p)) for p in parts)
    other = split(encode(big_message(50_000)), 16 * 1024)
    r = Reassembler()
    rng = np.random.default_rng(0)
    done = {}
    items = [("a", p) for p in parts] + [("b", p) for p in other]
    for i in rng.permutation(len(items)):
        sender, part = items[i]
        out = r.feed(sender, part)
        if out is not None:
            done[sender] = out
    assert np.array_equal(done["a"].tensors["w"], np.arange(100_000, dtype=np.float32))
    assert len(done["b"].tensors["w"]) == 50_000 and r.open_messages == 0


def test_limits():
    parts = split(encode(big_message()), 16 * 1024)
    with pytest.raises(EnvelopeError, match="out of bounds"):
        Reassembler(max_size=100_000).feed("a", parts[0])
    r = Reassembler(max_open=2)
    for i in range(3):
        r.feed(f"s{i}", parts[0])
    assert r.open_messages == 3  # the limit is per sender: one sender cannot push out another's messages
    for _ in range(3):
        r.feed("s0", split(encode(big_message()), 16 * 1024)[0])
    assert r.open_messages == 4 and r.evicted["s0"] == 2  # s0's own oldest went
    forged = encode(Message({"chunk_of": "x", "index": 0, "count": 2, "size": 10}, {"data": np.zeros(5, np.float32)}))
    with pytest.raises(EnvelopeError, match="uint8"):
        Reassembler().feed("a", forged)
    a = encode(Message({"chunk_of": "y", "index": 0, "count": 2, "size": 2000}, {"data": np.zeros(1024, np.uint8)}))
    b = encode(Message({"chunk_of": "y", "index": 1, "count": 3, "size": 2000}, {"data": np.zeros(976, np.uint8)}))
    r = Reassembler()
    r.feed("a", a)
    with pytest.raises(EnvelopeError, match="disagree"):
        r.feed("a", b)
    assert r.open_messages == 0
