"""The wire envelope: lossless round trip, and every malformed payload is an EnvelopeError."""

from __future__ import annotations

import json

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
    payload = bytearray(encode(Message({"phase": "x"})))
    text = payload.decode("latin-1").replace(f'\\"v\\": {PROTOCOL_VERSION}', '\\"v\\": 7')
    with pytest.raises(EnvelopeError, match="version"):
        decode(text.encode("latin-1"))


@pytest.mark.parametrize(
    "payload, needle",
    [
        (b"", "too short"),
        (b"\x00" * 4, "too short"),
        ((10**9).to_bytes(8, "little") + b"{}", "exceeds"),
        ((2).to_bytes(8, "little") + b"{}", "no fedal metadata"),
        ("not bytes", "must be bytes"),
    ],
)
def test_malformed_payloads(payload, needle):
    with pytest.raises(EnvelopeError, match=needle):
        decode(payload)


def test_metadata_must_be_a_json_object():
    header = json.dumps({"__metadata__": {"fedal": "[1, 2]"}}).encode()
    with pytest.raises(EnvelopeError, match="JSON object"):
        decode(len(header).to_bytes(8, "little") + header)


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


def test_dtypes_numpy_cannot_hold_are_refused_not_fatal():
    header = json.dumps({"__metadata__": {"fedal": json.dumps({"v": PROTOCOL_VERSION})},
                         "x": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(EnvelopeError):
        decode(len(header).to_bytes(8, "little") + header + b"\x00" * 4)


@pytest.mark.parametrize("meta", ['{"v": true}', '{"v": 1.0}', '{"v": 1, "loss": NaN}', '"just a string"'])
def test_metadata_must_be_strict(meta):
    header = json.dumps({"__metadata__": {"fedal": meta}}).encode()
    with pytest.raises(EnvelopeError):
        decode(len(header).to_bytes(8, "little") + header)


def test_encoding_refuses_non_finite_metadata():
    with pytest.raises(ValueError):
        encode(Message({"loss": float("nan")}))
