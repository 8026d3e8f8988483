"""An emulated edge agent: the wire protocol of docs/protocol.md, exactly, without a model.

It joins a run by the manifest's `instance`, holds tasks that overtake the manifest, reassembles
chunks and chunks its results. What it does with a task is the agent's own session
(fedal.session.ClientSession: addressing, (epoch, seq) ordering, the cached-result resend, the
replay guard of a resumed coordinator), around an emulated client half that answers every phase
of every registered strategy with a result of the shape the real client half sends and refuses
what the real one refuses. Only the numbers are made up: logits are seeded noise of shape
[len(indices), K], weights drift by noise, accuracies follow a fixed curve. No training, so one
process can stand in for a thousand devices (torch is imported for the strategy registry, never run).

Transport-free: every handler returns the messages to publish, the fleet (hil/fleet.py) carries
them over MQTT. Applied feedback is counted per (epoch, seq) and per (instance, round,
iteration), so a test can prove that no feedback was applied twice.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import http.client
import json
import logging
import math
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedal.data.public import content_hash, public_rows_from_npz
from fedal.protocol import (
    DEFAULT_MAX_PAYLOAD,
    MAX_MESSAGE_BYTES,
    EnvelopeError,
    ManifestError,
    Message,
    Reassembler,
    RunManifest,
    split,
    topics,
)
from fedal.protocol.wire_dtype import decode_tensor, encode_tensor
from fedal.session import ClientSession, TaskRefused, hold_until_joined, missed_step_decline
from fedal.strategies import MISSED_STEP, STRATEGIES, MissedStep, StrategyParams, StrategySpec, get_strategy
from fedal.strategies.cfd import LEVELS_KEY as CFD_LEVELS_KEY
from fedal.strategies.cfd import NO_REF as CFD_NO_REF
from fedal.strategies.cfd import TARGET_KEY as CFD_TARGET_KEY
from fedal.strategies.cfd import CFDClient, check_levels, delta_encode, distillation_rows, quantize
from fedal.strategies.fccl import S_KEY as FCCL_S_KEY
from fedal.strategies.fccl import SBAR_KEY as FCCL_SBAR_KEY
from fedal.strategies.fccl import Z_KEY as FCCL_Z_KEY
from fedal.strategies.fccl import ZBAR_KEY as FCCL_ZBAR_KEY
from fedal.strategies.fccl import FCCLClient, FCCLPlusClient
from fedal.strategies.fd import AVG_KEY as FD_AVG_KEY
from fedal.strategies.fd import COUNT_KEY as FD_COUNT_KEY
from fedal.strategies.fd import FDClient, read_teacher, rows_trained
from fedal.strategies.fedakd import FedAKDClient
from fedal.strategies.fedal import FedALClient, round_diagnostics
from fedal.strategies.fedavg import FedAvgClient
from fedal.strategies.feddf import WEIGHTS, FedDFClient
from fedal.strategies.fedhkd import (
    COUNT_KEY,
    H_KEY,
    KNOWLEDGE_KEYS,
    MASK_KEY,
    Q_KEY,
    FedHKDClient,
)
from fedal.strategies.fedproto import AVERAGE_KEY as PROTO_AVERAGE_KEY
from fedal.strategies.fedproto import COUNT_KEY as PROTO_COUNT_KEY
from fedal.strategies.fedproto import FEATURES_KEY as PROTO_FEATURES_KEY
from fedal.strategies.fedproto import GLOBAL_KEY as PROTO_GLOBAL_KEY
from fedal.strategies.fedproto import MASK_KEY as PROTO_MASK_KEY
from fedal.strategies.fedproto import PROTO_KEY, FedProtoClient, FedProtoPublicClient
from fedal.strategies.local import LocalClient
from fedal.strategies.public_rows import public_rows

log = logging.getLogger("hil.emulated_agent")


@dataclass(frozen=True)
class Publish:
    topic: str
    payload: bytes
    retain: bool = False


class JoinError(RuntimeError):
    """The run cannot be joined yet (public set unavailable, unknown strategy, bad params)."""


def status_payload(state: str, ts: float | None = None) -> bytes:
    return json.dumps({"state": state, "ts": time.time() if ts is None else ts}).encode()


@dataclass(frozen=True)
class ParsedManifest:
    manifest: RunManifest
    clients: frozenset[str]


def parse_manifest(payload: bytes) -> ParsedManifest:
    """RunManifest.from_json plus a set of the enrolled ids (membership is asked per agent)."""
    m = RunManifest.from_json(payload)
    return ParsedManifest(m, frozenset(m.clients))


class PublicSetSource:
    """The public set for a whole fleet: a provisioned file, else fetched once over HTTP; checked
    against the run's content hash like the agent does. Only its size matters to the emulation."""

    def __init__(self, file: Path | None = None, timeout_s: float = 10.0, retry_s: float = 1.0):
        self.file = Path(file) if file else None
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.sizes: dict[str | None, int] = {}  # content hash -> rows
        self.failed_at = -math.inf
        self.last_error = ""
        self.fetches = 0

    def size(self, expected_hash: str | None, url: str | None) -> int:
        if expected_hash in self.sizes:
            return self.sizes[expected_hash]
        if self.file is not None and self.file.exists():
            x = _read_npz(self.file.read_bytes(), str(self.file))
            if expected_hash is not None and content_hash(x) != expected_hash:
                raise JoinError(f"public set {self.file} does not match the run's content hash")
            self.sizes[expected_hash] = len(x)
            return len(x)
        if not url:
            raise JoinError("no public set: provision one or let the coordinator announce a public_url")
        if time.monotonic() - self.failed_at < self.retry_s:  # one fetch for the fleet, not one per agent
            raise JoinError(self.last_error)
        try:
            self.fetches += 1
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                payload = resp.read()
            x = _read_npz(payload, url)
            if expected_hash is not None and content_hash(x) != expected_hash:
                raise JoinError(f"public set from {url} does not match the run's content hash")
        except (OSError, JoinError, http.client.HTTPException) as exc:  # e.g. IncompleteRead: a body cut short
            self.failed_at, self.last_error = time.monotonic(), f"cannot obtain the public set from {url}: {exc}"
            raise JoinError(self.last_error) from None
        self.sizes[expected_hash] = len(x)
        return len(x)


def _read_npz(payload: bytes, where: str) -> np.ndarray:
    """The public set's rows, read as the reference agent reads them (public_rows_from_npz)."""
    try:
        return public_rows_from_npz(payload, where)
    except ValueError as exc:
        raise JoinError(str(exc)) from None


# -- the emulated models: only their state_dict layout matters ------------------------------------

@dataclass(frozen=True)
class ModelLayout:
    """A model's state_dict as names, shapes and dtypes, and its feature width d (FedHKD's H)."""

    name: str
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    feature_dim: int

    @functools.cached_property
    def tag(self) -> str:
        """The architecture tag FedDF groups by (the reference agent hashes its model the same way)."""
        sig = [self.name, [[k, list(shape), dtype] for k, shape, dtype in self.tensors]]
        return hashlib.sha256(json.dumps(sig).encode()).hexdigest()[:16]

    def initial(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return {k: rng.normal(0.0, 0.1, shape).astype(dtype) if np.dtype(dtype).kind == "f" else np.zeros(shape, dtype)
                for k, shape, dtype in self.tensors}

    def load(self, received: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The received weights in this model's dtypes; ValueError where load_state_dict would fail."""
        if set(received) != {k for k, _, _ in self.tensors}:
            raise ValueError("received weights do not match this client's model")
        out = {}
        for k, shape, dtype in self.tensors:
            arr = np.asarray(received[k])
            if shape == () and arr.shape == (1,):  # a scalar sent as [1] (some writers do); torch loads it too
                arr = arr.reshape(())
            if arr.shape != shape:
                raise ValueError(f"received {k!r} has shape {list(arr.shape)}, this client's is {list(shape)}")
            out[k] = arr.astype(dtype)
        return out


def synthetic_layout(num_classes: int, variant: int = 0) -> ModelLayout:
    """A small split model (features -> head, with an integer BatchNorm counter); variant 1 has
    another feature width, so strategies that take mixed models see two architectures."""
    d = (32, 48)[variant % 2]
    return ModelLayout(f"emulated-{variant % 2}", (
        ("features.weight", (d, 64), "float32"), ("features.bias", (d,), "float32"),
        ("features.bn.num_batches_tracked", (), "int64"),
        ("head.weight", (num_classes, d), "float32"), ("head.bias", (num_classes,), "float32")), d)


@functools.lru_cache(maxsize=32)
def zoo_layout(name: str, input_shape: tuple[int, ...], num_classes: int) -> ModelLayout:
    """The layout of a zoo model, for runs whose coordinator loads the clients' weights into its
    own model (FedAvg-type strategies score the global model as `global_acc`)."""
    import torch

    from fedal.models import build_model

    with torch.random.fork_rng(devices=[]):
        model = build_model(name, input_shape, num_classes)
    tensors = tuple((k, tuple(v.shape), str(v.detach().cpu().numpy().dtype)) for k, v in model.state_dict().items())
    return ModelLayout(name, tensors, int(model.feature_dim))


# -- the client halves, emulated -----------------------------------------------------------------

class EmulatedClient:
    """A client half's surface for ClientSession: `handle`, `state_dict`/`load_state_dict` (what
    the replay guard restores), `params` (its max_abs_value check on tasks), and `evaluate`."""

    PHASES: frozenset[str] = frozenset()

    def __init__(self, params: StrategyParams, num_classes: int, public_size: int, layout: ModelLayout, seed: int,
                 index: int, instance: str, on_applied: Callable[[tuple[int, int]], None]):
        self.params = params
        self.num_classes = num_classes
        self.public_size = public_size
        self.layout = layout
        self.seed = seed
        self.index = index
        self.instance = instance
        self.on_applied = on_applied
        self.num_samples = 100 + index
        # one stream per agent (seeding a generator per task costs more than the rest of the answer);
        # it is client state, so a replayed round draws the same numbers again
        self.rng = np.random.default_rng([seed, index])
        self.bias = np.random.default_rng([seed, index, 0x51]).normal(0.0, 1.0, 64).astype(np.float32)
        self.applied: Counter[tuple[str, int, int]] = Counter()  # undone with the state on a replay

    def handle(self, task: Message) -> Message:
        if task.phase not in self.PHASES:
            raise ValueError(f"unknown phase {task.phase!r}")
        return getattr(self, f"_{task.phase}")(task)

    def evaluate(self, task: Message) -> Message:
        noise = float(self.rng.normal(0, 0.02))
        acc = min(1.0, max(0.0, 0.1 + 0.8 * (1 - math.exp(-(_round(task) + 1) / 4)) + noise))
        return reply(task, acc=round(acc, 4), num_test=100)

    def loss(self, task: Message) -> float:
        return round(2.3 * math.exp(-(_round(task) + 1) / 6) + 0.05, 4)

    def count_applied(self, task: Message) -> None:
        self.applied[(self.instance, int(task.meta["round"]), int(task.meta["iteration"]))] += 1
        self.on_applied((task.meta["epoch"], task.meta["seq"]))

    def state_dict(self) -> dict[str, Any]:
        """Live references, like ClientHalf.state_dict: the store copies what it keeps."""
        return {"rng": self.rng.bit_generator.state, "applied": self.applied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.applied = Counter(state["applied"])


class LocalEmulation(EmulatedClient):
    """LocalClient: local training, a loss."""

    PHASES = frozenset({"local_train"})

    def _local_train(self, task: Message) -> Message:
        return reply(task, loss=self.loss(task))


class DistillationEmulation(EmulatedClient):
    """FedALClient (FedAL, FedMD, FedMD-LF): logits on the public rows; feedback first, then logits."""

    PHASES = frozenset({"local_train", "transfer"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: dict[str, Any] | None = None  # round, iteration, logits of the last upload
        self.ref_glo = False  # a less-forgetting reference exists (after the local training)
        self.transfer_diag: dict[str, list[float]] = {}  # this round's diagnostics, sent with its last iteration

    def _local_train(self, task: Message) -> Message:
        diag: dict[str, Any] = {"loss": self.loss(task)}
        self.ref_glo = self.params.lambda_lf_glo > 0
        self.transfer_diag.clear()
        return self._with_logits(task, diag, 0)

    def _transfer(self, task: Message) -> Message:
        diag = self._apply_feedback(task) if "fbar" in task.tensors else {}
        nxt = int(task.meta["iteration"]) + 1
        return self._with_logits(task, round_diagnostics(self.transfer_diag, diag, nxt >= (self.params.tau or 1)), nxt)

    def _with_logits(self, task: Message, diag: dict[str, Any], iteration: int) -> Message:
        tensors = {}
        if iteration < (self.params.tau or 1):  # the logits that open transfer iteration `iteration`
            tensors["logits"] = self.upload_logits(int(task.meta["round"]), iteration)
        return reply(task, tensors, **diag)

    def upload_logits(self, round_idx: int, iteration: int) -> np.ndarray:
        """Logits on the public rows of (round, iteration), which both ends compute."""
        rows = public_rows(self.params.rows_seed or 0, round_idx, iteration, self.public_size, self.params.public_batch_size)
        k = self.num_classes
        logits = self.rng.standard_normal((rows.size, k), dtype=np.float32) + self.bias[np.arange(k) % self.bias.size]
        self.pending = {"round": round_idx, "iteration": iteration, "logits": logits}
        return logits

    def _apply_feedback(self, task: Message) -> dict[str, Any]:
        p = self.params
        pend = self.pending
        if pend is None or (pend["round"], pend["iteration"]) != (task.meta["round"], task.meta["iteration"]):
            raise MissedStep("feedback for an iteration whose logits this client did not upload")
        self.pending = None
        own = pend["logits"]
        fbar = np.asarray(task.tensors["fbar"], dtype=np.float32)
        if fbar.shape != own.shape:
            raise ValueError(f"fbar has shape {fbar.shape}, expected {own.shape}")
        n_avg = int(task.meta.get("n_avg", 1))
        target = fbar if p.kd_target == "all" or n_avg <= 1 else (n_avg * fbar - own) / (n_avg - 1)
        gap = float(np.abs(target - own).mean())
        diag: dict[str, Any] = {"loss_kd": p.lambda_kd * gap, "gnorm_kd": p.lambda_kd * gap / own.shape[0]}
        if self.ref_glo:
            diag["gnorm_lf"] = 0.5 * p.lambda_lf_glo * gap / own.shape[0]
        if "grad" in task.tensors and p.lambda_adv > 0:
            g = np.asarray(task.tensors["grad"], dtype=np.float32)
            if g.shape != own.shape:
                raise ValueError(f"grad has shape {g.shape}, expected {own.shape}")
            diag["gnorm_adv"] = float(np.linalg.norm(p.lambda_adv * g / own.shape[0]))
        self.count_applied(task)
        return diag

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pending": self.pending, "ref_glo": self.ref_glo,
                "transfer_diag": copy.deepcopy(self.transfer_diag)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pending, self.ref_glo = state["pending"], state["ref_glo"]
        self.transfer_diag = copy.deepcopy(state.get("transfer_diag", {}))


class FedAvgEmulation(EmulatedClient):
    """FedAvgClient: its initial weights on `init`; on `train` loads the global model, "trains"
    (noise on the floats, +1 on integer counters) and uploads it with num_samples."""

    PHASES = frozenset({"init", "train"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights = initial_weights(self)

    def _init(self, task: Message) -> Message:
        return reply(task, self.copy_weights())

    def _train(self, task: Message) -> Message:
        self.apply_global(task, task.tensors)
        return reply(task, self.copy_weights(), loss=self.loss(task), num_samples=self.num_samples)

    def apply_global(self, task: Message, weights: dict[str, np.ndarray]) -> None:
        self.weights = self.layout.load(weights)
        self.count_applied(task)
        self.local_update()

    def local_update(self) -> None:
        self.weights = drift(self.weights, self.rng)

    def copy_weights(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.weights.items()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.weights = dict(state["weights"])


class FedHKDEmulation(FedAvgEmulation):
    """FedHKDClient: FedAvg's round, plus per-class knowledge up (hkd/h [K, d], hkd/q [K, K],
    hkd/count [K]) and the global knowledge taken from the task when it carries some."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k, n = self.num_classes, self.num_samples
        counts = np.full(k, (n - round(0.4 * n)) // (k - 1), np.int64)  # non-IID: 40 % of the rows in one class
        counts[self.index % k] = 0
        counts[self.index % k] = n - counts.sum()
        p = self.params
        share = (counts >= 1) & (counts >= p.hkd_nu * n) if p.hkd_preset == "paper" else counts >= 1
        self.shared_counts = np.where(share, counts, 0).astype(np.int64)

    def _train(self, task: Message) -> Message:
        weights = {k: v for k, v in task.tensors.items() if k not in KNOWLEDGE_KEYS}
        knowledge = self.global_knowledge(task.tensors)
        self.apply_global(task, weights)
        p = self.params
        loss = self.loss(task)
        stats: dict[str, Any] = {"loss": loss, "ce": loss}
        if knowledge is not None and ((p.hkd_lambda or 0) > 0 or (p.hkd_gamma or 0) > 0):
            head, feature = (round(float(v), 4) for v in np.abs(self.rng.normal(0.1, 0.02, 2)))
            stats.update(ce=round(loss - (p.hkd_lambda or 0) * head - (p.hkd_gamma or 0) * feature, 4),
                         hkd_head=head, hkd_feature=feature)
        k, d = self.num_classes, self.layout.feature_dim
        shared = self.shared_counts > 0
        h = np.where(shared[:, None], self.rng.normal(0, 1, (k, d)), 0).astype(np.float32)
        z = self.rng.normal(0, 1, (k, k)) / p.hkd_temperature
        q = np.exp(z - z.max(axis=1, keepdims=True))
        q = np.where(shared[:, None], q / q.sum(axis=1, keepdims=True), 0).astype(np.float32)
        tensors = {**self.copy_weights(), H_KEY: h, Q_KEY: q, COUNT_KEY: self.shared_counts.copy()}
        return reply(task, tensors, num_samples=self.num_samples, shared_classes=int(shared.sum()), **stats)

    def global_knowledge(self, tensors: dict[str, np.ndarray]) -> np.ndarray | None:
        """The mask of the classes whose knowledge the task carries (None: no knowledge); the real
        client's forward pass through its head would fail on other shapes."""
        if H_KEY not in tensors:
            return None
        k, d = self.num_classes, self.layout.feature_dim
        for key, shape in ((H_KEY, (k, d)), (Q_KEY, (k, k)), (MASK_KEY, (k,))):
            if key not in tensors or np.asarray(tensors[key]).shape != shape:
                raise ValueError(f"knowledge {key!r} missing or not of shape {list(shape)}")
        mask = np.asarray(tensors[MASK_KEY]).astype(bool)
        return mask if mask.any() else None


class FDEmulation(EmulatedClient):
    """FDClient: per-label mean softmax outputs (fd/avg [K, K]) and counts (fd/count [K]) up, the
    counts adding up to the rows a round trains on, skewed (40 % in one label, one label absent);
    the per-label teacher taken from the task when it carries one, checked as the real client does."""

    PHASES = frozenset({"local_train"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k = self.num_classes
        share = np.full(k, 0.6 / max(k - 2, 1))
        share[self.index % k], share[(self.index + 1) % k] = 0.4, 0.0
        self.share = share / share.sum()

    def _local_train(self, task: Message) -> Message:
        p, k = self.params, self.num_classes
        teacher = read_teacher(task.tensors, k)
        rows = rows_trained(p, int(task.meta.get("steps", p.tau or 1)), self.num_samples)
        counts = np.floor(self.share * rows).astype(np.int64)
        z = self.rng.normal(0, 1, (k, k)) + 2.0 * np.eye(k)
        probs = np.exp(z - z.max(axis=1, keepdims=True))
        avg = np.where(counts[:, None] > 0, probs / probs.sum(axis=1, keepdims=True), 0).astype(np.float32)
        loss = self.loss(task)
        stats: dict[str, Any] = {"loss": loss, "ce": loss}
        if teacher is not None:
            self.count_applied(task)
            if p.fd_beta > 0:
                term = round(abs(float(self.rng.normal(0.5, 0.05))), 4)
                stats.update(loss=round(loss + p.fd_beta * term, 4), fd_loss=term)
        return reply(task, {FD_AVG_KEY: avg, FD_COUNT_KEY: counts}, num_samples=self.num_samples, **stats)


class CFDEmulation(EmulatedClient):
    """CFDClient (cfd, mhat): softmax-like rows on the run's distillation rows quantized to cfd_bits,
    delta-coded against this agent's last upload when the task names it as the server's
    reference (else in full, ref -1); the target of a distill task checked as the real client does."""

    PHASES = frozenset({"local_train", "distill"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows = distillation_rows(self.params, self.public_size)
        self.ref_round, self.ref_levels = CFD_NO_REF, None

    def _local_train(self, task: Message) -> Message:
        p, k = self.params, self.num_classes
        bits = int(p.cfd_bits or 16)
        z = self.rng.normal(0, 1, (len(self.rows), k)) + 3.0 * np.eye(k)[(np.arange(len(self.rows)) + self.index) % k]
        levels = quantize(np.exp(z) / np.exp(z).sum(axis=1, keepdims=True), bits)
        server_ref, ref = int(task.meta.get("ref", CFD_NO_REF)), CFD_NO_REF
        if p.cfd_delta and self.ref_levels is not None and server_ref == self.ref_round != CFD_NO_REF:
            tensors, ref = delta_encode(levels, self.ref_levels), self.ref_round
        else:
            tensors = {CFD_LEVELS_KEY: levels}
        self.ref_round, self.ref_levels = int(task.meta["round"]), levels
        return reply(task, tensors, loss=self.loss(task), ref=ref)

    def _distill(self, task: Message) -> Message:
        p = self.params
        target = task.tensors.get(CFD_TARGET_KEY)
        if target is None:
            raise ValueError(f"a distill task carries {CFD_TARGET_KEY}")
        check_levels(target, (len(self.rows), self.num_classes), int(p.cfd_bits or 16), CFD_TARGET_KEY, slack=1.0)
        self.count_applied(task)
        if not p.lambda_kd:
            return reply(task)
        return reply(task, loss_kd=round(abs(float(self.rng.normal(0.8, 0.05))), 4))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ref_round": self.ref_round, "ref_levels": self.ref_levels}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ref_round, self.ref_levels = state["ref_round"], state["ref_levels"]


class FedProtoEmulation(EmulatedClient):
    """FedProtoClient: per-class prototypes (proto/mean [K, d], zero rows for absent classes) and
    counts (proto/count [K], one class absent) up; the global prototypes taken from the task when
    it carries some, refused unless of this model's width, as the real client does."""

    PHASES = frozenset({"local_train"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        k, n = self.num_classes, self.num_samples
        counts = np.full(k, n // max(k - 1, 1), np.int64)
        counts[self.index % k] = 0
        counts[(self.index + 1) % k] += n - counts.sum()
        self.counts = counts

    def _local_train(self, task: Message) -> Message:
        k, d, p = self.num_classes, self.layout.feature_dim, self.params
        loss = self.loss(task)
        stats: dict[str, Any] = {"loss": loss}
        if PROTO_GLOBAL_KEY in task.tensors:
            protos, mask = task.tensors[PROTO_GLOBAL_KEY], task.tensors.get(PROTO_MASK_KEY)
            if protos.dtype != np.float32 or protos.shape != (k, d):
                raise ValueError(f"global prototypes are {protos.dtype}{list(protos.shape)}, this model needs float32[{k}, {d}]")
            if mask is None or mask.dtype != np.uint8 or mask.shape != (k,):
                raise ValueError(f"{PROTO_MASK_KEY} must be uint8[{k}] next to {PROTO_GLOBAL_KEY}")
            if mask.any():
                self.count_applied(task)
                if (p.proto_lambda or 0) > 0:
                    term = round(abs(float(self.rng.normal(0.2, 0.02))), 4)
                    stats.update(loss=round(loss + (p.proto_lambda or 0) * term, 4), ce=loss, proto_loss=term)
        present = self.counts > 0
        protos = np.where(present[:, None], self.rng.normal(0, 1, (k, d)), 0).astype(np.float32)
        return reply(task, {PROTO_KEY: protos, PROTO_COUNT_KEY: self.counts.copy()}, num_samples=self.num_samples,
                     **stats)


class FedProtoPublicEmulation(EmulatedClient):
    """FedProtoPublicClient: FedAL's schedule with features [B, d] on the public rows in place of
    logits and their average (hbar) in place of fbar; the round's proto_loss once, with its last
    transfer iteration."""

    PHASES = frozenset({"local_train", "transfer"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: tuple[int, int] | None = None  # round, iteration of the last upload
        self.round_diag: list[float] = []

    def _local_train(self, task: Message) -> Message:
        self.round_diag = []
        return self._with_features(task, {"loss": self.loss(task)}, 0)

    def _transfer(self, task: Message) -> Message:
        tau = self.params.tau or 1
        if PROTO_AVERAGE_KEY in task.tensors:
            key = (int(task.meta["round"]), int(task.meta["iteration"]))
            if self.pending != key:
                raise MissedStep("an average for an iteration whose features this client did not upload")
            hbar = task.tensors[PROTO_AVERAGE_KEY]
            want = (self.rows(*key).size, self.layout.feature_dim)
            if hbar.dtype != np.float32 or hbar.shape != want:
                raise ValueError(f"{PROTO_AVERAGE_KEY} is {hbar.dtype}{list(hbar.shape)}, expected float32{list(want)}")
            self.pending = None
            self.round_diag.append(round(abs(float(self.rng.normal(0.3, 0.03))), 4))
            self.count_applied(task)
        nxt = int(task.meta["iteration"]) + 1
        diag: dict[str, Any] = {}
        if nxt >= tau and self.round_diag:
            diag, self.round_diag = {"proto_loss": float(np.mean(self.round_diag))}, []
        return self._with_features(task, diag, nxt)

    def rows(self, round_idx: int, iteration: int) -> np.ndarray:
        return public_rows(self.params.rows_seed or 0, round_idx, iteration, self.public_size, self.params.public_batch_size)

    def _with_features(self, task: Message, diag: dict[str, Any], iteration: int) -> Message:
        tensors = {}
        if iteration < (self.params.tau or 1):  # the features that open transfer iteration `iteration`
            round_idx = int(task.meta["round"])
            shape = (self.rows(round_idx, iteration).size, self.layout.feature_dim)
            tensors[PROTO_FEATURES_KEY] = self.rng.standard_normal(shape, dtype=np.float32)
            self.pending = (round_idx, iteration)
        return reply(task, tensors, **diag)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pending": self.pending, "round_diag": list(self.round_diag)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pending, self.round_diag = state["pending"], list(state["round_diag"])


class FedAKDEmulation(FedAvgEmulation):
    """FedAKDClient: FedAvg's messages; the upload is its copy of the global model after the
    local -> global step, with `selected` rows (what its personal model classifies correctly)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.personal_ready = False

    def _train(self, task: Message) -> Message:
        weights = self.layout.load(task.tensors)
        self.personal_ready = True  # w_k^0 = w^0 on the first train
        r, n = _round(task), self.num_samples
        selected = n if self.params.akd_selection == "all" else int(n * (0.3 + 0.6 * (1 - math.exp(-(r + 1) / 4))))
        self.weights = weights
        self.count_applied(task)
        if selected:
            self.local_update()
        loss = self.loss(task)
        return reply(task, self.copy_weights(), loss=loss, global_loss=round(1.1 * loss, 4) if selected else None,
                     selected=selected, num_samples=n)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "personal_ready": self.personal_ready}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.personal_ready = state["personal_ready"]


class FedDFEmulation(DistillationEmulation):
    """FedDFClient (FedDF-AL, FedDF): weights as `w/<key>` with an architecture tag, the group's
    average loaded before the logits of iteration 0, then FedAL's transfer stage."""

    PHASES = frozenset({"init", "local_train", "average", "transfer"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights = initial_weights(self)

    def _init(self, task: Message) -> Message:
        return reply(task, self.upload(), arch=self.layout.tag)

    def _local_train(self, task: Message) -> Message:
        self.transfer_diag.clear()
        self.load_group_weights(task)  # round 0: the group's common start
        self.weights = drift(self.weights, self.rng)
        return reply(task, self.upload(), loss=self.loss(task), num_samples=self.num_samples, arch=self.layout.tag)

    def upload(self) -> dict[str, np.ndarray]:
        return {WEIGHTS + k: v.copy() for k, v in self.weights.items()}

    def _average(self, task: Message) -> Message:
        averaged = self.load_group_weights(task)
        self.ref_glo = self.params.lambda_lf_glo > 0  # the transfer stage starts from the group average
        logits = self.upload_logits(int(task.meta["round"]), 0)
        return reply(task, {"logits": logits}, averaged=averaged)

    def load_group_weights(self, task: Message) -> bool:
        weights = {k[len(WEIGHTS):]: v for k, v in task.tensors.items() if k.startswith(WEIGHTS)}
        if not weights:
            return False
        self.weights = self.layout.load(weights)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "weights": self.weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.weights = dict(state["weights"])


class FCCLEmulation(EmulatedClient):
    """FCCLClient: batch-normalised logits (fccl/z [B, K]) up on each collaborate task, the mean
    (fccl/zbar) applied on the next task of the round; local_pretrain in round 0; local_train
    reports the round's collaborative loss (null without a step)."""

    PHASES = frozenset({"local_pretrain", "collaborate", "local_train"})
    PLUS = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: tuple[int, int] | None = None  # round, iteration of the last upload
        self.round_diag: list[float] = []

    def _local_pretrain(self, task: Message) -> Message:
        return reply(task, loss=self.loss(task))

    def _collaborate(self, task: Message) -> Message:
        r, i = int(task.meta["round"]), int(task.meta["iteration"])
        if FCCL_ZBAR_KEY in task.tensors:
            self.apply_mean(task, r, i - 1)
        elif i == 0:
            self.round_diag = []
        return reply(task, self.upload(r, i))

    def _local_train(self, task: Message) -> Message:
        if FCCL_ZBAR_KEY in task.tensors:
            self.apply_mean(task, int(task.meta["round"]), (self.params.tau or 1) - 1)
        loss_cc = float(np.mean(self.round_diag)) if self.round_diag else None
        self.round_diag = []
        diag: dict[str, Any] = {"loss_cc": loss_cc}
        if self.PLUS:
            diag["loss_isl"] = None if loss_cc is None else round(2 * loss_cc, 4)
        return reply(task, loss=self.loss(task), **diag)

    def rows(self, round_idx: int, iteration: int) -> int:
        return public_rows(self.params.rows_seed or 0, round_idx, iteration, self.public_size,
                           self.params.public_batch_size).size

    def upload(self, round_idx: int, iteration: int) -> dict[str, np.ndarray]:
        p, b = self.params, self.rows(round_idx, iteration)
        z = self.rng.standard_normal((b, self.num_classes))
        z = ((z - z.mean(axis=0)) / np.sqrt(z.var(axis=0) + 1e-8)).astype(np.float32)
        out = encode_tensor(FCCL_Z_KEY, z, p.wire_dtype, p.wire_int8_scale)
        if self.PLUS:  # cosine similarities of random features, the diagonal dropped
            h = self.rng.standard_normal((b, 8))
            h /= np.linalg.norm(h, axis=1, keepdims=True)
            s = (h @ h.T)[~np.eye(b, dtype=bool)].reshape(b, b - 1).astype(np.float32)
            out.update(encode_tensor(FCCL_S_KEY, s, p.wire_dtype, p.wire_int8_scale))
        self.pending = (round_idx, iteration)
        return out

    def apply_mean(self, task: Message, round_idx: int, iteration: int) -> None:
        if self.pending != (round_idx, iteration):
            raise MissedStep("an average for an iteration whose logits this client did not upload")
        p, b = self.params, self.rows(round_idx, iteration)
        decode_tensor(task.tensors, FCCL_ZBAR_KEY, p.wire_dtype, p.wire_int8_scale, (b, self.num_classes),
                      p.max_abs_value)
        if self.PLUS:
            decode_tensor(task.tensors, FCCL_SBAR_KEY, p.wire_dtype, p.wire_int8_scale, (b, b - 1), p.max_abs_value)
        self.pending = None
        self.round_diag.append(round(abs(float(self.rng.normal(1.0, 0.1))), 4))
        self.count_applied(task)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pending": self.pending, "round_diag": list(self.round_diag)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.pending, self.round_diag = state["pending"], list(state["round_diag"])


class FCCLPlusEmulation(FCCLEmulation):
    """FCCLPlusClient: FCCL's messages with the instance similarities (fccl/s [B, B-1]) next to the logits."""

    PHASES = frozenset({"collaborate", "local_train"})
    PLUS = True


def initial_weights(client: EmulatedClient) -> dict[str, np.ndarray]:
    """Seeded per client, apart from the stream of the answers."""
    return client.layout.initial(np.random.default_rng([client.seed, client.index, 0xA1]))


def drift(weights: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Emulated local training: noise on the floats, +1 on integer buffers (BatchNorm's counter)."""
    return {k: v + rng.normal(0, 0.01, v.shape).astype(v.dtype) if v.dtype.kind == "f" else v + 1
            for k, v in weights.items()}


# Each client half of the registry and its emulation; a strategy whose client half has none is
# refused at join, with the reason logged and counted under setup_failures.
EMULATIONS: dict[type, type[EmulatedClient]] = {
    FedALClient: DistillationEmulation, LocalClient: LocalEmulation, FedAvgClient: FedAvgEmulation,
    FedHKDClient: FedHKDEmulation, FedAKDClient: FedAKDEmulation, FedDFClient: FedDFEmulation,
    FDClient: FDEmulation, FedProtoClient: FedProtoEmulation, FedProtoPublicClient: FedProtoPublicEmulation,
    CFDClient: CFDEmulation, FCCLClient: FCCLEmulation, FCCLPlusClient: FCCLPlusEmulation,
}


def emulation_for(spec: StrategySpec) -> type[EmulatedClient]:
    cls = EMULATIONS.get(spec.client)
    if cls is None:
        raise JoinError(f"strategy {spec.name!r}: its client half {spec.client.__name__} has no emulation; "
                        f"emulated strategies: {', '.join(emulated_strategies())}")
    missing = set(spec.phases) - cls.PHASES
    if missing:
        raise JoinError(f"strategy {spec.name!r} has phases {sorted(missing)} its emulation {cls.__name__} does not answer")
    return cls


def emulated_strategies() -> tuple[str, ...]:
    """The registered strategies an emulated agent can join."""
    out = []
    for name, spec in STRATEGIES.items():
        cls = EMULATIONS.get(spec.client)
        if cls is not None and set(spec.phases) <= cls.PHASES:
            out.append(name)
    return tuple(out)


class MemoryStore:
    """The session's store kept in memory: nothing outlives an emulated process, but a coordinator
    that resumes a run replays the round under way, and the round-start state serves that."""

    def __init__(self):
        self.start: tuple[Any, dict[str, Any]] | None = None

    def save_round_start(self, round_no: Any, client_state: dict[str, Any]) -> None:
        self.start = (round_no, copy.deepcopy(client_state))

    def load_round_start(self) -> tuple[Any, dict[str, Any]] | None:
        return None if self.start is None else (self.start[0], copy.deepcopy(self.start[1]))

    def after_task(self, session: ClientSession) -> None:
        return None  # no checkpoint: a restarted emulated agent joins afresh


class EmulatedAgent:
    def __init__(self, run_id: str, client_id: str, index: int = 0, seed: int = 0,
                 public: PublicSetSource | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 manifest_parser: Callable[[bytes], ParsedManifest] = parse_manifest, exit_on_finish: bool = True,
                 models: Sequence[str] | None = None, input_shape: Sequence[int] | None = None):
        """models: zoo model names assigned round-robin by `index` as the coordinator assigns them
        (the first for strategies with one model for all), with the data's `input_shape`; by
        default a small synthetic model (two architectures for strategies that take mixed ones).
        A FedAvg-type run's coordinator loads the uploads into its own model: name that one."""
        self.run_id = topics.check_id(run_id, "run id")
        self.client_id = topics.check_id(client_id, "client id")
        self.index = index
        self.seed = seed
        self.public = public or PublicSetSource()
        self.max_payload = max_payload
        self.parse_manifest = manifest_parser
        self.exit_on_finish = exit_on_finish
        if models is not None and (not models or input_shape is None):
            raise ValueError("models needs at least one name and the data's input_shape")
        self.models = tuple(models) if models else None
        self.input_shape = tuple(int(v) for v in input_shape) if input_shape is not None else None
        self.mqtt_client_id = f"fedal-agent-{run_id}-{client_id}"
        self.manifest_topic = topics.run_manifest(run_id)
        self.task_topic = topics.task(run_id, client_id)
        self.result_topic = topics.result(run_id, client_id)
        self.status_topic = topics.status(run_id, client_id)
        self.reassembler = Reassembler()
        self.counters: Counter[str] = Counter()
        self.manifest: RunManifest | None = None
        self.session: ClientSession | None = None
        self.deferred: list[bytes] = []
        self.retry_at: float | None = None  # a failed join is retried from tick()
        self.join_backoff = 0.5
        self.finished = False
        self.connects = 0
        self.last_reject = ""
        # feedback applications: a test asserts every count is 1. Per (epoch, seq): every time
        # feedback was applied; per (instance, round, iteration): on the client's state as it is,
        # so a replayed round's applications replace those its restored state undid
        self.applied_keys: Counter[tuple[int, int]] = Counter()
        self._applied_left: Counter[tuple[str, int, int]] = Counter()  # of instances this agent left

    @property
    def joined(self) -> ClientSession | None:
        return self.session

    @property
    def last_key(self) -> tuple[int, int] | None:
        return None if self.session is None else self.session.last_key

    @property
    def applied_iterations(self) -> Counter[tuple[str, int, int]]:
        out = Counter(self._applied_left)
        if self.session is not None:
            out.update(self.session.client.applied)
        return out

    # -- session ------------------------------------------------------------------------------
    def subscriptions(self) -> list[tuple[str, int]]:
        return [(self.manifest_topic, 1), (self.task_topic, 1)]

    def will(self) -> Publish:
        return Publish(self.status_topic, status_payload("offline"), retain=True)

    def on_connected(self) -> list[Publish]:
        """After every CONNACK (and the subscriptions): the retained online status."""
        self.connects += 1
        return [Publish(self.status_topic, status_payload("online"), retain=True)]

    def goodbye(self) -> Publish:
        return Publish(self.status_topic, status_payload("offline"), retain=True)

    # -- messages -----------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> list[Publish]:
        try:
            if topic == self.manifest_topic:
                return self._on_manifest(payload)
            if topic == self.task_topic:
                if self.session is None:  # tasks may overtake the retained manifest: held, as the agent holds them
                    for dropped in hold_until_joined(self.deferred, payload, 2 * MAX_MESSAGE_BYTES):
                        self._reject(f"dropped a task of {len(dropped)} bytes held before joining the run")
                    return []
                return self._on_task(payload)
            self._reject(f"message on unexpected topic {topic}")
        except Exception:  # never let one message kill the agent
            self.counters["errors"] += 1
            log.exception("%s: error while handling a message on %s", self.client_id, topic)
        return []

    def tick(self, now: float | None = None) -> list[Publish]:
        """Retry a failed join once its backoff has passed (the agent's worker does the same)."""
        now = time.monotonic() if now is None else now
        m = self.manifest
        if m is None or m.state == "finished" or self.session is not None or self.retry_at is None or now < self.retry_at:
            return []
        return self._join(m)[1]

    def _on_manifest(self, payload: bytes) -> list[Publish]:
        if not payload:
            return []  # retained manifest cleared
        try:
            parsed = self.parse_manifest(payload)
        except ManifestError as exc:
            self._reject(str(exc))
            return []
        manifest = parsed.manifest
        if manifest.run_id != self.run_id or self.client_id not in parsed.clients:
            self._reject(f"manifest for run {manifest.run_id!r} does not enrol {self.client_id!r}")
            return []
        self.manifest = manifest
        if self.session is not None and manifest.instance != self.session.instance:
            self._leave()  # the run was started afresh: join it anew
        if manifest.state == "finished":
            # no checkpoint outlives an emulated agent: only a run it took part in ends here
            if self.session is not None and self.last_key is not None and not self.finished:
                self.finished = True
            return []
        out: list[Publish] = []
        if self.session is None:
            ok, out = self._join(manifest)
            if not ok:
                return []
        return out

    def _leave(self) -> None:
        self._applied_left.update(self.session.client.applied)
        self.session = None
        self.deferred.clear()

    def _join(self, manifest: RunManifest) -> tuple[bool, list[Publish]]:
        try:
            self.session = self._setup(manifest)
        except Exception as exc:  # noqa: BLE001 - as the reference agent: any bad file or download is retried with backoff
            self.counters["setup_failures"] += 1
            self.join_backoff = min(30.0, self.join_backoff * 2)
            self.retry_at = time.monotonic() + self.join_backoff
            log.warning("%s: cannot join run %s (retrying in %.0f s): %s", self.client_id, manifest.run_id,
                        self.join_backoff, exc)
            return False, []
        self.retry_at = None
        out: list[Publish] = []
        held, self.deferred = self.deferred, []
        for payload in held:
            out += self._on_task(payload)
        return True, out

    def _setup(self, manifest: RunManifest) -> ClientSession:
        """What the reference agent builds at join time, with an emulated client half."""
        try:
            spec = get_strategy(manifest.strategy)
        except ValueError as exc:
            raise JoinError(str(exc)) from None
        emulation = emulation_for(spec)
        params = StrategyParams(**manifest.strategy_params)
        if params.wire_dtype != "float32":
            raise JoinError(f"run {manifest.run_id!r} exchanges {params.wire_dtype} tensors (wire_dtype); "
                            "emulated agents send float32 only")
        public_size = self.public.size(manifest.public_hash, manifest.public_url) if spec.uses_public_set else 0
        position = 0 if spec.homogeneous_models or spec.same_feature_dim else self.index  # FedProto: one width
        if self.models:
            layout = zoo_layout(self.models[position % len(self.models)], self.input_shape, manifest.num_classes)
        else:
            layout = synthetic_layout(manifest.num_classes, position)
        client = emulation(params, manifest.num_classes, public_size, layout, self.seed, self.index, manifest.instance,
                           self._count_applied)
        session = ClientSession(self.run_id, self.client_id, client, manifest.instance, evaluate=client.evaluate,
                                store=MemoryStore())
        session.counters = self.counters  # tasks, duplicates, stale, round_replays next to this agent's own
        return session

    def _on_task(self, payload: bytes) -> list[Publish]:
        try:
            task = self.reassembler.feed("coordinator", payload)
        except EnvelopeError as exc:
            self._reject(f"malformed task: {exc}")
            return []
        if task is None:
            return []  # a chunk of a larger task
        try:
            wire = self.session.on_task(task)
        except TaskRefused as exc:
            wire = missed_step_decline(task, exc)  # e.g. restarted afresh: its phase need not wait for it
            if wire is None:
                self._reject(str(exc))
                return []
            self.counters[MISSED_STEP] += 1
        return [] if wire is None else self._publish_result(wire.payload)

    def _publish_result(self, wire: bytes) -> list[Publish]:
        return [Publish(self.result_topic, part) for part in split(wire, self.max_payload)]

    def _count_applied(self, key: tuple[int, int]) -> None:
        self.applied_keys[key] += 1
        self.counters["feedback_applied"] += 1

    def _reject(self, reason: str) -> None:
        self.counters["rejected"] += 1
        self.last_reject = reason
        log.debug("%s: rejected: %s", self.client_id, reason)

    # -- reporting ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        twice = sorted(k for k, n in self.applied_keys.items() if n > 1)
        return {"client_id": self.client_id, "counters": dict(self.counters),
                "last_key": list(self.last_key) if self.last_key else None, "connects": self.connects,
                "joined": self.session is not None, "finished": self.finished,
                "feedback_applied": sum(self.applied_keys.values()),
                "feedback_twice": [list(k) for k in twice],
                "iterations_twice": [list(k) for k, n in self.applied_iterations.items() if n > 1]}


def reply(task: Message, tensors: dict[str, np.ndarray] | None = None, **meta: Any) -> Message:
    """ClientHalf.reply: echo phase/round/iteration; a non-finite diagnostic goes out as null."""
    base = {k: task.meta[k] for k in ("phase", "round", "iteration") if k in task.meta}
    meta = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in meta.items()}
    return Message({**base, **meta}, tensors or {})


def _round(task: Message) -> int:
    r = task.meta.get("round")
    return r if isinstance(r, int) and not isinstance(r, bool) else 0
