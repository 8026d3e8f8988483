"""Waiting for ports and conditions in tests; no torch here, so broker-only tests stay light."""

from __future__ import annotations

import socket
import time


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_given: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on, for a server a test starts next.

    Not one the kernel hands out (bind to port 0): between this check and the server's own bind,
    that port can go to any outgoing connection on the machine (each MQTT or HTTP client takes
    one) or to another worker asking the same, and the server then fails with "address already in
    use". Ports below the kernel's ephemeral range are never given to connections; a random pick
    there, never the same twice in this process, leaves only a collision with another process
    picking that very port in the same instant."""
    import random

    pick = random.SystemRandom()  # not the seeded global one: workers seeded alike would pick alike
    low, _high = _ephemeral_range()
    lo = 10000 if low > 12000 else 1024
    for _ in range(1000):
        port = pick.randrange(lo, low)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {lo}..{low - 1}")


def wait_for_port(port: int, timeout_s: float = 10.0) -> bool:
    """True once something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def wait_until(predicate, timeout_s: float = 30, what: str = "condition", interval_s: float = 0.05):
    """predicate()'s first truthy value, polled until timeout_s; AssertionError naming `what` after."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}")
