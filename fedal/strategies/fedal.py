"""FedAL (fedal.txt, Algorithm 1; ALGORITHMS.md section 1): both halves of one round.

Round t, tau + 1 round trips (each transfer iteration's feedback travels with the next
iteration's public rows, so no message is a bare request or a bare acknowledgement):
  local_train      server -> client: steps, public rows of iteration 0
                   client: tau SGD steps on CE + lambda_lf_loc * KL(p(theta_ref_loc) || p),
                           then uploads its logits f_n on those rows                (K*B up)
  transfer i       server: one discriminator step on all f_n, per-sample G_n with the updated
  (i = 0..tau-1)           w, and fbar; sends fbar, G_n and the rows of iteration i+1 (2*K*B down)
                   client: one step on lambda_kd * KL(softmax(target) || p_n)
                           + lambda_lf_glo * KL(p(theta_ref_glo) || p_n)
                           + lambda_adv * <G_n / B, f_n> (a vector-Jacobian product),
                           then uploads f_n on the rows of iteration i+1 (none after the last)
FedMD and FedMD-LF are this file with other presets (lambda_adv = 0; no LF for FedMD).
FedDF-AL and FedDF (feddf.py) put a per-architecture parameter average before this transfer stage.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedal.protocol import Message
from fedal.protocol.wire_dtype import WireDtypeError, decode_tensor, encode_tensor, wire_round
from fedal.strategies import optim
from fedal.strategies.base import ClientHalf, InvalidResult, MissedStep, PhaseTasks, ServerContext, ServerHalf, StrategySpec
from fedal.strategies.discriminator import Discriminator, discriminator_input, per_sample_adversarial_grad, row_chunks
from fedal.strategies.frozen import Frozen, frozen_copy
from fedal.strategies.losses import cross_entropy, kl_grad_norms, kl_to_student, mean_kl_to_mean
from fedal.strategies.params import DISTILLATION_PARAMS, StrategyParams
from fedal.strategies.public_rows import public_inputs
from fedal.strategies.training import minibatch_steps, replaying, train_mode

PRESET = {"tau": 5, "lambda_kd": 1.0, "lambda_adv": 1.0, "lambda_lf_loc": 1.0, "lambda_lf_glo": 1.0}
# the phases of a round and their kind: "train" phases get the training deadline

PHASES = {"local_train": "train", "transfer": "exchange"}
# its own knobs, besides params.COMMON_PARAMS
PARAMS = DISTILLATION_PARAMS + ("privacy",)  # stage 1 is its only step on private data (docs/privacy.md)


def logits_iteration(phase: str, iteration: int, tau: int) -> int | None:
    """The transfer iteration whose public logits the result of (phase, iteration) carries: the
    local training's result opens iteration 0, each transfer result the next; the last, none."""
    if phase == "local_train":
        return 0
    if phase == "transfer" and iteration + 1 < tau:
        return iteration + 1
    return None


def round_diagnostics(kept: dict[str, list[float]], diag: dict[str, float], last: bool) -> dict[str, float]:
    """The transfer stage's diagnostics travel once, as their means, with the round's last
    iteration: at B = 32 four numbers per result would be 5 % of the logits they ride with.
    `kept` holds this round's values so far (emptied when they are sent); `diag`, this
    iteration's, joins them (an emulated client's; a client computes its own into `kept`)."""
    for key, value in diag.items():
        kept.setdefault(key, []).append(value)
    if not last:
        return {}
    means = {k: float(np.mean(v)) for k, v in kept.items()}
    kept.clear()
    return means


def rows_key(params: StrategyParams) -> int:
    return 0 if params.rows_seed is None else params.rows_seed


# -- a client's losses, shared by the per-client path and the vectorized one (stacked_fedal.py) --
def local_loss(p: StrategyParams, logits: torch.Tensor, y: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    """Stage 1 (eq. 7): CE + lambda_lf_loc * KL(p(theta_ref_loc) || p); per client for stacked
    [N, B, C] logits."""
    loss = cross_entropy(logits, y)
    if ref is not None:
        loss = loss + p.lambda_lf_loc * kl_to_student(ref, logits, p.temperature_lf)
    return loss


def transfer_terms(p: StrategyParams, f: torch.Tensor, target: torch.Tensor,
                   ref: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 2's distillation terms (eq. 8 without the adversarial one, which arrives as a
    gradient): lambda_kd * KL(softmax(target) || p_n) and lambda_lf_glo * KL(p(theta_ref_glo) || p_n);
    per client for stacked [N, B, C] logits."""
    kd = p.lambda_kd * kl_to_student(target, f, p.temperature_kd)
    lf = None if ref is None else p.lambda_lf_glo * kl_to_student(ref, f, p.temperature_lf)
    return kd, lf


def transfer_norms(p: StrategyParams, kd: torch.Tensor, f: torch.Tensor, target: torch.Tensor,
                   ref: torch.Tensor | None, adv: torch.Tensor | None) -> list[dict[str, float]]:
    """The distillation terms' diagnostics: the KD loss and the gradient norm of each term (the
    adversarial one as the server sent it). One dict for [B, C] logits, one per client for
    stacked [N, B, C] ones, computed for all of them at once (one softmax where both KL terms
    share a temperature, one conversion to floats)."""
    names, scales = ["loss_kd", "gnorm_kd"], [1.0, p.lambda_kd]
    student = f.detach()
    if ref is None:
        norms = kl_grad_norms([target], student, p.temperature_kd)
    else:
        names.append("gnorm_lf")
        scales.append(p.lambda_lf_glo)
        norms = kl_grad_norms([target, ref], student, p.temperature_kd) if p.temperature_lf == p.temperature_kd \
            else torch.cat([kl_grad_norms([target], student, p.temperature_kd),
                            kl_grad_norms([ref], student, p.temperature_lf)])
    rows = [kd.detach().reshape(-1).tolist(), *norms.reshape(len(norms), -1).tolist()]
    if adv is not None:
        names.append("gnorm_adv")
        scales.append(1.0)
        rows.append(torch.linalg.vector_norm(adv, dim=(-2, -1)).reshape(-1).tolist())
    columns = [[s * v for v in row] for s, row in zip(scales, rows)]
    return [dict(zip(names, client)) for client in zip(*columns)]


FUSED_ADAM_DEVICES = ("cpu", "cuda")


class FedALServer(ServerHalf):
    def __init__(self, params: StrategyParams, client_ids: list[str], context: ServerContext):
        super().__init__(params, client_ids, context)
        self.client_index = {cid: i for i, cid in enumerate(self.client_ids)}
        self.adversarial = params.lambda_adv > 0
        self.disc: Discriminator | None = None
        if self.adversarial:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(context.seed)
                self.disc = Discriminator(context.num_classes, len(self.client_ids), params.disc_hidden)
            self.disc.to(context.device)
            # Adam's fused kernel where torch has one for the device: one kernel for all of the
            # discriminator's tensors each step (on a CPU torch's default takes about ten small
            # operations per tensor; on CUDA its multi-tensor path, a few launches)
            fused = torch.device(context.device).type in FUSED_ADAM_DEVICES
            self.disc_opt = optim.Adam(self.disc.parameters(), lr=params.disc_lr, fused=fused or None)

    # -- phases ---------------------------------------------------------------------------
    def begin_round(self, round_idx: int) -> PhaseTasks:
        tasks = {cid: self.task("local_train", round_idx, 0, steps=self.params.tau) for cid in self.client_ids}
        return PhaseTasks("local_train", round_idx, 0, tasks)

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase == "local_train":
            for res in results.values():
                self.record("local_loss", res.meta.get("loss"))
            return self._transfer_phase(phase.round, 0, results)
        if phase.phase == "transfer":
            for res in results.values():
                for key in ("loss_kd", "gnorm_kd", "gnorm_lf", "gnorm_adv"):
                    self.record(key, res.meta.get(key))
            if phase.iteration + 1 < self.params.tau:
                return self._transfer_phase(phase.round, phase.iteration + 1, results)
            return None
        raise ValueError(f"unknown phase {phase.phase!r}")

    def logits_iteration(self, phase: str, iteration: int) -> int | None:
        """The transfer iteration whose logits a result of (phase, iteration) carries, if any."""
        return logits_iteration(phase, iteration, self.params.tau or 1)

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        if self.logits_iteration(phase.phase, phase.iteration) is not None:
            rows = min(self.params.public_batch_size, self.context.public_size)
            self.keep_decoded(client_id, result, self.received_logits(result, (rows, self.context.num_classes)))

    def received_logits(self, result: Message, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A result's logits in float32, refused unless in exactly the form the run's wire_dtype sends."""
        p = self.params
        try:
            return decode_tensor(result.tensors, "logits", p.wire_dtype, p.wire_int8_scale, shape, p.max_abs_value)
        except WireDtypeError as exc:
            raise InvalidResult(f"logits: {exc}", kind=exc.kind) from exc

    def send(self, name: str, x: np.ndarray) -> dict[str, np.ndarray]:
        """Float32 `x` in the run's wire form (with its scale for int8)."""
        return encode_tensor(name, x, self.params.wire_dtype, self.params.wire_int8_scale)

    def _transfer_phase(self, round_idx: int, iteration: int, results: dict[str, Message]) -> PhaseTasks | None:
        """Feedback on the logits of `iteration`; its result opens the next iteration (the rows of
        which both ends compute: public_rows)."""
        feedback = self._feedback(results) if results else {}
        more = iteration + 1 < self.params.tau
        tasks = {}
        for cid in self.client_ids:  # a client left out of this iteration still uploads for the next
            tensors = dict(feedback.get(cid, {}))
            if tensors or more:
                tasks[cid] = Message(self.task("transfer", round_idx, iteration, n_avg=len(results)).meta, tensors)
        return PhaseTasks("transfer", round_idx, iteration, tasks) if tasks else None

    def _feedback(self, results: dict[str, Message]) -> dict[str, dict[str, np.ndarray]]:
        cids = [cid for cid in self.client_ids if cid in results]  # enrolment order: deterministic
        f = torch.stack([torch.from_numpy(self.take_decoded(c, results[c], self.received_logits)) for c in cids])
        n_avg, batch = f.shape[0], f.shape[1]
        self.record("participation", n_avg / len(self.client_ids))
        self.record("discrepancy", mean_kl_to_mean(F.softmax(f, dim=2)))
        fbar = self.send("fbar", f.mean(dim=0).numpy())
        out = {c: dict(fbar) for c in cids}
        if self.adversarial:
            device = self.context.device
            rows = f.reshape(n_avg * batch, -1).to(device)
            target = torch.tensor([self.client_index[c] for c in cids]).repeat_interleave(batch).to(device)
            self._discriminator_step(rows, target)
            assert self.disc is not None  # built when lambda_adv > 0, the only case that reaches here
            g = per_sample_adversarial_grad(self.disc, rows, target, self.params.temperature_disc).cpu()
            for k, c in enumerate(cids):
                out[c].update(self.send("grad", g[k * batch : (k + 1) * batch].numpy()))
        return out

    def _discriminator_step(self, rows: torch.Tensor, target: torch.Tensor) -> None:
        """One Adam step on mean CE over all received rows: gradient ascent on U."""
        assert self.disc is not None
        self.disc.train()
        self.disc_opt.zero_grad()
        chunks = row_chunks(len(rows), len(self.client_ids))
        if len(chunks) == 1:
            out = self.disc(discriminator_input(rows, self.params.temperature_disc))
            loss = F.cross_entropy(out, target)
            loss.backward()
            disc_loss, disc_acc = loss.item(), (out.argmax(dim=1) == target).float().mean().item()
        else:  # many clients: the mean over all rows, its gradient accumulated chunk by chunk
            disc_loss, correct = 0.0, 0
            for part in chunks:
                out = self.disc(discriminator_input(rows[part], self.params.temperature_disc))
                loss = F.cross_entropy(out, target[part], reduction="sum") / len(rows)
                loss.backward()
                disc_loss += loss.item()
                correct += int((out.argmax(dim=1) == target[part]).sum().item())
            disc_acc = correct / len(rows)
        self.disc_opt.step()
        self.record("disc_loss", disc_loss)
        self.record("disc_acc", disc_acc)

    # -- persistence ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self.adversarial:
            return {}
        return copy.deepcopy({"disc": self.disc.state_dict(), "disc_opt": self.disc_opt.state_dict()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.adversarial and state:
            self.disc.load_state_dict(state["disc"])  # load_state_dict keeps the module's device
            self.disc_opt.load_state_dict(state["disc_opt"])


def _stacked(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The parts stacked on a new leading axis; None for parts that are None (all alike)."""
    return None if parts[0] is None else torch.stack([x for x in parts if x is not None])


# an iteration's (kd, f, target, ref, adv) as transfer_norms takes them, detached
KeptTerms = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


def compute_kept_diagnostics(clients: Sequence[FedALClient]) -> None:
    """transfer_norms of the clients' kept iterations, each client's appended to its round's
    diagnostics in iteration order; in one call where all are alike (stacked along the leading
    axis: the same numbers as one call each), so a stacked group pays it once a round."""
    kept = [(c, c.kept_terms) for c in clients if c.kept_terms]
    for c, _ in kept:
        c.kept_terms = []
    terms = [(c, t) for c, ts in kept for t in ts]
    if not terms:
        return
    p = terms[0][0].params
    alike = len({(t[3] is None, t[4] is None, t[1].shape) for _, t in terms}) == 1 \
        and all(c.params == p for c, _ in kept)
    for part in [terms] if alike else [[one] for one in terms]:
        kd, f, target, ref, adv = (_stacked([t[i] for _, t in part]) for i in range(5))
        assert kd is not None and f is not None and target is not None  # never None
        for (c, _), diag in zip(part, transfer_norms(part[0][0].params, kd, f, target, ref, adv)):
            for key, value in diag.items():
                c.transfer_diag.setdefault(key, []).append(value)


class FedALClient(ClientHalf):
    # stage 1 goes through self.private; stage 2 and the uploads are post-processing
    @classmethod
    def private_plan(cls, params: StrategyParams, n: int) -> tuple[int, int] | None:
        return int(params.tau or 1), 0  # stage 1: tau steps (the local_train task's)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ref_loc: Frozen | None = None
        self.ref_glo: Frozen | None = None
        self.pending: dict[str, Any] | None = None  # indices and logits of the last upload
        self.transfer_diag: dict[str, list[float]] = {}  # this round's per-iteration diagnostics
        # this round's transfer iterations whose diagnostics are still to compute: (kd, f, target,
        # ref, adv) each, detached; computed together when the round's means are due
        self.kept_terms: list[KeptTerms] = []

    def handle(self, task: Message) -> Message:
        if task.phase == "local_train":
            diag = self._local_train(task)
        elif task.phase == "transfer":
            if "fbar" in task.tensors:
                self._apply_feedback(task)
            diag = self.transfer_diagnostics(last=task.integer("iteration") + 1 >= self.params.tau)
        else:
            raise ValueError(f"unknown phase {task.phase!r}")
        tensors = {}
        nxt = logits_iteration(task.phase, task.integer("iteration"), self.params.tau or 1)
        if nxt is not None:  # the logits that open the next transfer iteration
            tensors = self._upload_logits(task.integer("round"), nxt)
        return self.reply(task, tensors, **diag)

    def transfer_diagnostics(self, last: bool) -> dict[str, float]:
        """The round's transfer diagnostics as they travel (round_diagnostics): their means on
        its last iteration, computed then from the kept terms, else {}."""
        if last and self.kept_terms:
            self._compute_kept_diagnostics()
        return round_diagnostics(self.transfer_diag, {}, last)

    def new_round_diagnostics(self) -> None:
        """A new round: what an interrupted transfer stage left is not reported."""
        self.transfer_diag.clear()
        self.kept_terms.clear()

    def _compute_kept_diagnostics(self) -> None:
        compute_kept_diagnostics([self])

    def _local_train(self, task: Message) -> dict[str, Any]:
        diag = self.training_report(lambda: self.local_steps(self.task_steps(task)))
        self.snapshot_ref_glo()
        return diag

    def local_steps(self, steps: int) -> float:
        """Stage 1: CE + lambda_lf_loc * KL(p(theta_ref_loc) || p), theta_ref_loc = round start."""
        p = self.params
        self.new_round_diagnostics()
        self.ref_loc = self.inference.snapshot(self.model, reuse=self.ref_loc) if p.lambda_lf_loc > 0 else None
        n = len(self.y_train)

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            x = self.x_train[idx]
            ref = None if self.ref_loc is None else self.ref_loc(x)
            return local_loss(p, self.model(x), self.y_train[idx], ref), {}

        if self.private is not None:  # Poisson-sampled batches, clipped and noised (fedal/privacy/)
            self.private.check_budget(steps)
            batches: Iterable[torch.Tensor] = self.private.batches(steps)
        else:  # tau batches, each drawn afresh (ClientHalf.sample_batch's draw)
            batches = (torch.randperm(n, generator=self.generator)[: min(p.batch_size, n)] for _ in range(steps))
        done = minibatch_steps(self.model, self.optimizer, batches, step, private=self.private)
        losses = [s["loss"] for s in done if "loss" in s]
        return float(np.mean(losses)) if losses else 0.0

    def snapshot_ref_glo(self) -> None:
        """theta_ref_glo: the model the transfer stage starts from."""
        self.ref_glo = self.inference.snapshot(self.model, reuse=self.ref_glo) if self.params.lambda_lf_glo > 0 else None

    def _upload_logits(self, round_idx: int, iteration: int) -> dict[str, np.ndarray]:
        """The logits on the public rows of (round, iteration), as the result's tensors in the run's wire form."""
        if self.public_x is None:
            raise ValueError("this client has no public set")
        p = self.params
        idx, x = public_inputs(self.public_x, rows_key(p), round_idx, iteration, p.public_batch_size)
        train_mode(self.model)
        logits = self.model(x)
        # the graph is kept: the feedback's vector-Jacobian product goes through this very forward
        self.pending = {"round": round_idx, "iteration": iteration, "indices": idx, "x": x, "logits": logits}
        return encode_tensor("logits", logits.detach().numpy().astype(np.float32), p.wire_dtype, p.wire_int8_scale)

    def received(self, task: Message, name: str) -> torch.Tensor:
        """Feedback tensor `name` in float32; WireDtypeError, a ValueError (the session's
        TaskRefused), unless it travels in exactly the run's wire form."""
        p = self.params
        return torch.from_numpy(decode_tensor(task.tensors, name, p.wire_dtype, p.wire_int8_scale,
                                              max_abs_value=p.max_abs_value))

    def _apply_feedback(self, task: Message) -> None:
        p = self.params
        pend = self.pending
        if pend is None or (pend["round"], pend["iteration"]) != (task.meta["round"], task.meta["iteration"]):
            raise MissedStep("feedback for an iteration whose logits this client did not upload")
        fbar = self.received(task, "fbar")  # before anything changes: a refused form leaves it as it was
        g = self.received(task, "grad") if "grad" in task.tensors and p.lambda_adv > 0 else None
        self.pending = None
        assert self.public_x is not None  # pending logits exist only after an upload from it
        x = pend["x"] if "x" in pend else self.public_x[pend["indices"]]
        f = pend.get("logits")
        if f is None:  # restored from a checkpoint: recompute the uploaded logits (same weights)
            with replaying(self.model):
                f = self.model(x)
        for name, t in (("fbar", fbar), ("grad", g)):
            if t is not None and t.shape != f.shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(f.shape)}")
        # the own logits as the server averaged them (float32: f itself), so that eq. 5's
        # leave-one-out removes exactly this client's share of fbar
        own = torch.from_numpy(wire_round(f.detach().numpy(), p.wire_dtype, p.wire_int8_scale))
        target = self.kd_target(fbar, own, task.integer("n_avg", 1))

        ref = None if self.ref_glo is None else self.ref_glo(x)
        loss, lf = transfer_terms(p, f, target, ref)
        adv = None if g is None else p.lambda_adv * g / f.shape[0]
        # diagnostics: computed with the round's other iterations (transfer_diagnostics)
        self.kept_terms.append((loss.detach(), f.detach(), target, ref, adv))
        if lf is not None:
            loss = loss + lf

        self.optimizer.zero_grad()
        if adv is not None:
            # d/df (f * adv).sum() = adv: the server's gradient joins the loss's in one scalar
            # backward (autograd.backward with explicit gradients would import sympy on a device)
            (loss + (f * adv).sum()).backward()
        else:
            loss.backward()
        self.optimizer.step()

    def kd_target(self, fbar: torch.Tensor, own: torch.Tensor, n_avg: int) -> torch.Tensor:
        """Eq. 5: the average of the *other* clients' logits, (N' fbar - f_n) / (N' - 1)."""
        if self.params.kd_target == "all" or n_avg <= 1:
            return fbar
        return (n_avg * fbar - own) / (n_avg - 1)

    def state_dict(self) -> dict[str, Any]:
        if self.kept_terms:  # saved as the numbers they give
            self._compute_kept_diagnostics()
        state = super().state_dict()
        state["ref_loc"] = None if self.ref_loc is None else self.ref_loc.state_dict()
        state["ref_glo"] = None if self.ref_glo is None else self.ref_glo.state_dict()
        state["transfer_diag"] = {k: list(v) for k, v in self.transfer_diag.items()}
        state["pending"] = None if self.pending is None else {
            k: self.pending[k].clone() if k == "indices" else self.pending[k] for k in ("round", "iteration", "indices")
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for name in ("ref_loc", "ref_glo"):
            if state.get(name) is not None:
                weights = frozen_copy(self.model)
                weights.load_state_dict(state[name])
                setattr(self, name, self.inference.snapshot(weights))
        self.pending = state.get("pending")
        self.transfer_diag = {k: [float(x) for x in v] for k, v in (state.get("transfer_diag") or {}).items()}
        self.kept_terms = []


SPECS = (StrategySpec("fedal", FedALServer, FedALClient, PRESET, PHASES, PARAMS, uses_public_set=True),)
