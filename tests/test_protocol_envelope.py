"""The wire envelope: lossless round trip, and every malformed payload is an EnvelopeError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedal.protocol import PROTOCOL_VERSION, EnvelopeError, Message, decode, encode, wire_size


def test_round_trip_keeps_meta_dtypes_and_values():
    msg = Message(
        {"phase": "feedback", "round": 4, "iteration": 2, "n_avg": 9, "ok": True, "loss": 0.25, "note": None},
        {
            "fbar": np.random.default_rng(0).normal(size=(32, 10)).astype(np.float32),
            "indices": np.arange(32, dtype=np.int64),
            "w": np.ones((2, 3, 4), np.float64),
        },
    )
    back = decode(encode(msg))
    assert back.meta == msg.meta
    assert set(back.tensors) == set(msg.tensors)
    for k, v in msg.tensors.items():
        assert back.tensors[k].dtype == v.dtype and np.array_equal(back.tensors[k], v)
    assert wire_size(msg) == len(encode(msg))
    assert wire_size(msg) >= msg.tensor_bytes()


def test_wrong_version_is_refused():
    _, meta, tensors = msgpack.unpackb(encode(Message({"phase": "x"})))
    for version in (1, 7, True, 2.0, "2"):
        with pytest.raises(EnvelopeError, match="version"):
            decode(msgpack.packb([version, meta, tensors]))


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"", "not a MessagePack envelope"),
        (b"\xc1", "not a MessagePack envelope"),  # a byte MessagePack never uses
        (msgpack.packb([2, {}]), "3-element array"),
        (msgpack.packb({"v": 2}), "3-element array"),
        (msgpack.packb([2, [], {}]), "must be maps"),
        (msgpack.packb([2, {}, {"x": ["f4", [2], b"\0" * 4]}]), "do not hold"),
        (msgpack.packb([2, {}, {"x": ["bf16", [2], b"\0" * 4]}]), "unknown dtype"),
        (msgpack.packb([2, {}, {"x": ["f4", [-1], b""]}]), "non-negative"),
        (msgpack.packb([2, {}, {"x": ["f4", [0, 2**62], b""]}]), "larger than"),  # empty, yet no array holds it
        (msgpack.packb([2, {}, {"x": ["f4", [0, 2**20, 2**20, 2**20], b""]}]), "larger than"),
        (msgpack.packb([2, {}, {"x": ["f4", [1], "text"]}]), "binary"),
        (msgpack.packb([2, {}, {"x": ["f4", [1]]}]), "dtype, shape, bytes"),
        (msgpack.packb([2, {"r": [1, 2]}, {}]), "scalar"),
        (msgpack.packb([2, {"round": 1}, {}]), "must travel as 'r'"),
        (msgpack.packb([2, {1: 2}, {}]), "not a MessagePack envelope"),  # map keys must be strings
        ("not bytes", "must be bytes"),
    ],
)
def test_malformed_payloads(payload, needle):
    with pytest.raises(EnvelopeError, match=needle):
        decode(payload)


def test_protocol_keys_travel_under_short_names():
    msg = Message({"phase": "transfer", "round": 3, "iteration": 1, "epoch": 0, "seq": 9, "instance": "a1", "n_avg": 4})
    version, meta, tensors = msgpack.unpackb(encode(msg))
    assert version == PROTOCOL_VERSION == 2 and tensors == {}
    assert meta == {"p": "transfer", "r": 3, "i": 1, "e": 0, "s": 9, "x": "a1", "n_avg": 4}
    with pytest.raises(ValueError, match="reserved"):
        encode(Message({"p": 1}))  # a strategy key may not shadow a wire name


def test_envelope_bytes_at_the_papers_batch():
    """At B = 32, K = 10 a result's envelope costs under 5 % of its logits (1280 bytes)."""
    logits = Message({"epoch": 0, "seq": 300}, {"logits": np.zeros((32, 10), np.float32)})
    assert len(encode(logits)) - 1280 < 0.05 * 1280


def test_tensors_arrive_writable_and_native():
    back = decode(encode(Message({}, {"x": np.arange(6, dtype=">f4").reshape(2, 3), "b": np.array([True, False])})))
    assert back.tensors["x"].flags.writeable and back.tensors["x"].dtype == np.float32
    assert np.array_equal(back.tensors["x"], np.arange(6).reshape(2, 3)) and back.tensors["b"].dtype == bool
    with pytest.raises(ValueError, match="no wire code"):
        encode(Message({}, {"c": np.zeros(2, np.complex64)}))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(data):
    try:
        msg = decode(data)
    except EnvelopeError:
        return  # refused with the protocol's own error: the outcome wanted
    assert isinstance(msg, Message)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 400), st.integers(0, 255))
def test_mutated_envelopes_never_crash(pos, byte):
    good = bytearray(encode(Message({"phase": "logits", "round": 1}, {"logits": np.ones((4, 3), np.float32)})))
    good[pos % len(good)] = byte
    try:
        msg = decode(bytes(good))
    except EnvelopeError:
        return  # refused with the protocol's own error
    assert isinstance(msg, Message) and isinstance(msg.meta, dict)  # a surviving mutation is still well formed


@pytest.mark.parametrize("meta", [{"loss": float("nan")}, {"loss": float("inf")}, {"nested": {"a": 1}}])
def test_metadata_must_be_strict(meta):
    with pytest.raises(EnvelopeError):
        decode(msgpack.packb([PROTOCOL_VERSION, meta, {}]))


def test_encoding_refuses_non_finite_metadata():
    with pytest.raises(ValueError):
        encode(Message({"loss": float("nan")}))


@pytest.mark.parametrize("per", ["row", "tensor"])
def test_int8_scales_travel_inside_their_tensors_entry(per):
    from fedal.protocol.wire_dtype import encode_tensor

    x = np.random.default_rng(1).normal(size=(32, 10)).astype(np.float32)
    tensors = encode_tensor("logits", x, "int8", per)
    payload = encode(Message({"epoch": 0, "seq": 3}, tensors))
    _, _, wire = msgpack.unpackb(payload)
    assert list(wire) == ["logits"] and wire["logits"][0] == "i1" and len(wire["logits"]) == 4
    assert len(wire["logits"][3]) == 4 * (32 if per == "row" else 1)
    back = decode(payload).tensors
    assert sorted(back) == ["logits", "logits.scale"]
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and np.array_equal(back[k], v)
    assert len(payload) - 320 - (128 if per == "row" else 4) < 0.05 * 1280  # the int8 B = 32 block's overhead
    # a float32 tensor's ".scale" companion (not a quantized pair) stays an entry of its own
    plain = {"w": np.ones((2, 2), np.float32), "w.scale": np.ones(1, np.float32)}
    assert sorted(msgpack.unpackb(encode(Message({}, plain)))[2]) == ["w", "w.scale"]


@pytest.mark.parametrize("entry, needle", [
    (["i1", [2, 2], b"\x00" * 4, b"\x00" * 3], "scale must be float32 bytes"),
    (["i1", [2, 2], b"\x00" * 4, b"\x00" * 12], "scale must be float32 bytes"),
    (["i1", [2, 2], b"\x00" * 4, "text"], "scale must be float32 bytes"),
    (["f4", [1], b"\x00" * 4, b"\x00" * 4], "only int8 tensors with rows"),
    (["i1", [], b"\x00", b"\x00" * 4], "only int8 tensors with rows"),
])
def test_malformed_packed_scales_are_refused(entry, needle):
    with pytest.raises(EnvelopeError, match=needle):
        decode(msgpack.packb([PROTOCOL_VERSION, {}, {"q": entry}]))
    both = {"q": ["i1", [2, 2], b"\x00" * 4, b"\x00" * 4], "q.scale": ["f4", [1], b"\x00" * 4]}
    with pytest.raises(EnvelopeError, match="sent as well"):
        decode(msgpack.packb([PROTOCOL_VERSION, {}, both]))


def test_an_empty_tensor_of_a_reasonable_shape_still_travels():
    msg = decode(encode(Message({}, {"x": np.zeros((0, 10), np.float32)})))
    assert msg.tensors["x"].shape == (0, 10)
