import contextlib
import fcntl
import os
from pathlib import Path

import pytest


def _share_ports_between_workers() -> None:
    """Each xdist worker (and what it starts) picks server ports from a slice of its own: two
    workers picking the same port before either binds it failed a coordinator with status 3."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count.isdigit() and "FEDAL_PORT_SLICE" not in os.environ:
        os.environ["FEDAL_PORT_SLICE"] = f"{int(worker[2:])}/{count}"


_share_ports_between_workers()

# Seconds the longest test files take in a run of the whole suite on two busy cores, three workers
# (pytest's durations; most of them start real processes). scripts/test.sh runs xdist with
# --no-loadscope-reorder: the workers take the files in collection order, and the order below puts
# the longest first, so that the workers finish together. xdist's own order, by number of tests, left
# files of a few long tests (a crashed agent, the real install) for the end, one worker idle meanwhile.
LONG_FILES = {
    "test_strategy_contract.py": 217, "test_sim_ray.py": 212, "test_agent_crash.py": 146,
    "test_setup_venv.py": 96, "test_process_signals.py": 93, "test_privacy.py": 78,
    "test_hil_proxy_mosquitto.py": 64, "test_sim_stop_signals.py": 56, "test_default_models.py": 51,
    "test_firmware_flash.py": 50, "test_firmware_wheelhouse.py": 49, "test_firmware_install_real.py": 47,
    "test_wire_dtype.py": 46, "test_coordinator_api.py": 43, "test_firmware_install.py": 35,
    "test_sim_ray_errors.py": 34, "test_agent_service_restarts.py": 34, "test_hil_fleet.py": 33,
    "test_dashboard_browser.py": 31, "test_runtime_dropout.py": 30, "test_hil_chaos_lossy.py": 30,
    "test_simulate.py": 29, "test_vectorized_clients.py": 23, "test_hil_emulated_strategies.py": 23,
    "test_crash_consistency.py": 23, "test_security_device_attack.py": 22, "test_cli_outputs.py": 22,
    "test_coordinator_pause_kept.py": 20, "test_export_cli.py": 18, "test_device_health.py": 18,
    "test_demo_linger.py": 18, "test_bench_usage_errors.py": 17, "test_agent_selfcheck.py": 17,
    "test_runtime_coordinator_restart.py": 16, "test_runtime_config.py": 16,
    "test_hil_proxy_wifi_lossy.py": 16, "test_hil_proxy_backlog.py": 16, "test_export_cli_errors.py": 16,
    "test_chaos_broker_restart.py": 16, "test_runtime_tls_auth.py": 15, "test_fleet_wheelhouse.py": 15,
    "test_sim_checkpoint.py": 45,
}


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first (LONG_FILES), the rest after them as collected; a file's tests stay
    together and in their order (a stable sort), as every xdist worker must collect alike."""
    items.sort(key=lambda item: -LONG_FILES.get(item.path.name, 0))


@pytest.fixture(scope="session", autouse=True)
def _fedal_cache(tmp_path_factory):
    """Generated datasets go to a cache private to this test session (never the user's)."""
    cache = tmp_path_factory.mktemp("fedal-cache")
    old = os.environ.get("FEDAL_CACHE_DIR")
    os.environ["FEDAL_CACHE_DIR"] = str(cache)
    yield Path(cache)
    if old is None:
        os.environ.pop("FEDAL_CACHE_DIR", None)
    else:
        os.environ["FEDAL_CACHE_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def _torch_threads_of_an_agent():
    """Tests compute in-process references at the thread count agents and `fedal simulate` use
    by default (1): a kernel's result can depend on how it splits its work between threads, and
    the count must not depend on which test ran before in the same worker."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def one_torch_thread():
    """Tiny models on shared CPU cores: extra intra-op threads only add contention stalls."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def mosquitto(mosquitto_server):
    """The session's Mosquitto with no retained `fedal/` message left by an earlier test: a run id
    is reused across tests ("demo"), and a retained status or manifest of another test's run would
    otherwise reach this one (counted as a reject, or worse)."""
    clear_retained(mosquitto_server)
    return mosquitto_server


def clear_retained(url: str) -> None:
    import threading
    import uuid

    import paho.mqtt.client as mqtt

    from fedal.protocol import parse_broker_url

    addr = parse_broker_url(url)
    seen: set[str] = set()
    marker = f"fedal/_sweeper/{uuid.uuid4().hex}"  # no run's topic: nobody else hears it
    swept = threading.Event()

    def on_message(_c, _u, msg):
        if msg.topic == marker:
            swept.set()
        elif msg.retain and msg.payload:
            seen.add(msg.topic)

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fedal-test-retained-sweeper")
    client.on_message = on_message
    client.connect(addr.host, addr.port)
    client.loop_start()
    try:
        client.subscribe("fedal/#", qos=1)
        # the broker sends a subscription's retained messages before anything published after it,
        # so once our own marker comes back every retained message is in, however loaded the machine
        client.publish(marker, b"1", qos=1)
        assert swept.wait(30), "the retained-message sweeper did not get its own marker back"
        for topic in sorted(seen):
            client.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)
    finally:
        client.loop_stop()
        client.disconnect()


@pytest.fixture(scope="session")
def mosquitto_server(tmp_path_factory):
    """A private Mosquitto on a free loopback port, with a generated config."""
    import shutil
    import subprocess

    from tests.waiting import free_port, wait_for_port

    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(binary).exists():
        pytest.fail("mosquitto is not installed: run the README's test command (scripts/test.sh installs it)")
    port = free_port()
    d = tmp_path_factory.mktemp("mosquitto")
    conf = d / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        f"log_dest file {d / 'mosquitto.log'}\nmax_queued_messages 10000\nset_tcp_nodelay true\n"
        + ("user root\n" if os.geteuid() == 0 else "")  # as root it would drop to a user that cannot write tmp
    )
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not wait_for_port(port):
        proc.kill()
        pytest.fail("mosquitto did not start")
    yield f"mqtt://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture()
def embedded_broker():
    from coordinator.broker import EmbeddedBroker
    from tests.waiting import free_port

    broker = EmbeddedBroker(port=free_port()).start()
    yield broker.url
    broker.stop()



@contextlib.contextmanager
def _ray_lock(tmp_path_factory, exclusive: bool):
    """A lock in the directory all xdist workers' temporary directories share: tests that start a
    Ray instance hold it shared, a test that needs no Ray instance anywhere on the machine (Ray's
    `auto` joins whichever it finds) holds it alone."""
    path = tmp_path_factory.getbasetemp().parent / "fedal-ray-instances.lock"
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture()
def ray_may_start(tmp_path_factory):
    """This test starts a Ray instance (in this process or in a command it runs)."""
    with _ray_lock(tmp_path_factory, exclusive=False):
        yield


@pytest.fixture(scope="module")
def ray_may_start_in_module(tmp_path_factory):
    """As `ray_may_start`, for a module-scoped Ray instance."""
    with _ray_lock(tmp_path_factory, exclusive=False):
        yield


@pytest.fixture()
def no_ray_starts_meanwhile(tmp_path_factory):
    """While this test runs, no other test on the machine starts a Ray instance."""
    with _ray_lock(tmp_path_factory, exclusive=True):
        yield


@pytest.fixture()
def unstarted_run(tmp_path):
    """A coordinator's run as the coordinator builds it, never started (no broker is needed)."""
    import numpy as np

    from coordinator.config import CoordinatorConfig
    from coordinator.run import Run

    np.savez(tmp_path / "public.npz", x=np.random.default_rng(0).standard_normal((100, 8), dtype=np.float32))
    cfg = CoordinatorConfig(run_id="race", client_ids=["a", "b"], public_file=tmp_path / "public.npz",
                            state_dir=tmp_path / "state", broker={"url": "mqtt://127.0.0.1:1"},
                            run={"strategy": "fedal", "rounds": 5, "public_size": 100})
    r = Run(cfg)
    r.store.register("race", r.run_spec(), "config")
    yield r
    r.store.close()
