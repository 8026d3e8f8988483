"""The measuring tools behind bench/agent_footprint.py and the arm64 smoke run, on real processes:
a peak RSS that is the process's own (not inherited from a large parent), qemu's share taken out
of an RSS, and the `agent` extra's dependency closure."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def footprint():
    spec = importlib.util.spec_from_file_location("agent_footprint", REPO / "bench" / "agent_footprint.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_peak_rss_is_the_process_own_not_its_parents(footprint, tmp_path):
    ballast = bytearray(300 * 2**20)  # this test process is now larger than anything measured below
    ballast[:: 4096] = b"x" * len(ballast[:: 4096])
    small = footprint.Measured([sys.executable, "-S", "-c", "pass"], tmp_path / "small.json")
    rc, small_kib = small.wait(timeout=60)
    assert rc == 0 and small_kib is not None and small_kib < 100 * 1024, small_kib
    grow = "b = bytearray(120 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    big = footprint.Measured([sys.executable, "-S", "-c", grow], tmp_path / "big.json")
    rc, big_kib = big.wait(timeout=60)
    assert rc == 0 and 120 * 1024 <= big_kib < 300 * 1024, big_kib
    assert big.pid is not None and big.pid != big.proc.pid  # the launcher's child is what was measured
    failing = footprint.Measured([sys.executable, "-S", "-c", "raise SystemExit(3)"], tmp_path / "fail.json")
    assert failing.wait(timeout=60)[0] == 3
    del ballast


def test_rss_without_qemu_leaves_out_executable_anonymous_memory_and_the_heap(footprint):
    code = ("import mmap, sys\n"
            "m = mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,\n"
            "              prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)  # like qemu's code cache\n"
            "m.write(b'x' * (64 * 2**20))\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        rss = footprint.proc_status_kib(proc.pid, "VmRSS")["VmRSS"]
        guest = footprint.guest_rss_kib(proc.pid)
        assert rss >= 64 * 1024
        assert guest is not None and 0 < guest <= rss - 64 * 1024, (rss, guest)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert footprint.guest_rss_kib(proc.pid) is None  # gone: no reading, no crash


def test_agent_closure_has_torch_and_mqtt_but_no_web_stack(footprint):
    closure = {name.lower() for name in footprint.dependency_closure("fedal-edge", ("agent",))}
    assert {"torch", "paho-mqtt", "onnxruntime", "numpy"} <= closure
    assert not closure & {"fastapi", "uvicorn", "amqtt", "starlette"}


def test_a_measured_process_ends_with_its_launcher(footprint, tmp_path):
    """The agents the benchmark measures ran on under init, retrying a dead broker, when the
    benchmark was stopped: the measured process now gets SIGTERM when its launcher ends (and the
    launcher when the benchmark does)."""
    import os
    import signal
    import time

    m = footprint.Measured([sys.executable, "-S", "-c", "import time; time.sleep(120)"], tmp_path / "sleep.json")
    deadline = time.monotonic() + 30
    while m.pid is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.pid is not None
    os.kill(m.proc.pid, signal.SIGKILL)  # the launcher killed outright: nothing of its own runs
    m.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(m.pid, 0)
        except ProcessLookupError:
            break
        try:  # a zombie of init's, not yet reaped, counts as gone
            if Path(f"/proc/{m.pid}/stat").read_text().split()[2] == "Z":
                break
        except OSError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the measured process outlived its launcher")
