"""A client restored between its upload and the server's feedback (an agent restarted) recomputes
the upload's forward for its graph; with BatchNorm that second train-mode forward counted the
upload's batch in the running statistics a second time. The restored client now ends the step in
exactly the state of one that ran through (parameters and buffers)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fedal.models.base import SplitModel
from fedal.strategies import ServerContext, StrategyParams, get_strategy
from tests.helpers import toy_dataset

IDS = ["c0", "c1", "c2"]


def bn_model() -> SplitModel:
    backbone = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
    return SplitModel(backbone, nn.Linear(8, 4), feature_dim=8, num_classes=4, input_shape=(6,))


def federation(strategy: str):
    spec = get_strategy(strategy)
    params = StrategyParams(tau=2).resolve(spec.preset)
    public = np.random.default_rng(0).normal(size=(50, 6)).astype(np.float32)
    clients = {}
    for i, cid in enumerate(IDS):
        torch.manual_seed(100 + i)
        clients[cid] = spec.client(cid, bn_model(), toy_dataset(seed=i), public, params, seed=7 + i)
    return clients, spec.server(params, IDS, ServerContext(num_classes=4, public_size=50, seed=0))


@pytest.mark.parametrize("strategy", ["fedal", "fedmd", "fedproto-public", "fccl"])
def test_a_client_restored_before_its_feedback_ends_the_step_as_one_that_ran_through(strategy):
    clients, server = federation(strategy)
    phase = server.begin_round(0)
    uploaded = False
    for _ in range(6):  # to the first upload; the next phase's tasks are the feedback on its rows
        results = {cid: clients[cid].handle(task) for cid, task in phase.tasks.items()}
        uploaded = clients["c0"].pending is not None
        checkpoint = copy.deepcopy(clients["c0"].state_dict())  # as an agent saves it, after the upload
        phase = server.collect(phase, results)
        if uploaded:
            break
    assert uploaded and checkpoint["pending"] is not None
    twin = federation(strategy)[0]["c0"]
    twin.load_state_dict(checkpoint)  # the restart: no graph kept, the upload's forward is recomputed
    clients["c0"].handle(phase.tasks["c0"])
    twin.handle(phase.tasks["c0"])
    ran, restored = clients["c0"].model.state_dict(), twin.model.state_dict()
    assert any("running_mean" in k for k in ran)
    for key in ran:
        assert torch.equal(ran[key], restored[key]), key
