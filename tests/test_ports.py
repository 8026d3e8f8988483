"""The server port picker: a port nothing listens on, from this process's slice of the range."""

from __future__ import annotations

import socket

import pytest

from fedal import ports


def test_a_picked_port_is_free_and_never_given_twice(monkeypatch):
    monkeypatch.delenv(ports.SLICE_ENV, raising=False)
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))  # nothing holds it


def test_slices_never_meet(monkeypatch):
    low, _ = ports._ephemeral_range()
    lo = 10000 if low > 12000 else 1024
    seen: list[set[int]] = []
    for k in range(3):
        monkeypatch.setenv(ports.SLICE_ENV, f"{k}/3")
        a, b = ports._slice(lo, low)
        got = {ports.free_port() for _ in range(40)}
        assert all(a <= p < b for p in got), (k, a, b)
        seen.append(got)
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2]) and not (seen[0] & seen[2])


@pytest.mark.parametrize("value, message", [("2", "expected K/N"), ("x/2", "expected K/N"), ("2/2", "K must be in"),
                                            ("0/0", "K must be in"), ("0/100000", "cannot be shared")])
def test_a_bad_slice_says_what_is_wrong(monkeypatch, value, message):
    monkeypatch.setenv(ports.SLICE_ENV, value)
    with pytest.raises(ValueError, match=message):
        ports.free_port()
