"""FedDF-AL and FedDF (fedal.txt section VI, "shareable models"; ALGORITHMS.md section 1 variants).

When clients may share parameters, those whose models have the same architecture are averaged
as in FedAvg, and knowledge crosses architectures by distillation on the public set. FedDF-AL is
FedAL's transfer stage after that average; FedDF is the same without the adversarial term.
Round t, tau + 2 round trips (round 0: one more, `init`):

  init          (until the server knows the groups) client: uploads its initial weights and tag
                server: per group, the first enrolled member's weights become the group's start
  local_train   server -> client: steps (after init, also the group's start for the other members)
                client: loads that start if sent; tau steps of FedAL's local training (CE +
                        less-forgetting), then uploads its weights, |D_n| and an architecture
                        tag                                                        (|theta| up)
  average       server: groups = same tag and same tensor names/shapes/dtypes; the average of
                        each group weighted by local data size (fedavg.weighted_average)
                server -> client: its group's average (not to the only contributor of a group,
                        whose model it already is), and the public rows of (t, 0)  (|theta| down)
                client: loads the average, snapshots theta_ref_glo, uploads f_n on the rows
  transfer i    exactly FedAL's (fedal.py): discriminator, fbar, G_n; KD + LF (+ adversarial)

The server learns the groups only from what clients send, so it needs no list of architectures;
checking the tensors' signature as well as the declared tag means a group never mixes shapes.
Members of a group start from the same weights, as FedDF's clients start from the server's model
(averaging independently initialised networks would average unrelated features). A client that
missed this round's upload still gets its group's average (from the tag of its last upload), as
FedAvg sends the global model to every client.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch

from fedal.protocol import Message
from fedal.strategies.base import InvalidResult, PhaseTasks, StrategySpec
from fedal.strategies.fedal import FedALClient, FedALServer
from fedal.strategies.fedavg import load_numpy_into, model_to_numpy, numpy_weights_problem, weight_dtype_problem, weighted_average
from fedal.strategies.params import DISTILLATION_PARAMS

# paper: tau = 15 for FedDF-AL and 10 for FedDF; E_d = 2, all lambdas 1 (fedal.txt VI-A)
FEDDF_AL_PRESET = {"tau": 15, "lambda_kd": 1.0, "lambda_adv": 1.0, "lambda_lf_loc": 1.0, "lambda_lf_glo": 1.0}
FEDDF_PRESET = {"tau": 10, "lambda_kd": 1.0, "lambda_adv": 0.0, "lambda_lf_loc": 1.0, "lambda_lf_glo": 1.0}

WEIGHTS = "w/"  # weight tensors travel as "w/<state_dict key>", apart from "logits"
MAX_TAG = 128
# the phases of a round and their kind: "train" phases get the training deadline
PHASES = {"init": "exchange", "local_train": "train", "average": "exchange", "transfer": "exchange"}
# its own knobs, besides params.COMMON_PARAMS: FedAL's transfer stage
PARAMS = DISTILLATION_PARAMS + ("feddf_ref_glo", "privacy")  # local training is its only step on private data


def architecture_tag(model: torch.nn.Module) -> str:
    """What a client declares: its model class and the names, shapes and dtypes of its state."""
    sig = [type(model).__name__, [[k, list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()]]
    return hashlib.sha256(json.dumps(sig).encode()).hexdigest()[:16]


def tensor_signature(tensors: dict[str, np.ndarray]) -> str:
    """The server's own view of an upload: names, shapes and dtypes of the weights."""
    sig = [[k, list(v.shape), str(v.dtype)] for k, v in sorted(tensors.items())]
    return hashlib.sha256(json.dumps(sig).encode()).hexdigest()[:16]


def group_key(result: Message) -> str:
    return f"{result.meta['arch']}/{tensor_signature(result.tensors)}"


class FedDFServer(FedALServer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_of: dict[str, str] = {}  # client -> group key of its last accepted upload

    def begin_round(self, round_idx: int) -> PhaseTasks:
        if not self.group_of:  # nobody has uploaded yet: learn the groups and give each one start
            meta = self.task("init", round_idx, 0).meta
            return PhaseTasks("init", round_idx, 0, {cid: Message(dict(meta)) for cid in self.client_ids})
        return self._local_train_phase(round_idx, {})

    def _local_train_phase(self, round_idx: int, starts: dict[str, dict[str, np.ndarray]]) -> PhaseTasks:
        meta = self.task("local_train", round_idx, 0, steps=self.params.tau).meta
        return PhaseTasks("local_train", round_idx, 0,
                          {cid: Message(dict(meta), starts.get(cid, {})) for cid in self.client_ids})

    def logits_iteration(self, phase: str, iteration: int) -> int | None:
        """The average's result opens the transfer stage; init and local training send weights."""
        if phase == "average":
            return 0
        return None if phase in ("init", "local_train") else super().logits_iteration(phase, iteration)

    def validate(self, phase: PhaseTasks, client_id: str, result: Message) -> None:
        super().validate(phase, client_id, result)
        if phase.phase not in ("init", "local_train"):
            return
        if not result.tensors or any(not k.startswith(WEIGHTS) for k in result.tensors):
            raise InvalidResult(f"a {phase.phase} result carries the model's weights only, as tensors named {WEIGHTS!r}...")
        problem = weight_dtype_problem(result.tensors)
        if problem:
            raise InvalidResult(problem)
        tag = result.meta.get("arch")
        if not isinstance(tag, str) or not 0 < len(tag) <= MAX_TAG:
            raise InvalidResult(f"a {phase.phase} result declares its architecture as a string tag of 1-{MAX_TAG} characters")
        if phase.phase == "init":
            return
        declared = self.group_of.get(client_id)
        if declared is not None and group_key(result) != declared:  # its model cannot change between rounds
            raise InvalidResult("local_train weights do not match the architecture and tensors this client uploaded before")
        n = result.meta.get("num_samples")
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not 0 < n < float("inf"):
            raise InvalidResult("a local_train result must report num_samples > 0")

    def collect(self, phase: PhaseTasks, results: dict[str, Message]) -> PhaseTasks | None:
        if phase.phase == "init":
            return self._local_train_phase(phase.round, self.group_starts(results))
        if phase.phase == "local_train":
            for res in results.values():
                self.record("local_loss", res.meta.get("loss"))
            return self._average_phase(phase.round, results)
        if phase.phase == "average":
            return self._transfer_phase(phase.round, 0, results)
        return super().collect(phase, results)

    def group_starts(self, results: dict[str, Message]) -> dict[str, dict[str, np.ndarray]]:
        """Per client: the initial weights of its group's first enrolled member (none for that member)."""
        cids = [c for c in self.client_ids if c in results]
        first: dict[str, str] = {}
        for c in cids:
            self.group_of[c] = group_key(results[c])
            first.setdefault(self.group_of[c], c)
        return {c: dict(results[first[self.group_of[c]]].tensors) for c in cids if first[self.group_of[c]] != c}

    def group_averages(self, results: dict[str, Message]) -> dict[str, tuple[list[str], dict[str, np.ndarray]]]:
        """Per group key: the contributing clients and their data-size-weighted average."""
        cids = [c for c in self.client_ids if c in results]  # enrolment order: deterministic
        for c in cids:
            self.group_of[c] = group_key(results[c])
        out = {}
        for key in sorted({self.group_of[c] for c in cids}):
            members = [c for c in cids if self.group_of[c] == key]
            out[key] = (members, weighted_average([results[c].tensors for c in members],
                                                  [results[c].number("num_samples") for c in members]))
        return out

    def _average_phase(self, round_idx: int, results: dict[str, Message]) -> PhaseTasks:
        averages = self.group_averages(results)
        self.record("groups", len(averages))
        self.record("param_participation", len(results) / len(self.client_ids))
        tasks = {}
        for cid in self.client_ids:
            tensors: dict[str, np.ndarray] = {}
            members, avg = averages.get(self.group_of.get(cid, ""), ([], {}))
            if members and members != [cid]:
                tensors.update(avg)
            tasks[cid] = Message(self.task("average", round_idx, 0, group_size=len(members)).meta, tensors)
        return PhaseTasks("average", round_idx, 0, tasks)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "groups": dict(self.group_of)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "groups"})
        self.group_of = dict(state.get("groups", {}))


class FedDFClient(FedALClient):
    # FedAL's stage 1 (its private path) is the only step on private data: the weights sent after it,
    # the group average, the logits and the transfer stage on the public set are post-processing

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arch = architecture_tag(self.model)

    def handle(self, task: Message) -> Message:
        if task.phase == "init":
            return self.reply(task, self.weights(), arch=self.arch)
        if task.phase == "local_train":
            self.load_group_weights(task)  # round 0: the group's common start
            # over the privacy budget: the weights as loaded
            report = self.training_report(lambda: self.local_steps(self.task_steps(task)))
            if self.params.feddf_ref_glo == "local_train":  # ALGORITHMS.md: right after local training
                self.snapshot_ref_glo()
            return self.reply(task, self.weights(), num_samples=len(self.y_train), arch=self.arch, **report)
        if task.phase == "average":
            weights = self.load_group_weights(task)
            if self.params.feddf_ref_glo == "average":  # the model the transfer stage starts from
                self.snapshot_ref_glo()
            logits = self._upload_logits(task.integer("round"), 0)
            return self.reply(task, logits, averaged=weights)
        return super().handle(task)

    def weights(self) -> dict[str, np.ndarray]:
        return {WEIGHTS + k: v for k, v in model_to_numpy(self.model).items()}

    def load_group_weights(self, task: Message) -> bool:
        """Load the `w/...` tensors of `task`, if any; True if there were some."""
        weights = self.group_weights(task)
        if not weights:
            return False
        load_numpy_into(self.model, weights)
        return True

    def group_weights(self, task: Message) -> dict[str, np.ndarray]:
        """The `w/...` tensors of `task` by state_dict key (none: empty); ValueError, changing
        nothing, unless they are exactly this client's tensor names and shapes."""
        weights = {k[len(WEIGHTS):]: v for k, v in task.tensors.items() if k.startswith(WEIGHTS)}
        mine = self.model.state_dict()
        if any(k in mine and tuple(v.shape) != tuple(mine[k].shape) for k, v in weights.items()):
            raise ValueError("the group's weights do not have this client's parameter shapes")
        problem = numpy_weights_problem(self.model, weights) if weights else None
        if problem:
            raise ValueError(problem)
        return weights


SPECS = (
    StrategySpec("feddf-al", FedDFServer, FedDFClient, FEDDF_AL_PRESET, PHASES, PARAMS, uses_public_set=True),
    StrategySpec("feddf", FedDFServer, FedDFClient, FEDDF_PRESET, PHASES, PARAMS, uses_public_set=True),
)
