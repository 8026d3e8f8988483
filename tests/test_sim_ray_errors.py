"""The Ray backend's errors: a run the cluster cannot host (more actors or resources than it has, or
resources other work holds) stops with one line instead of waiting forever; `--ray-address auto`
with no cluster and a ray:// address without Ray Client are one line, no traceback; and the
results' `backend` entry always carries its counts (0 when nothing happened).

The `fedal simulate` subprocesses come first: `--ray-address auto` must find no Ray instance, so
they run before this module's own local instance (2 CPUs and one `fedal_test_slot`) is started."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only
ray = pytest.importorskip("ray")

from fedal.sim import load_config, simulate  # noqa: E402
from fedal.sim.config import ConfigError  # noqa: E402
from tests.helpers import fedal_command  # noqa: E402

QUICK = ["--dataset", "digits", "--clients", "2", "--rounds", "1", "--strategy", "fedmd", "--public-size", "60",
         "--backend", "ray", "--quiet"]


def fedal(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    """`fedal ARGS` in its own session: one that hangs is ended with every Ray process it started."""
    cmd = fedal_command()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([*cmd, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`fedal {' '.join(args)}` still ran after {timeout} s (it waits forever?): {err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _one_line_error(r: subprocess.CompletedProcess, *parts: str) -> str:
    """The run failed as a usage error (exit 2), no traceback, and one `Error:` line holding `parts`."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, r.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def _ray_running(wait_s: float = 15.0) -> bool:
    """A Ray instance's GCS server runs on this machine (one that is shutting down is waited for)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        running = False
        for proc in psutil.process_iter(["name", "status"]):
            name, status = proc.info["name"] or "", proc.info["status"]
            if "gcs_server" in name and status != psutil.STATUS_ZOMBIE:
                running = True
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.5)


@pytest.mark.usefixtures("ray_may_start")
def test_cli_actors_that_ask_more_than_the_cluster_has_stop_at_once(tmp_path):
    """Before: the actor was never placed and the run waited silently forever."""
    started = time.monotonic()
    r = fedal("simulate", *QUICK, "--client-resources", "num_cpus=1000", cwd=tmp_path)
    line = _one_line_error(r, "1 Ray actor of num_cpus=1000 needs CPU=1000", "the Ray cluster has CPU=",
                           "--client-resources")
    assert time.monotonic() - started < 120, line
    assert not (tmp_path / "results.json").exists()


@pytest.mark.usefixtures("no_ray_starts_meanwhile")  # another worker's instance would be joined
def test_cli_ray_address_auto_without_a_cluster_is_one_line(tmp_path):
    if _ray_running():
        pytest.skip("a Ray instance runs on this machine: --ray-address auto would join it")
    r = fedal("simulate", *QUICK, "--ray-address", "auto", cwd=tmp_path)
    _one_line_error(r, "no Ray cluster at auto: start one with `ray start --head`, or leave --ray-address out "
                       "for a local instance")
    assert "ConnectionError" not in r.stderr


def test_cli_ray_client_address_without_ray_client_says_how_to_install_it(tmp_path):
    if importlib.util.find_spec("grpc") is not None:
        pytest.skip("Ray Client is installed here")
    r = fedal("simulate", *QUICK, "--ray-address", "ray://127.0.0.1:1", cwd=tmp_path)
    line = _one_line_error(r, "--ray-address ray://127.0.0.1:1 needs Ray Client",
                           f"pip install 'ray[client]=={ray.__version__}'", "virtualenv")
    assert "fedal-edge[ray]" not in line  # the `ray` extra is installed: it is not what is missing



def test_cli_ray_head_address_where_nothing_listens_is_one_line(tmp_path):
    """Before: `--ray-address 127.0.0.1:PORT` with nothing listening waited inside ray.init forever."""
    from tests.waiting import free_port

    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    r = fedal("simulate", *QUICK, "--ray-address", address, cwd=tmp_path, timeout=60)
    _one_line_error(r, f"no Ray cluster at {address} (", "`ray start --head`")
    assert time.monotonic() - started < 60
    assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("address", ["nohost", "host:port", ":6379", "10.0.0.1:70000"])
def test_ray_addresses_that_are_not_host_port_are_refused(address):
    from fedal.sim.ray_backend import RayClusterError, start_ray

    with pytest.raises(RayClusterError, match="not host:port, auto or ray://host:port"):
        start_ray(address, None, verbose=False)
    assert not ray.is_initialized()


# in this process, on a local instance of its own


@pytest.fixture(scope="module")
def local_ray(ray_may_start_in_module):
    ray.init(num_cpus=2, resources={"fedal_test_slot": 1}, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1", logging_level="ERROR")
    yield
    ray.shutdown()


def _config(**extra):
    base = dict(strategy="fedavg", dataset="mnist1d", clients=4, samples_per_client=60, public_size=60, rounds=1,
                seed=3, mnist1d_samples=1000, backend="ray", vectorize=False)
    return load_config(None, {**base, **extra})


def _all_free(cpus: float = 2.0) -> bool:
    """No actor of a refused run is left holding the instance's CPUs."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= cpus:
            return True
        time.sleep(0.5)
    return False


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("local_ray", "one_torch_thread")
def test_more_actors_than_cpus_are_refused_before_any_is_made():
    from fedal.sim.ray_backend import RayClusterError

    started = time.monotonic()
    with pytest.raises(RayClusterError) as err:
        simulate(_config(ray_actors=3))
    assert str(err.value) == ("3 Ray actors of num_cpus=1 each need CPU=3 in all, but the Ray cluster has CPU=2: "
                              "use --ray-actors 2 or fewer, or ask less in --client-resources")
    assert isinstance(err.value, ConfigError)  # what `fedal simulate` reports as one line
    assert time.monotonic() - started < 60
    assert _all_free() and ray.is_initialized()  # the joined instance is left as it was


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("local_ray", "one_torch_thread")
def test_resources_the_cluster_lacks_are_named():
    from fedal.sim.ray_backend import RayClusterError

    with pytest.raises(RayClusterError, match=r"^2 Ray actors of num_cpus=1,fedal_gpu_slot=1 each need "
                                              r"fedal_gpu_slot=2 in all, but the Ray cluster has fedal_gpu_slot=0: "):
        simulate(_config(ray_actors=2, client_resources="num_cpus=1,fedal_gpu_slot=1"))


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("local_ray", "one_torch_thread")
def test_actors_that_cannot_be_placed_in_time_stop_the_run(monkeypatch):
    """The cluster has the slot in all, but other work holds it: a bounded wait, then one line."""
    monkeypatch.setenv("FEDAL_RAY_START_TIMEOUT_S", "4")

    @ray.remote(num_cpus=0, resources={"fedal_test_slot": 1})
    class Holder:
        def ping(self) -> bool:
            return True

    holder = Holder.remote()
    try:
        assert ray.get(holder.ping.remote(), timeout=60)
        started = time.monotonic()
        with pytest.raises(ConfigError) as err:
            simulate(_config(ray_actors=1, client_resources="num_cpus=1,fedal_test_slot=1"))
        assert time.monotonic() - started < 90
    finally:
        ray.kill(holder)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("only 0 of 1 Ray actors (num_cpus=1,fedal_test_slot=1 each) started within 4 s; "
                              "the cluster has CPU=2, fedal_test_slot=0 free now"), message
    assert _all_free()  # the actor that waited is gone


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("local_ray", "one_torch_thread")
def test_the_backend_entry_always_has_its_counts():
    results = simulate(_config(clients=2, ray_actors=1))
    assert results["backend"] == {"name": "ray", "actors": 1, "actor_failures": 0, "lost_tasks": 0,
                                  "refused_tasks": 0, "restored_clients": 0}
