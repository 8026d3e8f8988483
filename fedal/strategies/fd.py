"""FD, federated distillation (Jeong et al., "Communication-Efficient On-Device Machine Learning:
Federated Distillation and Augmentation under Non-IID Private Data", 2018, Algorithm 1).

Clients exchange per-label mean outputs instead of weights, so they may run different models.
While it trains, a client sums its softmax outputs F(w, x) per ground-truth label (line 6) and
uploads the per-label means with the counts. For each client the server averages, per label,
the OTHER clients' means (line 15: (sum - own) / (M - 1)) and sends them down with the next
round's task. Local training minimises, per sample of label y,
phi(F(w, x), y) + gamma * phi(F(w, x), teacher[y]), phi the cross entropy (section 2); a label
no other client has carries no teacher and its samples get the first term alone. Only K x K
numbers travel each way.

Choices where the paper is silent (docs/algorithms.md, FD): minibatches (the paper's batch 64)
rather than Algorithm 1's per-sample updates, the accumulated output being the step's own
forward pass; the means of labels a client lacks are left out of the average (their 0/0);
`fd_exclude_own = False` averages every client, `fd_weighting = "counts"` weighs each client's
mean by its count; no teacher before the first uploads (round 1 trains on cross-entropy alone).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf, InvalidResult, PhaseTasks, ServerHalf, StrategySpec
from fedal.strategies.local import local_batches, local_step_count
from fedal.strategies.training import minibatch_steps

# the paper's n = 250 local iterations per global iteration; its batch size 64 is `batch_size`
PRESET = {"tau": 250, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0}
# the phases of a round and their kind: "train" phases get the training deadline
PHASES = {"local_train": "train"}
# its own knobs, besides params.COMMON_PARAMS
PARAMS = ("local_epochs", "fd_beta", "fd_exclude_own", "fd_weighting", "privacy")

AVG_KEY, COUNT_KEY = "fd/avg", "fd/count"  # up: per-label mean softmax output [K, K], counts [K]
TEACHER_KEY, MASK_KEY = "fd/teacher", "fd/mask"  # down: per-label teacher [K, K], which labels have one [K]
PROB_TOLERANCE = 1e-3  # how far a row of probabilities may sum from 1 (float32 means of softmax outputs)


@dataclass
class Teacher:
    """Per-label teacher vectors [K, K]; labels with mask False have none (their rows are 0)."""

    probs: np.ndarray
    mask: np.ndarray

    def tensors(self) -> dict[str, np.ndarray]:
        return {TEACHER_KEY: self.probs, MASK_KEY: self.mask.astype(np.uint8)}


def probability_rows_problem(rows: np.ndarray) -> str | None:
    if (rows < 0).any() or not np.allclose(rows.sum(axis=1), 1.0, atol=PROB_TOLERANCE):
        return "must be probability vectors (non-negative, summing to 1)"
    return None


def read_teacher(tensors: dict[str, np.ndarray], num_classes: int) -> Teacher | None:
    """The teacher a task carries (None: none yet, or no label has one); a malformed one is
    refused, as the real loss would be meaningless on it."""
    if TEACHER_KEY not in tensors and MASK_KEY not in tensors:
        return None
    if TEACHER_KEY not in tensors or MASK_KEY not in tensors:
        raise ValueError(f"a teacher needs both {TEACHER_KEY} and {MASK_KEY}")
    probs, mask = np.asarray(tensors[TEACHER_KEY]), np.asarray(tensors[MASK_KEY])
    k = num_classes
    if probs.dtype != np.float32 or probs.shape != (k, k):
        raise ValueError(f"{TEACHER_KEY} is {probs.dtype}{list(probs.shape)}, expected float32[{k}, {k}]")
    if mask.dtype != np.uint8 or mask.shape != (k,) or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"{MASK_KEY} must be uint8[{k}] of 0 and 1")
    present = mask.astype(bool)
    problem = probability_rows_problem(probs[present])
    if problem:
        raise ValueError(f"{TEACHER_KEY} rows of labels with mask 1 {problem}")
    return Teacher(probs, present) if present.any() else None


def distillation_term(logits: torch.Tensor, y: torch.Tensor, teacher: Teacher) -> torch.Tensor:
    """(1/B) sum_b [label y_b has a teacher] * phi(softmax(z_b), teacher[y_b]), with
    phi(p, q) = -sum_c q_c log p_c, the cross entropy the paper uses for both terms."""
    probs = torch.from_numpy(teacher.probs)[y]
    has = torch.from_numpy(teacher.mask)[y].to(logits.dtype)
    ce = -(probs * F.log_softmax(logits, dim=1)).sum(dim=1)
    return (ce * has).sum() / len(y)


def local_average(sums: torch.Tensor, counts: torch.Tensor) -> np.ndarray:
    """Line 8: per-label sum of outputs / count; labels never seen have a row of 0."""
    denom = counts.clamp_min(1).to(sums.dtype)[:, None]
    return torch.where(counts[:, None] > 0, sums / denom, torch.zeros_like(sums)).float().numpy()


class FDClient(ClientHalf):
    # local training goes through self.private; the per-label means, computed from private data,
    # through its Gaussian mechanism (private_train)
    @classmethod
    def private_plan(cls, params, n: int) -> tuple[int, int] | None:
        return local_step_count(params, int(params.tau or 1), n), 1  # and the per-label means

    def __init__(self, client_id, model, train, public_x, params, seed):
        super().__init__(client_id, model, train, public_x, params, seed)
        self.num_classes = int(train.num_classes)

    def handle(self, task: Message) -> Message:
        if task.phase != "local_train":
            raise ValueError(f"unknown phase {task.phase!r}")
        teacher = read_teacher(task.tensors, self.num_classes)
        steps = self.task_steps(task)
        if self.private is not None:
            stats, avg, counts = self.private_train(steps, teacher)
        else:
            stats, avg, counts = self.train(steps, teacher)
        return self.reply(task, {AVG_KEY: avg, COUNT_KEY: counts}, num_samples=len(self.y_train), **stats)

    def private_train(self, steps: int, teacher: Teacher | None) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        """With differential privacy: DP-SGD steps, then the per-label means of the trained
        model's outputs over the whole private set through the Gaussian mechanism (the outputs
        of the training steps themselves are not released), rows made probability vectors again
        (post-processing). Over budget: no step and no statistic (every count 0)."""
        private, k = self.private, self.num_classes
        assert private is not None

        def work() -> tuple[np.ndarray, np.ndarray]:
            count = local_step_count(self.params, steps, len(self.y_train))
            private.check_budget(count, releases=1)
            self.train(steps, teacher, batches=private.batches(count))
            with torch.no_grad():
                probs = F.softmax(self.predict(self.x_train), dim=1)
            avg, counts = private.release_class_means(probs, self.y_train, k, clip=1.0)
            avg = np.clip(avg, 0.0, None)
            total = avg.sum(axis=1, keepdims=True)
            avg = np.where((counts > 0)[:, None] & (total > 0), avg / np.where(total > 0, total, 1.0), 0.0)
            counts = np.where(avg.sum(axis=1) > 0, counts, 0)  # a label whose noisy mean vanished: left out
            return avg.astype(np.float32), counts

        report, out = private.spend(self.client_id, work)
        if out is None:
            out = np.zeros((k, k), np.float32), np.zeros(k, np.int64)
        return report, *out

    def train(self, steps: int, teacher: Teacher | None,
              batches: Iterable[torch.Tensor] | None = None) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
        """Local's minibatches on CE + fd_beta * distillation term, summing each step's softmax
        outputs per label as it goes. With no teacher, or fd_beta = 0, the term is not computed:
        the steps are then exactly Local's."""
        k, beta = self.num_classes, float(self.params.fd_beta)
        use = teacher is not None and beta > 0
        sums = torch.zeros(k, k, dtype=torch.float64)
        counts = torch.zeros(k, dtype=torch.int64)

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            x, y = self.x_train[idx], self.y_train[idx]
            logits = self.model(x)
            ce = F.cross_entropy(logits, y)
            sums.index_add_(0, y, F.softmax(logits.detach(), dim=1).double())
            counts.add_(torch.bincount(y, minlength=k)[:k])
            if not use or teacher is None:
                return ce, {"ce": ce.item()}
            term = distillation_term(logits, y, teacher)
            return ce + beta * term, {"ce": ce.item(), "fd_loss": term.item()}

        if batches is None:
            batches = local_batches(len(self.y_train), self.params, steps, self.generator)
        done = [s for s in minibatch_steps(self.model, self.optimizer, batches, step, private=self.private) if s]
        keys = ("loss", "ce", "fd_loss") if use else ("loss", "ce")
        stats = {key: float(np.mean([s[key] for s in done])) if done else 0.0 for key in keys}
        return stats, local_average(sums, counts), counts.numpy().copy()


def teacher_for(cid: str | None, uploads: dict[str, tuple[np.ndarray, np.ndarray]], exclude_own: bool,
                weighting: str, num_classes: int) -> Teacher:
    """Per label l, the mean of the uploaded means of l over the clients that saw l (count > 0),
    leaving out `cid`'s own when `exclude_own` (line 15); each weighs 1 (`clients`, the paper) or
    its count (`counts`). In float64, in the order of `uploads`, sent as float32."""
    k = num_classes
    num = np.zeros((k, k), np.float64)
    den = np.zeros(k, np.float64)
    for other, (avg, counts) in uploads.items():
        if exclude_own and other == cid:
            continue
        w = counts.astype(np.float64) if weighting == "counts" else (counts > 0).astype(np.float64)
        num += w[:, None] * avg.astype(np.float64)
        den += w
    mask = den > 0
    probs = num / np.where(mask, den, 1.0)[:, None]
    return Teacher(np.where(mask[:, None], probs, 0.0).astype(np.float32), mask)


def rows_trained(params, steps: int, num_samples: int) -> int:
    """How many rows one round of local training processes (what the counts add up to)."""
    epochs = int(params.local_epochs or 0)
    return epochs * num_samples if epochs > 0 else steps * min(params.batch_size, num_samples)


class FDServer(ServerHalf):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the accepted uploads of the last round anyone answered: client -> (means [K, K], counts [K])
        self.uploads: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def begin_round(self, round_idx: int) -> PhaseTasks:
        tasks = {}
        for cid in self.client_ids:
            msg = self.task("local_train", round_idx, 0, steps=self.params.tau)
            if self.uploads:
                teacher = teacher_for(cid, self.uploads, self.params.fd_exclude_own, self.params.fd_weighting,
                                      self.context.num_classes)
                if teacher.mask.any():
                    msg = Message(msg.meta, teacher.tensors())
            tasks[cid] = msg
        return PhaseTasks("local_train", round_idx, 0, tasks)

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        k, t = self.context.num_classes, result.tensors
        if set(t) != {AVG_KEY, COUNT_KEY}:
            raise InvalidResult(f"a local_train result carries exactly {AVG_KEY} and {COUNT_KEY}, got {sorted(t)}")
        avg, counts = t[AVG_KEY], t[COUNT_KEY]
        if avg.dtype != np.float32 or avg.shape != (k, k):
            raise InvalidResult(f"{AVG_KEY} is {avg.dtype}{list(avg.shape)}, expected float32[{k}, {k}]")
        if counts.dtype != np.int64 or counts.shape != (k,):
            raise InvalidResult(f"{COUNT_KEY} is {counts.dtype}{list(counts.shape)}, expected int64[{k}] (whole counts)")
        if (counts < 0).any():
            raise InvalidResult(f"{COUNT_KEY} holds a negative count")
        n = result.meta.get("num_samples")
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise InvalidResult(f"a local_train result must report an integer num_samples > 0, got {n!r}")
        most = rows_trained(self.params, int(self.params.tau or 0), n)
        if self.params.privacy is None and int(counts.sum()) > most:  # noisy counts (privacy) have no such bound
            raise InvalidResult(f"{COUNT_KEY} adds up to {int(counts.sum())}, more than the {most} rows a round trains on")
        seen = counts > 0
        if (avg[~seen] != 0).any():
            raise InvalidResult(f"rows of {AVG_KEY} for labels with count 0 must be 0")
        problem = probability_rows_problem(avg[seen])
        if problem:
            raise InvalidResult(f"rows of {AVG_KEY} for labels with a count {problem}")

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        cids = [c for c in self.client_ids if c in results]  # enrolment order: sums are order-independent of arrival
        if cids:
            self.uploads = {c: (results[c].tensors[AVG_KEY].copy(), results[c].tensors[COUNT_KEY].copy()) for c in cids}
            self.record("fd_labels", int((sum(counts for _, counts in self.uploads.values()) > 0).sum()))
        self.record("participation", len(cids) / len(self.client_ids))
        for c in cids:
            self.record("local_loss", results[c].meta.get("loss", float("nan")))
            self.record("fd_loss", results[c].meta.get("fd_loss", float("nan")))
        return None

    def state_dict(self) -> dict[str, Any]:
        if not self.uploads:
            return {}
        return {"uploads": {c: {"avg": torch.from_numpy(avg.copy()), "count": torch.from_numpy(counts.copy())}
                            for c, (avg, counts) in self.uploads.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stored = state.get("uploads") or {}
        self.uploads = {c: (torch.as_tensor(u["avg"]).numpy().copy(), torch.as_tensor(u["count"]).numpy().copy())
                        for c, u in stored.items()}


__all__ = ["FDClient", "FDServer", "Teacher", "distillation_term", "local_average", "read_teacher", "teacher_for"]


SPECS = (StrategySpec("fd", FDServer, FDClient, PRESET, PHASES, PARAMS),)
