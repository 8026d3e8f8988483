"""Chunk reassembly under attack: a peer with a device's credentials cannot make a receiver hold
memory. Unit tests of the reassembler's checks on arrival and its byte budgets; then a real
Mosquitto provisioned by `fedal fleet init` and a real coordinator, where dev-3's account floods
chunks during a run: refused, counted in the API and /metrics, and the run finishes.
"""

from __future__ import annotations

import tracemalloc
import uuid

import numpy as np
import pytest

from fedal.protocol import ChunkError, EnvelopeError, Message, Reassembler, ReassemblyLimitError, encode, split

MiB = 1024 * 1024


def chunk(chunk_of: str, index: int, count: int, size: int, length: int) -> bytes:
    return encode(Message({"chunk_of": chunk_of, "index": index, "count": count, "size": size},
                          {"data": np.full(length, 7, np.uint8)}))


def whole(n_bytes: int) -> bytes:
    return encode(Message({"phase": "train"}, {"w": np.arange(n_bytes // 4, dtype=np.float32)}))


def test_a_chunk_bigger_than_its_declared_message_is_refused_on_arrival():
    r = Reassembler()
    with pytest.raises(ChunkError, match="holds 8388608 bytes"):
        r.feed("pi-1", chunk("a" * 32, 0, 24, 1000, 8 * MiB))
    assert r.open_messages == 0 and r.held_bytes() == 0


def test_chunks_beyond_the_declared_total_or_layout_are_refused():
    r = Reassembler()
    assert r.feed("pi-1", chunk("m", 0, 2, 3000, 2000)) is None  # slices of 2000: the last holds 1000
    with pytest.raises(ChunkError, match="its message's layout says 1000"):
        r.feed("pi-1", chunk("m", 1, 2, 3000, 2000))
    assert r.open_messages == 0  # the message cannot complete: dropped with the chunk
    r.feed("pi-1", chunk("n", 2, 3, 5000, 1000))  # the last chunk first: slices of 2000
    with pytest.raises(ChunkError, match="layout says 2000"):
        r.feed("pi-1", chunk("n", 0, 3, 5000, 1500))
    with pytest.raises(ChunkError, match="no chunk layout"):  # 3 slices of 500: smaller than split() cuts
        r.feed("pi-1", chunk("o", 0, 3, 1500, 500))
    with pytest.raises(ChunkError, match="no chunk layout"):  # 4 slices of 1024 cannot make 8000 bytes
        r.feed("pi-1", chunk("p", 0, 4, 8000, 1024))
    with pytest.raises(ChunkError, match="malformed"):
        r.feed("pi-1", encode(Message({"chunk_of": "q", "index": "0", "count": 2, "size": 3000},
                                      {"data": np.zeros(2000, np.uint8)})))
    with pytest.raises(ChunkError, match="out of bounds"):
        Reassembler(max_size=4096).feed("pi-1", chunk("r", 0, 5, 5000, 1024))
    assert r.open_messages == 0 and r.held_bytes() == 0


def test_a_redelivered_chunk_replaces_its_copy_and_messages_still_complete():
    payload = whole(300_000)
    parts = split(payload, 16 * 1024)
    r = Reassembler(max_size=len(payload), max_total_bytes=len(payload))
    for p in parts[:-1]:
        assert r.feed("pi-1", p) is None
    assert r.feed("pi-1", parts[3]) is None  # a QoS 1 redelivery
    assert r.held_bytes("pi-1") <= len(payload)
    out = r.feed("pi-1", parts[-1])
    assert out is not None and np.array_equal(out.tensors["w"], np.arange(75_000, dtype=np.float32))
    assert r.open_messages == 0 and r.held_bytes() == 0


def test_one_sender_never_holds_more_than_its_budget():
    cap = 1 * MiB
    r = Reassembler(max_size=cap, max_sender_bytes=cap)
    for _ in range(10):  # ten messages of one MiB, each missing its last chunk
        mid = uuid.uuid4().hex
        for i in range(15):
            r.feed("attacker", chunk(mid, i, 16, cap, 64 * 1024))
        assert r.open_bytes <= cap and r.held_bytes("attacker") <= cap
    assert r.open_messages == 1 and r.evicted["attacker"] == 9  # its own older messages made room
    with pytest.raises(ReassemblyLimitError, match="one sender"):
        Reassembler(max_size=2 * cap, max_sender_bytes=cap).feed("attacker", chunk("x", 0, 32, 2 * cap, 64 * 1024))
    # meanwhile an honest sender's message goes through untouched
    honest = whole(200_000)
    done = [r.feed("pi-2", p) for p in split(honest, 16 * 1024)]
    assert done[-1] is not None and r.evicted["pi-2"] == 0


def test_all_senders_together_never_exceed_the_total_budget():
    r = Reassembler(max_size=1 * MiB, max_total_bytes=2 * MiB)
    for sender in ("dev-1", "dev-2"):
        r.feed(sender, chunk(uuid.uuid4().hex, 0, 16, 1 * MiB, 64 * 1024))
    with pytest.raises(ReassemblyLimitError, match="does not fit"):
        r.feed("dev-3", chunk(uuid.uuid4().hex, 0, 16, 1 * MiB, 64 * 1024))
    assert r.open_bytes == 2 * MiB and r.open_messages == 2
    assert isinstance(ReassemblyLimitError("x"), EnvelopeError)  # receivers count it like any bad envelope


def test_a_flood_of_never_completed_chunks_cannot_grow_memory_past_the_cap():
    """The attack as it was reported: 24 chunks of 8 MiB under one chunk_of that declares 1000
    bytes; then the same memory sent as well-formed chunks of messages that never complete."""
    cap = 4 * MiB
    r = Reassembler(max_size=cap)  # per sender: cap; in total: 4 x cap
    flood = [chunk("f" * 32, i, 24, 1000, 8 * MiB) for i in range(24)]
    shaped = [chunk(f"{m:032x}", i, 16, cap, cap // 16) for m in range(12) for i in range(15)]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        refused = 0
        for payload in flood:
            try:
                r.feed("pi-1", payload)
            except ChunkError:
                refused += 1
        assert refused == 24 and r.held_bytes() == 0
        for payload in shaped:  # 12 x 15 x 256 KiB = 45 MiB sent, none of it completes
            r.feed("pi-1", payload)
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert r.held_bytes("pi-1") <= cap and r.open_bytes <= cap
    assert held < cap + 1 * MiB, held  # what stays allocated is what the budget allows, plus bookkeeping
    assert r.evicted["pi-1"] == 11
