"""Warnings a sender controls, rate-limited: a flood of refused messages or requests cannot fill
the disk with log lines, and the next line that is written says how many were left out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["RateLimitedLog", "clip"]


def clip(text: str, limit: int = 300) -> str:
    """At most `limit` characters of a text that may quote a sender's bytes."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class RateLimitedLog:
    """Per key (a client id, or None for all): at most `burst` warnings at once, then `rate_per_s`
    a second (a token bucket)."""

    def __init__(self, logger: logging.Logger, what: str, burst: int = 20, rate_per_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.what = what  # e.g. "refused requests": "(3 more refused requests not logged)"
        self.burst, self.rate_per_s, self.clock = float(burst), rate_per_s, clock
        self.lock = threading.Lock()
        self._buckets: dict[Hashable, list[float]] = {}  # key -> [allowance, last time, skipped]

    def warning(self, msg: str, *args: Any, key: Hashable = None) -> bool:
        """Log it unless the key's allowance is spent; whether it was logged."""
        with self.lock:
            now = self.clock()
            bucket = self._buckets.setdefault(key, [self.burst, now, 0])
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate_per_s)
            bucket[1] = now
            if bucket[0] < 1:
                bucket[2] += 1
                return False
            bucket[0] -= 1
            skipped, bucket[2] = int(bucket[2]), 0
        self.logger.warning(msg + (f" ({skipped} more {self.what} not logged)" if skipped else ""), *args)
        return True
