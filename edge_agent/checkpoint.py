"""Atomic checkpoints: a crash mid-write leaves the previous checkpoint intact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedal.atomic import torch_save_atomic as save_atomic

__all__ = ["save_atomic", "load"]


def load(path: Path) -> Any | None:
    """The checkpoint's content, or None if there is none. Only tensors and plain data are
    accepted (weights_only), so a tampered file cannot run code."""
    if not path.exists():
        return None
    return torch.load(path, weights_only=True)
