"""The agent: the MQTT link, a worker thread running the strategy's client half, checkpoints.

Tasks carry (epoch, seq), a per-phase sequence number from the coordinator. A task older than
the last one handled is stale and ignored; the same one again (a QoS 1 redelivery, or the
coordinator re-sending after a reconnect) is answered from the cached result, never
recomputed, so feedback is applied exactly once. The checkpoint written after every phase holds
the client half's state together with that cached result, so a restarted agent resumes where
it was. A coordinator that restarts resumes after its last completed round, under a new epoch:
when a task repeats a step of the round under way, the agent first goes back to its state at
that round's start (saved when the round's first task came), so nothing is applied twice.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_agent import checkpoint
from edge_agent.config import AgentConfig
from edge_agent.mqtt_link import MqttLink
from edge_agent.inference import OnnxInference, write_final_onnx
from edge_agent.public_set import PublicSetError, load_public_set
from fedal.data import ArrayDataset
from fedal.models import build_model
from fedal.protocol import EnvelopeError, ManifestError, Message, Reassembler, RunManifest, encode, tensor_problem
from fedal.strategies import StrategyParams, get_strategy

log = logging.getLogger("edge_agent")


def load_npz_dataset(path: Path, num_classes: int, name: str) -> ArrayDataset:
    with np.load(path, allow_pickle=False) as z:
        x, y = z["x"], z["y"]
    return ArrayDataset(np.ascontiguousarray(x, np.float32), np.ascontiguousarray(y, np.int64), num_classes, name)


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.link = MqttLink(config, self.inbox)
        b = config.broker
        self.reassembler = Reassembler(max_size=b.max_message_bytes, max_sender_bytes=b.max_message_bytes,
                                       max_total_bytes=b.max_message_bytes)  # one sender: the coordinator
        self.stop_event = threading.Event()
        self.finished = threading.Event()
        self.counters: Counter[str] = Counter()
        self.rejects: Counter[str] = Counter()  # the rejected messages by why
        self.manifest: RunManifest | None = None
        self.client = None
        self.deferred: list[bytes] = []
        self.joined_instance: str | None = None
        self.last_key: tuple[int, int] | None = None
        self.last_result: bytes | None = None
        self.round_no: int | None = None
        self.round_steps: set[tuple[str, Any]] = set()
        self.workspace = Path(config.workspace)
        self.ckpt_path = self.workspace / "checkpoint.pt"
        self.round_start_path = self.workspace / "round-start.pt"
        self.retry_at = 0.0
        self.join_backoff = 0.5
        self.worker = threading.Thread(target=self._work, name="fedal-worker", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Block until the run finishes or stop() is called; returns a process exit code."""
        torch.set_num_threads(self.config.threads)
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.link.start()
        self.worker.start()
        while not self.stop_event.is_set() and not self.finished.is_set():
            self.stop_event.wait(0.2)
        self.stop_event.set()
        self.worker.join(timeout=30)
        self.link.stop()
        self._write_status_file()
        return 0

    def stop(self) -> None:
        self.stop_event.set()

    # -- worker thread -----------------------------------------------------------------------
    def _work(self) -> None:
        while not self.stop_event.is_set():
            try:
                topic, payload = self.inbox.get(timeout=0.2)
            except queue.Empty:
                m = self.manifest
                if m is not None and m.state != "finished" and self.client is None and time.monotonic() >= self.retry_at:
                    self._join(self.manifest)  # the last attempt to join failed: try again
                continue
            try:
                self._dispatch(topic, payload)
            except Exception:  # never let one message kill the agent
                self.counters["errors"] += 1
                log.exception("error while handling a message on %s", topic)

    def _dispatch(self, topic: str, payload: bytes) -> None:
        if topic == self.link.manifest_topic:
            self._on_manifest(payload)
        elif topic == self.link.task_topic:
            if self.client is None:
                self.deferred.append(payload)  # tasks may overtake the retained manifest
                return
            self._on_task(payload)
        else:
            self._reject(f"message on unexpected topic {topic}")

    def _on_manifest(self, payload: bytes) -> None:
        if not payload:
            return  # retained manifest cleared
        try:
            manifest = RunManifest.from_json(payload)
        except ManifestError as exc:
            self._reject(str(exc))
            return
        if manifest.run_id != self.config.run_id or self.config.client_id not in manifest.clients:
            self._reject(f"manifest for run {manifest.run_id!r} does not enrol {self.config.client_id!r}")
            return
        self.manifest = manifest
        if self.client is not None and manifest.instance != self.joined_instance:
            log.info("run %s was started afresh (instance %s); joining it anew", manifest.run_id, manifest.instance)
            self._leave()
        if manifest.state == "finished":
            # a finished run this agent took part in (now, or before a restart) ends here; a
            # finished run left retained on the broker by an earlier instance does not
            if self.client is None and self._checkpoint_instance() == manifest.instance:
                self._join(manifest)
            if self.client is not None and self.last_key is not None:
                self._finish(manifest)
            else:
                log.info("ignoring run instance %s: finished without this agent; waiting for a new one", manifest.instance)
            return
        if self.client is None and not self._join(manifest):
            return
        if manifest.state == "stopped":
            log.info("run %s is stopped; waiting for it to resume", manifest.run_id)

    def _checkpoint_instance(self) -> str | None:
        try:
            state = checkpoint.load(self.ckpt_path)
        except Exception:  # an unreadable checkpoint is no checkpoint
            return None
        return None if state is None else state.get("instance")

    def _leave(self) -> None:
        self.client = None
        self.joined_instance = None
        self.last_key = self.last_result = None
        self.round_no, self.round_steps = None, set()
        self.deferred.clear()

    def _join(self, manifest: RunManifest) -> bool:
        try:
            self._setup(manifest)
        except (PublicSetError, ValueError, OSError) as exc:
            self.counters["setup_failures"] += 1
            self.join_backoff = min(30.0, self.join_backoff * 2)
            self.retry_at = time.monotonic() + self.join_backoff
            log.error("cannot join run %s (retrying in %.0f s): %s", manifest.run_id, self.join_backoff, exc)
            return False
        for held in self.deferred:
            self._on_task(held)
        self.deferred.clear()
        return True

    def _setup(self, manifest: RunManifest) -> None:
        cfg = self.config
        spec = get_strategy(manifest.strategy)
        params = StrategyParams(**manifest.strategy_params)
        train = load_npz_dataset(cfg.data_file, manifest.num_classes, f"{cfg.client_id}-train")
        self.test = load_npz_dataset(cfg.test_file, manifest.num_classes, "test") if cfg.test_file else None
        self.local_test = (load_npz_dataset(cfg.local_test_file, manifest.num_classes, f"{cfg.client_id}-test")
                           if cfg.local_test_file else None)
        public = None
        if spec.uses_public_set:
            public = load_public_set(manifest.public_hash, cfg.public_file, manifest.public_url, self.workspace / "public.npz")
        torch.manual_seed(cfg.seed)  # the same initialisation as `fedal simulate` for this seed
        model = build_model(cfg.model, train.input_shape, manifest.num_classes)
        self.client = spec.client(cfg.client_id, model, train, public, params, seed=cfg.seed)
        if cfg.inference_backend != "torch":
            self.client.inference = OnnxInference(cfg.inference_backend, self.workspace, cfg.threads, train.x)
        try:
            state = checkpoint.load(self.ckpt_path)
        except Exception as exc:  # unreadable (e.g. torn by a power cut before the atomic rename existed)
            log.warning("ignoring an unreadable checkpoint: %s", exc)
            state = None
        if state is not None and (state.get("run_id"), state.get("instance")) == (cfg.run_id, manifest.instance):
            self.client.load_state_dict(state["client"])
            self.last_key = tuple(state["last_key"]) if state.get("last_key") else None
            self.last_result = bytes(state["last_result"].numpy().tobytes()) if state.get("last_result") is not None else None
            self.round_no = state.get("round")
            self.round_steps = {tuple(s) for s in state.get("round_steps", [])}
            log.info("resumed from checkpoint at %s", self.last_key)
        self.joined_instance = manifest.instance
        log.info("joined run %s as %s with a private %s", manifest.run_id, cfg.client_id, cfg.model)

    def _on_task(self, payload: bytes) -> None:
        try:
            task = self.reassembler.feed("coordinator", payload)
        except EnvelopeError as exc:
            self._reject(f"malformed task: {exc}", exc.kind)
            return
        if task is None:
            return  # a chunk of a larger task
        meta = task.meta
        if meta.get("run") != self.config.run_id or meta.get("client") != self.config.client_id:
            self._reject(f"task addressed to run {meta.get('run')!r} client {meta.get('client')!r}")
            return
        if meta.get("instance") != self.joined_instance:
            self.counters["stale"] += 1  # e.g. queued by the broker for an earlier run under this id
            return
        key = (meta.get("epoch"), meta.get("seq"))
        if not all(type(v) is int for v in key):
            self._reject("task without integer epoch and seq")
            return
        if self.last_key is not None and key < self.last_key:
            self.counters["stale"] += 1
            return
        if key == self.last_key and self.last_result is not None:
            self.counters["duplicates"] += 1
            self.link.publish_result(self.last_result)  # answered before: resend, never recompute
            return
        problem = tensor_problem(task.tensors, self.client.params.max_abs_value)
        if problem is not None:  # e.g. feedback of absurd magnitude: never trained on
            self._reject(f"task {task.phase} r{meta.get('round')} i{meta.get('iteration')} refused: {problem[1]}", problem[0])
            return
        try:
            self._replay_guard(meta.get("round"), (task.phase, meta.get("iteration")))
            result = self._evaluate(task) if task.phase == "evaluate" else self.client.handle(task)
        except Exception as exc:  # a task this client cannot apply is refused, not fatal
            self._reject(f"task {task.phase} r{meta.get('round')} i{meta.get('iteration')} refused: {exc}")
            return
        result.meta.update(run=self.config.run_id, client=self.config.client_id, epoch=key[0], seq=key[1])
        wire = encode(result)
        self.last_key, self.last_result = key, wire
        self._checkpoint()
        self.link.publish_result(wire)
        self.counters["tasks"] += 1

    def _replay_guard(self, round_no: Any, step: tuple[str, Any]) -> None:
        if round_no != self.round_no:  # the round's first task: remember where it started
            checkpoint.save_atomic({"round": round_no, "client": self.client.state_dict()}, self.round_start_path)
            self.round_no, self.round_steps = round_no, set()
        elif step in self.round_steps:  # a resumed coordinator replays this round from its start
            start = checkpoint.load(self.round_start_path)
            if start is None or start.get("round") != round_no:
                raise RuntimeError(f"round {round_no} is replayed but its start state is missing")
            self.client.load_state_dict(start["client"])
            self.round_steps = set()
            self.counters["round_replays"] += 1
            log.info("the coordinator replays round %s: back to this agent's state at its start", round_no)
        self.round_steps.add(step)

    def _evaluate(self, task: Message) -> Message:
        """Accuracy on the common test set and on this device's own test split, where provisioned:
        numbers only, so the coordinator can show progress without seeing data or the model."""
        report = {}
        for key, data in (("", self.test), ("local_", self.local_test)):
            if data is not None and len(data):
                report[f"{key}acc"] = self.client.evaluate(data.x, data.y)
                report[f"num_{key}test"] = len(data)
        return self.client.reply(task, acc=report.pop("acc", None), **report)

    def _checkpoint(self) -> None:
        checkpoint.save_atomic(
            {
                "run_id": self.config.run_id,
                "instance": self.manifest.instance if self.manifest else "",
                "client": self.client.state_dict(),
                "last_key": list(self.last_key) if self.last_key else None,
                "last_result": torch.frombuffer(bytearray(self.last_result), dtype=torch.uint8) if self.last_result else None,
                "round": self.round_no,
                "round_steps": sorted([list(s) for s in self.round_steps], key=repr),
            },
            self.ckpt_path,
        )

    def _finish(self, manifest: RunManifest) -> None:
        """The deployable artifacts of a finished run: the final weights and test-set outputs."""
        if self.client is None or self.finished.is_set():
            return
        out = self.workspace / "final"
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.save_atomic(self.client.model.state_dict(), out / "model.pt")
        if self.test is not None:
            np.save(out / "test_logits.npy", self.client.predict(self.test.x).numpy())
        write_final_onnx(self.client.model, self.client.train_data.x, out, self.config.export_int8)
        log.info("run %s %s; final model in %s", manifest.run_id, manifest.state, out)
        if self.config.exit_on_finish:
            self.finished.set()

    def _reject(self, reason: str, kind: str = "other") -> None:
        self.counters["rejected"] += 1
        self.rejects[kind] += 1
        log.warning("rejected: %s", reason)

    def _write_status_file(self) -> None:
        status: dict[str, Any] = {"client_id": self.config.client_id, "counters": dict(self.counters),
                                  "rejects": dict(self.rejects),
                                  "last_key": self.last_key, "connects": self.link.connects, "ts": time.time()}
        (self.workspace / "agent-status.json").write_text(json.dumps(status, indent=2))
