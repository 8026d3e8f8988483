"""The device's health, as the agent reports it with its status (docs/protocol.md section 3).

Everything is read from files under `root` ("/" on a device; a fake sysfs/procfs tree in tests,
or the host's mounted elsewhere in a container): CPU temperature from /sys/class/thermal, the
Raspberry Pi firmware's throttling state, load, memory, the agent's own RSS, versions and the
board model. A value the device does not have (no thermal zone, not a Pi) is left out, and
nothing here raises: a report must never take the MQTT link down with it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import fedal
from fedal.engine.health import MAX_TEXT

log = logging.getLogger("edge_agent.health")

THROTTLED_FILE = "sys/devices/platform/soc/soc:firmware/get_throttled"
CPU_ZONE_TYPES = ("cpu-thermal", "cpu_thermal", "soc_thermal", "x86_pkg_temp", "cpu")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except (OSError, ValueError):
        return None


def _clean(text: str | None) -> str | None:
    """One printable line, short enough for the coordinator to accept."""
    if text is None:
        return None
    text = "".join(ch for ch in text.replace("\x00", "").strip() if ch.isprintable())
    return text[:MAX_TEXT] or None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


class HealthProbe:
    """root: where /proc, /sys and /etc are read. disk_path: whose filesystem's free space counts
    (the agent's workspace). vcgencmd: the Pi tool asked for the throttling state when the
    firmware's sysfs file is missing; by default `vcgencmd` on PATH, and only with root "/"."""

    def __init__(self, root: str | Path = "/", disk_path: str | Path = ".", vcgencmd: str | None = "auto"):
        self.root = Path(root)
        self.disk_path = Path(disk_path)
        if vcgencmd == "auto":
            vcgencmd = shutil.which("vcgencmd") if self.root == Path("/") else None
        self.vcgencmd = vcgencmd
        self._versions: dict[str, str] | None = None

    def sample(self) -> dict[str, Any]:
        """One report; fields the device cannot tell are left out."""
        out: dict[str, Any] = {"ts": round(time.time(), 3)}
        for name, read in (("cpu_temp_c", self.cpu_temp_c), ("throttled", self.throttled), ("load", self.load),
                           ("memory", self.memory), ("disk", self.disk), ("rss_bytes", self.rss_bytes)):
            try:
                value = read()
            except Exception:  # a surprise in one file costs that field, never the report
                log.exception("cannot read the device's %s", name)
                continue
            if isinstance(value, dict):
                out.update(value)
            elif value is not None:
                out[name] = value
        out["versions"] = self.versions()
        return out

    def cpu_temp_c(self) -> float | None:
        """The CPU's thermal zone (by its type), else the first one that reads."""
        zones = []
        for zone in (self.root / "sys/class/thermal").glob("thermal_zone*"):
            index = zone.name.removeprefix("thermal_zone")
            if index.isdigit():
                kind = (_read(zone / "type") or "").strip()
                zones.append((kind not in CPU_ZONE_TYPES, int(index), zone))
        for _, _, zone in sorted(zones):
            raw = (_read(zone / "temp") or "").strip()
            if re.fullmatch(r"-?\d+", raw):
                return round(int(raw) / 1000.0, 1)  # millidegrees Celsius
        return None

    def throttled(self) -> int | None:
        """The firmware's get_throttled bits (docs/protocol.md section 3): its sysfs file, else
        `vcgencmd get_throttled`; None on other boards."""
        raw = _read(self.root / THROTTLED_FILE)
        if raw is not None:
            return _hex(raw)
        if self.vcgencmd is None:
            return None
        value = None
        try:
            done = subprocess.run([self.vcgencmd, "get_throttled"], capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            why = str(exc)
        else:
            why = f"exit {done.returncode}: {(done.stdout.strip() or done.stderr.strip())[:200]!r}"
            if done.returncode == 0:
                value = _hex(done.stdout.strip().removeprefix("throttled="))
        if value is None:
            log.warning("%s get_throttled gave no throttling state (%s); not asking again", self.vcgencmd, why)
            self.vcgencmd = None
        return value

    def load(self) -> dict[str, float] | None:
        fields = (_read(self.root / "proc/loadavg") or "").split()
        try:
            return {"load1": float(fields[0]), "load5": float(fields[1]), "load15": float(fields[2])}
        except (IndexError, ValueError):
            return None

    def memory(self) -> dict[str, int] | None:
        info = _kib_fields(_read(self.root / "proc/meminfo"))
        out = {}
        if "MemTotal" in info:
            out["mem_total_bytes"] = info["MemTotal"]
        if "MemAvailable" in info:
            out["mem_available_bytes"] = info["MemAvailable"]
        elif {"MemFree", "Cached"} <= set(info):  # kernels before 3.14
            out["mem_available_bytes"] = info["MemFree"] + info.get("Buffers", 0) + info["Cached"]
        return out or None

    def disk(self) -> dict[str, int] | None:
        path = self.disk_path.absolute()
        while not path.exists() and path != path.parent:  # the workspace may not be made yet
            path = path.parent
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return {"disk_total_bytes": st.f_blocks * st.f_frsize, "disk_free_bytes": st.f_bavail * st.f_frsize}

    def rss_bytes(self) -> int | None:
        return _kib_fields(_read(self.root / "proc/self/status")).get("VmRSS")

    def versions(self) -> dict[str, str]:
        """Read once: they do not change while the agent runs."""
        if self._versions is None:
            found = {
                "fedal": fedal.__version__,
                "torch": _package_version("torch"),
                "onnxruntime": _package_version("onnxruntime"),
                "python": platform.python_version(),
                "os": _os_name(self.root),
                "kernel": _clean(_read(self.root / "proc/sys/kernel/osrelease")),
                "arch": platform.machine() or None,
                "board": _clean(_read(self.root / "proc/device-tree/model")),
            }
            self._versions = {k: v for k, v in ((k, _clean(v)) for k, v in found.items()) if v}
        return dict(self._versions)


def _hex(text: str) -> int | None:
    text = text.strip().lower().removeprefix("0x")
    return int(text, 16) if re.fullmatch(r"[0-9a-f]{1,8}", text) else None


def _kib_fields(text: str | None) -> dict[str, int]:
    """/proc/meminfo or /proc/self/status lines `Name:   1234 kB`, in bytes."""
    out = {}
    for line in (text or "").splitlines():
        m = re.fullmatch(r"(\w+):\s+(\d+) kB", line.strip())
        if m:
            out[m.group(1)] = int(m.group(2)) * 1024
    return out


def _os_name(root: Path) -> str | None:
    for name in ("etc/os-release", "usr/lib/os-release"):
        text = _read(root / name)
        if text is not None:
            m = re.search(r'^PRETTY_NAME=(["\']?)(.*)\1\s*$', text, re.M)
            if m:
                return m.group(2)
    return None
