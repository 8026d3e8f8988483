"""Local-only baseline: every client trains on its own data; nothing is exchanged."""

from __future__ import annotations

import numpy as np
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf, PhaseTasks, ServerHalf

PRESET = {"tau": 5, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0}


class LocalServer(ServerHalf):
    def begin_round(self, round_idx: int) -> PhaseTasks:
        tasks = {cid: self.task("local_train", round_idx, 0, steps=self.params.tau) for cid in self.client_ids}
        return PhaseTasks("local_train", round_idx, 0, tasks)

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        for res in results.values():
            self.record("local_loss", res.meta.get("loss", float("nan")))
        return None


class LocalClient(ClientHalf):
    def handle(self, task: Message) -> Message:
        if task.phase != "local_train":
            raise ValueError(f"unknown phase {task.phase!r}")
        return self.reply(task, loss=train_steps(self, int(task.meta.get("steps", self.params.tau))))


def train_steps(client: ClientHalf, steps: int) -> float:
    """Plain cross-entropy minibatch steps on the client's private data; returns the mean loss."""
    client.model.train()
    losses = []
    for _ in range(steps):
        x, y = client.sample_batch()
        loss = F.cross_entropy(client.model(x), y)
        client.optimizer.zero_grad()
        loss.backward()
        client.optimizer.step()
        losses.append(loss.item())
    return float(np.mean(losses)) if losses else 0.0
