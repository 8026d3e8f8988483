"""An emulated edge agent: the wire protocol of docs/protocol.md, exactly, without a model.

It joins a run by the manifest's `instance`, holds tasks that overtake the manifest, reassembles
chunks, deduplicates by (epoch, seq) and answers a repeated task from the cached result bytes,
refuses what the reference agent (edge_agent/agent.py with the strategies' client halves)
refuses, and answers every phase with a result of the shape the real client half sends. Only
the numbers are made up: logits are seeded noise of shape [len(indices), K], accuracies follow a
fixed curve. No torch, no training, so one process can stand in for a thousand devices.

Transport-free: every handler returns the messages to publish, the fleet (hil/fleet.py) carries
them over MQTT. Applied feedback is counted per (epoch, seq) and per (instance, round,
iteration), so a test can prove that no feedback was applied twice.
"""

from __future__ import annotations

import io
import json
import math
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from fedal.data.public import content_hash
from fedal.protocol import DEFAULT_MAX_PAYLOAD, EnvelopeError, ManifestError, Message, Reassembler, RunManifest
from fedal.protocol import encode, split, topics

DISTILLATION = ("fedal", "fedmd", "fedmd-lf")
STRATEGIES = (*DISTILLATION, "local", "fedavg")
# FedAvg's emulated model: one float layer and an integer buffer, like a BatchNorm counter
FEDAVG_MODEL = {"fc.weight": ((64, 32), np.float32), "fc.bias": ((64,), np.float32),
                "bn.num_batches_tracked": ((), np.int64)}


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
        except (OSError, JoinError) as exc:
            self.failed_at, self.last_error = time.monotonic(), f"cannot obtain the public set from {url}: {exc}"
            raise JoinError(self.last_error) from None
        self.sizes[expected_hash] = len(x)
        return len(x)


def _read_npz(payload: bytes, where: str) -> np.ndarray:
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as z:
            return np.ascontiguousarray(z["x"], dtype=np.float32)
    except (ValueError, KeyError, OSError) as exc:
        raise JoinError(f"{where} is not an .npz with an array 'x': {exc}") from None


@dataclass
class Joined:
    """What the reference agent builds at join time, reduced to what shapes the answers."""

    instance: str
    strategy: str
    num_classes: int
    public_size: int
    lambda_adv: float
    lambda_lf_glo: float
    ref_glo: bool = False  # a less-forgetting reference exists (after the first local_train)
    pending: dict[str, Any] | None = None  # round, iteration, rows of the last logits upload
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # FedAvg


class EmulatedAgent:
    def __init__(self, run_id: str, client_id: str, index: int = 0, seed: int = 0,
                 public: PublicSetSource | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 manifest_parser: Callable[[bytes], ParsedManifest] = parse_manifest, exit_on_finish: bool = True):
        self.run_id = topics.check_id(run_id, "run id")
        self.client_id = topics.check_id(client_id, "client id")
        self.index = index
        self.seed = seed
        self.public = public or PublicSetSource()
        self.max_payload = max_payload
        self.parse_manifest = manifest_parser
        self.exit_on_finish = exit_on_finish
        self.mqtt_client_id = f"fedal-agent-{run_id}-{client_id}"
        self.manifest_topic = topics.run_manifest(run_id)
        self.task_topic = topics.task(run_id, client_id)
        self.result_topic = topics.result(run_id, client_id)
        self.status_topic = topics.status(run_id, client_id)
        self.reassembler = Reassembler()
        self.counters: Counter[str] = Counter()
        self.manifest: RunManifest | None = None
        self.joined: Joined | None = None
        self.deferred: list[bytes] = []
        self.last_key: tuple[int, int] | None = None
        self.last_result: bytes | None = None
        self.retry_at: float | None = None  # a failed join is retried from tick()
        self.join_backoff = 0.5
        self.finished = False
        self.connects = 0
        # feedback applications: a test asserts every count is 1
        self.applied_keys: Counter[tuple[int, int]] = Counter()
        self.applied_iterations: Counter[tuple[str, int, int]] = Counter()
        self.rng: np.random.Generator | None = None
        bias_rng = np.random.default_rng([seed, index, 0x51])
        self.bias = bias_rng.normal(0.0, 1.0, 64).astype(np.float32)  # a client "style" the discriminator can see

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
                if self.joined is None:
                    self.deferred.append(payload)  # tasks may overtake the retained manifest
                    return []
                return self._on_task(payload)
            self._reject(f"message on unexpected topic {topic}")
        except Exception:  # never let one message kill the agent
            self.counters["errors"] += 1
        return []

    def tick(self, now: float | None = None) -> list[Publish]:
        """Retry a failed join once its backoff has passed (the agent's worker does the same)."""
        now = time.monotonic() if now is None else now
        m = self.manifest
        if m is None or m.state == "finished" or self.joined is not None or self.retry_at is None or now < self.retry_at:
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
        if self.joined is not None and manifest.instance != self.joined.instance:
            self._leave()  # the run was started afresh: join it anew
        if manifest.state == "finished":
            # no checkpoint outlives an emulated agent: only a run it took part in ends here
            if self.joined is not None and self.last_key is not None and not self.finished:
                self.finished = True
            return []
        out: list[Publish] = []
        if self.joined is None:
            ok, out = self._join(manifest)
            if not ok:
                return []
        return out

    def _leave(self) -> None:
        self.joined = None
        self.last_key = self.last_result = None
        self.deferred.clear()

    def _join(self, manifest: RunManifest) -> tuple[bool, list[Publish]]:
        try:
            self.joined = self._setup(manifest)
        except (JoinError, ValueError, TypeError, OSError):
            self.counters["setup_failures"] += 1
            self.join_backoff = min(30.0, self.join_backoff * 2)
            self.retry_at = time.monotonic() + self.join_backoff
            return False, []
        self.retry_at = None
        out: list[Publish] = []
        held, self.deferred = self.deferred, []
        for payload in held:
            out += self._on_task(payload)
        return True, out

    def _setup(self, manifest: RunManifest) -> Joined:
        if manifest.strategy not in STRATEGIES:
            raise JoinError(f"unknown strategy {manifest.strategy!r}")
        params = manifest.strategy_params
        lam_adv, lam_lf = float(params.get("lambda_adv") or 0.0), float(params.get("lambda_lf_glo") or 0.0)
        public_size = 0
        if manifest.strategy in DISTILLATION:
            public_size = self.public.size(manifest.public_hash, manifest.public_url)
        joined = Joined(manifest.instance, manifest.strategy, manifest.num_classes, public_size, lam_adv, lam_lf)
        if manifest.strategy == "fedavg":
            rng = np.random.default_rng([self.seed, self.index, 0xA1])
            joined.weights = {k: (rng.normal(0, 0.1, shape).astype(dt) if dt == np.float32 else np.zeros(shape, dt))
                              for k, (shape, dt) in FEDAVG_MODEL.items()}
        return joined

    def _on_task(self, payload: bytes) -> list[Publish]:
        try:
            task = self.reassembler.feed("coordinator", payload)
        except EnvelopeError as exc:
            self._reject(f"malformed task: {exc}")
            return []
        if task is None:
            return []  # a chunk of a larger task
        meta = task.meta
        if meta.get("run") != self.run_id or meta.get("client") != self.client_id:
            self._reject(f"task addressed to run {meta.get('run')!r} client {meta.get('client')!r}")
            return []
        if meta.get("instance") != self.joined.instance:
            self.counters["stale"] += 1  # e.g. queued by the broker for an earlier run under this id
            return []
        key = (meta.get("epoch"), meta.get("seq"))
        if not all(type(v) is int for v in key):
            self._reject("task without integer epoch and seq")
            return []
        if self.last_key is not None and key < self.last_key:
            self.counters["stale"] += 1
            return []
        if key == self.last_key and self.last_result is not None:
            self.counters["duplicates"] += 1
            return self._publish_result(self.last_result)  # answered before: resend, never recompute
        try:
            result = self._evaluate(task) if task.phase == "evaluate" else self._handle(task, key)
        except Exception as exc:  # a task this client cannot apply is refused, not fatal
            self._reject(f"task {task.phase} refused: {exc}")
            return []
        result.meta.update(run=self.run_id, client=self.client_id, epoch=key[0], seq=key[1])
        wire = encode(result)
        self.last_key, self.last_result = key, wire
        self.counters["tasks"] += 1
        return self._publish_result(wire)

    def _publish_result(self, wire: bytes) -> list[Publish]:
        return [Publish(self.result_topic, part) for part in split(wire, self.max_payload)]

    # -- the client halves, emulated ------------------------------------------------------------
    def _handle(self, task: Message, key: tuple[int, int]) -> Message:
        j = self.joined
        if j.strategy in DISTILLATION:
            return self._distillation(task, key)
        if j.strategy == "local":
            if task.phase != "local_train":
                raise ValueError(f"unknown phase {task.phase!r}")
            return reply(task, loss=self._loss(task))
        if task.phase == "init":  # fedavg
            return reply(task, {k: v.copy() for k, v in j.weights.items()})
        if task.phase == "train":
            if set(task.tensors) != set(j.weights):
                raise ValueError("received weights do not match this client's model")
            j.weights = {k: np.array(v).astype(j.weights[k].dtype) for k, v in task.tensors.items()}
            self._count_applied(key, task)
            rng = self._rng(task)
            out = {k: (v + rng.normal(0, 0.01, v.shape).astype(v.dtype) if v.dtype.kind == "f" else v + 1)
                   for k, v in j.weights.items()}
            j.weights = out
            return reply(task, {k: v.copy() for k, v in out.items()}, loss=self._loss(task), num_samples=100 + self.index)
        raise ValueError(f"unknown phase {task.phase!r}")

    def _distillation(self, task: Message, key: tuple[int, int]) -> Message:
        """FedALClient.handle (FedMD and FedMD-LF share it): feedback first, then logits."""
        j = self.joined
        if task.phase == "local_train":
            diag: dict[str, Any] = {"loss": self._loss(task)}
            j.ref_glo = j.lambda_lf_glo > 0
        elif task.phase == "transfer":
            diag = self._apply_feedback(task, key) if "fbar" in task.tensors else {}
        else:
            raise ValueError(f"unknown phase {task.phase!r}")
        tensors = {}
        if "indices" in task.tensors:
            nxt = 0 if task.phase == "local_train" else int(task.meta["iteration"]) + 1
            tensors["logits"] = self._upload_logits(task, task.tensors["indices"], int(task.meta["round"]), nxt)
        return reply(task, tensors, **diag)

    def _upload_logits(self, task: Message, indices: np.ndarray, round_idx: int, iteration: int) -> np.ndarray:
        raw = np.asarray(indices)
        if raw.ndim != 1 or not np.issubdtype(raw.dtype, np.integer) or raw.size == 0:
            raise ValueError("indices must be a non-empty 1-D integer array")
        if raw.min() < 0 or raw.max() >= self.joined.public_size:
            raise ValueError(f"indices outside the public set of {self.joined.public_size} rows")
        k = self.joined.num_classes
        rng = self._rng(task)
        logits = rng.standard_normal((raw.size, k), dtype=np.float32) + self.bias[np.arange(k) % self.bias.size]
        self.joined.pending = {"round": round_idx, "iteration": iteration, "logits": logits}
        return logits

    def _apply_feedback(self, task: Message, key: tuple[int, int]) -> dict[str, Any]:
        j = self.joined
        pend = j.pending
        if pend is None or (pend["round"], pend["iteration"]) != (task.meta["round"], task.meta["iteration"]):
            raise ValueError("feedback for an iteration whose logits this client did not upload")
        j.pending = None
        own = pend["logits"]
        fbar = np.asarray(task.tensors["fbar"], dtype=np.float32)
        if fbar.shape != own.shape:
            raise ValueError(f"fbar has shape {fbar.shape}, expected {own.shape}")
        n_avg = int(task.meta.get("n_avg", 1))
        target = fbar if n_avg <= 1 else (n_avg * fbar - own) / (n_avg - 1)
        gap = float(np.abs(target - own).mean())
        diag: dict[str, Any] = {"loss_kd": gap, "gnorm_kd": gap / own.shape[0]}
        if j.ref_glo:
            diag["gnorm_lf"] = 0.5 * gap / own.shape[0]
        if "grad" in task.tensors and j.lambda_adv > 0:
            g = np.asarray(task.tensors["grad"], dtype=np.float32)
            if g.shape != own.shape:
                raise ValueError(f"grad has shape {g.shape}, expected {own.shape}")
            diag["gnorm_adv"] = float(np.linalg.norm(j.lambda_adv * g / own.shape[0]))
        self._count_applied(key, task)
        return diag

    def _count_applied(self, key: tuple[int, int], task: Message) -> None:
        self.applied_keys[key] += 1
        self.applied_iterations[(self.joined.instance, int(task.meta["round"]), int(task.meta["iteration"]))] += 1
        self.counters["feedback_applied"] += 1

    def _evaluate(self, task: Message) -> Message:
        r = task.meta.get("round")
        r = r if isinstance(r, int) and not isinstance(r, bool) else 0
        noise = float(self._rng(task).normal(0, 0.02))
        acc = min(1.0, max(0.0, 0.1 + 0.8 * (1 - math.exp(-(r + 1) / 4)) + noise))
        return reply(task, acc=round(acc, 4), num_test=100)

    def _loss(self, task: Message) -> float:
        r = task.meta.get("round")
        r = r if isinstance(r, int) and not isinstance(r, bool) else 0
        return round(2.3 * math.exp(-(r + 1) / 6) + 0.05, 4)

    def _rng(self, task: Message) -> np.random.Generator:
        """One stream per agent (seeding a generator per task costs more than the rest of the answer);
        each task is computed once, so the numbers follow from the seed and the tasks received."""
        if self.rng is None:
            self.rng = np.random.default_rng([self.seed, self.index])
        return self.rng

    def _reject(self, reason: str) -> None:
        self.counters["rejected"] += 1
        self.last_reject = reason

    # -- reporting ----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        twice = sorted(k for k, n in self.applied_keys.items() if n > 1)
        return {"client_id": self.client_id, "counters": dict(self.counters),
                "last_key": list(self.last_key) if self.last_key else None, "connects": self.connects,
                "joined": self.joined is not None, "finished": self.finished,
                "feedback_applied": sum(self.applied_keys.values()),
                "feedback_twice": [list(k) for k in twice],
                "iterations_twice": [list(k) for k, n in self.applied_iterations.items() if n > 1]}


def reply(task: Message, tensors: dict[str, np.ndarray] | None = None, **meta: Any) -> Message:
    """ClientHalf.reply: echo phase/round/iteration; a non-finite diagnostic goes out as null."""
    base = {k: task.meta[k] for k in ("phase", "round", "iteration") if k in task.meta}
    meta = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in meta.items()}
    return Message({**base, **meta}, tensors or {})
