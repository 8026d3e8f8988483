"""Fake sysfs/procfs trees for the agent's health report (edge_agent/health.py reads under a root)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import tomli_w

PI_MODEL = "Raspberry Pi 4 Model B Rev 1.4"


def write(root: Path, rel: str, text: str | bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def common_tree(root: Path, *, mem_total_kb: int = 3_884_000, mem_available_kb: int = 3_100_000,
                rss_kb: int = 182_344, load: str = "0.52 0.61 0.70") -> Path:
    """What any Linux has: /proc and /etc."""
    write(root, "proc/loadavg", f"{load} 2/311 4242\n")
    write(root, "proc/meminfo", f"MemTotal:       {mem_total_kb} kB\nMemFree:          120000 kB\n"
                                f"MemAvailable:   {mem_available_kb} kB\nBuffers:           40000 kB\n")
    write(root, "proc/self/status", f"Name:\tpython3\nVmPeak:\t  400000 kB\nVmRSS:\t  {rss_kb} kB\nThreads:\t5\n")
    write(root, "proc/sys/kernel/osrelease", "6.6.51+rpt-rpi-v8\n")
    write(root, "etc/os-release", 'PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n')
    return root


def pi_tree(root: Path, *, temp_mc: int = 52_583, throttled: str | None = "0", model: str = PI_MODEL,
            **common) -> Path:
    """A Raspberry Pi: cpu-thermal zone, the firmware's get_throttled (hex, no 0x), device-tree model."""
    common_tree(root, **common)
    write(root, "sys/class/thermal/thermal_zone0/type", "cpu-thermal\n")
    write(root, "sys/class/thermal/thermal_zone0/temp", f"{temp_mc}\n")
    if throttled is not None:
        write(root, "sys/devices/platform/soc/soc:firmware/get_throttled", f"{throttled}\n")
    write(root, "proc/device-tree/model", model.encode() + b"\x00")
    return root


def set_agent_options(agent_config: Path, **options) -> None:
    """Override keys of one agent's TOML config (a Deployment's agents otherwise share overrides)."""
    cfg = tomllib.loads(agent_config.read_text())
    cfg.update({k: str(v) if isinstance(v, Path) else v for k, v in options.items()})
    agent_config.write_text(tomli_w.dumps(cfg))
