"""FedProto (Tan et al., AAAI 2022) and the FedAL paper's public-set adaptation of it.

`fedproto` (the paper): each client uploads per-class prototypes, the mean feature (the head's
input) of its private samples of each class, with the class counts; the server averages them per
class weighted by the counts (eq. 6) and sends the global prototypes down; local training
minimises CE + proto_lambda * distance(features, global prototype of the label) (eq. 7-8).

`fedproto-public` (fedal.txt, "Baselines": FedProto "adapted to incorporate unlabeled public
data", KD "using the intermediate features before the fully-connected layer ... instead of model
outputs in FedMD"): FedMD's round with features in place of logits. Local steps on CE, then tau
transfer iterations: each client uploads its features on the iteration's public rows (computed
by both ends: public_rows), the server averages them row by row, and each client takes one step
on proto_lambda * MSE(features, the others' average) (FedMD's leave-one-out target).

Both need one feature width d on every client (models may differ otherwise): the first accepted
upload of the run fixes d, and uploads of another width are rejected (reason `feature_dim`);
a client refuses global prototypes or averages of another width than its own.
docs/algorithms.md (FedProto) has the equations, defaults and the choices where the papers are open.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf, InvalidResult, MissedStep, PhaseTasks, ServerContext, ServerHalf, StrategySpec
from fedal.strategies.fedal import logits_iteration, rows_key
from fedal.strategies.local import local_batches, local_step_count
from fedal.strategies.params import StrategyParams
from fedal.strategies.public_rows import public_inputs
from fedal.strategies.training import minibatch_steps, replaying, train_mode

# the paper: lambda = 1 for MNIST and FEMNIST (0.1 for CIFAR-10), the authors' code's default `ld`
PRESET = {"tau": 5, "local_epochs": 1, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0,
          "proto_lambda": 1.0}
# the FedAL paper runs FedMD and its FedProto with tau = 1
PUBLIC_PRESET = {"tau": 1, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0,
                 "proto_lambda": 1.0}
PHASES = {"local_train": "train"}
PUBLIC_PHASES = {"local_train": "train", "transfer": "exchange"}
# their own knobs, besides params.COMMON_PARAMS
PARAMS = ("local_epochs", "proto_lambda", "proto_weighting")
PRIVATE_PARAMS = PARAMS + ("privacy",)  # fedproto: DP-SGD, and its prototypes through the Gaussian mechanism
PUBLIC_PARAMS = ("proto_lambda", "public_batch_size", "rows_seed", "kd_target", "privacy")

# tensor names: prototypes and counts up, global prototypes and their mask down (private);
# features on public rows up, their average down (public)
PROTO_KEY, COUNT_KEY, GLOBAL_KEY, MASK_KEY = "proto/mean", "proto/count", "proto/global", "proto/mask"
FEATURES_KEY, AVERAGE_KEY = "features", "hbar"


def features_of(model) -> None:
    if not (hasattr(model, "features") and hasattr(model, "head")):
        raise ValueError("FedProto needs a model split into features and head, like every zoo model")


def feature_width(model, x: torch.Tensor) -> int:
    """d: the width of the model's features (the head's input): a zoo model says it, any other
    model is asked with one sample in eval mode."""
    if isinstance(getattr(model, "feature_dim", None), int):
        return int(model.feature_dim)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        d = int(model.features(x[:1]).shape[1])
    model.train(was_training)
    return d


def proto_distance(h: torch.Tensor, y: torch.Tensor, prototypes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The authors' code's L_R: nn.MSELoss between the batch's features and the global prototype
    of each label, over all B x d elements; a sample whose class has no global prototype is its own
    target (it adds 0 and still counts in the mean)."""
    rows = mask[y]
    diff = h[rows] - prototypes[y[rows]]
    return diff.pow(2).sum() / h.numel()


@torch.no_grad()
def local_prototypes(model, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                     batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 5: per class j the mean feature of the client's samples of class j [K, d] (eval mode,
    the model after local training; zero rows for absent classes) and the counts |D_ij| [K]."""
    was_training = model.training
    model.eval()
    h = torch.cat([model.features(x[i : i + batch_size]) for i in range(0, len(x), batch_size)]).double()
    model.train(was_training)
    counts = torch.bincount(y, minlength=num_classes)[:num_classes]
    sums = F.one_hot(y, num_classes).double().T @ h
    means = sums / counts.clamp_min(1).double()[:, None]
    return means.float().numpy(), counts.numpy().astype(np.int64)


def aggregate_prototypes(uploads: list[tuple[np.ndarray, np.ndarray]], weighting: str = "count"
                         ) -> tuple[np.ndarray, np.ndarray]:
    """The global prototypes [K, d] and their mask [K] from (prototypes, counts) per client.

    "count" (eq. 6 without its extra 1/|N_j|, which would shrink every prototype by the number of
    clients that have class j): C[j] = sum_i |D_ij| C_i[j] / sum_i |D_ij|. "client" (the authors'
    code): the plain mean over the clients that have class j. A client without class j
    (count 0) adds nothing to C[j]; a class nobody has is masked out (its row is 0)."""
    k, d = uploads[0][0].shape
    num = np.zeros((k, d), np.float64)
    total = np.zeros(k, np.float64)
    for protos, counts in uploads:
        counts = np.asarray(counts)
        w = counts.astype(np.float64) if weighting == "count" else (counts > 0).astype(np.float64)
        num += np.where(w[:, None] > 0, w[:, None] * np.asarray(protos, np.float64), 0.0)  # rows of absent classes: unread
        total += w
    mask = total > 0
    return (num / np.where(mask, total, 1.0)[:, None]).astype(np.float32), mask


def check_width(name: str, arr: np.ndarray, width: int | None) -> None:
    if width is not None and arr.shape[-1] != width:
        raise InvalidResult(f"{name} has feature width {arr.shape[-1]}, this run's is {width} (FedProto needs one "
                            "feature width on every client)", kind="feature_dim")


# -- fedproto: prototypes of the private data ----------------------------------------------------

class FedProtoServer(ServerHalf):
    def __init__(self, params: StrategyParams, client_ids: list[str], context: ServerContext):
        super().__init__(params, client_ids, context)
        self.prototypes: np.ndarray | None = None  # [K, d] float32
        self.mask: np.ndarray | None = None  # [K] bool
        self.feature_dim: int | None = None  # fixed by the first accepted upload (or the prototypes)
        # clients whose last upload had another width: their tasks go without prototypes, which
        # they could not use (they train on CE alone, and their uploads stay rejected)
        self.other_width: set[str] = set()

    def begin_round(self, round_idx: int) -> PhaseTasks:
        tensors = {}
        if self.prototypes is not None and self.mask is not None and self.mask.any():
            tensors = {GLOBAL_KEY: self.prototypes, MASK_KEY: self.mask.astype(np.uint8)}
        tasks = {cid: Message(self.task("local_train", round_idx, 0, steps=self.params.tau).meta,
                              {} if cid in self.other_width else dict(tensors))
                 for cid in self.client_ids}
        return PhaseTasks("local_train", round_idx, 0, tasks)

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        k, t = self.context.num_classes, result.tensors
        if set(t) != {PROTO_KEY, COUNT_KEY}:
            raise InvalidResult(f"a local_train result carries exactly {PROTO_KEY} and {COUNT_KEY}, got {sorted(t)}")
        protos, counts = t[PROTO_KEY], t[COUNT_KEY]
        if protos.dtype != np.float32 or protos.ndim != 2 or protos.shape[0] != k or protos.shape[1] < 1:
            raise InvalidResult(f"{PROTO_KEY} is {protos.dtype}{list(protos.shape)}, expected float32[{k}, d]")
        if counts.dtype != np.int64 or counts.shape != (k,) or (counts < 0).any():
            raise InvalidResult(f"{COUNT_KEY} must be int64[{k}] and non-negative")
        n = result.meta.get("num_samples")
        noisy = self.params.privacy is not None  # counts through the Gaussian mechanism may exceed n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (counts.sum() > n and not noisy):
            raise InvalidResult(f"num_samples {n!r} must be an integer > 0 and at least the class counts' sum")
        try:
            check_width(PROTO_KEY, protos, self.feature_dim)
        except InvalidResult:
            self.other_width.add(client_id)
            raise
        self.other_width.discard(client_id)
        self.feature_dim = protos.shape[1]

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        cids = [c for c in self.client_ids if c in results]  # enrolment order: deterministic sums
        for c in cids:
            self.record("local_loss", results[c].meta.get("loss"))
            self.record("proto_loss", results[c].meta.get("proto_loss"))
        if cids:  # this round's prototypes replace the last round's (the authors' code)
            uploads = [(results[c].tensors[PROTO_KEY], results[c].tensors[COUNT_KEY]) for c in cids]
            self.prototypes, self.mask = aggregate_prototypes(uploads, self.params.proto_weighting)
            self.record("proto_classes", int(self.mask.sum()))
        return None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"other_width": sorted(self.other_width)} if self.other_width else {}
        if self.prototypes is not None and self.mask is not None:
            state.update(prototypes=torch.from_numpy(self.prototypes.copy()), mask=torch.from_numpy(self.mask.copy()))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("prototypes") is not None:
            self.prototypes = torch.as_tensor(state["prototypes"]).numpy().copy()
            self.mask = torch.as_tensor(state["mask"]).numpy().astype(bool)
            self.feature_dim = int(self.prototypes.shape[1])
        self.other_width = set(state.get("other_width") or [])


class FedProtoClient(ClientHalf):
    # local training through self.private, the prototypes through its Gaussian mechanism
    @classmethod
    def private_plan(cls, params: StrategyParams, n: int) -> tuple[int, int] | None:
        return local_step_count(params, int(params.tau or 1), n), 1  # and the prototypes

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        features_of(self.model)
        self.num_classes = int(getattr(self.model, "num_classes"))  # noqa: B009 (an attribute of the zoo's models, not of Module)
        self.feature_dim = feature_width(self.model, self.x_train)

    def handle(self, task: Message) -> Message:
        if task.phase != "local_train":
            raise ValueError(f"unknown phase {task.phase!r}")
        glob = self.global_prototypes(task)
        steps = self.task_steps(task)
        if self.private is not None:
            stats, protos, counts = self.private_train(steps, glob)
        else:
            stats = self.train(steps, glob)
            protos, counts = local_prototypes(self.model, self.x_train, self.y_train, self.num_classes)
        return self.reply(task, {PROTO_KEY: protos, COUNT_KEY: counts}, num_samples=len(self.y_train), **stats)

    def private_train(self, steps: int, glob) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        """With differential privacy: DP-SGD steps, then the prototypes (per-class mean features
        over the private set, each feature clipped to statistic_clip) through the Gaussian
        mechanism. Over budget: no step and no prototype (every count 0)."""
        private, privacy = self.private, self.params.privacy
        assert private is not None and privacy is not None

        def work() -> tuple[np.ndarray, np.ndarray]:
            count = local_step_count(self.params, steps, len(self.y_train))
            private.check_budget(count, releases=1)
            self.train(steps, glob, batches=private.batches(count))
            was = self.model.training
            self.model.eval()
            with torch.no_grad():
                h = torch.cat([self.model.features(self.x_train[i : i + 1024])
                               for i in range(0, len(self.x_train), 1024)])
            self.model.train(was)
            return private.release_class_means(h, self.y_train, self.num_classes, clip=privacy.statistic_clip)

        report, out = private.spend(self.client_id, work)
        if out is None:
            out = np.zeros((self.num_classes, self.feature_dim), np.float32), np.zeros(self.num_classes, np.int64)
        return report, *out

    def global_prototypes(self, task: Message) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The task's global prototypes and mask; ValueError (the task is refused) where they do
        not fit this client's model."""
        if GLOBAL_KEY not in task.tensors:
            return None
        protos, mask = task.tensors[GLOBAL_KEY], task.tensors.get(MASK_KEY)
        want = (self.num_classes, self.feature_dim)
        if protos.dtype != np.float32 or protos.shape != want:
            raise ValueError(f"global prototypes are {protos.dtype}{list(protos.shape)}, this client's model needs "
                             f"float32{list(want)} (FedProto needs one feature width on every client)")
        if mask is None or mask.shape != (self.num_classes,) or mask.dtype != np.uint8:
            raise ValueError(f"{MASK_KEY} must be uint8[{self.num_classes}] next to {GLOBAL_KEY}")
        if not mask.any():
            return None
        return torch.from_numpy(np.array(protos)), torch.from_numpy(mask.astype(bool))

    def train(self, steps: int, glob: tuple[torch.Tensor, torch.Tensor] | None,
              batches: Iterable[torch.Tensor] | None = None) -> dict[str, float]:
        """Local's batches (tau steps, or local_epochs passes) on CE + proto_lambda * L_R; plain CE,
        step for step `local`'s, while there are no global prototypes or proto_lambda is 0."""
        lam = float(self.params.proto_lambda or 0.0)
        use = glob is not None and lam > 0

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            x, y = self.x_train[idx], self.y_train[idx]
            if not use:
                return F.cross_entropy(self.model(x), y), {}
            assert glob is not None
            h = self.model.features(x)
            ce = F.cross_entropy(self.model.head(h), y)
            dist = proto_distance(h, y, glob[0], glob[1])
            return ce + lam * dist, {"ce": ce.item(), "proto_loss": dist.item()}

        if batches is None:
            batches = local_batches(len(self.y_train), self.params, steps, self.generator)
        done = [s for s in minibatch_steps(self.model, self.optimizer, batches, step, private=self.private) if s]
        keys = ("loss", "ce", "proto_loss") if use else ("loss",)
        return {k: float(np.mean([s[k] for s in done])) if done else 0.0 for k in keys}


# -- fedproto-public: features on the public rows (the FedAL paper's adaptation) ------------------

class FedProtoPublicServer(ServerHalf):
    def __init__(self, params: StrategyParams, client_ids: list[str], context: ServerContext):
        super().__init__(params, client_ids, context)
        # fixed by the first accepted upload; not state: no average outlives its iteration, and a
        # resumed coordinator fixes it again from the next upload
        self.feature_dim: int | None = None

    def begin_round(self, round_idx: int) -> PhaseTasks:
        tasks = {cid: self.task("local_train", round_idx, 0, steps=self.params.tau) for cid in self.client_ids}
        return PhaseTasks("local_train", round_idx, 0, tasks)

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        if logits_iteration(phase.phase, phase.iteration, self.params.tau or 1) is None:
            return  # the round's last transfer result: diagnostics only
        rows = min(self.params.public_batch_size, self.context.public_size)
        if set(result.tensors) != {FEATURES_KEY}:
            raise InvalidResult(f"this result carries exactly {FEATURES_KEY!r}, got {sorted(result.tensors)}")
        h = result.tensors[FEATURES_KEY]
        if h.dtype != np.float32 or h.ndim != 2 or h.shape[0] != rows or h.shape[1] < 1:
            raise InvalidResult(f"{FEATURES_KEY} is {h.dtype}{list(h.shape)}, expected float32[{rows}, d]")
        check_width(FEATURES_KEY, h, self.feature_dim)
        self.feature_dim = h.shape[1]

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase == "local_train":
            for res in results.values():
                self.record("local_loss", res.meta.get("loss"))
            return self._transfer_phase(phase.round, 0, results)
        if phase.phase == "transfer":
            for res in results.values():
                self.record("proto_loss", res.meta.get("proto_loss"))
            if phase.iteration + 1 < (self.params.tau or 1):
                return self._transfer_phase(phase.round, phase.iteration + 1, results)
            return None
        raise ValueError(f"unknown phase {phase.phase!r}")

    def _transfer_phase(self, round_idx: int, iteration: int, results: dict[str, Message]) -> PhaseTasks | None:
        """FedAL's schedule: the average of the features of `iteration` goes to their senders; every
        client gets a task while another iteration follows, so that it uploads for it."""
        cids = [c for c in self.client_ids if c in results]  # enrolment order: deterministic sums
        tensors: dict[str, np.ndarray] = {}
        if cids:
            stacked = np.stack([results[c].tensors[FEATURES_KEY].astype(np.float64) for c in cids])
            mean = stacked.mean(axis=0)
            tensors = {AVERAGE_KEY: mean.astype(np.float32)}
            self.record("participation", len(cids) / len(self.client_ids))
            self.record("proto_spread", float(((stacked - mean) ** 2).mean()))
        more = iteration + 1 < (self.params.tau or 1)
        tasks = {}
        for cid in self.client_ids:
            if cid in results or more:
                meta = self.task("transfer", round_idx, iteration, n_avg=len(cids)).meta
                tasks[cid] = Message(meta, dict(tensors) if cid in results else {})
        return PhaseTasks("transfer", round_idx, iteration, tasks) if tasks else None


class FedProtoPublicClient(ClientHalf):
    # the local steps are its only ones on private data (DP-SGD); the features it uploads and the
    # steps towards their average are on public rows: post-processing
    @classmethod
    def private_plan(cls, params: StrategyParams, n: int) -> tuple[int, int] | None:
        return int(params.tau or 1), 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        features_of(self.model)
        self.pending: dict[str, Any] | None = None  # round, iteration, rows and features of the last upload
        self.round_diag: list[float] = []  # this round's proto_loss per feedback step

    def handle(self, task: Message) -> Message:
        tau = self.params.tau or 1
        if task.phase == "local_train":
            self.round_diag = []
            diag: dict[str, Any] = self.training_report(lambda: self.local_steps(self.task_steps(task)))
        elif task.phase == "transfer":
            if AVERAGE_KEY in task.tensors:
                self.round_diag.append(self.apply_average(task))
            diag = {}
            if task.integer("iteration") + 1 >= tau and self.round_diag:  # the round's diagnostics, once
                diag, self.round_diag = {"proto_loss": float(np.mean(self.round_diag))}, []
        else:
            raise ValueError(f"unknown phase {task.phase!r}")
        nxt = logits_iteration(task.phase, task.integer("iteration"), tau)
        tensors = {} if nxt is None else {FEATURES_KEY: self.upload_features(task.integer("round"), nxt)}
        return self.reply(task, tensors, **diag)

    def local_steps(self, steps: int) -> float:
        """Plain CE minibatches, drawn as FedAL's local stage draws them (FedMD's has no LF term);
        with differential privacy, Poisson-sampled DP-SGD steps."""
        n = len(self.y_train)

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            return F.cross_entropy(self.model(self.x_train[idx]), self.y_train[idx]), {}

        if self.private is not None:
            self.private.check_budget(steps)
            batches: Iterable[torch.Tensor] = self.private.batches(steps)
        else:
            batches = (torch.randperm(n, generator=self.generator)[: min(self.params.batch_size, n)]
                       for _ in range(steps))
        done = minibatch_steps(self.model, self.optimizer, batches, step, private=self.private)
        losses = [s["loss"] for s in done if "loss" in s]
        return float(np.mean(losses)) if losses else 0.0

    def upload_features(self, round_idx: int, iteration: int) -> np.ndarray:
        if self.public_x is None:
            raise ValueError("this client has no public set")
        p = self.params
        idx, x = public_inputs(self.public_x, rows_key(p), round_idx, iteration, p.public_batch_size)
        train_mode(self.model)
        h = self.model.features(x)
        # the graph is kept: the feedback step goes through this very forward (as FedAL's logits)
        self.pending = {"round": round_idx, "iteration": iteration, "indices": idx, "features": h}
        return h.detach().numpy().astype(np.float32)

    def apply_average(self, task: Message) -> float:
        """One step on proto_lambda * MSE(h, target): target the others' mean (kd_target
        leave_one_out, n_avg > 1) or the mean of all; returns the MSE."""
        p, pend = self.params, self.pending
        if pend is None or (pend["round"], pend["iteration"]) != (task.meta["round"], task.meta["iteration"]):
            raise MissedStep("an average for an iteration whose features this client did not upload")
        hbar = task.tensors[AVERAGE_KEY]
        h = pend.get("features")
        if h is None:  # restored from a checkpoint: recompute the uploaded features (same weights)
            assert self.public_x is not None
            with replaying(self.model):
                h = self.model.features(self.public_x[pend["indices"]])
        if hbar.dtype != np.float32 or hbar.shape != tuple(h.shape):
            raise ValueError(f"{AVERAGE_KEY} is {hbar.dtype}{list(hbar.shape)}, this client's features are "
                             f"float32{list(h.shape)} (FedProto needs one feature width on every client)")
        self.pending = None
        mean = torch.from_numpy(np.array(hbar))
        n_avg = task.integer("n_avg", 1)
        target = mean if p.kd_target == "all" or n_avg <= 1 else (n_avg * mean - h.detach()) / (n_avg - 1)
        mse = F.mse_loss(h, target)
        self.optimizer.zero_grad()
        (float(p.proto_lambda or 0.0) * mse).backward()
        self.optimizer.step()
        return mse.item()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["round_diag"] = list(self.round_diag)
        state["pending"] = None if self.pending is None else {
            "round": self.pending["round"], "iteration": self.pending["iteration"],
            "indices": self.pending["indices"].clone()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pending = state.get("pending")
        self.round_diag = [float(v) for v in state.get("round_diag") or []]


SPECS = (
    StrategySpec("fedproto", FedProtoServer, FedProtoClient, PRESET, PHASES, PRIVATE_PARAMS, same_feature_dim=True),
    StrategySpec("fedproto-public", FedProtoPublicServer, FedProtoPublicClient, PUBLIC_PRESET, PUBLIC_PHASES,
                 PUBLIC_PARAMS, uses_public_set=True, same_feature_dim=True),
)
