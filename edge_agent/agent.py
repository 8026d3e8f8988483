"""The agent: the MQTT link, a worker thread running the client session, checkpoints.

What a task does to the client (ordering by (epoch, seq), the cached-result resend, the replay
guard for a coordinator that resumes a round) is the shared client session
(fedal/session/session.py, the same one simulation runs). The agent adds the device around it:
the MQTT link, joining runs, the private data on disk, and durability (`durability`):

- journal (default): a checkpoint of the whole state at each round's first task (the round's
  start, which is also what the replay guard goes back to), and before each result is published
  an fsync'd journal record of the task that produced it (edge_agent/checkpoint.py). A restarted
  agent loads the checkpoint and replays the journal's tasks through the very same decode and
  session path, silently: training is deterministic for the same state and generators, so it
  reaches exactly the state, last key and cached result it had.
- phase: a checkpoint after every task (and the round's start in round-start.pt).
- round: the round's checkpoint only; a restarted agent sits out the rest of the round that was
  under way and rejoins at the next one from that checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_agent import checkpoint
from edge_agent.config import AgentConfig
from edge_agent.data_files import read_rows
from edge_agent.inference import OnnxInference, write_final_onnx
from edge_agent.mqtt_link import MqttLink
from edge_agent.own_workspace import KEPT_UNFIT, KEPT_UNREADABLE, claim_workspace
from edge_agent.public_set import load_public_set
from fedal.atomic import write_atomic, write_bytes_atomic
from fedal.data import ArrayDataset
from fedal.models import build_model
from fedal.protocol import EnvelopeError, ManifestError, Message, Packet, Reassembler, RunManifest, decode, encode
from fedal.protocol.chunking import is_chunk
from fedal.session import (
    MAX_HELD,
    STORE_FAILED,
    ClientSession,
    TaskRefused,
    declining,
    evaluation_reply,
    hold_until_joined,
    missed_step_decline,
)
from fedal.strategies import MISSED_STEP, StrategyParams, get_strategy
from fedal.strategies.training import TrainingStopped, stoppable
from fedal.workspace import WorkspaceError, held

log = logging.getLogger("edge_agent")

CRASH_POINTS = ("after_journal", "after_publish", "next_task", "mid_snapshot")
FINISHED_MARK = "instance"  # in final/: the run instance whose final model it holds
FINAL_WRITE_FAILED = 75  # exit status (EX_TEMPFAIL) when the final model could not be written: the service restarts it
FINAL_WRITE_REFUSED = 2  # final/ is a link or a file: not the agent's to write through (the service does not restart)


class CrashHook:
    """TEST HOOK, inert in production: FEDAL_AGENT_CRASH_AT=<point>:<n> (read once, when the
    agent starts) makes the agent SIGKILL itself the n-th time it reaches <point>, so the crash
    tests kill it at an exact step however fast or slow the machine is. Points: after_journal
    (a task's journal record is fsync'd, its result not yet published), after_publish (its
    result acknowledged by the broker, waited for up to 10 s), next_task (a new task arrived,
    before it is applied: the previous result was received, or the coordinator would not have
    moved on), mid_snapshot (half of a checkpoint written to its temporary file). Unset: never
    fires."""

    def __init__(self, spec: str | None):
        self.point: str | None = None
        self.n = 0
        self.seen = 0
        if not spec:
            return
        point, _, n = spec.partition(":")
        if point not in CRASH_POINTS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"FEDAL_AGENT_CRASH_AT={spec!r}: expected <point>:<n> with point one of "
                             f"{', '.join(CRASH_POINTS)} and n >= 1")
        self.point, self.n = point, int(n)

    def reached(self, point: str, settle: Callable[[], object] | None = None) -> None:
        """`settle` runs before the kill (only then): what must have happened at this point."""
        if point != self.point:
            return
        self.seen += 1
        if self.seen == self.n:
            if settle is not None:
                settle()
            log.warning("test hook FEDAL_AGENT_CRASH_AT: SIGKILL at %s #%d", point, self.n)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


class CheckpointUnfit(ValueError):
    """The workspace's checkpoint of this run is of another model than the config's."""


class ReplayDiverged(RuntimeError):
    """Replaying the journal did not reproduce what was published (another torch, thread count...)."""


def load_npz_dataset(path: Path, num_classes: int, name: str) -> ArrayDataset:
    """A provisioned .npz (edge_agent.data_files.read_rows) for a run of `num_classes`; a
    ValueError names the file."""
    x, y = read_rows(path)
    try:
        return ArrayDataset(x, y, num_classes, name)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _layout(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A row's shape without its axes of length 1: (40,) and (1, 40) are one layout."""
    return tuple(int(d) for d in shape if d != 1)


class Agent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.inbox: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.link = MqttLink(config, self.inbox)
        b = config.broker
        self.reassembler = Reassembler(max_size=b.max_message_bytes, max_sender_bytes=b.max_message_bytes,
                                       max_total_bytes=b.max_message_bytes)  # one sender: the coordinator
        self.stop_event = threading.Event()
        self.stop_requested = False  # set by request_stop() from a signal handler
        self.finished = threading.Event()
        self.counters: Counter[str] = Counter()
        # the last result this agent computed and published, and how many messages were waiting in
        # the inbox when it went out: a re-send of its task among those came while it was computed
        self._published: Packet | None = None
        self._queued_before_publish = 0
        self._taken_before_publish = False
        self.rejects: Counter[str] = Counter()  # the rejected messages by why
        self.manifest: RunManifest | None = None
        self.client = None
        self.session: ClientSession | None = None
        self.test: ArrayDataset | None = None  # evaluation's common test set and this device's own split
        self.local_test: ArrayDataset | None = None
        self.deferred: list[bytes] = []
        self.joined_instance: str | None = None
        self.workspace = Path(config.workspace)
        self.ckpt_path = self.workspace / "checkpoint.pt"
        self.round_start_path = self.workspace / "round-start.pt"  # durability "phase"
        self.journal = checkpoint.Journal(self.workspace / "journal.bin")
        # a private run's privacy ledger, written before each of its results may leave: a restart that
        # goes back to before a result that went out (a round's start) keeps what that result cost
        self.ledger_path = self.workspace / "privacy-ledger.json"
        self.crash = CrashHook(os.environ.get("FEDAL_AGENT_CRASH_AT"))
        self.ckpt_round_start: Any = None  # the round whose start checkpoint.pt holds (journal, round)
        self.replaying = False
        self.sit_out: Any = None  # durability "round": the round a restarted agent leaves out
        self._sitting_out = False
        self._payload: bytes | None = None  # the whole envelope of the task under way (its journal record)
        self._context: tuple[Any, str] = (None, "join")  # (round, phase) the bytes written are counted under
        self.written: Counter[tuple[Any, str, str]] = Counter()  # bytes written: (round, phase, file kind)
        self.retry_at = 0.0
        self.join_backoff = 0.5
        self.worker = threading.Thread(target=self._work, name="fedal-worker", daemon=True)
        self.exit_status = 0  # FINAL_WRITE_FAILED once the final model could not be written

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        """Block until the run finishes or stop() is called; returns a process exit code."""
        try:
            claim_workspace(self.config)
        except (WorkspaceError, OSError) as exc:
            log.error("workspace %s: %s", self.workspace, exc)
            return 2  # the config's to fix: the service does not restart it (RestartPreventExitStatus)
        try:
            with held(self.workspace, f"the agent {self.config.client_id}"):
                return self._run()
        except WorkspaceError as exc:  # another agent on this workspace: it may end, a later restart may go on
            log.error("%s", exc)
            return 1

    def _run(self) -> int:
        torch.set_num_threads(self.config.threads)
        self.link.start()
        self.worker.start()
        while not self.stop_event.is_set() and not self.finished.is_set() and not self.stop_requested:
            time.sleep(0.2)  # (not stop_event.wait: a signal handler interrupting it must find no lock held)
        self.stop_event.set()
        self.worker.join(timeout=30)
        if self.worker.is_alive():  # one step or evaluation longer than that: the process ends without it
            log.warning("the worker is still computing after 30 s; the agent ends without waiting for it")
        self.link.stop()
        self._write_status_file()
        return self.exit_status

    def stop(self) -> None:
        self.stop_event.set()

    def request_stop(self) -> None:
        """stop() for a signal handler: it takes no lock. Event.set() does, and the main thread the
        handler interrupts may hold that very lock (in Event.wait or set): a second SIGTERM/SIGHUP
        then hung the agent for ever, its port and workspace lock held."""
        self.stop_requested = True

    # -- worker thread -----------------------------------------------------------------------
    def _work(self) -> None:
        with stoppable(lambda: self.stop_requested or self.stop_event.is_set()):
            try:
                self._work_until_stopped()
            except TrainingStopped:  # asked to stop in a long task: its state was never made durable
                log.info("stopped in the middle of a task; it is not answered (the coordinator sends it again, "
                         "or the agent takes it up after its restart)")

    def _work_until_stopped(self) -> None:
        while not self.stop_event.is_set():
            self._report_dropped()
            try:
                topic, payload = self.inbox.get(timeout=0.2)
                self.link.taken(topic, payload)
                self._taken_before_publish = self._queued_before_publish > 0
                self._queued_before_publish = max(0, self._queued_before_publish - 1)
            except queue.Empty:
                m = self.manifest
                if m is not None and m.state != "finished" and self.client is None and time.monotonic() >= self.retry_at:
                    self._guarded("joining the run again", self._join, m)  # the last attempt failed: again
                continue
            self._guarded(f"handling a message on {topic}", self._dispatch, topic, payload)

    def _guarded(self, what: str, step: Any, *args: Any) -> None:
        """`step(*args)`, counted and logged should it fail: nothing a message holds ends the worker."""
        try:
            step(*args)
        except Exception:
            self.counters["errors"] += 1
            log.exception("error while %s", what)

    def _dispatch(self, topic: str, payload: bytes) -> None:
        if topic == self.link.manifest_topic:
            self._on_manifest(payload)
        elif topic == self.link.task_topic:
            if self.client is None:
                self._defer(payload)  # tasks may overtake the retained manifest
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
            if self.client is None and self._finished_instance() == manifest.instance:
                # its final model is written already: a service restarting the agent after it
                # exited (exit_on_finish) waits for the next run instead of finishing this one again
                log.info("run %s (instance %s) finished here already; final model in %s; waiting for the next run",
                         manifest.run_id, manifest.instance, self.workspace / "final")
                return
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

    def _finished_instance(self) -> str | None:
        """The run instance whose final model `final/` holds (written last by _finish)."""
        try:
            return (self.workspace / "final" / FINISHED_MARK).read_text().strip() or None
        except OSError:
            return None

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
        self.journal.close()
        self.ckpt_round_start = self.sit_out = None
        self._sitting_out = False
        self._published, self._queued_before_publish = None, 0  # (a model's bytes, not kept past the run)

    def _join(self, manifest: RunManifest) -> bool:
        try:
            self._setup(manifest)
        except Exception as exc:  # a bad file of any kind (a truncated .npz, one without y): retried with backoff
            self._leave()  # nothing half-restored stays attached: the next try starts from the files again
            self.counters["setup_failures"] += 1
            self.join_backoff = min(30.0, self.join_backoff * 2)
            self.retry_at = time.monotonic() + self.join_backoff
            log.error("cannot join run %s (retrying in %.0f s): %s", manifest.run_id, self.join_backoff, exc)
            return False
        held, self.deferred = self.deferred, []
        self._taken_before_publish = False  # the first held task is computed; each one after it came
        for payload in held:  # before any answer this loop sends (a copy of a task answered here: dropped)
            self._guarded("handling a task held until the run was joined", self._on_task, payload)
            self._taken_before_publish = True
        self._taken_before_publish = False
        return True

    def _defer(self, payload: bytes) -> None:
        """Hold a task until the run is joined, within a bound (a few tasks overtake a manifest;
        the coordinator sends its open tasks again anyway): beyond it the oldest go, counted."""
        limit = 2 * self.config.broker.max_message_bytes
        for dropped in hold_until_joined(self.deferred, payload, limit):
            self._reject(f"dropped a task of {len(dropped)} bytes held before joining the run "
                         f"(more than {MAX_HELD} tasks or {limit} bytes held)", "deferred")

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
            most = None if manifest.public_size is None else manifest.public_size * int(np.prod(train.input_shape))
            public = load_public_set(manifest.public_hash, cfg.public_file, manifest.public_url,
                                     self.workspace / "public.npz", max_elements=most)
            if _layout(public.shape[1:]) != _layout(train.input_shape):  # most models flatten what they get:
                # a device whose data is laid out otherwise would train and distil on scrambled inputs
                raise ValueError(f"the run's public set has rows of shape {tuple(public.shape[1:])}, this device's "
                                 f"data_file {cfg.data_file} rows of {tuple(train.input_shape)}: they must be laid out "
                                 "alike (the same dataset, preprocessed the same way)")
        torch.manual_seed(cfg.seed)  # the same initialisation as `fedal simulate` for this seed
        model = build_model(cfg.model, train.input_shape, manifest.num_classes)
        client = spec.client(cfg.client_id, model, train, public, params, seed=cfg.seed)
        if client.private is not None and not cfg.dp_seeded_noise:
            client.private.draw_secretly()  # (a checkpoint of this run restores its own draw, in host())
        if cfg.inference_backend != "torch":
            client.inference = OnnxInference(cfg.inference_backend, self.workspace, cfg.threads, train.x)
        self.host(client, manifest.instance)
        log.info("joined run %s as %s with a private %s (durability %s)", manifest.run_id, cfg.client_id, cfg.model,
                 cfg.durability)

    def host(self, client, instance: str) -> None:
        """Run `client` (a strategy's client half, as built for this run) in this agent's session
        for run `instance`, in the state its workspace holds for that instance, if any."""
        cfg = self.config
        self._context = (None, "join")
        for name in (self.ckpt_path.name, self.round_start_path.name, self.journal.path.name):
            for tmp in self.workspace.glob(f".{name}.*.tmp"):  # our own writes, torn by a crash
                tmp.unlink(missing_ok=True)
        try:
            state = checkpoint.load(self.ckpt_path)
        except Exception as exc:  # unreadable: a damaged card; kept for a look, never written over
            self.counters["checkpoint_unreadable"] += 1
            self._keep_aside(KEPT_UNREADABLE, f"the checkpoint is unreadable ({type(exc).__name__}: {exc})")
            state = None
        self._attach(client, instance)
        if state is not None and (state.get("run_id"), state.get("instance")) == (cfg.run_id, instance):
            try:
                self._restore(state)
            except CheckpointUnfit as exc:  # the next join starts from a new model (the client is half loaded)
                self.counters["checkpoint_unfit"] += 1
                self._keep_aside(KEPT_UNFIT, f"the checkpoint does not fit this device's {cfg.model} model (was the "
                                 f"config's model or data changed since it was written?): {exc}")
                raise
        elif cfg.durability != "phase":  # the base the journal follows, before any task changes the state
            self._save_checkpoint(round_start=None)
        self._take_ledger()

    def _take_ledger(self) -> None:
        """A private client restored to a state from before results that went out (a round's start,
        a checkpoint without its journal, no checkpoint at all): its accountant takes the ledger's
        count, and its noise is drawn afresh (the restored generator would draw the noise of those
        results again, on other inputs: their difference would be noise-free)."""
        private = getattr(self.client, "private", None)
        if private is None:
            return
        try:
            ledger = json.loads(self.ledger_path.read_text())
            if (ledger.get("run_id"), ledger.get("instance")) != (self.config.run_id, self.session.instance):
                return  # another run's (or an earlier start's) ledger
            spent = ledger["accountant"]
            steps = int(sum(entry[2] for entry in spent["history"]))
            if spent["kind"] != private.accountant.kind:
                raise ValueError(f"a {spent['kind']} accountant's ledger, this run's is {private.accountant.kind}")
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # damaged: said, not fatal
            log.error("the privacy ledger %s cannot be read (%s: %s): this device's epsilon may be under-counted",
                      self.ledger_path, type(exc).__name__, exc)
            return
        if steps <= private.accountant.steps:
            return
        log.warning("restored to before results that went out: the privacy ledger's %d steps are counted (the "
                    "restored state had %d), and the noise is drawn afresh", steps, private.accountant.steps)
        private.accountant.load_state_dict(spent)
        if self.config.dp_seeded_noise:  # reproducible still, but not the noise already used
            private.generator.manual_seed((self.config.seed * 0x9E3779B97F4A7C15 + steps) % 2**64)
        else:
            private.draw_secretly()
        self.counters["ledger_restored"] += 1

    def _keep_aside(self, suffix: str, why: str) -> None:
        """A checkpoint that cannot be taken up again is moved aside for a look, never written over."""
        kept = self.ckpt_path.with_name(f"{self.ckpt_path.name}{suffix}{int(time.time())}")
        try:
            os.replace(self.ckpt_path, kept)
            where = f"kept as {kept}"
        except OSError as move:  # (a card gone read-only: the next write fails as well, and says so)
            where = f"not moved aside ({move.strerror or move})"
        log.error("%s: %s; this device takes part again from a new model, its progress in this run lost", why, where)

    def _restore_checkpoint(self, state: dict[str, Any]) -> None:
        try:
            self.client.load_state_dict(state["client"])
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:  # torch's size mismatch, a missing key
            raise CheckpointUnfit(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}") from exc
        self.session.restore_saved(state)

    def _restore(self, state: dict[str, Any]) -> None:
        """The state this agent had: its checkpoint, then the journal's tasks replayed on it (any
        durability: a journal of this checkpoint is never ignored, whatever wrote it)."""
        self._restore_checkpoint(state)
        self.ckpt_round_start = state.get("round_start")
        at = self.session.last_key
        records, torn = self.journal.read(state["id"]) if state.get("id") else ([], 0)
        if torn:
            log.warning("dropped a torn journal record (%d bytes): its result was never published", torn)
        replayed = 0
        try:
            replayed = self._replay(records)
        except ReplayDiverged as exc:
            log.error("%s; back to the checkpoint, sitting out round %s", exc, self.ckpt_round_start)
            self.counters["replay_diverged"] += 1
            # read again: the replay trained on the loaded tensors in place (the optimizer's state)
            self._restore_checkpoint(checkpoint.load(self.ckpt_path))
            self.sit_out = self.ckpt_round_start
        if self.config.durability == "journal" and self.journal.checkpoint_id is None:
            if state.get("id"):
                self.journal.reset(state["id"])  # none, or a stale one: appends follow this checkpoint
            else:  # a checkpoint written before journals existed: a base the journal can name
                self._save_checkpoint(round_start=None)
        if self.config.durability == "round" and not records and self.ckpt_round_start is not None:
            self.sit_out = self.ckpt_round_start  # what was done of that round since is lost
        self.counters["replayed"] += replayed
        log.info("resumed from checkpoint at %s (%d journal records replayed: at %s)%s", at, replayed,
                 self.session.last_key, f"; sitting out round {self.sit_out}" if self.sit_out is not None else "")

    def _replay(self, records: list[checkpoint.JournalRecord]) -> int:
        """Apply the journal's tasks again, silently (no publishing, no writes, no counts)."""
        session, counters = self.session, self.session.counters
        session.counters = Counter()
        self.replaying = True
        try:
            for rec in records:
                try:
                    wire = session.on_task(decode(rec.payload))
                except (EnvelopeError, TaskRefused) as exc:
                    raise ReplayDiverged(f"journal task {rec.key} is refused on replay: {exc}") from exc
                if wire is None or session.last_key != rec.key or hashlib.sha256(wire.payload).hexdigest() != rec.result_sha256:
                    raise ReplayDiverged(f"replaying journal task {rec.key} did not reproduce its published result")
        finally:
            self.replaying = False
            session.counters = counters
        return len(records)

    def _attach(self, client, instance: str):
        """Run `client` (a strategy's client half) in this agent's session for run `instance`."""
        self.client, self.joined_instance = client, instance
        self.session = ClientSession(self.config.run_id, self.config.client_id, client, instance,
                                     evaluate=lambda task: evaluation_reply(client, task, self.test, self.local_test),
                                     store=self, counters=self.counters)
        return client

    def _on_task(self, payload: bytes) -> None:
        wire = self.apply_task(payload)
        if wire is None:
            return
        if wire is self._published and self._taken_before_publish:
            # a copy the coordinator re-sent (every resend_s) while this agent computed the task: it
            # was queued before the answer went out, which answers it too (a Pi's link is slow)
            self.counters["resends_while_computing"] += 1
            return
        self.link.publish_result(wire.payload)
        if wire is not self._published:  # computed now, not a cached answer sent again
            self._published, self._queued_before_publish = wire, self.inbox.qsize()
        self.crash.reached("after_publish", settle=lambda: self.link.wait_result_delivered(10.0))

    def apply_task(self, payload: bytes) -> Packet | None:
        """The result to send for one received task payload (None: nothing to send), with the
        durable writes of the configured durability done before it is returned."""
        try:
            msg = decode(payload)
            if is_chunk(msg):
                task = self.reassembler.feed("coordinator", payload)
                whole = None if task is None else encode(task)  # the reassembled envelope
            else:
                task, whole = msg, payload
        except EnvelopeError as exc:
            self._reject(f"malformed task: {exc}", exc.kind)
            return None
        if task is None:
            return None  # a chunk of a larger task
        if self._sits_out(task):
            return declining(task, "sat_out")  # so its phase need not wait out its deadline for this agent
        if self._is_new(task):
            self.crash.reached("next_task")
        self._payload, self._context = whole, (task.meta.get("round"), str(task.meta.get("phase")))
        try:
            return self.session.on_task(task)
        except TaskRefused as exc:  # a task this client cannot apply is refused, not fatal
            if exc.kind == STORE_FAILED:  # not the task's fault: the card's, as below
                self._durability_failed(task)
                return None
            decline = missed_step_decline(task, exc)  # e.g. restarted without its checkpoint
            if decline is not None:
                self.counters[MISSED_STEP] += 1
                log.warning("declining %s: %s", task.phase, exc)
                return decline
            self._reject(str(exc), exc.kind)
            return None
        except Exception:  # its durable record failed (e.g. a full or failing SD card): never sent
            self._durability_failed(task)
            return None
        finally:
            self._payload = None

    def _durability_failed(self, task: Message) -> None:
        self.counters["durability_errors"] += 1
        log.exception("task %s %s: its state could not be made durable; not answering, and rejoining "
                      "from the last durable state", task.phase, self.session.last_key)
        self._rejoin_from_disk()

    def _rejoin_from_disk(self) -> None:
        """Drop the in-memory state that is ahead of the disk: the worker joins again at once and
        restores the checkpoint and journal, as a restarted agent would."""
        self._leave()
        self.retry_at = 0.0

    def _is_new(self, task: Message) -> bool:
        key = (task.meta.get("epoch"), task.meta.get("seq"))
        last = self.session.last_key
        return type(key[0]) is int and type(key[1]) is int and (last is None or key > last)

    def _sits_out(self, task: Message) -> bool:
        """durability "round": a restarted agent leaves out the round it crashed in (the state it
        reached there is lost), declining its tasks, and takes part again from the next round's
        first task."""
        if self.sit_out is None or task.meta.get("instance") != self.session.instance:
            return False
        if task.meta.get("round") == self.sit_out:
            self.counters["sat_out"] += 1
            if not self._sitting_out:
                log.warning("sitting out the rest of round %s (durability round: its progress was lost)", self.sit_out)
                self._sitting_out = True
            return True
        if self._is_new(task):
            log.info("round %s under way: taking part again", task.meta.get("round"))
            self.sit_out, self._sitting_out = None, False
        return False

    # -- the session's store: files in the workspace -----------------------------------------
    def save_round_start(self, round_no: Any, client_state: dict[str, Any]) -> None:
        if self.replaying:  # the checkpoint replayed from is this round's start
            if round_no != self.ckpt_round_start:
                raise ReplayDiverged(f"the journal starts round {round_no}, its checkpoint holds round "
                                     f"{self.ckpt_round_start}'s start")
            return
        if self.config.durability == "phase":
            self._count("round_start", checkpoint.save_checkpoint({"round": round_no, "client": client_state},
                                                                  self.round_start_path))
        else:  # the session has not taken the round's first task yet: its fields are the round's base
            self._save_checkpoint(round_start=round_no)

    def load_round_start(self) -> tuple[Any, dict[str, Any]] | None:
        if self.config.durability == "phase":
            start = checkpoint.load(self.round_start_path)
            return None if start is None else (start.get("round"), start["client"])
        state = checkpoint.load(self.ckpt_path)
        if state is None or state.get("round_start") is None:
            return None
        return state["round_start"], state["client"]

    def after_task(self, session: ClientSession) -> None:
        """Durable before the result may leave: the next restart reaches this very state."""
        if self.replaying:
            return
        private = getattr(self.client, "private", None)
        if private is not None:  # what every result so far cost, whatever the durability keeps of the rest
            ledger = json.dumps({"run_id": self.config.run_id, "instance": session.instance,
                                 "accountant": private.accountant.state_dict()}).encode()
            write_bytes_atomic(self.ledger_path, ledger, private=True)
            self._count("ledger", len(ledger))
        if self.config.durability == "phase":
            self._save_checkpoint(round_start=None)
        elif self.config.durability == "journal":
            if self._payload is None:
                raise RuntimeError("a task was applied without its envelope to journal")
            assert session.last_key is not None and session.last_result is not None
            self._count("journal", self.journal.append(session.last_key, self._payload,
                                                       hashlib.sha256(session.last_result.payload).hexdigest()))
            self.crash.reached("after_journal")

    def _save_checkpoint(self, round_start: Any) -> None:
        """The whole state, atomically; with durability journal, the journal then starts afresh
        for it. A crash between the two leaves the old journal, which names the old checkpoint's
        id and so is ignored: the new checkpoint is taken before the round's first task."""
        s = self.session
        ckpt_id = uuid.uuid4().hex
        written = checkpoint.save_checkpoint(
            {
                "run_id": self.config.run_id,
                "instance": s.instance,
                "id": ckpt_id,
                "durability": self.config.durability,
                "round_start": round_start,  # its client state is this round's start (the replay guard's)
                "client": self.client.state_dict(),
                **s.saved(),  # last_key, last_result, round, round_steps
            },
            self.ckpt_path, midway=lambda: self.crash.reached("mid_snapshot"),
        )
        self._count("checkpoint", written)
        self.ckpt_round_start = round_start
        if self.config.durability == "journal":
            self._count("journal", self.journal.reset(ckpt_id))
        elif self.journal.path.exists():  # another durability's journal: stale from now on
            self.journal.close()
            self.journal.path.unlink()

    def _count(self, kind: str, nbytes: int) -> None:
        self.written[(*self._context, kind)] += nbytes

    def _finish(self, manifest: RunManifest) -> None:
        """The deployable artifacts of a finished run: the final weights and test-set outputs."""
        if self.client is None or self.finished.is_set():
            return
        if self._finished_instance() == manifest.instance:  # (the retained manifest again, after a reconnect)
            return
        out = self.workspace / "final"
        if out.is_symlink() or (out.exists() and not out.is_dir()):  # written through, it would be another folder's
            log.error("%s is not a folder of the agent's own (a link or a file): the final model is not written "
                      "there; move it away and start the agent again", out)
            self.counters["errors"] += 1
            self.exit_status = FINAL_WRITE_REFUSED
            self.stop_requested = True
            return
        try:
            if self.config.durability != "phase" and self.session is not None:
                self._context = (self.session.round_no, "finish")
                self._save_checkpoint(round_start=None)  # the end state: a restart replays nothing
            logits = self._final_test_logits()
            out.mkdir(parents=True, exist_ok=True)
            checkpoint.save_atomic(self.client.model.state_dict(), out / "model.pt")
            if logits is not None:
                write_atomic(out / "test_logits.npy", lambda fh: np.save(fh, logits))
            write_final_onnx(self.client.model, self.client.train_data.x, out, self.config.export_int8)
            write_bytes_atomic(out / FINISHED_MARK, f"{manifest.instance}\n".encode())  # last: what came before is complete
        except (OSError, RuntimeError) as exc:  # a full card (torch.save says so as a RuntimeError)
            # exit, not idle: the service starts the agent again, which writes them from its end checkpoint
            log.error("cannot write the final model to %s (%s: %s): exiting with status %d so that a restart writes it",
                      out, type(exc).__name__, exc, FINAL_WRITE_FAILED)
            self.counters["errors"] += 1
            self.exit_status = FINAL_WRITE_FAILED
            self.stop_requested = True
            return
        log.info("run %s %s; final model in %s", manifest.run_id, manifest.state, out)
        if self.config.exit_on_finish:
            self.finished.set()

    def _final_test_logits(self) -> np.ndarray | None:
        """The test set's outputs; None, said and counted, where the model cannot take its rows
        (the final model is still written: a restart would fail the same way)."""
        if self.test is None or self.client is None:
            return None
        try:
            return self.client.predict(self.test.x).numpy()
        except Exception as exc:  # noqa: BLE001 - torch's RuntimeError, onnxruntime's own errors alike
            log.error("the test set's rows do not go through the model (%s): the final model is written without "
                      "test_logits.npy", exc)
            self.counters["errors"] += 1
            return None

    def bytes_written(self) -> dict[str, int]:
        """Bytes this process wrote to the workspace for durability, by file kind."""
        out: Counter[str] = Counter()
        for (_round, _phase, kind), n in self.written.items():
            out[kind] += n
        return dict(out)

    def _reject(self, reason: str, kind: str = "other", count: int = 1) -> None:
        self.counters["rejected"] += count
        self.rejects[kind] += count
        log.warning("rejected: %s", reason)

    def _report_dropped(self) -> None:
        """What the link dropped unread: one line and a count per reason, however many."""
        for why, n in self.link.take_dropped().items():
            if why == "size":
                self._reject(f"{n} message(s) larger than broker.max_message_bytes "
                             f"({self.link.max_message_bytes}) dropped unread", "size", n)
            else:
                self._reject(f"{n} message(s) dropped unread: more than {self.link.inbox_bytes} bytes of tasks were "
                             "waiting (the coordinator sends an open task again)", "flood", n)

    def _write_status_file(self) -> None:
        status: dict[str, Any] = {"client_id": self.config.client_id, "counters": dict(self.counters),
                                  "rejects": dict(self.rejects),
                                  "last_key": self.session.last_key if self.session else None,
                                  "connects": self.link.connects, "durability": self.config.durability,
                                  "bytes_written": self.bytes_written(), "ts": time.time()}
        try:  # the last one stays whole until the new one is (a full card leaves the last one)
            write_bytes_atomic(self.workspace / "agent-status.json", json.dumps(status, indent=2).encode())
        except OSError as exc:
            log.error("cannot write %s: %s", self.workspace / "agent-status.json", exc)
