"""The `health` object of an agent's status message (docs/protocol.md section 3): what the engine
accepts of it, and the flags an operator is shown.

A device is only trusted to describe itself, and a newer agent may send fields this coordinator
does not know: every field is checked on its own, and what fails (or is unknown) is left out and
reported, never the whole status refused (it still says the device is online).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Raspberry Pi firmware `get_throttled` bits: conditions now (0-3) and since boot (16-19)
THROTTLE_BITS = {0: "under_voltage", 1: "freq_capped", 2: "throttled", 3: "soft_temp_limit",
                 16: "under_voltage_occurred", 17: "freq_capped_occurred", 18: "throttled_occurred",
                 19: "soft_temp_limit_occurred"}
UNDER_VOLTAGE_NOW = 0x1
THROTTLED_NOW = 0xE  # frequency capped, throttled, soft temperature limit
FLAGS = ("under_voltage", "throttled", "hot", "low_memory", "low_disk")
VERSION_KEYS = ("fedal", "torch", "onnxruntime", "python", "os", "kernel", "arch", "board")
MAX_TEXT = 128

_NUMBERS: dict[str, tuple[float, float]] = {
    "ts": (0.0, 1e11),
    "cpu_temp_c": (-60.0, 200.0),
    "load1": (0.0, 1e4),
    "load5": (0.0, 1e4),
    "load15": (0.0, 1e4),
}
_INTEGERS: dict[str, int] = {
    "throttled": 2**32 - 1,
    "mem_total_bytes": 2**50,
    "mem_available_bytes": 2**50,
    "disk_total_bytes": 2**60,
    "disk_free_bytes": 2**60,
    "rss_bytes": 2**50,
}
FIELDS = (*_NUMBERS, *_INTEGERS, "versions")


def _number(value: Any, low: float, high: float) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not low <= value <= high:  # before float(): an int too large for a float is out of range, not an error
        return None
    return float(value)


def _text(value: Any) -> str | None:
    if not isinstance(value, str) or len(value) > MAX_TEXT or not value.isprintable():
        return None
    return value


def validate_health(raw: Any) -> tuple[dict[str, Any], list[str]]:
    """(the usable fields, why each other one was left out). A null field is simply absent."""
    if not isinstance(raw, dict):
        return {}, [f"health is a {type(raw).__name__}, not an object"]
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in raw.items():
        if value is None:
            continue
        if key in _NUMBERS:
            number = _number(value, *_NUMBERS[key])
            if number is None:
                problems.append(f"{key}: {_show(value)} is not a number in [{_NUMBERS[key][0]:g}, {_NUMBERS[key][1]:g}]")
            else:
                out[key] = number
        elif key in _INTEGERS:
            if type(value) is int and 0 <= value <= _INTEGERS[key]:
                out[key] = value
            else:
                problems.append(f"{key}: {_show(value)} is not an integer in [0, {_INTEGERS[key]}]")
        elif key == "versions":
            versions, bad = _versions(value)
            if versions:
                out[key] = versions
            problems += bad
        else:
            problems.append(f"unknown field {_show(key)}")
    return out, problems


def _versions(raw: Any) -> tuple[dict[str, str], list[str]]:
    if not isinstance(raw, dict):
        return {}, [f"versions: a {type(raw).__name__}, not an object"]
    out, problems = {}, []
    for key, value in raw.items():
        if key not in VERSION_KEYS:
            problems.append(f"unknown version {_show(key)}")
        elif value is not None:
            text = _text(value)
            if text is None:
                problems.append(f"versions.{key}: not a printable string of at most {MAX_TEXT} characters")
            else:
                out[key] = text
    return out, problems


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"  # never the repr of a big one
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def throttle_conditions(bits: int) -> list[str]:
    """The named conditions of a `get_throttled` value, now and since boot."""
    return [name for bit, name in THROTTLE_BITS.items() if bits >> bit & 1]


@dataclass(frozen=True)
class HealthLimits:
    """Where a reported value becomes a flag (the coordinator's `health` settings)."""

    max_cpu_temp_c: float = 80.0
    min_memory_available_bytes: int = 100 * 2**20
    min_disk_free_bytes: int = 500 * 2**20


def health_flags(health: dict[str, Any] | None, limits: HealthLimits) -> list[str]:
    """What needs the operator's eye in one client's last health, in FLAGS order."""
    if not health:
        return []
    found = set()
    bits = health.get("throttled", 0)
    if bits & UNDER_VOLTAGE_NOW:
        found.add("under_voltage")
    if bits & THROTTLED_NOW:
        found.add("throttled")
    if health.get("cpu_temp_c", -math.inf) >= limits.max_cpu_temp_c:
        found.add("hot")
    if health.get("mem_available_bytes", math.inf) < limits.min_memory_available_bytes:
        found.add("low_memory")
    if health.get("disk_free_bytes", math.inf) < limits.min_disk_free_bytes:
        found.add("low_disk")
    return [f for f in FLAGS if f in found]
