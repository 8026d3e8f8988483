"""The strategy contract: a server half and a client half that talk only in Messages.

A round is a short sequence of phases. In each phase the server half produces one task per
client; each client half answers with a result; the server half turns the results into the
next phase's tasks, or ends the round. Neither half knows how messages travel (in-process
for simulation, MQTT for deployment), and the engine that moves them knows no algorithm.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedal.data import ArrayDataset
from fedal.privacy import PrivateTraining, dp_compatible, require_opacus
from fedal.protocol import Message, tensor_problem
from fedal.protocol.message import Scalar
from fedal.strategies import optim
from fedal.strategies.frozen import TorchInference
from fedal.strategies.params import MAX_STEPS, StrategyParams


class InvalidResult(ValueError):
    """A client's result that the server half refuses (wrong phase, shape, NaN, ...)."""

    def __init__(self, message: str, kind: str = "result"):
        super().__init__(message)
        self.kind = kind  # the reject reason the coordinator counts it under


MISSED_STEP = "missed_step"


class MissedStep(ValueError):
    """A task that builds on an earlier step of its round that this client did not take (an agent
    restarted without that state): it cannot be computed however often it is sent. Its session
    refuses it under the kind "missed_step"; its host (an agent, an emulated agent, a Ray actor)
    declines it (fedal.session.missed_step_decline; docs/protocol.md section 8)."""

    kind = MISSED_STEP


@dataclass
class PhaseTasks:
    phase: str
    round: int
    iteration: int
    tasks: dict[str, Message] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerContext:
    num_classes: int
    public_size: int
    seed: int
    device: str = "cpu"  # where server-side models (FedAL's discriminator) run
    # the public set's inputs, for a server half that runs a model on them (MHAT's server model)
    public_x: np.ndarray | None = None
    # the global model's tensors (name -> (shape, dtype name)) where the server knows its
    # architecture (global_model strategies: the run's first model): the first upload, which
    # becomes the global model, is held to it
    weight_layout: dict[str, tuple[tuple[int, ...], str]] | None = None


class ServerHalf(ABC):
    """Runs on the coordinator. Holds no client data and no client model."""

    def __init__(self, params: StrategyParams, client_ids: list[str], context: ServerContext):
        if len(set(client_ids)) != len(client_ids) or not client_ids:
            raise ValueError("client_ids must be a non-empty list of unique ids")
        self.params = params
        self.client_ids = list(client_ids)
        self.context = context
        self.metrics: dict[str, list[float]] = {}
        self._decoded: dict[str, tuple[Message, Any]] = {}  # each client's last validated result, decoded

    @abstractmethod
    def begin_round(self, round_idx: int) -> PhaseTasks: ...

    @abstractmethod
    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        """Turn the valid results of `phase` into the next phase's tasks, or None at round end."""

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        """Raise InvalidResult unless `result` answers `phase` for an enrolled client."""
        if client_id not in phase.tasks:
            raise InvalidResult(f"client {client_id!r} had no task in phase {phase.phase!r}")
        for key, want in (("phase", phase.phase), ("round", phase.round), ("iteration", phase.iteration)):
            got = result.meta.get(key)
            if got != want or type(got) is not type(want):
                raise InvalidResult(f"result {key}={result.meta.get(key)!r}, expected {want!r}")
        problem = tensor_problem(result.tensors, self.params.max_abs_value)
        if problem is not None:
            raise InvalidResult(problem[1], kind=problem[0])

    def keep_decoded(self, client_id: str, result: Message, decoded: Any) -> None:
        """What validate decoded of `result`, for collect to use instead of decoding it again."""
        self._decoded[client_id] = (result, decoded)

    def take_decoded(self, client_id: str, result: Message, decode: Callable[[Message], Any]) -> Any:
        """`result` as validate decoded it (keep_decoded), or `decode(result)` where validate did
        not see this very result; forgotten either way."""
        kept = self._decoded.pop(client_id, None)
        return kept[1] if kept is not None and kept[0] is result else decode(result)

    def record(self, name: str, value: object) -> None:
        """Keep a diagnostic; values a client sent that are not finite numbers are ignored."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        self.metrics.setdefault(name, []).append(float(value))

    def round_metrics(self) -> dict[str, float]:
        """Mean of every metric recorded since the last call (one round's diagnostics)."""
        out = {k: float(np.mean(v)) for k, v in self.metrics.items() if v}
        self.metrics = {}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def global_model(self) -> dict[str, np.ndarray] | None:
        """The aggregated model's weights for strategies that keep one on the server (their spec
        says `global_model`); it is scored as `global_acc`. None before there is one."""
        return None

    def task(self, phase: str, round_idx: int, iteration: int, **meta: Any) -> Message:
        return Message({"phase": phase, "round": round_idx, "iteration": iteration, **meta})


def task_steps(task: Message, tau: int | None) -> int:
    """The local steps `task` asks for (default tau), within a run's bounds for tau: a negative
    count was answered as a task of no steps, with loss 0, and a huge one trained on for days."""
    steps = task.integer("steps", tau or 1)
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be between 1 and {MAX_STEPS}, got {steps}")
    return steps


class ClientHalf(ABC):
    """Runs on the device. Owns the private model, its optimizer and the private data.

    With `params.privacy`, the half trains on its private data with DP-SGD (`self.private`,
    fedal/privacy/): a half that passes its private steps through `self.private` says what they
    cost a round (`private_plan`); one that says nothing refuses the setting."""

    def __init__(
        self,
        client_id: str,
        model: torch.nn.Module,
        train: ArrayDataset,
        public_x: np.ndarray | torch.Tensor | None,
        params: StrategyParams,
        seed: int,
    ):
        self.client_id = client_id
        self.private: PrivateTraining | None = None
        if params.privacy is not None:
            plan = self.private_plan(params, len(train))
            if plan is None:
                raise ValueError(f"{type(self).__name__} has no differentially private training: a run with privacy "
                                 "settings cannot use it")
            require_opacus()  # before anything: a device without it refuses the run
            model = dp_compatible(model, f"{client_id}'s model")
            steps, releases = plan
            self.private = PrivateTraining(params.privacy, len(train), params.batch_size, seed=(int(seed) * 7919 + 0xD9) % 2**64,
                                           steps_per_round=steps, releases_per_round=releases,
                                           one_off_steps=self.private_one_off(params, len(train)))
        self.model = model
        self.train_data = train
        self.params = params
        self.x_train = torch.from_numpy(np.ascontiguousarray(train.x))
        self.y_train = torch.from_numpy(np.ascontiguousarray(train.y))
        # a tensor is taken as it is: clients built on one (a simulation's) share it, and with it
        # each iteration's gathered public inputs (public_rows.public_inputs)
        self.public_x = None if public_x is None else public_x.contiguous() if isinstance(public_x, torch.Tensor) \
            else torch.from_numpy(np.ascontiguousarray(public_x))
        self.generator = torch.Generator().manual_seed(int(seed))
        self.optimizer = make_optimizer(params, model.parameters())
        self.inference = TorchInference()  # the agent may install a faster backend
        self.group: Any = None  # vectorized simulation: the stacked group this client last stepped in

    @abstractmethod
    def handle(self, task: Message) -> Message: ...

    @classmethod
    def private_plan(cls, params: StrategyParams, n: int) -> tuple[int, int] | None:
        """(DP-SGD steps, private statistics) a round of this half takes on `n` private samples,
        what target_epsilon calibrates the noise for; None for a half that has not routed its
        steps on private data through `self.private` (it refuses privacy settings)."""
        return None

    @classmethod
    def private_one_off(cls, params: StrategyParams, n: int) -> int:
        """DP-SGD steps this half takes once in a run besides its rounds (FCCL's pretraining)."""
        return 0

    def training_report(self, train: Callable[[], float]) -> dict[str, Any]:
        """`train()`'s mean loss, or with differential privacy what a result says instead (the loss
        on private rows is not released): the privacy spent and whether the budget stopped it."""
        if self.private is None:
            return {"loss": train()}
        return self.private.spend(self.client_id, train)[0]

    def task_steps(self, task: Message) -> int:
        return task_steps(task, self.params.tau)

    def reply(self, task: Message, tensors: dict[str, np.ndarray] | None = None, **meta: Any) -> Message:
        base: dict[str, Scalar] = {k: task.meta[k] for k in ("phase", "round", "iteration") if k in task.meta}
        # a diverged loss is reported as null: non-finite numbers are not JSON
        meta = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in meta.items()}
        return Message({**base, **meta}, tensors or {})

    def sample_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.y_train)
        idx = torch.randperm(n, generator=self.generator)[: min(self.params.batch_size, n)]
        return self.x_train[idx], self.y_train[idx]

    def predict(self, x: np.ndarray | torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
        """The current model's logits, without gradients (on the inference backend)."""
        return self.inference.predict(self.model, x, batch_size)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> float:
        pred = self.predict(x).argmax(dim=1).numpy()
        return float((pred == np.asarray(y)).mean())

    def state_dict(self) -> dict[str, Any]:
        """Live references, like torch's state_dict: serialise it (the agent's checkpoint) or
        deep-copy it before training goes on. Not copying keeps the per-phase checkpoint cheap."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
        }
        if self.private is not None:  # the privacy spent so far lives with the client's state
            state["privacy"] = self.private.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        if self.private is not None:
            if "privacy" not in state:
                raise ValueError("a state saved without differential privacy does not load into a private client")
            self.private.load_state_dict(state["privacy"])


def make_optimizer(params: StrategyParams, parameters) -> torch.optim.Optimizer:
    if params.optimizer == "adam":
        return optim.Adam(parameters, lr=params.lr)
    return optim.SGD(parameters, lr=params.lr, momentum=params.momentum)


@dataclass(frozen=True)
class StrategySpec:
    """What a strategy module declares about itself: the registry and the engine read only this."""

    name: str
    server: type[ServerHalf]
    client: type[ClientHalf]
    preset: dict
    # every phase of a round and its kind: "train" (the training deadline) or "exchange"
    phases: Mapping[str, str]
    # its own parameters, besides params.COMMON_PARAMS: others set to a non-default value are refused
    params: tuple[str, ...]
    homogeneous_models: bool = False
    uses_public_set: bool = False
    # the server half keeps the aggregated model (ServerHalf.global_model()), evaluated as `global_acc`
    global_model: bool = False
    # results report collaborative fairness against a standalone (`local`) run of the same clients
    fairness: bool = False
    # models may differ, but their features (the heads' input) must have one width on every client
    same_feature_dim: bool = False
    # the fewest public rows one transfer iteration may hold (FCCL normalises along the batch)
    min_public_rows: int = 1
