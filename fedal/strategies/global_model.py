"""The aggregated model of parameter-averaging strategies, evaluated where it lives: the server.

FedAvg-type server halves (StrategySpec.global_model) keep the average (`ServerHalf.global_model()`) that
no client holds after the last round (each client holds its own locally trained copy). Both
`fedal simulate` and the coordinator score it on the balanced common test set with this one
function, so the two report the same `global_acc`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from fedal.models import build_model
from fedal.privacy import dp_compatible
from fedal.strategies.base import ServerHalf
from fedal.strategies.fedavg import load_numpy_into
from fedal.strategies.frozen import TorchInference


def global_accuracy(server: ServerHalf, model_name: str, num_classes: int, x: np.ndarray, y: np.ndarray,
                    threads: int | None = None) -> float | None:
    """Accuracy of the server half's global model on (x, y); None before it has one (or if the
    server half keeps none). `threads` pins torch's intra-op threads for the forward pass, so a
    process with another setting (the coordinator) computes bit-for-bit what the simulation does."""
    weights = server.global_model()
    if weights is None or len(y) == 0:
        return None
    model = global_model_module(model_name, tuple(np.asarray(x).shape[1:]), num_classes, server.params.privacy is not None)
    load_numpy_into(model, weights)
    with torch_threads(threads):
        pred = TorchInference().predict(model, np.ascontiguousarray(x, dtype=np.float32)).argmax(dim=1).numpy()
    return float((pred == np.asarray(y)).mean())


def global_model_module(model_name: str, input_shape: tuple[int, ...], num_classes: int,
                        private: bool) -> torch.nn.Module:
    """The module the global model's weights load into, as the clients build theirs."""
    model: torch.nn.Module = build_model(model_name, input_shape, num_classes)
    if private:  # the clients' DP-compatible variant (BatchNorm -> GroupNorm)
        model = dp_compatible(model, "the global model", announce=False)  # the clients announced it
    return model


def global_weight_layout(model_name: str, input_shape: tuple[int, ...], num_classes: int,
                         private: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """ServerContext.weight_layout: what the global model's tensors must be for it to load."""
    state = global_model_module(model_name, input_shape, num_classes, private).state_dict()
    return {k: (tuple(v.shape), str(v.detach().cpu().numpy().dtype)) for k, v in state.items()}


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def fedavg_style_metrics(summary: dict, global_acc: float | None) -> dict:
    """The two accuracies of the FedHKD paper: `global_acc` (the aggregated model on the balanced
    test set) and `personal_acc` (each client's own model on its own local test split, the mean
    over clients; present when the run has local test splits)."""
    out = {}
    if global_acc is not None:
        out["global_acc"] = global_acc
    if summary.get("local_mean_acc") is not None:
        out["personal_acc"] = summary["local_mean_acc"]
    return out


def global_model_line(final: dict) -> str | None:
    """One line for the CLI summaries of `fedal simulate` and `fedal demo`; None without a global model."""
    if final.get("global_acc") is None:
        return None
    personal = f", personal acc {final['personal_acc']:.4f}" if final.get("personal_acc") is not None else ""
    return f"global model acc {final['global_acc']:.4f}{personal}"
