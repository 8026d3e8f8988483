"""The agent's onnxruntime backend for frozen forward passes: same logits as torch, a safe
fallback when export fails on the device, and the deployable ONNX artifact."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import export
from edge_agent.inference import OnnxInference, write_final_onnx
from export.session import OrtModel
from fedal.models import build_model
from fedal.strategies.frozen import TorchInference
from tests.helpers import per_client, toy_federation

SHAPES = {"mlp": (40,), "cnn1d": (40,), "cnn1d_wide": (40,), "lenet5": (1, 8, 8), "smallcnn": (1, 8, 8)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", list(SHAPES))
def test_onnx_backend_gives_the_torch_logits_on_the_public_set(name, tmp_path):
    torch.manual_seed(0)
    model = build_model(name, SHAPES[name], 10)
    public = np.random.default_rng(1).normal(size=(200, *SHAPES[name])).astype(np.float32)
    backend = OnnxInference("onnx", tmp_path, threads=1, example=public)
    fast, ref = backend.snapshot(model), TorchInference().snapshot(model)
    x = torch.from_numpy(public)
    assert np.max(np.abs(fast(x).numpy() - ref(x).numpy())) <= 1e-4
    assert backend.use_onnx is True and backend.name == "onnxruntime"
    np.testing.assert_allclose(backend.predict(model, public, 64).numpy(),
                               TorchInference().predict(model, public, 64).numpy(), atol=1e-4)


def test_export_failure_on_the_device_falls_back_to_torch(tmp_path, monkeypatch, caplog):
    def broken(*_a, **_k):
        raise RuntimeError("exporter crashed")

    monkeypatch.setattr(export, "export_onnx", broken)
    model = build_model("mlp", (40,), 10)
    x = np.random.default_rng(0).normal(size=(16, 40)).astype(np.float32)
    backend = OnnxInference("onnx", tmp_path, threads=1, example=x)
    with caplog.at_level(logging.INFO, logger="edge_agent.inference"):
        out = backend.snapshot(model)(torch.from_numpy(x))
    assert backend.use_onnx is False and "exporter crashed" in caplog.text
    with torch.no_grad():
        assert torch.equal(out, model.eval()(torch.from_numpy(x)))
    assert write_final_onnx(model, x, tmp_path / "final", int8=False) == []  # and says so, not fatal


def test_auto_calibrates_once_and_says_why(tmp_path, caplog):
    model = build_model("cnn1d", (40,), 10)
    x = np.random.default_rng(0).normal(size=(64, 40)).astype(np.float32)
    backend = OnnxInference("auto", tmp_path, threads=1, example=x)
    with caplog.at_level(logging.INFO, logger="edge_agent.inference"):
        backend.snapshot(model)
        backend.snapshot(model)
    assert backend.use_onnx in (True, False)
    assert caplog.text.count("calibration on a batch of 32") == 1


def test_fedal_client_trains_the_same_with_either_backend(tmp_path):
    server_t, clients_t, _ = toy_federation("fedal", tau=2)
    server_o, clients_o, _ = toy_federation("fedal", tau=2)
    for cid, c in clients_o.items():
        c.inference = OnnxInference("onnx", tmp_path / cid, threads=1, example=c.train_data.x)
    from tests.helpers import in_process

    in_process(server_t, clients_t).run_round(0)
    in_process(server_o, clients_o).run_round(0)
    for cid in clients_t:
        assert clients_o[cid].inference.use_onnx is True
        for a, b in zip(clients_t[cid].model.parameters(), clients_o[cid].model.parameters()):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_final_artifacts_load_and_match(tmp_path):
    torch.manual_seed(0)
    model = build_model("smallcnn", (1, 8, 8), 10)
    x = np.random.default_rng(0).random(size=(300, 1, 8, 8)).astype(np.float32)
    paths = write_final_onnx(model, x, tmp_path, int8=True)
    assert [p.name for p in paths] == ["model.onnx", "model.int8.onnx"]
    fp32, int8 = OrtModel(paths[0], threads=1), OrtModel(paths[1], threads=1)
    with torch.no_grad():
        ref = model.eval()(torch.from_numpy(x)).numpy()
    assert np.max(np.abs(fp32(x) - ref)) <= 1e-4
    assert int8(x).shape == ref.shape and np.isfinite(int8(x)).all()


def test_agents_on_the_onnx_backend_over_mosquitto(mosquitto, tmp_path):
    from fedal.sim import load_config, simulate
    from tests.deployment import Deployment

    config = load_config(None, dict(strategy="fedal", dataset="digits", clients=3, rounds=2, tau=2, public_size=100, seed=8))
    dep = Deployment(config, tmp_path / "dep", mosquitto, agent={"inference_backend": "onnx", "export_int8": True})
    try:
        dep.start_all()
        results = dep.finish()
        for cid in ("c00", "c01", "c02"):
            assert dep.agents[cid].wait(timeout=60) == 0
    finally:
        dep.close()
    expected = simulate(per_client(config))["final"]["client_acc"]
    assert np.max(np.abs(np.array(results["final"]["client_acc"]) - np.array(expected))) <= 0.05
    for cid in ("c00", "c01", "c02"):
        final = dep.agent_path(cid).parent / "final"
        assert (final / "model.onnx").exists() and (final / "model.int8.onnx").exists()
