"""Export a model to ONNX with a dynamic batch axis, for onnxruntime on the edge agents.

Exporter choice (checked on torch 2.13 with every zoo model, opset 17):

* The legacy TorchScript exporter (`dynamo=False` + `dynamic_axes`) is used first. It
  honours the requested opset, exports every zoo model with a symbolic batch dimension
  in well under two seconds (resnet18) and takes the same arguments from torch 2.10 (the
  Pi builds) to 2.13. Its only noise is DeprecationWarnings, which are filtered here.
* The dynamo exporter (`dynamo=True` + `dynamic_shapes`) is only a fallback for when the
  legacy one is gone or fails. It also exports every zoo model with parity, but it always
  builds opset 18 and then tries to down-convert: for models with global average pooling
  (smallcnn, the WRNs, resnet18) that conversion fails (logging a traceback) and the file
  silently stays at opset 18. It is also 5-10x slower (1-5 s per model) and chatty
  (stdout progress, warnings, logs), which `_quiet` suppresses. A batch of 1 in the example
  would make it specialise the batch dimension, so the example always has >= 2 rows.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx
import torch

from fedal.atomic import temporary_beside, write_bytes_atomic
from fedal.owned import MARK

from .layout import CHANNEL_MULTIPLE, has_1d_layers, lift_1d_to_2d, nchwc_available

__all__ = ["export_onnx", "written_opset", "INPUT_NAME", "OUTPUT_NAME", "BATCH_AXIS_NAME", "MIN_OPSET",
           "MAX_OPSET"]

# The opsets export_onnx accepts: the legacy TorchScript exporter's range in torch 2.10-2.13
# (torch.onnx._constants.ONNX_MIN_OPSET .. ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET). Below 7
# onnxruntime does not guarantee to run the file; above 20 torch warns that the opset is not
# supported by this exporter. Anything else is refused instead of being handed to the dynamo
# fallback, which would silently write opset 18.
MIN_OPSET = 7
MAX_OPSET = 20

INPUT_NAME = "input"
OUTPUT_NAME = "logits"
BATCH_AXIS_NAME = "batch"

_log = logging.getLogger(__name__)


def export_onnx(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    path: str | os.PathLike[str],
    opset: int = 17,
    conv1d_as_2d: bool = True,
    channel_multiple: int | None = None,
    mark: bool = True,
) -> Path:
    """Write `model` as ONNX to `path` and return it as a Path, after `onnx.checker` passes.

    The graph has one input "input" and one output "logits", both with a dynamic batch axis
    (dimension 0, named "batch"). `example_input` is a batch [B, *input_shape]; only its
    per-sample shape and dtype matter. The model is exported in eval mode (BatchNorm uses
    its running statistics); its previous train/eval mode is restored afterwards.

    With `conv1d_as_2d` (the default) 1-D conv stacks are exported as unit-height 2-D ones
    (`export.layout`): same outputs, but onnxruntime runs them with its blocked NCHWc kernels
    instead of a per-sample im2col path that is slower than torch. Channels between two such
    convolutions are zero-padded to a multiple of `channel_multiple`; None means
    `CHANNEL_MULTIPLE` where this machine's onnxruntime has NCHWc kernels, else no padding
    (export on the device that will run the file, or pass the value for that device).
    The model passed in is not modified.

    `opset` must be in MIN_OPSET..MAX_OPSET (ValueError otherwise). The file normally has that
    opset; if the legacy exporter fails, the dynamo fallback may leave it at 18 (a warning is
    logged): `written_opset(path)` tells what was written. `mark`: record in its metadata that the
    toolkit wrote it (mark_onnx), so a later export may replace it (fedal.owned).
    """
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset {opset!r} is not supported: choose {MIN_OPSET} to {MAX_OPSET}")
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise ValueError("example_input must be a batched tensor [B, *input_shape]")
    if example_input.shape[0] < 1:
        raise ValueError("example_input must hold at least one sample")
    expected = getattr(model, "input_shape", None)
    if expected is not None and tuple(example_input.shape[1:]) != tuple(expected):
        raise ValueError(
            f"example_input has per-sample shape {tuple(example_input.shape[1:])}, "
            f"but the model expects {tuple(expected)}"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the mode of the file it replaces, or of a plain write (an agent's service account, a web
    # server, a container reads the model that is shipped)
    fd, tmp_name = temporary_beside(path)
    os.close(fd)
    tmp = Path(tmp_name)  # written, marked and checked here; `path` is replaced only by a file that passed
    try:
        mode = stat.S_IMODE(tmp.stat().st_mode)
        with contextlib.suppress(FileNotFoundError):
            mode = stat.S_IMODE(os.stat(path).st_mode)
        _export_checked(model, example_input, tmp, opset, conv1d_as_2d, channel_multiple, mark)
        os.chmod(tmp, mode)  # (the exporter may write the file anew)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    actual = written_opset(path)
    if actual != opset:
        _log.warning("ONNX file %s has opset %d instead of the requested %d", path, actual, opset)
    return path


def _export_checked(model: torch.nn.Module, example_input: torch.Tensor, path: Path, opset: int, conv1d_as_2d: bool,
                    channel_multiple: int | None, mark: bool) -> None:
    example = example_input.detach()
    if example.shape[0] == 1:
        # Size-1 dims get specialised by torch.export; two rows keep the batch axis symbolic.
        example = torch.cat([example, example])

    was_training = model.training
    model.eval()
    try:
        traced = model
        if conv1d_as_2d and has_1d_layers(model):
            if channel_multiple is None:
                channel_multiple = CHANNEL_MULTIPLE if nchwc_available() else 0
            traced = lift_1d_to_2d(model, channel_multiple)
        with torch.no_grad():
            try:
                _export_legacy(traced, example, path, opset)
            except OSError:  # the disk, not the exporter: the other exporter would fail alike
                raise
            except Exception as exc:  # legacy exporter removed or unable to trace the model
                _log.warning("legacy ONNX export failed (%s); retrying with dynamo", exc)
                _export_dynamo(traced, example, path, opset)
    finally:
        model.train(was_training)

    if mark:  # a file for someone else (fedal export, an agent's final model); not a per-round snapshot
        mark_onnx(path)
    # Path form lets the checker handle external data; full_check also runs shape inference.
    onnx.checker.check_model(str(path), full_check=True)


def mark_onnx(path: str | os.PathLike[str]) -> None:
    """Record in the file's metadata that this toolkit wrote it (fedal.owned: a later export to
    the same path may replace it; a file without the mark is refused)."""
    proto = onnx.load(str(path))
    if not any(p.key == "producer" and p.value == MARK for p in proto.metadata_props):
        entry = proto.metadata_props.add()
        entry.key, entry.value = "producer", MARK
        write_bytes_atomic(path, proto.SerializeToString())  # never a torn model at `path`


def written_opset(path: str | os.PathLike[str]) -> int:
    """The opset of the default ONNX domain ("" / "ai.onnx") that the file at `path` imports."""
    proto = onnx.load(str(path), load_external_data=False)
    versions = {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")}
    if len(versions) != 1:
        raise ValueError(f"ONNX file {path} imports {len(versions)} versions of the default opset domain")
    return versions.pop()


def _export_legacy(model: torch.nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    with warnings.catch_warnings():
        # "You are using the legacy TorchScript-based ONNX export" and friends; tracer notes.
        for category in (DeprecationWarning, FutureWarning, torch.jit.TracerWarning):
            warnings.simplefilter("ignore", category)
        # Opsets 7-8: torch keeps the initializers as graph inputs (valid ONNX IR 3) and says so.
        warnings.filterwarnings("ignore", message=".*keep_initializers_as_inputs", category=UserWarning)
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_axes={INPUT_NAME: {0: BATCH_AXIS_NAME}, OUTPUT_NAME: {0: BATCH_AXIS_NAME}},
            opset_version=opset,
            do_constant_folding=True,
        )


def _export_dynamo(model: torch.nn.Module, example: torch.Tensor, path: Path, opset: int) -> None:
    batch = torch.export.Dim(BATCH_AXIS_NAME)
    with _quiet():
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=True,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},),
            opset_version=opset,
            external_data=False,  # one self-contained file to ship to the agents
            verbose=False,
        )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the dynamo exporter's progress prints, warnings and opset-conversion logs."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "onnxscript")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
