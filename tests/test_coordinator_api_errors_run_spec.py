"""POST /api/v1/runs with a spec the coordinator cannot run answers 422 saying why, creates
nothing and leaves the service running: a discriminator too large to allocate (it used to try:
RuntimeError, 500, gigabytes taken for moderate widths), a public_file without `x` (KeyError,
500) or not a readable .npz (BadZipFile, 500). In process, then against a real coordinator."""

from __future__ import annotations

import signal

import httpx
import numpy as np
import pytest
import tomli_w

from coordinator.config import MAX_DISCRIMINATOR_PARAMS, RunSpec, discriminator_params, load_coordinator_config
from coordinator.runs import RunManager
from fedal.settings import SettingsError
from fedal_cli.demo import spawn, terminate
from tests.local_api import local_client
from tests.waiting import free_port, wait_for_port, wait_until

TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLIENTS = ["pi-1", "pi-2"]


def bad_public_files(state_dir) -> dict[str, tuple]:
    """name -> (public_file, what the 422 says), the files written into state_dir."""
    state_dir.mkdir(parents=True, exist_ok=True)
    np.savez(state_dir / "no_x.npz", y=np.zeros(3))
    (state_dir / "corrupt.npz").write_bytes(b"PK\x03\x04garbage")  # a truncated/corrupt .npz
    (state_dir / "empty.npz").write_bytes(b"")
    np.save(state_dir / "array.npy", np.zeros((4, 3), np.float32))
    np.savez(state_dir / "objects.npz", x=np.array([{"a": 1}], dtype=object))
    np.savez(state_dir / "flat.npz", x=np.zeros(5, np.float32))
    np.savez(state_dir / "nan.npz", x=np.full((3, 2), np.nan, np.float32))
    # labels beside a few rows: more bytes than an agent reads for those rows (the file, or inflated)
    np.savez(state_dir / "labels.npz", x=np.ones((10, 4)), y=np.zeros(200_000, np.int64))
    np.savez_compressed(state_dir / "labels_z.npz", x=np.ones((10, 4)), y=np.zeros(200_000, np.int64))
    return {
        "no_x": (state_dir / "no_x.npz", "holds no array x (it holds: y)"),
        "corrupt": (state_dir / "corrupt.npz", "is not a readable .npz file"),
        "empty": (state_dir / "empty.npz", "is not a readable .npz file"),
        "npy": (state_dir / "array.npy", "not an .npz holding an array x"),
        "objects": (state_dir / "objects.npz", "cannot be read as float32 rows"),
        "flat": (state_dir / "flat.npz", "at least one row"),
        "nan": (state_dir / "nan.npz", "NaN or infinite"),
        "labels": (state_dir / "labels.npz", "every agent would refuse it"),
        "labels_z": (state_dir / "labels_z.npz", "every agent would refuse it"),
    }


def spec(run_id: str, **fields) -> dict:
    return {"run_id": run_id, "client_ids": CLIENTS, **fields}


def disc(hidden: list[int]) -> dict:
    return {"run": {"strategy": "fedal", "dataset": "digits", "strategy_params": {"disc_hidden": hidden}}}


@pytest.fixture()
def client(tmp_path):
    cfg = load_coordinator_config(None, state_dir=tmp_path / "state", api={"token": TOKEN})
    runs = RunManager(cfg)
    yield local_client(runs, raise_server_exceptions=False), runs, tmp_path / "state"
    runs.store.close()


def test_bad_specs_are_refused_in_process(client):
    api, runs, state_dir = client
    bad = [(spec(f"pub-{name}", public_file=str(path)), needle) for name, (path, needle) in bad_public_files(state_dir).items()]
    bad += [
        (spec("huge", **disc([10_000_000, 10_000_000])), "less than or equal to 65536"),  # a width no run needs
        (spec("moderate", **disc([30_000, 30_000])), "disc_hidden [30000, 30000]"),  # 3.6 GB of float32
        (spec("zero", **disc([0])), "greater than or equal to 1"),
        (spec("negative", **disc([32, -5])), "greater than or equal to 1"),
        (spec("classes", num_classes=10**9), "num_classes"),
    ]
    for body, needle in bad:
        resp = api.post("/api/v1/runs", json=body, headers=AUTH)
        assert resp.status_code == 422 and needle in resp.text, (body, resp.status_code, resp.text)
    assert api.get("/api/v1/runs").json() == []  # nothing half-created
    assert runs.store.run_ids(origin="api") == []
    assert api.get("/healthz").json()["status"] == "ok"
    # a sound public file and a discriminator of sensible size still make runs
    np.savez(state_dir / "good.npz", x=np.zeros((20, 64), np.float32))
    assert api.post("/api/v1/runs", json=spec("good", public_file=str(state_dir / "good.npz"), **disc([32, 256])),
                    headers=AUTH).status_code == 201
    assert [r["run_id"] for r in api.get("/api/v1/runs").json()] == ["good"]


def test_the_discriminator_bound():
    assert discriminator_params(10, [32, 256], 2) == 10 * 32 + 32 + 32 * 256 + 256 + 256 * 2 + 2
    RunSpec.model_validate(spec("wide", **disc([2048, 4096])))  # 8.5 M parameters: within the bound
    RunSpec.model_validate(spec("many", client_ids=[f"c{i}" for i in range(10_000)]))  # the default, 10,000 clients
    with pytest.raises(ValueError, match="more than (the )?16,777,216"):
        RunSpec.model_validate(spec("big", **disc([4096, 4096])))
    assert MAX_DISCRIMINATOR_PARAMS == 1 << 24


def test_a_coordinator_config_with_a_discriminator_too_large_is_refused_at_load(tmp_path):
    path = tmp_path / "coordinator.toml"
    path.write_text(tomli_w.dumps({"client_ids": CLIENTS, "state_dir": str(tmp_path / "state"),
                                   **disc([100_000, 100_000])}))
    with pytest.raises(SettingsError, match="disc_hidden"):
        load_coordinator_config(path)


def test_a_live_coordinator_answers_422_and_keeps_running(mosquitto, tmp_path):
    """The reviewer's three inputs against a real coordinator process started with no run."""
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    state_dir = tmp_path / "state"
    public = bad_public_files(state_dir)
    config = tmp_path / "coordinator.toml"
    config.write_text(tomli_w.dumps({"state_dir": str(state_dir), "broker": {"url": mosquitto}, "threads": 1,
                                     "api": {"host": "127.0.0.1", "port": port, "token": TOKEN}}))
    config.chmod(0o600)
    log = tmp_path / "coordinator.log"
    coordinator = spawn("coordinator", config, log)
    try:
        wait_until(lambda: wait_for_port(port, timeout_s=1) or coordinator.poll() is not None, timeout_s=60,
                   what="the coordinator's API")
        assert coordinator.poll() is None, log.read_text()[-3000:]
        for body, needle in [
            (spec("big", run={"strategy_params": {"disc_hidden": [10_000_000, 10_000_000]}}), "disc_hidden"),
            (spec("nox", public_file=str(public["no_x"][0])), public["no_x"][1]),
            (spec("bad", public_file=str(public["corrupt"][0])), public["corrupt"][1]),
        ]:
            resp = httpx.post(f"{api}/api/v1/runs", json=body, headers=AUTH, timeout=60)
            assert resp.status_code == 422, (body, resp.status_code, resp.text, log.read_text()[-3000:])
            assert needle in resp.text, resp.text
        assert coordinator.poll() is None
        assert httpx.get(f"{api}/healthz", timeout=10).json() == {"status": "ok", "broker_connected": None, "runs": {}}
        assert httpx.get(f"{api}/api/v1/runs", timeout=10).json() == []
        assert "Traceback" not in log.read_text()
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        terminate([coordinator])
