"""Every module of the toolkit and every benchmark imports, in a fresh interpreter.

mypy checks the core's names; the runtimes, the HIL emulation and the benchmarks import the
core's functions by name too, and a name the core drops would otherwise surface only in the
subprocess of whichever test happens to start that module.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["fedal", "fedal_cli", "edge_agent", "coordinator", "export", "fleet", "hil", "mqtt_link"]

SCRIPT = """
import importlib, pkgutil, sys
failed = []
names = []
for package in sys.argv[1].split(","):
    module = importlib.import_module(package)
    names += [package] + [m.name for m in pkgutil.walk_packages(module.__path__, package + ".")]
sys.path.insert(0, "bench")
names += sys.argv[2].split(",")
for name in names:
    if name.endswith("__main__"):  # runs the command line
        continue
    try:
        importlib.import_module(name)
    except Exception as exc:  # every failure, not the first
        failed.append(f"{name}: {exc!r}")
print(len(names))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_and_benchmark_imports():
    benches = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
    assert benches and "sim_speed" in benches
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(PACKAGES), ",".join(benches)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert int(proc.stdout.split()[0]) > 100  # the walk found the modules
