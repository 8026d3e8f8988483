"""FedAKD (Yu et al., KDD 2025): asynchronous two-way distillation for collaborative fairness.

Every client keeps a personal model w_k across rounds (`self.model`: what is evaluated,
checkpointed and exported) next to a working copy of the global model. Per round, client k:

1. global -> local: w_g frozen as teacher, w_k trains on its data D_k with
   CE(w_k(x), y) + alpha * T^2 * KL(softmax(w_g(x)/T) || softmax(w_k(x)/T));
2. selects I_k = the samples of D_k that w_k (eval mode, after step 1) classifies correctly
   (`akd_selection = all` keeps D_k: the paper's "All-Data" ablation; `akd_confidence` > 0
   additionally asks the predicted class's probability to reach it, an extension, off by default);
3. local -> global: w_k frozen as teacher, a copy w_gk of w_g trains on I_k with
   CE(w_gk(x), y) + beta * T^2 * KL(softmax(w_k(x)/T) || softmax(w_gk(x)/T)); empty I_k: w_g as is;
4. uploads w_gk with |D_k|; the server is FedAvg's (data-size-weighted average, BatchNorm
   buffers included).

Training lasts `local_epochs` passes over the data per step (the paper: 1), or tau minibatches
when local_epochs = 0. w_k keeps its optimizer across rounds; w_gk gets a fresh one every round,
because it is a new copy of w_g every round (as in the authors' code). Step 3 draws its batches
from its own generator, seeded like FedAvg's, so with beta = 0 and selection `all` a round is
exactly a FedAvg round whatever step 1 did. Before its first round w_k is set to the initial
global model (Algorithm 1, line 4). Teacher outputs are frozen forward passes in eval mode.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedal.privacy import PrivateTraining
from fedal.protocol import Message
from fedal.strategies.base import ClientHalf, InvalidResult, PhaseTasks, StrategySpec, make_optimizer
from fedal.strategies.fedavg import FedAvgServer, load_numpy_into, model_to_numpy
from fedal.strategies.local import local_batches, local_step_count
from fedal.strategies.losses import kl_per_row, kl_to_student
from fedal.strategies.training import minibatch_steps

PRESET = {"tau": 5, "local_epochs": 1, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0}
PHASES = {"init": "exchange", "train": "train"}  # FedAvg's round; the personal model stays on the device
PARAMS = ("local_epochs", "akd_alpha", "akd_beta", "akd_temperature", "akd_selection", "akd_confidence", "privacy")


class FedAKDServer(FedAvgServer):
    """FedAvg's server (init from one client, |D_k|-weighted average) plus FedAKD's diagnostics."""

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        if phase.phase == "train":
            sel, n = result.meta.get("selected"), result.meta["num_samples"]
            if isinstance(sel, bool) or not isinstance(sel, int) or not 0 <= sel <= n:
                raise InvalidResult(f"a train result must report 0 <= selected <= num_samples ({n}), got {sel!r}")

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase == "train":
            for res in results.values():
                self.record("selected_frac", res.meta["selected"] / res.meta["num_samples"])
                self.record("global_loss", res.meta.get("global_loss", float("nan")))
        return super().collect(phase, results)


class FedAKDClient(ClientHalf):
    # both distillations run on private data: with differential privacy each is DP-SGD (the
    # second over every private sample, those the personal model does not select adding 0), and
    # the number selected goes through the Gaussian mechanism (private_train)
    @classmethod
    def private_plan(cls, params, n: int) -> tuple[int, int] | None:
        return 2 * local_step_count(params, int(params.tau or 1), n), 1

    def __init__(self, client_id, model, train, public_x, params, seed):
        super().__init__(client_id, model, train, public_x, params, seed)
        self.global_model = copy.deepcopy(model)  # w_g, then w_gk; same architecture
        self.global_generator = torch.Generator().manual_seed(int(seed))  # step 3's batches
        self.personal_ready = False

    def handle(self, task: Message) -> Message:
        if task.phase == "init":
            return self.reply(task, model_to_numpy(self.model))
        if task.phase != "train":
            raise ValueError(f"unknown phase {task.phase!r}")
        self.load_task_weights(task)
        p = self.params
        steps = self.task_steps(task)
        if self.private is not None:
            return self.reply(task, model_to_numpy(self.global_model), num_samples=len(self.y_train),
                              **self.private_train(steps))
        # 1. global -> local
        teacher = self.inference.predict(self.global_model, self.x_train)
        loss_local = distill(self.model, self.optimizer, self.x_train, self.y_train, teacher, p.akd_alpha,
                             p.akd_temperature, local_batches(len(self.y_train), p, steps, self.generator))
        return self.local_to_global(task, steps, loss_local)

    def load_task_weights(self, task: Message) -> None:
        """w_g into the global model; w_k^0 = w^0 into the personal one at the first task."""
        load_numpy_into(self.global_model, task.tensors)
        if not self.personal_ready:
            load_numpy_into(self.model, task.tensors)
            self.personal_ready = True

    def local_to_global(self, task: Message, steps: int, loss_local: float) -> Message:
        """Steps 2 and 3, after the personal model's distillation: the result."""
        p = self.params
        # 2. selection, with the personal model's outputs that also teach step 3
        personal = self.inference.predict(self.model, self.x_train)
        keep = select(personal, self.y_train, p.akd_selection, p.akd_confidence)
        idx = torch.nonzero(keep).flatten()
        # 3. local -> global on I_k
        loss_global = float("nan")
        if len(idx):
            x, y, t = self.x_train[idx], self.y_train[idx], personal[idx]
            optimizer = make_optimizer(p, self.global_model.parameters())
            loss_global = distill(self.global_model, optimizer, x, y, t, p.akd_beta, p.akd_temperature,
                                  local_batches(len(idx), p, steps, self.global_generator))
        return self.reply(task, model_to_numpy(self.global_model), loss=loss_local, global_loss=loss_global,
                          selected=int(len(idx)), num_samples=len(self.y_train))

    def private_train(self, steps: int) -> dict[str, Any]:
        """Steps 1-3 with differential privacy: Poisson-sampled DP-SGD for both distillations;
        step 3 weighs each sample by whether the personal model selects it (a per-sample loss of
        0 otherwise, so each sample's gradient is still clipped alone), over the expected batch;
        the number selected released through the Gaussian mechanism. Over budget: no step, the
        global model sent back as it came, selected 0."""
        private, p, n = self.private, self.params, len(self.y_train)
        assert private is not None

        def work() -> int:
            count = local_step_count(p, steps, n)
            private.check_budget(2 * count, releases=1)
            teacher = self.inference.predict(self.global_model, self.x_train)
            distill(self.model, self.optimizer, self.x_train, self.y_train, teacher, p.akd_alpha, p.akd_temperature,
                    private.batches(count), private=private)
            personal = self.inference.predict(self.model, self.x_train)
            keep = select(personal, self.y_train, p.akd_selection, p.akd_confidence)
            optimizer = make_optimizer(p, self.global_model.parameters())
            distill(self.global_model, optimizer, self.x_train, self.y_train, personal, p.akd_beta, p.akd_temperature,
                    private.batches(count), private=private, weights=keep.to(torch.float32))
            return private.release_count(int(keep.sum()), most=n)

        report, selected = private.spend(self.client_id, work)
        return {**report, "selected": selected or 0}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "global_generator": self.global_generator.get_state(),
                "personal_ready": self.personal_ready}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.global_generator.set_state(state["global_generator"])
        self.personal_ready = bool(state["personal_ready"])


def select(logits: torch.Tensor, y: torch.Tensor, selection: str, confidence: float = 0.0) -> torch.Tensor:
    """Boolean mask of the samples that go into local -> global distillation."""
    if selection == "all":
        return torch.ones(len(y), dtype=torch.bool)
    if selection != "correct":
        raise ValueError(f"unknown selection {selection!r}; use correct or all")
    keep = logits.argmax(dim=1) == y
    if confidence > 0:
        keep &= F.softmax(logits, dim=1).max(dim=1).values >= confidence
    return keep


def distill(student: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
            teacher_logits: torch.Tensor, weight: float, temperature: float, batches,
            private: PrivateTraining | None = None, weights: torch.Tensor | None = None) -> float:
    """Minibatch steps on CE(student(x), y) + weight * T^2 * KL(softmax(teacher/T) || softmax(student/T));
    returns the mean loss. `weights` (differential privacy): each sample's loss times its weight,
    still a mean over the batch, so that every sample's gradient is its own."""
    def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        out = student(x[idx])
        if weights is None:
            loss = F.cross_entropy(out, y[idx])
            return loss + weight * temperature**2 * kl_to_student(teacher_logits[idx], out, temperature), {}
        per = F.cross_entropy(out, y[idx], reduction="none") + weight * temperature**2 * kl_per_row(
            teacher_logits[idx], out, temperature)
        return (weights[idx] * per).sum() / len(idx), {}

    done = minibatch_steps(student, optimizer, batches, step, private=private)
    losses = [s["loss"] for s in done if "loss" in s]
    return float(np.mean(losses)) if losses else float("nan")


SPECS = (StrategySpec("fedakd", FedAKDServer, FedAKDClient, PRESET, PHASES, PARAMS, homogeneous_models=True,
                      global_model=True, fairness=True),)
