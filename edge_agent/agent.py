"""The agent: the MQTT link, a worker thread running the client session, checkpoints.

What a task does to the client (ordering by (epoch, seq), the cached-result resend, the replay
guard for a coordinator that resumes a round) is the shared client session
(fedal/session/session.py, the same one simulation runs). The agent adds the device around it:
the MQTT link, joining runs, the private data on disk, and durability. The checkpoint written
after every phase holds the client half's state together with the cached result, so a
restarted agent resumes where it was; the state at a round's start is kept in its own file for
the replay guard.
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
from edge_agent.inference import OnnxInference, write_final_onnx
from edge_agent.mqtt_link import MqttLink
from edge_agent.public_set import PublicSetError, load_public_set
from fedal.data import ArrayDataset
from fedal.models import build_model
from fedal.protocol import EnvelopeError, ManifestError, Reassembler, RunManifest
from fedal.session import ClientSession, TaskRefused, evaluation_reply
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
        self.session: ClientSession | None = None
        self.deferred: list[bytes] = []
        self.joined_instance: str | None = None
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
            if self.session is not None and self.session.last_key is not None:
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
        self.client = self.session = None
        self.joined_instance = None
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
        client = self._attach(self.client, manifest.instance)
        if state is not None and (state.get("run_id"), state.get("instance")) == (cfg.run_id, manifest.instance):
            client.load_state_dict(state["client"])
            self.session.restore(
                tuple(state["last_key"]) if state.get("last_key") else None,
                bytes(state["last_result"].numpy().tobytes()) if state.get("last_result") is not None else None,
                state.get("round"), {tuple(s) for s in state.get("round_steps", [])})
            log.info("resumed from checkpoint at %s", self.session.last_key)
        log.info("joined run %s as %s with a private %s", manifest.run_id, cfg.client_id, cfg.model)

    def _attach(self, client, instance: str):
        """Run `client` (a strategy's client half) in this agent's session for run `instance`."""
        self.client, self.joined_instance = client, instance
        self.session = ClientSession(self.config.run_id, self.config.client_id, client, instance,
                                     evaluate=lambda task: evaluation_reply(client, task, self.test, self.local_test),
                                     store=self, counters=self.counters)
        return client

    def _on_task(self, payload: bytes) -> None:
        try:
            task = self.reassembler.feed("coordinator", payload)
        except EnvelopeError as exc:
            self._reject(f"malformed task: {exc}", exc.kind)
            return
        if task is None:
            return  # a chunk of a larger task
        try:
            wire = self.session.on_task(task)
        except TaskRefused as exc:  # a task this client cannot apply is refused, not fatal
            self._reject(str(exc), exc.kind)
            return
        if wire is not None:
            self.link.publish_result(wire)

    # -- the session's store: files in the workspace -----------------------------------------
    def save_round_start(self, round_no: Any, client_state: dict[str, Any]) -> None:
        checkpoint.save_atomic({"round": round_no, "client": client_state}, self.round_start_path)

    def load_round_start(self) -> tuple[Any, dict[str, Any]] | None:
        start = checkpoint.load(self.round_start_path)
        return None if start is None else (start.get("round"), start["client"])

    def after_task(self, session: ClientSession) -> None:
        self._checkpoint()

    def _checkpoint(self) -> None:
        s = self.session
        checkpoint.save_atomic(
            {
                "run_id": self.config.run_id,
                "instance": self.manifest.instance if self.manifest else "",
                "client": self.client.state_dict(),
                "last_key": list(s.last_key) if s.last_key else None,
                "last_result": torch.frombuffer(bytearray(s.last_result), dtype=torch.uint8) if s.last_result else None,
                "round": s.round_no,
                "round_steps": sorted([list(step) for step in s.round_steps], key=repr),
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
                                  "last_key": self.session.last_key if self.session else None,
                                  "connects": self.link.connects, "ts": time.time()}
        (self.workspace / "agent-status.json").write_text(json.dumps(status, indent=2))
