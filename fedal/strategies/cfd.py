"""CFD, Compressed Federated Distillation (Sattler et al., "Communication-Efficient Federated
Distillation", 2020), and MHAT (Hu et al., "MHAT: An efficient model-heterogenous aggregation
training scheme for federated learning", Information Sciences 2021): the FedAL paper's one
baseline "CFD (= MHAT)".

A round, two phases:
  local_train  server -> client: steps, and which of the client's earlier uploads the server
                                 holds (`ref`, for delta coding)
               client: tau CE steps on its private data (Local's steps), then its softmax outputs
                       on the distillation rows D (a fixed subset of the public set, the same every
                       round), quantized to b bits: levels round(p (2^b - 1)) as integers; sent in
                       full, or (cfd_delta) as the entries that changed since the upload `ref`
                       (a bitmap of changed positions + their new levels)
  distill      server: decodes, averages the dequantized soft labels over the clients (CFD), or
                       distils that average into a server model of its own (MHAT, mhat_server_model,
                       on ServerContext.device) and takes that model's softmax outputs on D; the
                       result, quantized to b bits, goes to every client
               client: tau steps on lambda_kd * CE(target, softmax(f / T)) on minibatches of D
Everything on the wire is an integer tensor; the scale 1 / (2^b - 1) follows from cfd_bits, a run
parameter both ends hold, so simulation and deployment decode the same numbers.
Choices where the papers are open: docs/algorithms.md, CFD and MHAT.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedal.models import build_model
from fedal.protocol import Message
from fedal.strategies import optim
from fedal.strategies.base import ClientHalf, InvalidResult, PhaseTasks, ServerContext, ServerHalf, StrategySpec
from fedal.strategies.local import local_step_count, train_steps
from fedal.strategies.params import StrategyParams
from fedal.strategies.public_rows import public_rows
from fedal.strategies.training import minibatch_steps

# CFD: b = 1 bit per soft-label entry, delta coding on; the FedAL paper's schedule of FedMD-type
# baselines otherwise (tau local steps, then the exchange and tau distillation steps)
CFD_PRESET = {"tau": 5, "lambda_kd": 1.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0,
              "cfd_bits": 1, "cfd_delta": True}
# MHAT exchanges soft labels without compression: 16 bits (quantization error <= 2^-17), no delta coding
MHAT_PRESET = {**CFD_PRESET, "cfd_bits": 16, "cfd_delta": False}
# the phases of a round and their kind: "train" phases get the training deadline
PHASES = {"local_train": "train", "distill": "exchange"}
# its own knobs, besides params.COMMON_PARAMS
CFD_PARAMS = ("public_batch_size", "lambda_kd", "temperature_kd", "rows_seed", "cfd_bits", "cfd_delta", "cfd_public_rows",
              "privacy")
MHAT_PARAMS = (*CFD_PARAMS, "mhat_server_model", "mhat_server_epochs", "mhat_server_lr")

LEVELS_KEY = "cfd/levels"  # up, full: quantized soft labels [D, K]
CHANGED_KEY = "cfd/changed"  # up, delta: bitmap of changed entries of [D, K], np.packbits order [ceil(D K / 8)]
NEW_KEY = "cfd/new"  # up, delta: the new levels of the changed entries, row-major [m] (absent when m = 0)
TARGET_KEY = "cfd/target"  # down: quantized distillation target [D, K]
NO_REF = -1  # `ref` of a full upload: coded against nothing


# -- the code on the wire -------------------------------------------------------------------------
def top_level(bits: int) -> int:
    return (1 << int(bits)) - 1


def level_dtype(bits: int) -> np.dtype:
    return np.dtype(np.uint8) if bits <= 8 else np.dtype(np.uint16)


def quantize(probs: np.ndarray, bits: int) -> np.ndarray:
    """round(p (2^b - 1)) of probabilities clipped to [0, 1]; error at most 1 / (2 (2^b - 1)) per entry."""
    top = top_level(bits)
    scaled = np.clip(np.asarray(probs, np.float64), 0.0, 1.0) * top
    return np.rint(scaled).astype(level_dtype(bits))


def dequantize(levels: np.ndarray, bits: int) -> np.ndarray:
    return np.asarray(levels, np.float64) / top_level(bits)


def delta_encode(levels: np.ndarray, reference: np.ndarray) -> dict[str, np.ndarray]:
    """The entries of `levels` that differ from `reference`: a bitmap of positions (row-major,
    np.packbits' big-endian bit order, zero padding) and their new levels."""
    changed = (levels != reference).reshape(-1)
    out = {CHANGED_KEY: np.packbits(changed)}
    if changed.any():
        out[NEW_KEY] = levels.reshape(-1)[changed].copy()
    return out


def delta_decode(tensors: dict[str, np.ndarray], reference: np.ndarray, bits: int) -> np.ndarray:
    """`reference` with the changed entries replaced; ValueError unless the code is exactly the
    form delta_encode writes for this shape and bit width."""
    size = reference.size
    bitmap, dtype = tensors.get(CHANGED_KEY), level_dtype(bits)
    if bitmap is None or bitmap.dtype != np.uint8 or bitmap.shape != ((size + 7) // 8,):
        got = "nothing" if bitmap is None else f"{bitmap.dtype}{list(bitmap.shape)}"
        raise ValueError(f"{CHANGED_KEY} is {got}, expected uint8[{(size + 7) // 8}]")
    bits_all = np.unpackbits(bitmap)
    if bits_all[size:].any():
        raise ValueError(f"{CHANGED_KEY} sets padding bits past the {size} entries")
    changed = bits_all[:size].astype(bool)
    m = int(changed.sum())
    new = tensors.get(NEW_KEY)
    if m == 0:
        if new is not None:
            raise ValueError(f"{NEW_KEY} sent with no changed entry")
        return reference.copy()
    if new is None or new.dtype != dtype or new.shape != (m,):
        got = "nothing" if new is None else f"{new.dtype}{list(new.shape)}"
        raise ValueError(f"{NEW_KEY} is {got}, expected {dtype}[{m}] (one level per changed entry)")
    if (new > top_level(bits)).any():
        raise ValueError(f"{NEW_KEY} holds a level above {top_level(bits)} ({bits} bits)")
    out = reference.copy().reshape(-1)
    out[changed] = new
    return out.reshape(reference.shape)


def check_levels(levels: np.ndarray, shape: tuple[int, int], bits: int, name: str, slack: float = 0.5) -> None:
    """Quantized probability rows: the dtype of b bits, the shape, levels <= 2^b - 1, and each row's
    levels adding up to 2^b - 1 within the rounding of its K entries (slack K / 2; an average of
    quantized rows, quantized again, K)."""
    dtype, top = level_dtype(bits), top_level(bits)
    if levels.dtype != dtype or levels.shape != shape:
        raise ValueError(f"{name} is {levels.dtype}{list(levels.shape)}, expected {dtype}{list(shape)}")
    if (levels > top).any():
        raise ValueError(f"{name} holds a level above {top} ({bits} bits)")
    sums = levels.astype(np.int64).sum(axis=1)
    if (np.abs(sums - top) > shape[1] * slack).any():
        raise ValueError(f"{name} rows are not quantized probability vectors (their levels must add up to {top} "
                         f"within {shape[1] * slack:g})")


def distillation_rows(params: StrategyParams, public_size: int) -> np.ndarray:
    """D: cfd_public_rows rows (all when unset) of the public set, drawn once by public_rows with
    (round 0, iteration 0) and the same every round, so that delta coding compares like with like."""
    n = public_size if params.cfd_public_rows is None else min(params.cfd_public_rows, public_size)
    key = 0 if params.rows_seed is None else params.rows_seed
    return public_rows(key, 0, 0, public_size, n)


def soft_target(levels: np.ndarray, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantized target's rows scaled to sum to 1, and which rows have any mass (at b = 1 a
    row of levels can be all 0: it carries no target and is left out)."""
    q = torch.from_numpy(dequantize(levels, bits)).float()
    total = q.sum(dim=1, keepdim=True)
    has = total.squeeze(1) > 0
    return torch.where(total > 0, q / total.clamp_min(1e-12), torch.zeros_like(q)), has


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, has: torch.Tensor, temperature: float) -> torch.Tensor:
    """(1/B) sum_b [row b has a target] * -sum_c t_bc log softmax(z_b / T)_c; per client for
    stacked [N, B, C] logits (vectorized simulation)."""
    ce = -(target * F.log_softmax(logits / temperature, dim=-1)).sum(dim=-1)
    return (ce * has.to(ce.dtype)).sum(dim=-1) / max(ce.shape[-1], 1)


# -- client ---------------------------------------------------------------------------------------
class CFDClient(ClientHalf):
    # local training (train_steps' private path) is its only step on private data; the soft labels
    # and the distillation are on the public rows: post-processing
    @classmethod
    def private_plan(cls, params, n: int) -> tuple[int, int] | None:
        return local_step_count(params, int(params.tau or 1), n), 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.public_x is None:
            raise ValueError("CFD/MHAT needs the public set")
        self.public: torch.Tensor = self.public_x
        self.num_classes = int(self.train_data.num_classes)
        self.rows = torch.from_numpy(distillation_rows(self.params, len(self.public_x)))
        self.ref_round = NO_REF  # the round of the last upload, its levels: what a delta is coded against
        self.ref_levels: np.ndarray | None = None

    def handle(self, task: Message) -> Message:
        if task.phase == "local_train":
            report = self.training_report(lambda: train_steps(self, self.task_steps(task)))
            tensors, ref = self.upload(task.integer("round"), task.integer("ref", NO_REF))
            return self.reply(task, tensors, ref=ref, **report)
        if task.phase == "distill":
            return self.reply(task, None, **self.distill(task))
        raise ValueError(f"unknown phase {task.phase!r}")

    def soft_labels(self) -> np.ndarray:
        """softmax outputs on D in eval mode (no BatchNorm statistics move)."""
        return F.softmax(self.predict(self.public[self.rows]).float(), dim=1).numpy()

    def upload(self, round_idx: int, server_ref: int) -> tuple[dict[str, np.ndarray], int]:
        """The quantized soft labels: as a delta against the upload the server holds when this
        client holds it too, else in full (ref NO_REF)."""
        p = self.params
        bits = int(p.cfd_bits or 16)
        levels = quantize(self.soft_labels(), bits)
        coded_ref = NO_REF
        if p.cfd_delta and self.ref_levels is not None and server_ref == self.ref_round != NO_REF:
            tensors, coded_ref = delta_encode(levels, self.ref_levels), self.ref_round
        else:
            tensors = {LEVELS_KEY: levels}
        self.ref_round, self.ref_levels = round_idx, levels
        return tensors, coded_ref

    def distill(self, task: Message) -> dict[str, float]:
        """tau steps on lambda_kd * CE(target, softmax(f / T)), minibatches of D; none with lambda_kd = 0."""
        p = self.params
        bits = int(p.cfd_bits or 16)
        target_levels = task.tensors.get(TARGET_KEY)
        if target_levels is None:
            raise ValueError(f"a distill task carries {TARGET_KEY}")
        check_levels(np.asarray(target_levels), (len(self.rows), self.num_classes), bits, TARGET_KEY, slack=1.0)
        if not p.lambda_kd:
            return {}
        target, has = soft_target(np.asarray(target_levels), bits)
        x = self.public[self.rows]
        n, b = len(self.rows), min(p.public_batch_size, len(self.rows))
        batches = (torch.randperm(n, generator=self.generator)[:b] for _ in range(self.task_steps(task)))

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            loss = p.lambda_kd * soft_cross_entropy(self.model(x[idx]), target[idx], has[idx], p.temperature_kd)
            return loss, {}

        losses = [s["loss"] for s in minibatch_steps(self.model, self.optimizer, batches, step)]
        return {"loss_kd": float(np.mean(losses)) if losses else 0.0}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["ref_round"] = self.ref_round
        state["ref_levels"] = None if self.ref_levels is None else torch.from_numpy(self.ref_levels.copy())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ref_round = int(state.get("ref_round", NO_REF))
        levels = state.get("ref_levels")
        self.ref_levels = None if levels is None else torch.as_tensor(levels).numpy().copy()


# -- server ---------------------------------------------------------------------------------------
class CFDServer(ServerHalf):
    """Decodes and averages the clients' soft labels; sends the average down (CFD)."""

    def __init__(self, params: StrategyParams, client_ids: list[str], context: ServerContext):
        super().__init__(params, client_ids, context)
        self.bits = int(params.cfd_bits or 16)
        self.rows = distillation_rows(params, context.public_size)
        self.shape = (len(self.rows), context.num_classes)
        # per client, its last accepted upload: (round, levels [D, K]), what its next delta is coded against
        self.refs: dict[str, tuple[int, np.ndarray]] = {}

    def begin_round(self, round_idx: int) -> PhaseTasks:
        tasks = {}
        for cid in self.client_ids:
            meta: dict[str, Any] = {"steps": self.params.tau}
            if self.params.cfd_delta:
                meta["ref"] = self.refs[cid][0] if cid in self.refs else NO_REF
            tasks[cid] = self.task("local_train", round_idx, 0, **meta)
        return PhaseTasks("local_train", round_idx, 0, tasks)

    def decoded(self, client_id: str, result: Message) -> np.ndarray:
        """The levels [D, K] a local_train result carries; InvalidResult unless in exactly the form
        the client half sends (full, or a delta against the upload this server holds for it)."""
        t, ref = result.tensors, result.meta.get("ref")
        if isinstance(ref, bool) or not isinstance(ref, int):
            raise InvalidResult(f"a local_train result names the upload its code refers to (integer ref), got {ref!r}")
        try:
            if ref == NO_REF:
                if set(t) != {LEVELS_KEY}:
                    raise ValueError(f"a full upload carries exactly {LEVELS_KEY}, got {sorted(t)}")
                levels = t[LEVELS_KEY]
            else:
                held = self.refs.get(client_id)
                if not self.params.cfd_delta or held is None or held[0] != ref:
                    raise ValueError(f"a delta against round {ref}'s upload, which this server does not hold "
                                     f"(it holds {'none' if held is None else held[0]})")
                if not set(t) <= {CHANGED_KEY, NEW_KEY} or CHANGED_KEY not in t:
                    raise ValueError(f"a delta upload carries {CHANGED_KEY} (and {NEW_KEY}), got {sorted(t)}")
                levels = delta_decode(t, held[1], self.bits)
            check_levels(levels, self.shape, self.bits, "the soft labels")
        except ValueError as exc:
            raise InvalidResult(str(exc)) from exc
        return levels

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        if phase.phase == "local_train":
            self.decoded(client_id, result)
        elif result.tensors:
            raise InvalidResult(f"a distill result carries no tensors, got {sorted(result.tensors)}")

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase == "distill":
            for res in results.values():
                self.record("loss_kd", res.meta.get("loss_kd"))
            return None
        if phase.phase != "local_train":
            raise ValueError(f"unknown phase {phase.phase!r}")
        cids = [c for c in self.client_ids if c in results]  # enrolment order: the sum's order is fixed
        self.record("participation", len(cids) / len(self.client_ids))
        if not cids:
            return None
        decoded = {c: self.decoded(c, results[c]) for c in cids}
        for c in cids:
            self.record("local_loss", results[c].meta.get("loss"))
            if self.params.cfd_delta:  # the share of uploads that came delta-coded
                self.record("cfd_delta", int(results[c].meta.get("ref", NO_REF) != NO_REF))
            self.refs[c] = (phase.round, decoded[c])
        average = np.mean([dequantize(decoded[c], self.bits) for c in cids], axis=0)
        target = quantize(self.target(average), self.bits)
        tasks = {cid: Message(self.task("distill", phase.round, 0, steps=self.params.tau).meta, {TARGET_KEY: target})
                 for cid in self.client_ids}
        return PhaseTasks("distill", phase.round, 0, tasks)

    def target(self, average: np.ndarray) -> np.ndarray:
        """CFD: the average of the clients' dequantized soft labels."""
        return average

    def state_dict(self) -> dict[str, Any]:
        if not self.refs:
            return {}
        return {"refs": {c: {"round": r, "levels": torch.from_numpy(levels.copy())} for c, (r, levels) in self.refs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.refs = {c: (int(v["round"]), torch.as_tensor(v["levels"]).numpy().copy())
                     for c, v in (state.get("refs") or {}).items()}


class MHATServer(CFDServer):
    """CFDServer whose target is a server model's softmax output on D, after distilling the
    clients' average soft labels into it (mhat_server_epochs passes, Adam mhat_server_lr)."""

    def __init__(self, params: StrategyParams, client_ids: list[str], context: ServerContext):
        super().__init__(params, client_ids, context)
        if context.public_x is None:
            raise ValueError("MHAT's server model needs the public set's inputs on the server (ServerContext.public_x)")
        self.x = torch.from_numpy(np.ascontiguousarray(context.public_x[self.rows], dtype=np.float32))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(context.seed)
            self.model = build_model(params.mhat_server_model, tuple(self.x.shape[1:]), context.num_classes)
        self.model.to(context.device)
        self.opt = optim.Adam(self.model.parameters(), lr=params.mhat_server_lr)
        self.generator = torch.Generator().manual_seed(int(context.seed))

    def target(self, average: np.ndarray) -> np.ndarray:
        self.train_server(average)
        return self.outputs()

    def train_server(self, average: np.ndarray) -> list[float]:
        """Distil the average soft labels (rows scaled to sum 1) into the server model; the losses."""
        device = self.context.device
        total = average.sum(axis=1, keepdims=True)
        target = torch.from_numpy(np.where(total > 0, average / np.where(total > 0, total, 1.0), 0.0)).float()
        has = torch.from_numpy(total[:, 0] > 0)
        n, b = len(self.x), min(self.params.public_batch_size, len(self.x))
        batches = [chunk for _ in range(self.params.mhat_server_epochs)
                   for chunk in torch.randperm(n, generator=self.generator).split(b)]

        def step(idx: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            logits = self.model(self.x[idx].to(device))
            return soft_cross_entropy(logits, target[idx].to(device), has[idx].to(device), 1.0), {}

        losses = [s["loss"] for s in minibatch_steps(self.model, self.opt, batches, step)]
        if losses:
            self.record("server_loss", float(np.mean(losses)))
        return losses

    @torch.no_grad()
    def outputs(self) -> np.ndarray:
        self.model.eval()
        out = F.softmax(self.model(self.x.to(self.context.device)).float(), dim=1).cpu().numpy()
        self.model.train()
        return out

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(copy.deepcopy({"model": self.model.state_dict(), "opt": self.opt.state_dict()}))
        state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "model" in state:
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.generator.set_state(state["generator"])


__all__ = ["CFDClient", "CFDServer", "MHATServer", "delta_decode", "delta_encode", "dequantize", "quantize"]


SPECS = (
    StrategySpec("cfd", CFDServer, CFDClient, CFD_PRESET, PHASES, CFD_PARAMS, uses_public_set=True),
    StrategySpec("mhat", MHATServer, CFDClient, MHAT_PRESET, PHASES, MHAT_PARAMS, uses_public_set=True),
)
