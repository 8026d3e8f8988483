"""The tests' port picker: ports a server can still bind a moment later on a busy machine."""

from __future__ import annotations

import socket

from fedal.ports import _ephemeral_range
from tests.waiting import free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_repeated():
    low, _high = _ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p < low for p in ports)  # never one the kernel gives an outgoing connection
    # while outgoing connections take ephemeral ports, a picked port stays bindable
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname()) for _ in range(50)]
        try:
            for port in ports[:20]:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        finally:
            for c in clients:
                c.close()
