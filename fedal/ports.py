"""A free loopback port for a server the toolkit is about to start (the demo's broker and API,
a private Mosquitto, the tests' servers): one picker for all of them."""

from __future__ import annotations

import os
import random
import socket

SLICE_ENV = "FEDAL_PORT_SLICE"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_given: set[int] = set()


def _slice(lo: int, high: int) -> tuple[int, int]:
    """The part of lo..high-1 this process picks from. Processes that start servers side by side
    (parallel test workers, CI jobs on one machine) each set FEDAL_PORT_SLICE=K/N (K in 0..N-1),
    inherited by what they start: their picks then never meet, and none takes a port another has
    picked but not yet bound (the coordinator binds its API only after torch has loaded)."""
    value = os.environ.get(SLICE_ENV, "").strip()
    if not value:
        return lo, high
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        raise ValueError(f"{SLICE_ENV}={value!r}: expected K/N, e.g. 0/2") from None
    if not (n >= 1 and 0 <= k < n):
        raise ValueError(f"{SLICE_ENV}={value!r}: K must be in 0..N-1")
    width = (high - lo) // n
    if width < 16:
        raise ValueError(f"{SLICE_ENV}={value!r}: {high - lo} ports cannot be shared {n} ways")
    return lo + k * width, lo + (k + 1) * width


def free_port() -> int:
    """A loopback port nothing listens on, for a server started next.

    Not one the kernel hands out (bind to port 0): between this check and the server's own bind,
    that port can go to any outgoing connection on the machine (each MQTT or HTTP client takes
    one) or to another worker asking the same, and the server then fails with "address already in
    use". Ports below the kernel's ephemeral range are never given to connections; a random pick
    there, never the same twice in this process, leaves only a collision with another process
    picking that very port in the same instant."""
    pick = random.SystemRandom()  # not the seeded global one: workers seeded alike would pick alike
    low, _high = _ephemeral_range()
    lo, high = _slice(10000 if low > 12000 else 1024, low)
    for _ in range(1000):
        port = pick.randrange(lo, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {lo}..{high - 1}")


def unreachable(host: str, port: int, timeout_s: float = 10.0) -> str | None:
    """Why nothing answers at host:port over TCP (None when something listens there): a check
    before handing an address to a client that would otherwise retry it silently for ever."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__
