"""A simulated link counts bytes from tensor sizes and hands over what decoding would give:
both are checked against a real encode and decode, on messages of every kind the protocol carries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedal.protocol import EnvelopeError, Message, Packet, carried, decode, encode, wire_size
from fedal.protocol.wire_dtype import scale_name

DTYPES = ["<f4", ">f4", "<f2", "<f8", "<i1", "<u1", "<i2", "<i4", ">i8", "<u8", "?"]
# row counts around MessagePack's bin header steps (255/256, 65535/65536 bytes) for float32 x 4 columns
ROWS = [0, 1, 15, 16, 63, 64, 4095, 4096, 4097]

meta_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=40),
    st.floats(allow_nan=False, allow_infinity=False),
)


@st.composite
def messages(draw):
    meta = draw(st.dictionaries(st.text(min_size=2, max_size=12).filter(lambda k: k not in ("p", "r", "i", "e", "s", "x")),
                                meta_values, max_size=6))
    for key in draw(st.lists(st.sampled_from(["phase", "round", "iteration", "epoch", "seq", "instance"]), unique=True)):
        meta[key] = draw(st.integers(0, 2**40)) if key != "phase" and key != "instance" else draw(st.text(max_size=20))
    tensors = {}
    for k in range(draw(st.integers(0, 4))):
        dtype = np.dtype(draw(st.sampled_from(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        if draw(st.booleans()):
            shape = (draw(st.sampled_from(ROWS)), 4)
        arr = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape).astype(dtype)
        tensors[f"t{k}"] = arr.T if draw(st.booleans()) else arr  # not always contiguous
        if dtype == np.int8 and arr.ndim >= 1 and draw(st.booleans()):  # a packed scale, per row or one in all
            n = draw(st.sampled_from([1, len(arr)])) if len(arr) else 1
            tensors[scale_name(f"t{k}")] = np.linspace(0.5, 2.0, n, dtype=np.float32)
    return Message(meta, tensors)


@settings(max_examples=400, deadline=None)
@given(messages())
def test_wire_size_and_carried_equal_a_real_encode_and_decode(msg):
    payload = encode(msg)
    assert wire_size(msg) == len(payload)
    assert Packet.of(msg).size == len(payload) == Packet(payload=payload).size
    got, want = carried(msg), decode(payload)
    assert got.meta == want.meta and list(got.meta) == list(want.meta)
    assert set(got.tensors) == set(want.tensors)
    for name, arr in want.tensors.items():
        assert got.tensors[name].dtype == arr.dtype and got.tensors[name].shape == arr.shape
        assert np.array_equal(got.tensors[name], arr)


def test_the_receiver_gets_its_own_copy():
    logits = np.ones((32, 10), np.float32)
    packet = Packet.of(Message({"phase": "transfer"}, {"logits": logits}))
    got = packet.received()
    got.tensors["logits"][0, 0] = 7.0  # a receiver may write to what it gets
    logits[1, 1] = 9.0  # and the sender keeps its own
    assert packet.received().tensors["logits"][0, 0] == 1.0 and got.tensors["logits"][1, 1] == 1.0


def test_a_packet_is_encoded_once_and_only_when_bytes_are_needed(monkeypatch):
    import fedal.protocol.packet as packet_module

    calls = []
    monkeypatch.setattr(packet_module, "encode", lambda m: calls.append(m) or encode(m))
    packet = Packet.of(Message({"phase": "x"}, {"a": np.zeros(3, np.float32)}))
    packet.received(), packet.size
    assert calls == []
    assert packet.payload == packet.payload and len(calls) == 1
    assert decode(packet.payload).meta == {"phase": "x"}


@pytest.mark.parametrize("meta, error", [
    ({"loss": float("nan")}, ValueError),  # what encode refuses, a packet refuses at once
    ({"p": 1}, ValueError),
    ({"v": np.float32(1.0)}, TypeError),
    ({"v": [1, 2]}, EnvelopeError),  # what decode refuses, the receiver refuses
])
def test_a_packet_refuses_what_the_wire_refuses(meta, error):
    with pytest.raises(error):
        Packet.of(Message(meta)).received()
    with pytest.raises(error):
        decode(encode(Message(meta)))


def test_tensors_without_a_wire_code_are_refused():
    with pytest.raises(ValueError, match="wire code"):
        Packet.of(Message({}, {"c": np.zeros(2, np.complex64)}))
