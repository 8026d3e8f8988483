"""Local-only baseline: every client trains on its own data; nothing is exchanged."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf, PhaseTasks, ServerHalf, StrategySpec
from fedal.strategies.training import minibatch_steps

PRESET = {"tau": 5, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0}
# the phases of a round and their kind: "train" phases get the training deadline
PHASES = {"local_train": "train"}
# its own knobs, besides params.COMMON_PARAMS
PARAMS = ("local_epochs", "privacy")


class LocalServer(ServerHalf):
    def begin_round(self, round_idx: int) -> PhaseTasks:
        tasks = {cid: self.task("local_train", round_idx, 0, steps=self.params.tau) for cid in self.client_ids}
        return PhaseTasks("local_train", round_idx, 0, tasks)

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        for res in results.values():
            self.record("local_loss", res.meta.get("loss", float("nan")))
        return None


class LocalClient(ClientHalf):
    # its only step on private data goes through train_steps' private path
    @classmethod
    def private_plan(cls, params, n: int) -> tuple[int, int] | None:
        return local_step_count(params, int(params.tau or 1), n), 0

    def handle(self, task: Message) -> Message:
        if task.phase != "local_train":
            raise ValueError(f"unknown phase {task.phase!r}")
        return self.reply(task, **self.training_report(lambda: train_steps(self, self.task_steps(task))))


def train_steps(client: ClientHalf, steps: int) -> float:
    """Plain cross-entropy minibatch steps on the client's private data; returns the mean loss.
    With `local_epochs` > 0 these are that many passes over the data instead of `steps`. With
    differential privacy (client.private) as many DP-SGD steps on Poisson-sampled batches;
    PrivacyBudgetExhausted, before any step, when they would exceed the budget."""
    def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return F.cross_entropy(client.model(client.x_train[idx]), client.y_train[idx]), {}

    n = len(client.y_train)
    if client.private is not None:
        count = local_step_count(client.params, steps, n)
        client.private.check_budget(count)
        batches: Iterable[torch.Tensor] = client.private.batches(count)
    else:
        batches = local_batches(n, client.params, steps, client.generator)
    done = minibatch_steps(client.model, client.optimizer, batches, step, private=client.private)
    losses = [s["loss"] for s in done if "loss" in s]
    return float(np.mean(losses)) if losses else 0.0


def local_step_count(params, steps: int, n: int) -> int:
    """How many batches local_batches yields: `steps`, or local_epochs passes of batch_size rows
    (a last batch of one row joins the one before). Under differential privacy the same number
    of Poisson-sampled batches is drawn (each row joins with rate batch_size / n)."""
    epochs = int(getattr(params, "local_epochs", 0) or 0)
    if epochs <= 0:
        return steps
    b = params.batch_size
    return epochs * max(1, n // b + (1 if n % b > 1 else 0))


def local_batches(n: int, params, steps: int, generator: torch.Generator, epochs: int | None = None):
    """Row indices of one round's local minibatches over `n` samples.

    local_epochs = 0: `steps` batches of min(batch_size, n) rows, each drawn afresh without
    replacement (the toolkit's tau; what ClientHalf.sample_batch draws). local_epochs = E > 0:
    E shuffled passes over all rows in batches of batch_size (the FedAKD paper's unit, so a
    client with more data takes more steps); a last batch of a single row joins the one before,
    since BatchNorm cannot train on one sample. `epochs` (default: the params') overrides E.
    """
    if epochs is None:
        epochs = int(getattr(params, "local_epochs", 0) or 0)
    b = params.batch_size
    if epochs <= 0:
        for _ in range(steps):
            yield torch.randperm(n, generator=generator)[: min(b, n)]
        return
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator)
        chunks = list(perm.split(b))
        if len(chunks) > 1 and len(chunks[-1]) == 1:
            chunks[-2:] = [torch.cat(chunks[-2:])]
        yield from chunks


SPECS = (StrategySpec("local", LocalServer, LocalClient, PRESET, PHASES, PARAMS),)
