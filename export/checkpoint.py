"""Load a checkpoint into a zoo model, refusing mismatches with a message a user can act on.

Exporting the wrong weights (another model's, a different num_classes) must fail loudly:
torch's own strict-load error is a wall of text, so the first problem is named here instead.
"""

from __future__ import annotations

import os
import re
import warnings
import zipfile
from collections.abc import Mapping

import torch

__all__ = ["load_checkpoint"]


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike[str]) -> torch.nn.Module:
    """Load `path` (a state_dict saved with torch.save, e.g. an agent's final/model.pt) into `model`.

    Uses `torch.load(weights_only=True)` (no pickled code runs) and a strict load. Raises
    FileNotFoundError if the file is missing and ValueError for an unreadable file, a file
    torch.load cannot read (e.g. a results .json), something that is not a state_dict,
    missing/unexpected keys, or the first shape mismatch. Every message is one line.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        with open(path, "rb") as fh:
            head = fh.read(_HEAD_BYTES)
    except OSError as exc:
        raise ValueError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4" for a plain pickle
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle/zip errors, non-weights content: torch's text is a page long
        raise ValueError(_unloadable(path, head, exc)) from None
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
        if tensor.is_floating_point() and not state[key].is_floating_point():  # complex would lose its
            raise ValueError(f"checkpoint {path}: {key} is {state[key].dtype}, not a floating-point "  # imaginary part
                             f"tensor as model {name} has it")
        if state[key].is_floating_point() and not bool(torch.isfinite(state[key]).all()):
            raise ValueError(f"checkpoint {path}: {key} holds NaN or infinite values (a diverged run?); "
                             "the exported model would answer NaN")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # e.g. meta tensors: torch's own message is a page long
        raise ValueError(f"checkpoint {path} does not load into model {name}: "
                         f"{next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), exc)}") from None
    return model


_HEAD_BYTES = 64
# How torch.save's legacy (non-zip) format starts: pickle protocol 2, then its magic number.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"


def _unloadable(path: str, head: bytes, exc: BaseException) -> str:
    """One line saying why torch.load(weights_only=True) refused `path`, instead of torch's page."""
    text = str(exc)
    found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if found:  # a real torch.save file, but of pickled objects (e.g. a whole model), not tensors
        return (f"{path} is not a state_dict checkpoint: it pickles {found.group(1)}, which "
                f"torch.load(weights_only=True) does not run; save model.state_dict() instead")
    if not head:
        reason = "the file is empty"
    elif zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError):
            names = None
        if names is None:
            reason = "a damaged zip archive"
        elif any(n.endswith("/data.pkl") for n in names):
            reason = _first_line(text)
        else:
            reason = "a zip archive without torch's data.pkl"
    elif head.startswith(b"PK\x03\x04"):
        reason = "a truncated or damaged zip archive"
    elif isinstance(exc, EOFError):
        reason = "the file ends early; truncated?"
    elif head.startswith(b"\x80") and not head.startswith(_LEGACY_MAGIC):
        reason = "a plain pickle, not torch.save's format"
    elif _is_text(head):
        start = " ".join(head.decode("utf-8", "replace").split())[:24]
        reason = f"it is a text file starting {start!r}"
    else:
        reason = _first_line(text)
    return f"{path} is not a model checkpoint saved by torch.save ({reason})"


def _is_text(head: bytes) -> bool:
    try:
        decoded = head.decode("utf-8")
    except UnicodeDecodeError:  # may be a multi-byte character cut at the end of the head
        decoded = head[:-3].decode("utf-8", "replace")
    return all(c.isprintable() or c in "\t\r\n" for c in decoded) and bool(decoded.strip())


def _first_line(text: str, limit: int = 120) -> str:
    """torch's own reason, shortened: the WeightsUnpickler detail if any, else the first line."""
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    if detail:
        text = detail.group(1)
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = f"torch.load: {line}" if line else "torch.load failed"
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _short(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")
