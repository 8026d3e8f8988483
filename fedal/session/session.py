"""One client's session: (epoch, seq) ordering, the cached-result resend, the replay guard.

Tasks carry (epoch, seq), a per-phase sequence number from the coordinator. A task older than
the last one handled is stale and ignored; the same one again (a QoS 1 redelivery, or the
coordinator re-sending) is answered from the cached result, never recomputed, so feedback is
applied exactly once. A coordinator that restarts resumes after its last completed round under
a new epoch: when a task repeats a step of the round under way, the session first goes back to
its state at that round's start, so nothing is applied twice. A task refused after that (one
the client half cannot apply) leaves the client as it was before it: the going back is undone.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fedal.data import ArrayDataset
from fedal.protocol import TASK_CONTEXT, Message, Packet, tensor_problem
from fedal.strategies import ClientHalf
from fedal.strategies.base import MISSED_STEP, task_steps

log = logging.getLogger("fedal.session")


class NewTask:
    """ClientSession.admit's answer for a task that is new and is to be computed."""


class TaskRefused(ValueError):
    """A task this session will not apply (wrong address, no epoch/seq, a step it cannot take)."""

    def __init__(self, message: str, kind: str = "task"):
        super().__init__(message)
        self.kind = kind  # the reject reason it is counted under


MAX_HELD = 32  # tasks a client holds until it has joined the run (hold_until_joined)


def hold_until_joined(held: list[bytes], payload: bytes, max_bytes: int) -> list[bytes]:
    """Hold a task that came before the run was joined, within a bound (a few tasks overtake a
    manifest; the coordinator sends its open tasks again anyway): beyond MAX_HELD tasks or
    `max_bytes` the oldest go. Returns those dropped, for the caller to count."""
    held.append(payload)
    dropped = []
    while len(held) > MAX_HELD or (len(held) > 1 and sum(map(len, held)) > max_bytes):
        dropped.append(held.pop(0))
    return dropped


STORE_FAILED = "store_failed"  # TaskRefused.kind of a task whose round start could not be written


class RoundStartUnsaved(OSError):
    """The store could not write a round's start (a full or failing card): the task was not
    computed. Refused under STORE_FAILED, so an agent can tell it from a task it cannot apply."""

    kind = STORE_FAILED


class SessionStore(Protocol):
    """Where a session keeps what must survive a restart (the agent: files on its workspace)."""

    def save_round_start(self, round_no: Any, client_state: dict[str, Any]) -> None: ...

    def load_round_start(self) -> tuple[Any, dict[str, Any]] | None: ...

    def after_task(self, session: ClientSession) -> None:
        """Called with the new result cached and before it is sent (the agent checkpoints here)."""


def evaluation_reply(client: ClientHalf, task: Message, test: ArrayDataset | None,
                     local_test: ArrayDataset | None) -> Message:
    """Accuracy on the common test set and on this device's own test split, where provisioned:
    numbers only, so the coordinator can show progress without seeing data or the model. A client
    that trains with differential privacy does not report its own split's accuracy: that split is
    private data, and the accountant does not cover it (docs/privacy.md)."""
    report: dict[str, Any] = {}
    if client.private is not None:  # its own test split is private data, which no accountant covers
        local_test = None
    for key, data in (("", test), ("local_", local_test)):
        if data is not None and len(data):
            report[f"{key}acc"] = client.evaluate(data.x, data.y)
            report[f"num_{key}test"] = len(data)
    return client.reply(task, acc=report.pop("acc", None), **report)


def wire_result(result: Message, key: tuple[int, int]) -> Message:
    """What travels for a result: it names its task by (epoch, seq), so the task's phase, round
    and iteration, which the receiver holds, are not sent again (docs/protocol.md)."""
    meta = {k: v for k, v in result.meta.items() if k not in TASK_CONTEXT}
    return Message({**meta, "epoch": key[0], "seq": key[1]}, result.tensors)


def declining(task: Message, reason: str) -> Packet | None:
    """The answer of a client that will not compute `task` (a restarted agent sitting out the
    rest of a round it lost): the coordinator stops waiting for it (docs/protocol.md section 8).
    None for a task without integer epoch and seq, which no answer could name."""
    key = (task.meta.get("epoch"), task.meta.get("seq"))
    if not all(type(v) is int for v in key):
        return None
    return Packet.of(wire_result(Message({"declined": reason}), key))  # type: ignore[arg-type]  # ints: checked


def missed_step_decline(task: Message, refusal: TaskRefused) -> Packet | None:
    """The decline answering a task refused because it builds on a step of its round that its
    client no longer has (restarted without that state: no re-send could make it computable), so
    that its phase need not wait for this client; None for any other refusal. Every host of a
    session (the agent, an emulated agent, a Ray actor) answers such a task so."""
    return declining(task, MISSED_STEP) if refusal.kind == MISSED_STEP else None


class ClientSession:
    def __init__(self, run_id: str, client_id: str, client: ClientHalf, instance: str,
                 evaluate: Callable[[Message], Message], store: SessionStore | None = None,
                 counters: Counter[str] | None = None):
        self.run_id = run_id
        self.client_id = client_id
        self.client = client
        self.instance = instance
        self.evaluate = evaluate
        self.store = store
        self.counters: Counter[str] = Counter() if counters is None else counters  # shared with the owner's
        self.last_key: tuple[int, int] | None = None
        self.last_result: Packet | None = None
        self.round_no: Any = None
        self.round_steps: set[tuple[str, Any]] = set()
        self._undo_replay: Callable[[], None] | None = None  # set by a replay guard that went back or opened a round

    def restore(self, last_key: tuple[int, int] | None, last_result: Packet | None, round_no: Any,
                round_steps: set[tuple[str, Any]]) -> None:
        self.last_key, self.last_result, self.round_no, self.round_steps = last_key, last_result, round_no, round_steps

    def saved(self) -> dict[str, Any]:
        """The session's state as tensors and plain data (what torch.load(weights_only=True)
        reads back: a tampered file cannot run code): an agent's checkpoint holds it, a
        simulation's too (restore_saved)."""
        return {
            "last_key": list(self.last_key) if self.last_key else None,
            "last_result": torch.frombuffer(bytearray(self.last_result.payload), dtype=torch.uint8)
            if self.last_result else None,
            "round": self.round_no,
            "round_steps": sorted([list(step) for step in self.round_steps], key=repr),
        }

    def restore_saved(self, state: dict[str, Any]) -> None:
        """The session as `saved()` gave it."""
        result = state.get("last_result")
        self.restore(tuple(state["last_key"]) if state.get("last_key") else None,
                     Packet(payload=bytes(result.numpy().tobytes())) if result is not None else None,
                     state.get("round"), {tuple(step) for step in state.get("round_steps", [])})

    def on_task(self, task: Message) -> Packet | None:
        """The result to send for `task` (new, or the cached one for a repeat), or None
        for a task to ignore (stale, another instance). Raises TaskRefused for a bad task."""
        early = self.admit(task)
        if not isinstance(early, NewTask):
            return early
        self.prepare(task)
        try:
            result = self.compute(task)
        except TaskRefused:
            self.refused_after_prepare()
            raise
        return self.answer(task, result)

    # on_task in its steps, for a transport that computes a group of clients' tasks at once
    # (vectorized simulation): admit and prepare each, compute together, answer each.
    def admit(self, task: Message) -> Packet | NewTask | None:
        """A NewTask for a task to compute; else what on_task returns without computing (None,
        or the cached result of a repeat). Raises TaskRefused for a bad task."""
        meta = task.meta  # addressed by its topic: the transport delivers only this client's tasks
        if meta.get("instance") != self.instance:
            self.counters["stale"] += 1  # e.g. queued by the broker for an earlier run under this id
            return None
        key = (meta.get("epoch"), meta.get("seq"))
        if not (type(key[0]) is int and type(key[1]) is int):
            raise TaskRefused("task without integer epoch and seq", "sequence")
        ikey = (int(key[0]), int(key[1]))
        if self.last_key is not None and ikey < self.last_key:
            self.counters["stale"] += 1
            return None
        if ikey == self.last_key and self.last_result is not None:
            self.counters["duplicates"] += 1
            return self.last_result  # answered before: resend, never recompute
        problem = tensor_problem(task.tensors, self.client.params.max_abs_value)
        if problem is not None:  # e.g. feedback of absurd magnitude: never trained on
            raise TaskRefused(f"task {task.phase} r{meta.get('round')} i{meta.get('iteration')} refused: {problem[1]}",
                              problem[0])
        if "steps" in meta:  # checked before the client half takes the task (it may load weights first)
            self._refusing(task, lambda: task_steps(task, self.client.params.tau))
        return NewTask()

    def prepare(self, task: Message) -> None:
        """The replay guard for an admitted task, before it is computed."""
        self._undo_replay = None
        self._refusing(task, lambda: self._replay_guard(task.meta.get("round"), (task.phase, task.meta.get("iteration")),
                                                        task.meta.get("epoch")))

    def refused_after_prepare(self) -> None:
        """The prepared task was refused: a replay guard that went back to the round's start is
        undone (the client's state, its round's steps), and one that opened a new round is too
        (the round under way and its steps), as a refused task changes nothing."""
        undo, self._undo_replay = self._undo_replay, None
        if undo is not None:
            undo()

    def compute(self, task: Message) -> Message:
        """The client half's result for an admitted, prepared task."""
        return self._refusing(task, lambda: self.evaluate(task) if task.phase == "evaluate" else self.client.handle(task))

    def answer(self, task: Message, result: Message) -> Packet:
        """Record `result` as the answer to `task`, as it goes on the wire (encoded where a link
        needs the bytes: Packet)."""
        self._undo_replay = None  # answered: its state before the replay is no longer needed
        ikey = (int(task.meta["epoch"]), int(task.meta["seq"]))  # type: ignore[arg-type]  # admitted: ints
        self.round_steps.add((task.phase, task.meta.get("iteration")))  # taken: a repeat means a replayed round
        wire = Packet.of(wire_result(result, ikey))
        self.last_key, self.last_result = ikey, wire
        if self.store is not None:
            self.store.after_task(self)
        self.counters["tasks"] += 1
        return wire

    def _refusing(self, task: Message, work: Callable[[], Any]) -> Any:
        try:
            return work()
        except Exception as exc:  # a task this client cannot apply is refused, not fatal
            meta = task.meta
            raise TaskRefused(f"task {task.phase} r{meta.get('round')} i{meta.get('iteration')} refused: {exc}",
                              getattr(exc, "kind", "task")) from exc

    def _newer_epoch(self, epoch: Any) -> bool:
        """Steps of the round under way were taken (the last answer was one of them) under an
        epoch older than this task's: a coordinator restarted since, which runs the round again
        from its first phase (docs/protocol.md section 8)."""
        return bool(self.round_steps) and self.last_key is not None and type(epoch) is int \
            and epoch > self.last_key[0]

    def _replay_guard(self, round_no: Any, step: tuple[str, Any], epoch: Any) -> None:
        if round_no != self.round_no:  # the round's first task: remember where it started
            if self.store is not None:
                try:
                    self.store.save_round_start(round_no, self.client.state_dict())
                except OSError as exc:
                    raise RoundStartUnsaved(f"round {round_no}'s start could not be saved: {exc}") from exc
            previous = self.round_no, self.round_steps

            def forget_round() -> None:  # a refused task opens no round: the next task of the one
                # under way is no round's first (its start, as saved, would be that round's middle)
                self.round_no, self.round_steps = previous
                log.info("the task that opened round %s was refused: still in round %s", round_no, previous[0])

            self.round_no, self.round_steps = round_no, set()
            self._undo_replay = forget_round
        elif step in self.round_steps or self._newer_epoch(epoch):  # a resumed coordinator replays this round
            # from its start: a step taken again, or any step under a later epoch than the steps
            # taken (its first may be one this client missed, e.g. offline at local training)
            start = self.store.load_round_start() if self.store is not None else None
            if start is None or start[0] != round_no:
                raise RuntimeError(f"round {round_no} is replayed but its start state is missing")
            state, steps = copy.deepcopy(self.client.state_dict()), self.round_steps

            def undo() -> None:
                self.client.load_state_dict(state)
                self.round_steps = steps
                self.counters["round_replays"] -= 1
                log.info("the task that replayed round %s was refused: back to the state before it", round_no)

            # the privacy ledger and noise are not taken back: the replayed steps cost their
            # epsilon again, with fresh noise (the same noise on other inputs would cancel out
            # in the difference of the two releases)
            self.client.load_state_dict({**start[1], "privacy": state["privacy"]} if "privacy" in state else start[1])
            self.round_steps = set()
            self.counters["round_replays"] += 1
            self._undo_replay = undo
            log.info("the coordinator replays round %s: back to this client's state at its start", round_no)
