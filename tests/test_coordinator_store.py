"""The run store: SQLite by default, PostgreSQL through a URL; rounds recorded once, the server
state round-trips, a changed config resets the run."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

from coordinator.store import RunStore, default_store_url, flat_metrics
from fedal.ports import free_port


def record(r: int) -> dict:
    return {"round": r, "mean_acc": 0.5 + r / 100, "bytes_up": 10 * r, "server": {"disc_loss": 2.0 - r / 10},
            "client_acc": [0.1, 0.2], "phases": {"transfer": {"p50_s": 0.1}}}


def exercise(store: RunStore) -> None:
    store.register("r1", {"run_id": "r1", "client_ids": ["a", "b"]}, "api")
    store.register("r0", {"run_id": "r0"}, "config")
    assert store.run_ids() == ["r1", "r0"] and store.run_ids(origin="api") == ["r1"]
    fresh = store.load("r1")
    assert fresh.completed_rounds == 0 and fresh.records == [] and fresh.state == "pending"
    assert store.load("nope") is None and store.load_server_state("r1") == {}

    state = {"disc": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7}
    progress = {"config_hash": "h" * 64, "completed_rounds": 1, "epoch": 0, "instance": "i-1", "started_at": 1.0,
                "state": "running"}
    store.save("r1", progress, [record(1)], {"a": {"answered": 3}, "b": {"answered": 2}}, state)
    # the next round re-sends the whole list: stored rounds are not written twice
    store.save("r1", {**progress, "completed_rounds": 2}, [record(1), record(2)], {"a": {"answered": 6}}, None)
    loaded = store.load("r1")
    assert loaded.completed_rounds == 2 and loaded.instance == "i-1" and loaded.config_hash == "h" * 64
    assert [r["round"] for r in loaded.records] == [1, 2] and loaded.records[1] == record(2)
    assert loaded.clients == {"a": {"answered": 6}}
    restored = store.load_server_state("r1")
    assert torch.equal(restored["disc"]["w"], state["disc"]["w"]) and restored["step"] == 7
    assert store.metric_series("r1", "mean_acc") == [(1, 0.51), (2, 0.52)]
    assert store.metric_series("r1", "server.disc_loss") == [(1, 1.9), (2, 1.8)]

    store.set_state("r1", "finished", 5.0)
    assert store.load("r1").state == "finished" and store.load("r1").finished_at == 5.0
    store.reset("r1")
    after = store.load("r1")
    assert after.records == [] and after.completed_rounds == 0 and after.config_hash is None
    assert store.load_server_state("r1") == {} and store.metric_series("r1", "mean_acc") == []
    assert after.spec == {"run_id": "r1", "client_ids": ["a", "b"]}  # the run itself is kept


def test_sqlite_store_is_one_file_under_the_state_dir(tmp_path):
    url = default_store_url(tmp_path / "state")
    store = RunStore(url)
    exercise(store)
    store.close()
    assert (tmp_path / "state" / "coordinator.db").is_file()
    reopened = RunStore(url)  # what a restarted coordinator sees
    assert reopened.run_ids() == ["r1", "r0"]
    reopened.close()


def test_flat_metrics_keeps_numbers_only():
    assert flat_metrics(record(3)) == {"mean_acc": 0.53, "bytes_up": 30.0, "server.disc_loss": 1.7}


def _postgres_bin() -> Path | None:
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin")):
        if (candidate / "initdb").exists():
            return candidate
    found = shutil.which("initdb")
    return Path(found).parent if found else None


@pytest.fixture()
def postgres_url():
    """A throwaway PostgreSQL server on a free loopback port (Debian's postgresql binaries)."""
    pytest.importorskip("psycopg")
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (Debian package postgresql) are not installed")
    # not under pytest's tmp dir: that is private to root, and PostgreSQL refuses to run as root
    tmp_path = Path(tempfile.mkdtemp(prefix="fedal-pg-"))
    data = tmp_path / "pg"
    env = dict(os.environ)
    run_as = []
    if os.geteuid() == 0:
        shutil.chown(tmp_path, "nobody")
        run_as = ["runuser", "-u", "nobody", "--"]
        env["HOME"] = str(tmp_path)
    port = free_port()  # not one the kernel hands out: initdb takes seconds before postgres binds it
    subprocess.run([*run_as, str(bindir / "initdb"), "-D", str(data), "-U", "fedal", "--auth=trust", "-E", "UTF8"],
                   check=True, capture_output=True, env=env)
    server = subprocess.Popen([*run_as, str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
                               "-k", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"postgresql+psycopg://fedal@127.0.0.1:{port}/postgres"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("PostgreSQL did not start")
                time.sleep(0.2)
        time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_postgresql_store_through_a_url(postgres_url):
    for attempt in range(20):  # the server accepts TCP a moment before it accepts logins
        try:
            store = RunStore(postgres_url)
            break
        except Exception:
            if attempt == 19:
                raise
            time.sleep(0.5)
    exercise(store)
    store.close()


def test_a_damaged_store_is_one_line_and_left_as_it_is(tmp_path):
    """A coordinator.db that is no database was a SQLAlchemy traceback at start."""
    import numpy as np
    from click.testing import CliRunner

    from coordinator.store import RunStore, StoreError
    from fedal_cli.main import cli

    state = tmp_path / "state"
    state.mkdir()
    damaged = b"not a database: a file damaged by a power cut " * 100
    (state / "coordinator.db").write_bytes(damaged)
    with pytest.raises(StoreError, match=r"^the run store sqlite:///.*coordinator.db cannot be opened: file is not a "
                                         r"database$"):
        RunStore(f"sqlite:///{state / 'coordinator.db'}")
    np.savez(tmp_path / "public.npz", x=np.zeros((20, 40), np.float32))
    (tmp_path / "c.toml").write_text(f'run_id = "r"\nclient_ids = ["a", "b"]\nnum_classes = 10\n'
                                     f'public_file = "{tmp_path / "public.npz"}"\nstate_dir = "{state}"\n'
                                     f'[api]\nport = {free_port()}\n')
    r = CliRunner().invoke(cli, ["coordinator", "--config", str(tmp_path / "c.toml")])
    assert r.exit_code == 1, r.output
    assert "Error: the run store" in r.output and "file is not a database" in r.output and "Traceback" not in r.output
    assert (state / "coordinator.db").read_bytes() == damaged


def test_a_store_the_toolkit_makes_is_its_owners_alone(tmp_path):
    """It lists every run's clients, their health and specs: mode 0600 (its WAL files too), in a
    folder of mode 0700 where the toolkit makes that folder; one that exists is left as it is."""
    store = RunStore(default_store_url(tmp_path / "state"))
    exercise(store)
    store.close()
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    made = [p for p in (tmp_path / "state").iterdir() if p.name.startswith("coordinator.db")]
    assert made and all(p.stat().st_mode & 0o077 == 0 for p in made), [(p.name, oct(p.stat().st_mode)) for p in made]

    # a URL with a query: the database file is the path alone (no stray file named after the query)
    store = RunStore(f"sqlite:///{tmp_path / 'q' / 'coordinator.db'}?timeout=20")
    exercise(store)
    store.close()
    assert sorted(p.name for p in (tmp_path / "q").iterdir() if "?" in p.name) == []
    assert (tmp_path / "q" / "coordinator.db").stat().st_mode & 0o077 == 0

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    (mine / "coordinator.db").touch(mode=0o644)
    os.chmod(mine / "coordinator.db", 0o644)
    store = RunStore(default_store_url(mine))
    exercise(store)
    store.close()
    assert mine.stat().st_mode & 0o777 == 0o755 and (mine / "coordinator.db").stat().st_mode & 0o777 == 0o644
