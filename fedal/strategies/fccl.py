"""FCCL (Huang et al., CVPR 2022) and FCCL+ (Huang et al., TPAMI 2023): both halves of a round.

Round t (docs/algorithms.md, FCCL; docs/protocol.md section 7):
  local_pretrain   round 0, `fccl` only: fccl_pretrain_epochs passes of plain CE; the result is
                   the pretrained model theta*, the intra-domain teacher (and round 0's inter one)
  collaborate i    (i = 0..tau-1) the client applies the average of iteration i-1 (if it uploaded
                   then), then uploads its logits on the rows of (t, i), normalised along the batch
                   (z [B, K]); `fccl-plus` also the similarity matrix of the instances' normalised
                   features without the diagonal (s [B, B-1]); the server averages them
  local_train      the average of iteration tau-1, then the local update on the private data:
                   CE + inter/intra-domain KL (fccl, non-forgetting distillation), or
                   CE + non-target KL to the previous round's model (fccl-plus, FNTD)
The cross-correlation loss (FCCL eq. 3): C = Z_own^T Zbar / B with both normalised along the batch,
sum_u (1 - C_uu)^2 + fccl_offdiag_weight * sum_{u != v} C_uv^2. The instance-similarity loss (FCCL+):
KL(softmax(sbar / T_s) || softmax(s / T_s)) per row, batchmean. Any architecture (s is B x (B-1)).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.protocol.wire_dtype import WireDtypeError, decode_tensor, encode_tensor, scale_name
from fedal.strategies.base import ClientHalf, InvalidResult, MissedStep, PhaseTasks, ServerContext, ServerHalf, StrategySpec
from fedal.strategies.fedal import rows_key
from fedal.strategies.frozen import Frozen, frozen_copy
from fedal.strategies.local import local_batches, local_step_count
from fedal.strategies.losses import kl_to_student
from fedal.strategies.params import StrategyParams
from fedal.strategies.public_rows import public_inputs
from fedal.strategies.training import minibatch_steps, replaying, train_mode

# tau public iterations per round (the authors' code: one public epoch of 5000 rows in batches of
# 256, about 20); local training as the toolkit's tau steps unless local_epochs is set (their code: 20)
PRESET = {"tau": 5, "local_epochs": 0, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0,
          "lambda_lf_glo": 0.0, "fccl_pretrain_epochs": 40, "fccl_temperature": 1.0}
PLUS_PRESET = {**{k: v for k, v in PRESET.items() if k != "fccl_pretrain_epochs"}, "fccl_temperature": 3.0}
PHASES = {"local_pretrain": "train", "collaborate": "exchange", "local_train": "train"}
PLUS_PHASES = {"collaborate": "exchange", "local_train": "train"}
_COMMON = ("local_epochs", "public_batch_size", "rows_seed", "wire_dtype", "wire_int8_scale", "fccl_col_weight",
           "fccl_offdiag_weight", "fccl_inter_weight", "fccl_temperature", "privacy")
PARAMS = (*_COMMON, "fccl_pretrain_epochs", "fccl_intra_weight")
PLUS_PARAMS = (*_COMMON, "fccl_isl_weight", "fccl_isl_temperature")

Z_KEY, S_KEY, ZBAR_KEY, SBAR_KEY = "fccl/z", "fccl/s", "fccl/zbar", "fccl/sbar"
VAR_EPS = 1e-8  # added to each column's variance before dividing (a constant column becomes 0)
# how far a decoded upload may stray from normalised (column mean 0, variance <= 1; similarities
# in [-1, 1]) under each wire form's rounding
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "int8": 5e-2}


# -- the math ------------------------------------------------------------------------------------

def batch_normalise(z: torch.Tensor) -> torch.Tensor:
    """Each column (class) of z [B, K] centred and scaled to unit variance over the batch
    (population variance, so that Z^T Z / B holds the columns' correlations). Here and below a
    leading client axis ([N, B, K], vectorized simulation) gives each client's own."""
    c = z - z.mean(dim=-2, keepdim=True)
    return c / torch.sqrt(c.pow(2).mean(dim=-2, keepdim=True) + VAR_EPS)


def off_diagonal(c: torch.Tensor) -> torch.Tensor:
    n = c.shape[-1]
    return c.flatten(-2)[..., :-1].reshape(*c.shape[:-2], n - 1, n + 1)[..., 1:].flatten(-2)


def cross_correlation(z_own: torch.Tensor, z_avg: torch.Tensor) -> torch.Tensor:
    """C [K, K] of two batch-normalised logit matrices [B, K]."""
    return z_own.transpose(-2, -1) @ z_avg / z_own.shape[-2]


def cross_correlation_loss(z_own: torch.Tensor, z_avg: torch.Tensor, offdiag_weight: float) -> torch.Tensor:
    """FCCL eq. 3: on-diagonal correlations pushed to 1, off-diagonal to 0 (weight lambda)."""
    c = cross_correlation(z_own, z_avg)
    on = (torch.diagonal(c, dim1=-2, dim2=-1) - 1).pow(2).sum(-1)
    return on + offdiag_weight * off_diagonal(c).pow(2).sum(-1)


def instance_similarity(h: torch.Tensor) -> torch.Tensor:
    """[B, B-1]: cosine similarity of each instance's features with every other instance's."""
    hn = F.normalize(h, dim=-1)
    s = hn @ hn.transpose(-2, -1)
    b = s.shape[-1]
    return s[..., ~torch.eye(b, dtype=torch.bool)].view(*s.shape[:-2], b, b - 1)


def instance_similarity_loss(s_own: torch.Tensor, s_avg: torch.Tensor, temperature: float) -> torch.Tensor:
    """FCCL+ FISL: KL(softmax(s_avg / T) || softmax(s_own / T)) over each row's others, batchmean."""
    return kl_to_student(s_avg, s_own, temperature)


def non_target_kl(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, temperature: float) -> torch.Tensor:
    """FCCL+ FNTD as the authors' code computes it: both softmaxes (at T) over all classes, the
    label's column dropped (not renormalised), KL summed over the rest, batchmean, times T^2."""
    *lead, b, k = student.shape
    keep = torch.ones(*lead, b, k, dtype=torch.bool).scatter_(-1, y.unsqueeze(-1), False)
    # log_softmax, not log(softmax): a class whose probability underflows to 0 for both would give
    # 0 * log 0 = NaN (logit gaps of a few hundred at T = 3), where its term is 0
    log_p = F.log_softmax(student / temperature, dim=-1)[keep].view(*lead, b, k - 1)
    with torch.no_grad():
        log_q = F.log_softmax(teacher / temperature, dim=-1)[keep].view(*lead, b, k - 1)
    return (log_q.exp() * (log_q - log_p)).sum((-2, -1)) / b * temperature**2


def kd_term(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """FCCL's inter/intra-domain term: KL(softmax(teacher/T) || softmax(student/T)) * T^2."""
    return kl_to_student(teacher, student, temperature) * temperature**2


def upload_problem(z: np.ndarray, s: np.ndarray | None, tolerance: float) -> str | None:
    """Why decoded uploads are not what the client must send (normalised logits; similarities)."""
    mean, var = z.astype(np.float64).mean(axis=0), z.astype(np.float64).var(axis=0)
    if np.abs(mean).max() > tolerance or var.max() > 1 + tolerance:
        return (f"{Z_KEY} is not normalised along the batch (column means up to {np.abs(mean).max():.3g}, "
                f"variances up to {var.max():.3g}; expected 0 and at most 1)")
    if s is not None and np.abs(s).max() > 1 + tolerance:
        return f"{S_KEY} holds {np.abs(s).max():.4g}, not a cosine similarity"
    return None


# -- server half -----------------------------------------------------------------------------------

class FCCLServer(ServerHalf):
    PLUS = False

    def __init__(self, params: StrategyParams, client_ids: list[str], context: ServerContext):
        super().__init__(params, client_ids, context)
        self.rows = min(params.public_batch_size, context.public_size)
        if self.rows < 2:
            raise ValueError("FCCL normalises along the public batch: it needs public_batch_size and a public set "
                             f"of at least 2 rows, got {self.rows}")

    def begin_round(self, round_idx: int) -> PhaseTasks:
        if round_idx == 0 and not self.PLUS:
            tasks = {cid: self.task("local_pretrain", round_idx, 0) for cid in self.client_ids}
            return PhaseTasks("local_pretrain", round_idx, 0, tasks)
        return self._next(round_idx, 0, {})

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase == "local_pretrain":
            for res in results.values():
                self.record("pretrain_loss", res.meta.get("loss"))
            return self._next(phase.round, 0, {})
        if phase.phase == "collaborate":
            return self._next(phase.round, phase.iteration + 1, results)
        if phase.phase == "local_train":
            for res in results.values():
                for key in ("loss", "loss_cc", "loss_isl"):
                    self.record("local_loss" if key == "loss" else key, res.meta.get(key))
            return None
        raise ValueError(f"unknown phase {phase.phase!r}")

    def _next(self, round_idx: int, iteration: int, results: dict[str, Message]) -> PhaseTasks:
        """collaborate(round, iteration) or, after the last, local_train; each with the average of
        the previous iteration's uploads for the clients that made one."""
        feedback = self._average(results) if results else {}
        if iteration < (self.params.tau or 1):
            phase, meta = "collaborate", {}
        else:
            phase, meta, iteration = "local_train", {"steps": self.params.tau}, 0
        tasks = {cid: Message(self.task(phase, round_idx, iteration, n_avg=len(results), **meta).meta,
                              dict(feedback) if cid in results else {})
                 for cid in self.client_ids}
        return PhaseTasks(phase, round_idx, iteration, tasks)

    def _average(self, results: dict[str, Message]) -> dict[str, np.ndarray]:
        cids = [c for c in self.client_ids if c in results]  # enrolment order: deterministic sums
        self.record("participation", len(cids) / len(self.client_ids))
        uploads = [self.take_decoded(c, results[c], self._decode_all) for c in cids]
        out = self._send(ZBAR_KEY, [u[Z_KEY] for u in uploads])
        if self.PLUS:
            out.update(self._send(SBAR_KEY, [u[S_KEY] for u in uploads]))
        return out

    def _decode_all(self, result: Message) -> dict[str, np.ndarray]:
        """Every tensor an upload carries (z; FCCL+ also s), decoded."""
        return {name: self._decode(result, name) for name in ([Z_KEY, S_KEY] if self.PLUS else [Z_KEY])}

    def _send(self, name: str, uploads: list[np.ndarray]) -> dict[str, np.ndarray]:
        """The mean of the uploads (float64, sent as float32) in the run's wire form."""
        mean = np.stack(uploads).astype(np.float64).mean(axis=0).astype(np.float32)
        return encode_tensor(name, mean, self.params.wire_dtype, self.params.wire_int8_scale)

    def _decode(self, result: Message, name: str) -> np.ndarray:
        p, b = self.params, self.rows
        shape = (b, self.context.num_classes) if name == Z_KEY else (b, b - 1)
        try:
            return decode_tensor(result.tensors, name, p.wire_dtype, p.wire_int8_scale, shape, p.max_abs_value)
        except WireDtypeError as exc:
            raise InvalidResult(f"{name}: {exc}", kind=exc.kind) from exc

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        p = self.params
        if phase.phase != "collaborate":
            if result.tensors:
                raise InvalidResult(f"a {phase.phase} result carries no tensors, got {sorted(result.tensors)}")
            return
        names = [Z_KEY, S_KEY] if self.PLUS else [Z_KEY]
        scales = [scale_name(n) for n in names] if p.wire_dtype == "int8" else []
        extra = set(result.tensors) - set(names) - set(scales)
        if extra:
            raise InvalidResult(f"a collaborate result carries {', '.join(names)}, also got {sorted(extra)}")
        z = self._decode(result, Z_KEY)
        s = self._decode(result, S_KEY) if self.PLUS else None
        problem = upload_problem(z, s, TOLERANCE[p.wire_dtype])
        if problem is not None:
            raise InvalidResult(problem, kind="fccl_upload")
        self.keep_decoded(client_id, result, {Z_KEY: z} if s is None else {Z_KEY: z, S_KEY: s})


class FCCLPlusServer(FCCLServer):
    PLUS = True


# -- client half -----------------------------------------------------------------------------------

class FCCLClient(ClientHalf):
    PLUS = False
    # pretraining and local updating are its steps on private data (DP-SGD; their teachers are
    # earlier, private models); the collaborative updating is on public rows: post-processing
    @classmethod
    def private_plan(cls, params: StrategyParams, n: int) -> tuple[int, int] | None:
        return local_step_count(params, int(params.tau or 1), n), 0

    @classmethod
    def private_one_off(cls, params: StrategyParams, n: int) -> int:
        return 0 if cls.PLUS else local_step_count(_Epochs(params, int(params.fccl_pretrain_epochs or 0)), 0, n)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.PLUS and not (hasattr(self.model, "features") and hasattr(self.model, "head")):
            raise ValueError("FCCL+ needs a model split into features and head, like every zoo model")
        # inter-domain teacher: the model as the previous local update left it (before any: the
        # initial model, or theta* once pretrained); intra-domain teacher: theta* (fccl)
        self.inter: Frozen = self.inference.snapshot(self.model)
        self.intra: Frozen | None = None
        self.pending: dict[str, Any] | None = None  # round, iteration, indices (and graph) of the last upload
        self.col_diag: dict[str, list[float]] = {}  # this round's collaborative losses

    def handle(self, task: Message) -> Message:
        if task.phase == "local_pretrain":
            return self.reply(task, **self.training_report(self.pretrain))
        if task.phase == "collaborate":
            if ZBAR_KEY in task.tensors:
                self.apply_average(task, task.integer("round"), task.integer("iteration") - 1)
            elif task.integer("iteration") == 0:
                self.col_diag.clear()  # a new round
            return self.reply(task, self.upload(task.integer("round"), task.integer("iteration")))
        if task.phase == "local_train":
            if ZBAR_KEY in task.tensors:
                self.apply_average(task, task.integer("round"), (self.params.tau or 1) - 1)
            # the round's collaborative losses, null where this client took no collaborative step
            keys = ("loss_cc", "loss_isl") if self.PLUS else ("loss_cc",)
            diag = {k: float(np.mean(self.col_diag[k])) if self.col_diag.get(k) else float("nan") for k in keys}
            self.col_diag.clear()
            report = self.training_report(lambda: self.local_update(self.task_steps(task)))
            return self.reply(task, None, **report, **diag)
        raise ValueError(f"unknown phase {task.phase!r}")

    def private_batches(self, params, steps: int) -> Iterable[torch.Tensor]:
        """local_batches for `params`, or with differential privacy as many Poisson-sampled ones
        (PrivacyBudgetExhausted, before any, when they would exceed the budget)."""
        if self.private is None:
            return local_batches(len(self.y_train), params, steps, self.generator)
        count = local_step_count(params, steps, len(self.y_train))
        self.private.check_budget(count)
        return self.private.batches(count)

    # -- pretraining (fccl) -------------------------------------------------------------------
    def pretrain(self) -> float:
        """fccl_pretrain_epochs passes of CE on the private data; theta* becomes both teachers."""
        epochs = int(self.params.fccl_pretrain_epochs or 0)

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            return F.cross_entropy(self.model(self.x_train[idx]), self.y_train[idx]), {}

        batches = self.private_batches(_Epochs(self.params, epochs), 0) if epochs else []
        done = minibatch_steps(self.model, self.optimizer, batches, step, private=self.private) if epochs else []
        losses = [s["loss"] for s in done if "loss" in s]
        self.intra = self.inference.snapshot(self.model)
        self.inter = self.inference.snapshot(self.model)  # its own copy: the two teachers part from round 1
        return float(np.mean(losses)) if losses else 0.0

    # -- collaborative updating (public rows) ---------------------------------------------------
    def forward_public(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and (FCCL+) instance similarities of public inputs, through one forward."""
        train_mode(self.model)
        if not self.PLUS:
            return self.model(x), None
        h = self.model.features(x)
        return self.model.head(h), instance_similarity(h)

    def upload(self, round_idx: int, iteration: int) -> dict[str, np.ndarray]:
        if self.public_x is None:
            raise ValueError("this client has no public set")
        p = self.params
        idx, x = public_inputs(self.public_x, rows_key(p), round_idx, iteration, p.public_batch_size)
        logits, sim = self.forward_public(x)
        z = batch_normalise(logits)
        # the graph is kept: the average's step goes through this very forward
        self.pending = {"round": round_idx, "iteration": iteration, "indices": idx, "z": z, "s": sim}
        out = encode_tensor(Z_KEY, z.detach().numpy().astype(np.float32), p.wire_dtype, p.wire_int8_scale)
        if sim is not None:
            out.update(encode_tensor(S_KEY, sim.detach().numpy().astype(np.float32), p.wire_dtype, p.wire_int8_scale))
        return out

    def received(self, task: Message, name: str, shape: tuple[int, ...] | None) -> torch.Tensor:
        p = self.params
        return torch.from_numpy(decode_tensor(task.tensors, name, p.wire_dtype, p.wire_int8_scale, shape,
                                              p.max_abs_value))

    def apply_average(self, task: Message, round_idx: int, iteration: int) -> None:
        """One optimizer step on fccl_col_weight * L_cc (+ fccl_isl_weight * L_isl), through the
        forward of the upload of (round, iteration); no step when both weights are 0."""
        p, pend = self.params, self.pending
        if pend is None or (pend["round"], pend["iteration"]) != (round_idx, iteration):
            raise MissedStep("an average for an iteration whose logits this client did not upload")
        b = len(pend["indices"])
        zbar = self.received(task, ZBAR_KEY, None)  # before anything changes: a refused form leaves it as it was
        sbar = self.received(task, SBAR_KEY, (b, b - 1)) if self.PLUS else None
        self.pending = None
        z, s = pend.get("z"), pend.get("s")
        if z is None:  # restored from a checkpoint: recompute the uploaded forward (same weights)
            assert self.public_x is not None  # pending rows exist only after an upload from it
            with replaying(self.model):
                logits, s = self.forward_public(self.public_x[pend["indices"]])
            z = batch_normalise(logits)
        if zbar.shape != z.shape:
            raise ValueError(f"{ZBAR_KEY} has shape {tuple(zbar.shape)}, expected {tuple(z.shape)}")
        loss_cc = cross_correlation_loss(z, batch_normalise(zbar), p.fccl_offdiag_weight)
        loss = p.fccl_col_weight * loss_cc
        self.col_diag.setdefault("loss_cc", []).append(loss_cc.item())
        if self.PLUS:
            assert s is not None and sbar is not None
            loss_isl = instance_similarity_loss(s, sbar, p.fccl_isl_temperature)
            loss = loss + p.fccl_isl_weight * loss_isl
            self.col_diag.setdefault("loss_isl", []).append(loss_isl.item())
        if p.fccl_col_weight == 0 and (not self.PLUS or p.fccl_isl_weight == 0):
            return
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    # -- local updating (private data) -----------------------------------------------------------
    def local_update(self, steps: int) -> float:
        """CE + the non-forgetting terms; the model it leaves is the next round's inter teacher."""
        p = self.params
        if not self.PLUS and self.intra is None:  # missed round 0's local_pretrain: pretrain now
            self.pretrain()
        t = float(p.fccl_temperature or 1.0)
        w_inter = p.fccl_inter_weight
        w_intra = 0.0 if self.PLUS else p.fccl_intra_weight

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            x, y = self.x_train[idx], self.y_train[idx]
            out = self.model(x)
            loss = F.cross_entropy(out, y)
            if w_inter > 0:
                teacher = self.inter(x)
                loss = loss + w_inter * (non_target_kl(out, teacher, y, t) if self.PLUS else kd_term(out, teacher, t))
            if w_intra > 0:
                assert self.intra is not None
                loss = loss + w_intra * kd_term(out, self.intra(x), t)
            return loss, {}

        batches = self.private_batches(p, steps)
        done = minibatch_steps(self.model, self.optimizer, batches, step, private=self.private)
        losses = [s["loss"] for s in done if "loss" in s]
        self.inter = self.inference.snapshot(self.model, reuse=self.inter)
        return float(np.mean(losses)) if losses else 0.0

    # -- persistence -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["inter"] = self.inter.state_dict()
        state["intra"] = None if self.intra is None else self.intra.state_dict()
        state["col_diag"] = {k: list(v) for k, v in self.col_diag.items()}
        state["pending"] = None if self.pending is None else {
            "round": self.pending["round"], "iteration": self.pending["iteration"],
            "indices": self.pending["indices"].clone()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.inter = self._frozen(state["inter"])
        self.intra = None if state.get("intra") is None else self._frozen(state["intra"])
        self.col_diag = {k: [float(x) for x in v] for k, v in (state.get("col_diag") or {}).items()}
        self.pending = state.get("pending")

    def _frozen(self, weights: dict) -> Frozen:
        module = frozen_copy(self.model)
        module.load_state_dict(weights)
        return self.inference.snapshot(module)


class FCCLPlusClient(FCCLClient):
    PLUS = True


class _Epochs:
    """The run's params with local_epochs replaced (local_batches reads batch_size and local_epochs)."""

    def __init__(self, params: StrategyParams, epochs: int):
        self.batch_size, self.local_epochs = params.batch_size, epochs


SPECS = (
    StrategySpec("fccl", FCCLServer, FCCLClient, PRESET, PHASES, PARAMS, uses_public_set=True, min_public_rows=2),
    StrategySpec("fccl-plus", FCCLPlusServer, FCCLPlusClient, PLUS_PRESET, PLUS_PHASES, PLUS_PARAMS,
                 uses_public_set=True, min_public_rows=2),
)
