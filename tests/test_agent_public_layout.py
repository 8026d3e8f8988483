"""An agent joins a run only where its data is laid out as the run's public set: most models
flatten what they get, so a mismatch trained and distilled on scrambled inputs without a word."""

from __future__ import annotations

import numpy as np

from edge_agent.agent import Agent
from edge_agent.config import AgentConfig
from fedal.data.public import content_hash
from fedal.protocol import RunManifest


def test_an_agent_whose_data_is_laid_out_unlike_the_public_set_does_not_join(tmp_path, caplog):
    """A device with rows of 44 values joined a run whose public set has rows of 40: the model
    (built for the device's data) flattened whatever it got, and trained and distilled on
    scrambled inputs without a word."""
    rng = np.random.default_rng(0)
    data = tmp_path / "train.npz"
    np.savez(data, x=rng.normal(size=(64, 44)).astype(np.float32), y=rng.integers(0, 10, 64))
    public = tmp_path / "public.npz"
    np.savez(public, x=rng.normal(size=(50, 40)).astype(np.float32))
    (tmp_path / "ws").mkdir()
    agent = Agent(AgentConfig(client_id="c0", run_id="r", model="cnn1d", data_file=data, public_file=public,
                              workspace=tmp_path / "ws"))
    manifest = RunManifest(run_id="r", strategy="fedal", strategy_params={}, num_classes=10, clients=["c0", "c1"],
                           rounds=2, public_hash=content_hash(np.load(public)["x"]), public_size=50, instance="i1")
    assert not agent._join(manifest)
    assert agent.client is None and "must be laid out alike" in caplog.text
    np.savez(public, x=rng.normal(size=(50, 1, 44)).astype(np.float32))  # (1, 44) is the same layout as (44,)
    manifest = manifest.model_copy(update={"public_hash": content_hash(np.load(public)["x"])})
    assert agent._join(manifest) and agent.client is not None
