"""FedHKD (Chen & Vikalo, ICLR 2023): FedAvg plus data-free hyper-knowledge distillation.

Besides its weights, each client uploads per-class "hyper-knowledge": the mean feature H[j]
of its samples of class j (with Gaussian noise for differential privacy) and the mean soft
prediction Q[j], with the class counts. The server averages the weights as FedAvg does and the
knowledge per class weighted by counts (eq. 9); the global knowledge goes down with the global
weights and adds two terms to local training (eq. 11): the head G must map each global feature
H[j] to Q[j], and the feature extractor R must map a sample of class y near H[y].

`hkd_preset = paper` follows the paper (ALGORITHMS.md section 4); `official` follows the
authors' published code: no sharing threshold, no clipping, one noise vector of fixed std per
upload shared by all classes, elementwise-mean KL and MSE instead of Euclidean norms, gradient
norm clipped to 1.1 while knowledge is present, and last-writer-wins aggregation in a random
client order with classes kept from earlier rounds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedal.protocol import Message, tensor_problem
from fedal.strategies.base import InvalidResult, PhaseTasks, StrategySpec
from fedal.strategies.fedavg import PHASES as PHASES  # FedAvg's round, knowledge added to its messages
from fedal.strategies.fedavg import FedAvgClient, FedAvgServer, load_numpy_into, model_to_numpy
from fedal.strategies.local import local_batches, local_step_count
from fedal.strategies.params import StrategyParams
from fedal.strategies.training import minibatch_steps

# the paper's training (ALGORITHMS.md section 4): 5 local epochs of batch 64 a round
PRESET = {"tau": 5, "local_epochs": 5, "batch_size": 64, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0,
          "lambda_lf_glo": 0.0, "hkd_lambda": 0.05, "hkd_gamma": 0.05}
# its own knobs, besides params.COMMON_PARAMS
PARAMS = ("local_epochs", "hkd_preset", "hkd_lambda", "hkd_gamma", "hkd_temperature", "hkd_sigma", "hkd_nu",
          "hkd_zeta", "hkd_official_noise_std", "hkd_official_grad_clip", "privacy")

# Tensor names of the knowledge; state_dict keys are dotted module paths and never hold "/".
H_KEY, Q_KEY, COUNT_KEY, MASK_KEY = "hkd/h", "hkd/q", "hkd/count", "hkd/mask"
KNOWLEDGE_KEYS = (H_KEY, Q_KEY, COUNT_KEY, MASK_KEY)
NOISE_STREAM = 0x48_4B_44  # "HKD": the noise generator's seed offset, apart from the batch generator's


@dataclass
class Knowledge:
    """Global hyper-knowledge: H [K, d], Q [K, K]; rows with mask False carry nothing."""

    h: np.ndarray
    q: np.ndarray
    mask: np.ndarray

    def tensors(self) -> dict[str, np.ndarray]:
        return {H_KEY: self.h, Q_KEY: self.q, MASK_KEY: self.mask.astype(np.uint8)}

    @staticmethod
    def from_tensors(tensors: dict[str, np.ndarray]) -> Knowledge | None:
        if H_KEY not in tensors:
            return None
        return Knowledge(np.asarray(tensors[H_KEY], np.float32), np.asarray(tensors[Q_KEY], np.float32),
                         np.asarray(tensors[MASK_KEY]).astype(bool))


# -- client side ------------------------------------------------------------------------------

@torch.no_grad()
def extract_knowledge(model, x: torch.Tensor, y: torch.Tensor, num_classes: int, params: StrategyParams,
                      generator: torch.Generator, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A client's hyper-knowledge (eq. 4 and 7): per class the noisy mean feature [K, d], the mean
    soft prediction [K, K] and the count [K] it shares (0 for a class it keeps back; its rows are 0).

    Paper: h = clip(R(x), -zeta, zeta), q = softmax(G(h) / T); class j is shared only if
    N^j >= nu N (and N^j >= 1); independent noise N(0, (2 zeta sigma / N^j)^2) per element.
    Official: unclipped features, every present class shared, one noise vector of fixed std.
    """
    was_training = model.training
    model.eval()  # BatchNorm running statistics, no dropout: the model the client keeps
    feats, probs = [], []
    for i in range(0, len(x), batch_size):
        h = model.features(x[i : i + batch_size])
        if params.hkd_preset == "paper":
            h = h.clamp(-params.hkd_zeta, params.hkd_zeta)
        feats.append(h)
        probs.append(F.softmax(model.head(h) / params.hkd_temperature, dim=1))
    model.train(was_training)
    h_all, q_all = torch.cat(feats).double(), torch.cat(probs).double()
    d = h_all.shape[1]
    counts = torch.bincount(y, minlength=num_classes)[:num_classes]
    onehot = F.one_hot(y, num_classes).double()  # [N, K]
    denom = counts.clamp_min(1).double()[:, None]
    h_mean = onehot.T @ h_all / denom
    q_mean = onehot.T @ q_all / denom
    if params.hkd_preset == "paper":
        share = (counts >= 1) & (counts >= params.hkd_nu * len(y))
        std = 2.0 * params.hkd_zeta * params.hkd_sigma / denom  # [K, 1]: per class, from its own count
        noise = torch.randn(num_classes, d, generator=generator, dtype=torch.float64) * std
    else:
        share = counts >= 1
        one = torch.randn(d, generator=generator, dtype=torch.float64)
        noise = (params.hkd_official_noise_std * one).expand(num_classes, d)
    h_shared = torch.where(share[:, None], h_mean + noise, torch.zeros_like(h_mean))
    q_shared = torch.where(share[:, None], q_mean, torch.zeros_like(q_mean))
    return (h_shared.float().numpy(), q_shared.float().numpy(), torch.where(share, counts, 0).numpy().astype(np.int64))


def knowledge_terms(model, h: torch.Tensor, y: torch.Tensor, knowledge: Knowledge,
                    params: StrategyParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The two knowledge terms of eq. 11 for one batch with features h = R(x).

    head term: G applied to the global features of the present classes, so only the head gets
    its gradient; feature term: R(x) against constant targets, so only the feature extractor
    gets its gradient. Paper: mean over present classes of ||softmax(G(H[j])/T) - Q[j]||_2 and
    mean over the batch of ||R(x_b) - H[y_b]||_2 (rows of absent classes add 0). Official:
    elementwise-mean KL(Q || softmax(G(H)/T)) and elementwise-mean squared error (rows of
    absent classes add 0, as the authors' code makes them their own target).
    """
    return head_term(model, knowledge, params), feature_term(h, y, knowledge, params)


def head_term(model, knowledge: Knowledge, params: StrategyParams) -> torch.Tensor:
    """G on the global features of the present classes against their soft predictions: it reads no
    sample of the batch (with differential privacy: a public term, fedal/privacy/training.py)."""
    present = torch.from_numpy(knowledge.mask)
    big_h = torch.from_numpy(knowledge.h)[present]
    big_q = torch.from_numpy(knowledge.q)[present]
    logits = model.head(big_h) / params.hkd_temperature
    if params.hkd_preset == "paper":
        return (F.softmax(logits, dim=1) - big_q).norm(dim=1).mean()
    return F.kl_div(F.log_softmax(logits, dim=1), big_q, reduction="sum") / big_q.numel()  # torch's "mean"


def feature_term(h: torch.Tensor, y: torch.Tensor, knowledge: Knowledge, params: StrategyParams) -> torch.Tensor:
    """R(x) of each sample against its class's global feature: a mean over the batch's samples."""
    present = torch.from_numpy(knowledge.mask)
    rows = present[y]
    target = torch.from_numpy(knowledge.h)[y[rows]]
    if params.hkd_preset == "paper":
        return (h[rows] - target).norm(dim=1).sum() / len(y)
    return (h[rows] - target).pow(2).sum() / h.numel()


class FedHKDClient(FedAvgClient):
    # DP-SGD on CE + the feature term, the head term (no private data) added as public; the
    # per-class features and soft predictions through the Gaussian mechanism (private_knowledge)
    @classmethod
    def private_plan(cls, params, n: int) -> tuple[int, int] | None:
        return local_step_count(params, int(params.tau or 1), n), 2  # and two statistics

    def __init__(self, client_id, model, train, public_x, params, seed):
        super().__init__(client_id, model, train, public_x, params, seed)
        if not (hasattr(model, "features") and hasattr(model, "head")):
            raise ValueError("FedHKD needs a model split into features (R) and head (G), like every zoo model")
        self.num_classes = int(model.num_classes)
        self.noise_generator = torch.Generator().manual_seed((int(seed) + NOISE_STREAM) % 2**64)

    def handle(self, task: Message) -> Message:
        if task.phase != "train":
            return super().handle(task)  # init: the initial weights, as FedAvg
        weights = {k: v for k, v in task.tensors.items() if k not in KNOWLEDGE_KEYS}
        load_numpy_into(self.model, weights)
        knowledge = Knowledge.from_tensors(task.tensors)
        if knowledge is not None and not knowledge.mask.any():
            knowledge = None
        steps = self.task_steps(task)
        if self.private is not None:
            stats, (h, q, counts) = self.private_train(steps, knowledge)
        else:
            stats = self.train(steps, knowledge)
            h, q, counts = extract_knowledge(self.model, self.x_train, self.y_train, self.num_classes, self.params,
                                             self.noise_generator)
        tensors = {**model_to_numpy(self.model), H_KEY: h, Q_KEY: q, COUNT_KEY: counts}
        return self.reply(task, tensors, num_samples=len(self.y_train), shared_classes=int((counts > 0).sum()), **stats)

    def private_train(self, steps: int, knowledge: Knowledge | None) -> tuple[dict[str, Any], tuple]:
        """With differential privacy: DP-SGD steps (the paper's own feature noise and share rule
        give way to the Gaussian mechanism), then the knowledge through it. Over budget: no step,
        the global weights sent back as they came, no knowledge (every count 0)."""
        private = self.private
        assert private is not None

        def work() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            count = local_step_count(self.params, steps, len(self.y_train))
            private.check_budget(count, releases=2)
            self.train(steps, knowledge, batches=private.batches(count))
            return self.private_knowledge()

        report, released = private.spend(self.client_id, work)
        if released is None:
            d, k = int(self.model.features(self.x_train[:1]).shape[1]), self.num_classes
            released = np.zeros((k, d), np.float32), np.zeros((k, k), np.float32), np.zeros(k, np.int64)
        return report, released

    def private_knowledge(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per class the mean feature (each clipped to statistic_clip) and the mean soft prediction
        (norm <= 1), each through the Gaussian mechanism; the soft predictions made probability
        rows again and the paper's share rule applied to the noisy counts (post-processing)."""
        assert self.private is not None and self.params.privacy is not None
        p, k = self.params, self.num_classes
        was = self.model.training
        self.model.eval()
        with torch.no_grad():
            h = torch.cat([self.model.features(self.x_train[i : i + 1024]) for i in range(0, len(self.x_train), 1024)])
            q = F.softmax(self.model.head(h) / p.hkd_temperature, dim=1)
        self.model.train(was)
        h_mean, h_counts = self.private.release_class_means(h, self.y_train, k, clip=p.privacy.statistic_clip)
        q_mean, q_counts = self.private.release_class_means(q, self.y_train, k, clip=1.0)
        q_mean = np.clip(q_mean, 0.0, None)
        total = q_mean.sum(axis=1, keepdims=True)
        share = (h_counts > 0) & (q_counts > 0) & (total[:, 0] > 0)
        if p.hkd_preset == "paper":
            share &= h_counts >= p.hkd_nu * max(int(h_counts.sum()), 1)
        q_mean = np.where(share[:, None], q_mean / np.where(total > 0, total, 1.0), 0.0).astype(np.float32)
        return (np.where(share[:, None], h_mean, 0.0).astype(np.float32), q_mean,
                np.where(share, h_counts, 0).astype(np.int64))

    def train(self, steps: int, knowledge: Knowledge | None,
              batches: Iterable[torch.Tensor] | None = None) -> dict[str, float]:
        """FedAvg's local batches (tau steps, or local_epochs passes) on eq. 11: plain cross-entropy
        while there is no knowledge, and exactly FedAvg's steps when lambda = gamma = 0 (terms
        with weight 0 are not computed) under the paper preset (the official one clips the
        gradient norm while knowledge is present, whatever the weights, as the authors' code).
        With differential privacy (`batches` Poisson-sampled) the head term, which reads no
        private sample, joins each step as a public term."""
        p = self.params
        lam, gam = float(p.hkd_lambda or 0.0), float(p.hkd_gamma or 0.0)
        use = knowledge is not None and (lam > 0 or gam > 0)
        clip = p.hkd_official_grad_clip if p.hkd_preset == "official" and knowledge is not None else None
        if self.private is not None:  # DP-SGD clips every sample's gradient instead of clip
            self._private_steps(batches or [], knowledge if use else None, lam, gam)
            return {}
        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            x, y = self.x_train[idx], self.y_train[idx]
            h = self.model.features(x)
            ce = F.cross_entropy(self.model.head(h), y)
            loss, terms = ce, {"ce": ce.item(), "hkd_head": 0.0, "hkd_feature": 0.0}
            if use and knowledge is not None:
                head, feature = knowledge_terms(self.model, h, y, knowledge, p)
                if lam > 0:
                    loss = loss + lam * head
                if gam > 0:
                    loss = loss + gam * feature
                terms.update(hkd_head=head.item(), hkd_feature=feature.item())
            return loss, terms

        batches = local_batches(len(self.y_train), p, steps, self.generator)
        done = minibatch_steps(self.model, self.optimizer, batches, step, clip_norm=clip)
        sums = {"loss": 0.0, "ce": 0.0, "hkd_head": 0.0, "hkd_feature": 0.0}
        for s in done:  # summed in the order the loop always did
            for k in ("hkd_head", "hkd_feature", "loss", "ce"):
                sums[k] += s[k]
        stats = {k: v / max(len(done), 1) for k, v in sums.items()}
        if not use:
            del stats["hkd_head"], stats["hkd_feature"]
        return stats

    def _private_steps(self, batches: Iterable[torch.Tensor], knowledge: Knowledge | None, lam: float,
                       gam: float) -> None:
        """DP-SGD on CE + gamma * the feature term (per sample); lambda * the head term, which
        reads only the server's knowledge, joins every step unclipped and un-noised."""
        p = self.params

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            x, y = self.x_train[idx], self.y_train[idx]
            h = self.model.features(x)
            loss = F.cross_entropy(self.model.head(h), y)
            if knowledge is not None and gam > 0:
                loss = loss + gam * feature_term(h, y, knowledge, p)
            return loss, {}

        public = None
        if knowledge is not None and lam > 0:
            known = knowledge

            def public() -> torch.Tensor:
                return lam * head_term(self.model, known, p)

        minibatch_steps(self.model, self.optimizer, batches, step, private=self.private, public_loss=public)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "noise_generator": self.noise_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.noise_generator.set_state(state["noise_generator"])


# -- server side ------------------------------------------------------------------------------

def aggregate_knowledge(uploads: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Knowledge:
    """Eq. 9: per class j, H[j] = sum_i N_i^j h_i^j / N^j and Q[j] likewise, over the clients
    that shared j (N_i^j > 0); classes nobody shared are masked out (their rows are 0)."""
    h0, q0, _ = uploads[0]
    num = np.zeros(h0.shape, np.float64)
    qnum = np.zeros(q0.shape, np.float64)
    total = np.zeros(h0.shape[0], np.float64)
    for h, q, counts in uploads:
        w = counts.astype(np.float64)
        num += w[:, None] * h.astype(np.float64)
        qnum += w[:, None] * q.astype(np.float64)
        total += w
    mask = total > 0
    denom = np.where(mask, total, 1.0)[:, None]
    return Knowledge((num / denom).astype(np.float32), (qnum / denom).astype(np.float32), mask)


def last_writer_knowledge(uploads: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                          previous: Knowledge | None) -> Knowledge:
    """The authors' code: a dict updated by each client in turn, so per class the last client
    (in the order given) that has it wins, and classes nobody sent keep their earlier value."""
    h0, q0, _ = uploads[0]
    if previous is not None and previous.h.shape == h0.shape:
        out = Knowledge(previous.h.copy(), previous.q.copy(), previous.mask.copy())
    else:
        out = Knowledge(np.zeros_like(h0, np.float32), np.zeros_like(q0, np.float32), np.zeros(h0.shape[0], bool))
    for h, q, counts in uploads:
        sent = counts > 0
        out.h[sent], out.q[sent], out.mask[sent] = h[sent], q[sent], True
    return out


class FedHKDServer(FedAvgServer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.knowledge: Knowledge | None = None

    def _train_phase(self, round_idx: int) -> PhaseTasks:
        phase = super()._train_phase(round_idx)
        if self.knowledge is not None and self.knowledge.mask.any():
            extra = self.knowledge.tensors()  # the task dicts are the global weights' own: build new ones
            phase.tasks = {cid: Message(msg.meta, {**msg.tensors, **extra}) for cid, msg in phase.tasks.items()}
        return phase

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        weights = {k: v for k, v in result.tensors.items() if not k.startswith("hkd/")}
        super().validate(phase, client_id, Message(result.meta, weights))
        if phase.phase != "train":
            return
        k = self.context.num_classes
        t = result.tensors
        if set(t) - set(weights) != {H_KEY, Q_KEY, COUNT_KEY}:
            raise InvalidResult(f"a train result must carry {H_KEY}, {Q_KEY} and {COUNT_KEY}")
        h, q, counts = t[H_KEY], t[Q_KEY], t[COUNT_KEY]
        if h.dtype != np.float32 or h.ndim != 2 or h.shape[0] != k or h.shape[1] < 1:
            raise InvalidResult(f"{H_KEY} is {h.dtype}{list(h.shape)}, expected float32[{k}, d]")
        if self.knowledge is not None and h.shape != self.knowledge.h.shape:
            raise InvalidResult(f"{H_KEY} has feature size {h.shape[1]}, the run's is {self.knowledge.h.shape[1]}")
        if q.dtype != np.float32 or q.shape != (k, k):
            raise InvalidResult(f"{Q_KEY} is {q.dtype}{list(q.shape)}, expected float32[{k}, {k}]")
        if counts.dtype != np.int64 or counts.shape != (k,) or (counts < 0).any():
            raise InvalidResult(f"{COUNT_KEY} must be int64[{k}] and non-negative")
        if self.params.privacy is None and counts.sum() > result.meta["num_samples"]:  # noisy counts have no bound
            raise InvalidResult("class counts add up to more than num_samples")
        problem = tensor_problem({H_KEY: h, Q_KEY: q}, self.params.max_abs_value)
        if problem is not None:
            raise InvalidResult(f"knowledge: {problem[1]}", kind=problem[0])
        shared = counts > 0
        if (q[shared] < 0).any() or not np.allclose(q[shared].sum(axis=1), 1.0, atol=1e-3):
            raise InvalidResult(f"rows of {Q_KEY} for shared classes must be probability vectors")

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase != "train":
            return super().collect(phase, results)
        weights_only = {c: Message(r.meta, {k: v for k, v in r.tensors.items() if not k.startswith("hkd/")})
                        for c, r in results.items()}
        super().collect(phase, weights_only)
        cids = [c for c in self.client_ids if c in results]
        uploads = [(results[c].tensors[H_KEY], results[c].tensors[Q_KEY], results[c].tensors[COUNT_KEY]) for c in cids]
        uploads = [u for u in uploads if u[0].shape == uploads[0][0].shape] if uploads else []
        if uploads:
            if self.params.hkd_preset == "paper":
                self.knowledge = aggregate_knowledge(uploads)
            else:  # the authors' clients run in a random order each round
                order = np.random.default_rng([self.context.seed, phase.round, NOISE_STREAM]).permutation(len(uploads))
                self.knowledge = last_writer_knowledge([uploads[i] for i in order], self.knowledge)
            self.record("hkd_classes", int(self.knowledge.mask.sum()))
        for c in cids:
            for key in ("hkd_head", "hkd_feature", "shared_classes"):
                self.record(key, results[c].meta.get(key, float("nan")))
        return None

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.knowledge is not None:
            state["knowledge"] = {k: torch.from_numpy(np.array(v)) for k, v in self.knowledge.tensors().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("knowledge") is not None:
            stored = state["knowledge"]
            self.knowledge = Knowledge.from_tensors({k: torch.as_tensor(v).numpy().copy() for k, v in stored.items()})


__all__ = ["FedHKDClient", "FedHKDServer", "Knowledge", "aggregate_knowledge", "extract_knowledge",
           "knowledge_terms", "last_writer_knowledge"]


SPECS = (StrategySpec("fedhkd", FedHKDServer, FedHKDClient, PRESET, PHASES, PARAMS, homogeneous_models=True,
                      global_model=True),)
