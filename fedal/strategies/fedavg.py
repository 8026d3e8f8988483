"""FedAvg (McMahan et al.): data-size-weighted parameter averaging of identical models.

Round 0 starts with an `init` phase in which the first client uploads its initial weights, so
every client starts from the same point without relying on identical random initialisation
across devices and torch builds. BatchNorm buffers are averaged too; integer buffers (batch
counters) take the weighted mean rounded down.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedal.protocol import Message
from fedal.strategies.base import ClientHalf, InvalidResult, PhaseTasks, ServerHalf, StrategySpec
from fedal.strategies.local import local_step_count, train_steps

PRESET = {"tau": 5, "lambda_kd": 0.0, "lambda_adv": 0.0, "lambda_lf_loc": 0.0, "lambda_lf_glo": 0.0}
# the phases of a round and their kind: "train" phases get the training deadline
PHASES = {"init": "exchange", "train": "train"}
# its own knobs, besides params.COMMON_PARAMS
PARAMS = ("local_epochs", "privacy")


def weighted_average(states: list[dict[str, np.ndarray]], weights: list[float]) -> dict[str, np.ndarray]:
    w = np.asarray(weights, dtype=np.float64)
    with np.errstate(over="ignore"):  # (an overflowing sum is handled here, not warned of)
        total = w.sum()
    if not np.isfinite(total):  # finite weights whose sum overflows (clients claiming 1e308 samples):
        w = w / w.max()  # the same proportions (all zeros before, a global model of nothing)
        total = w.sum()
    w = w / total
    out = {}
    for key in states[0]:
        stacked = np.stack([s[key].astype(np.float64) for s in states])
        avg = np.tensordot(w, stacked, axes=1)
        dtype = states[0][key].dtype
        # np.asarray: a 0-d weight (BatchNorm's batch counter) stays an array, not a numpy scalar
        out[key] = np.asarray((np.floor(avg) if np.issubdtype(dtype, np.integer) else avg).astype(dtype))
    return out


def weight_dtype_problem(tensors: dict[str, np.ndarray]) -> str | None:
    """Model weights are float32 (parameters, BatchNorm statistics) or int64 (BatchNorm's batch
    counter); anything else is not a model of this toolkit's, whatever its shape."""
    for key, arr in tensors.items():
        if arr.dtype not in (np.float32, np.int64):
            return f"tensor {key!r} has dtype {arr.dtype}; model weights are float32 or int64"
    return None


def weight_layout_problem(tensors: dict[str, np.ndarray], layout: dict[str, tuple[tuple[int, ...], str]],
                          what: str) -> str | None:
    """Why `tensors` are not weights of `layout` (name -> (shape, dtype name)); None: they are."""
    if set(tensors) != set(layout):
        return f"uploaded weights do not match {what}'s tensors"
    for key, arr in tensors.items():
        shape, dtype = layout[key]
        if tuple(arr.shape) != tuple(shape) or arr.dtype.name != dtype:
            return f"tensor {key!r} is {arr.dtype}{list(arr.shape)}, expected {dtype}{list(shape)}"
    return None


class FedAvgServer(ServerHalf):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.global_weights: dict[str, np.ndarray] | None = None

    def begin_round(self, round_idx: int) -> PhaseTasks:
        if self.global_weights is None:
            first = self.client_ids[0]
            return PhaseTasks("init", round_idx, 0, {first: self.task("init", round_idx, 0)})
        return self._train_phase(round_idx)

    def _train_phase(self, round_idx: int) -> PhaseTasks:
        msg = self.task("train", round_idx, 0, steps=self.params.tau)
        assert self.global_weights is not None  # training rounds start once init delivered weights
        tasks = {cid: Message(dict(msg.meta), self.global_weights) for cid in self.client_ids}
        return PhaseTasks("train", round_idx, 0, tasks)

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        ref = self.global_weights
        if ref is not None:
            problem = weight_layout_problem(result.tensors, {k: (v.shape, v.dtype.name) for k, v in ref.items()},
                                            "the global model")
        elif self.context.weight_layout is not None:  # the first upload becomes the global model
            problem = weight_layout_problem(result.tensors, self.context.weight_layout, "the run's model")
        else:  # a server that does not know the architecture: at least the dtypes are the models' own
            problem = weight_dtype_problem(result.tensors)
        if problem:
            raise InvalidResult(problem)
        n = result.meta.get("num_samples")
        if phase.phase == "train" and (isinstance(n, bool) or not isinstance(n, (int, float)) or not 0 < n < float("inf")):
            raise InvalidResult("a train result must report num_samples > 0")

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase == "init":
            if not results:
                return None  # nobody answered: try again next round
            (res,) = results.values()
            if not res.tensors:
                return None  # no weights: ask again next round
            self.global_weights = dict(res.tensors)
            return self._train_phase(phase.round)
        if results:
            cids = [c for c in self.client_ids if c in results]
            self.global_weights = weighted_average(
                [results[c].tensors for c in cids], [results[c].number("num_samples") for c in cids]
            )
            self.record("participation", len(cids) / len(self.client_ids))
            for c in cids:
                self.record("local_loss", results[c].meta.get("loss", float("nan")))
        return None

    def global_model(self) -> dict[str, np.ndarray] | None:
        return self.global_weights

    def state_dict(self) -> dict[str, Any]:
        if self.global_weights is None:
            return {}
        return {"global": {k: torch.from_numpy(v.copy()) for k, v in self.global_weights.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("global") is not None:
            self.global_weights = {k: torch.as_tensor(v).numpy().copy() for k, v in state["global"].items()}


class FedAvgClient(ClientHalf):
    # local training goes through train_steps' private path: the weights it sends are DP-SGD's;
    # the init weights are the random initialisation, which saw no data
    @classmethod
    def private_plan(cls, params, n: int) -> tuple[int, int] | None:
        return local_step_count(params, int(params.tau or 1), n), 0

    def handle(self, task: Message) -> Message:
        if task.phase == "init":
            return self.reply(task, model_to_numpy(self.model))
        if task.phase == "train":
            load_numpy_into(self.model, task.tensors)
            report = self.training_report(lambda: train_steps(self, self.task_steps(task)))
            return self.reply(task, model_to_numpy(self.model), num_samples=len(self.y_train), **report)
        raise ValueError(f"unknown phase {task.phase!r}")


def model_to_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def numpy_weights_problem(model: torch.nn.Module, tensors: dict[str, np.ndarray]) -> str | None:
    """Why `tensors` do not load into `model` (None: they do): other names, or other shapes."""
    current = model.state_dict()
    if set(tensors) != set(current):
        return "received weights do not match this client's model"
    for key, arr in tensors.items():
        if tuple(np.shape(arr)) != tuple(current[key].shape):
            return f"tensor {key!r} has shape {list(np.shape(arr))}, expected {list(current[key].shape)}"
    return None


def load_numpy_into(model: torch.nn.Module, tensors: dict[str, np.ndarray]) -> None:
    problem = numpy_weights_problem(model, tensors)
    if problem:
        raise ValueError(problem)
    current = model.state_dict()
    model.load_state_dict({k: torch.from_numpy(np.array(v)).to(current[k].dtype) for k, v in tensors.items()})


SPECS = (StrategySpec("fedavg", FedAvgServer, FedAvgClient, PRESET, PHASES, PARAMS, homogeneous_models=True,
                      global_model=True),)
