"""Load a checkpoint into a zoo model, refusing mismatches with a message a user can act on.

Exporting the wrong weights (another model's, a different num_classes) must fail loudly:
torch's own strict-load error is a wall of text, so the first problem is named here instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

__all__ = ["load_checkpoint"]


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike[str]) -> torch.nn.Module:
    """Load `path` (a state_dict saved with torch.save, e.g. an agent's final/model.pt) into `model`.

    Uses `torch.load(weights_only=True)` (no pickled code runs) and a strict load. Raises
    FileNotFoundError if the file is missing and ValueError for an unreadable file, something
    that is not a state_dict, missing/unexpected keys, or the first shape mismatch.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle/zip errors, non-weights content
        raise ValueError(f"cannot read checkpoint {path}: {exc}") from None
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint {path} is not a state_dict (a mapping of names to tensors)")

    name = getattr(model, "name", type(model).__name__)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {_short(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {_short(unexpected)}")
        raise ValueError(f"checkpoint {path} does not match model {name}: " + "; ".join(parts))
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint {path} does not match model {name}: {key} has shape "
                             f"{tuple(state[key].shape)} in the checkpoint but {tuple(tensor.shape)} "
                             f"in the model (different model, input shape or num_classes?)")
    model.load_state_dict(state, strict=True)
    return model


def _short(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")
