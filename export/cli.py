"""`fedal export`: a zoo model (optionally with trained weights) to ONNX, checked, optionally int8.

One command so a deployment is one reproducible step: the agent ships the .onnx (or
.int8.onnx) and the JSON report records what was checked (parity, int8 accuracy cost).
Bad arguments exit 2 (click.UsageError); failed checks or unusable files exit 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from export.onnx_export import MAX_OPSET, MIN_OPSET
from fedal import procs
from fedal.model_names import MAX_NUM_CLASSES
from fedal.models import MODEL_NAMES
from fedal.owned import ForeignFile, check_replaceable, is_export_report, is_our_onnx

DATASETS = ("mnist1d", "digits")
PARITY_ATOL = 1e-4
PARITY_RANDOM_ROWS = 16
PARITY_REAL_ROWS = 256
STATIC_INT8_MIN_OPSET = 13  # per-channel QDQ: DequantizeLinear's axis attribute arrived in opset 13
INT8_MIN_OPSET = 11  # onnxruntime's quantiser writes opset 11 at least: a lower --opset would not hold for the int8 file
STAGE_PREFIX = ".fedal-export-"  # the work folder beside --out, removed at the end (or by the next run if killed)


def _check_opset(ctx: click.Context, param: click.Parameter, value: int) -> int:
    """Refuse an opset the exporter cannot write while parsing, before any work is done."""
    if not MIN_OPSET <= value <= MAX_OPSET:
        raise click.BadParameter(f"{value} is not supported: the exporter writes opsets {MIN_OPSET} to "
                                 f"{MAX_OPSET}")
    return value


def _one_line(message: str) -> str:
    """The first non-empty line of an error message: the command promises one-line errors."""
    return next((line.strip() for line in message.splitlines() if line.strip()), message.strip())


MAX_INPUT_VALUES = 1 << 24  # per sample: a 3x2048x2048 image is 12.6 M


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise click.UsageError(f"--input-shape must be positive integers like 1,8,8, got {text!r}")
    if math.prod(shape) > MAX_INPUT_VALUES:  # the parity check's random rows would not fit in memory
        raise click.UsageError(f"--input-shape {text} is {math.prod(shape):,} values per sample, more than "
                               f"{MAX_INPUT_VALUES:,}")
    return shape


@click.command("export")
@click.option("--model", "model_name", required=True, type=click.Choice(MODEL_NAMES), help="Zoo model name.")
@click.option("--checkpoint", type=click.Path(exists=True, dir_okay=False),
              help="state_dict file (torch.save), e.g. an agent's final/model.pt. Default: untrained weights.")
@click.option("--dataset", type=click.Choice(DATASETS),
              help="Gives input shape/classes and real samples for parity, calibration and int8 accuracy.")
@click.option("--input-shape", help="Per-sample shape, e.g. 1,8,8 (required without --dataset).")
@click.option("--num-classes", type=int, help="Number of classes (required without --dataset).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Output .onnx file.")
@click.option("--opset", type=int, default=17, show_default=True, callback=_check_opset,
              help=f"ONNX opset, {MIN_OPSET} to {MAX_OPSET} (static int8 needs {STATIC_INT8_MIN_OPSET}+).")
@click.option("--quantize", type=click.Choice(["int8"]), help="Also write <out stem>.int8.onnx.")
@click.option("--quantize-mode", type=click.Choice(["dynamic", "static"]),
              help="int8 mode. Default: static (QDQ, calibrated on the train split) with --dataset, else dynamic.")
@click.option("--check", is_flag=True, help=f"Fail unless ONNX matches torch within {PARITY_ATOL:g}.")
@click.option("--threads", type=int, help="onnxruntime intra-op threads for the checks. Default: all cores.")
@click.option("--channel-multiple", type=click.IntRange(min=0),
              help="1-D models: pad channels between convolutions to this multiple (0: none). Default: 16 "
                   "if this machine's onnxruntime has NCHWc kernels, else 0; set it for the target device.")
def export_cmd(model_name, checkpoint, dataset, input_shape, num_classes, out, opset, quantize,
               quantize_mode, check, threads, channel_multiple) -> None:
    """Export a zoo model to ONNX, optionally check parity and write an int8 copy."""
    import torch

    from export.checkpoint import load_checkpoint
    from export.layout import CHANNEL_MULTIPLE, has_1d_layers, nchwc_available
    from fedal.models import build_model

    if threads is not None and threads < 1:
        raise click.UsageError("--threads must be >= 1")
    if quantize_mode and not quantize:  # else it was ignored without a word
        raise click.UsageError("--quantize-mode applies to --quantize int8 only")
    if num_classes is not None and not 2 <= num_classes <= MAX_NUM_CLASSES:
        raise click.UsageError(f"--num-classes must be 2 to {MAX_NUM_CLASSES}, got {num_classes}")
    mode = quantize_mode or ("static" if dataset else "dynamic")
    if quantize and mode == "static" and not dataset:
        raise click.UsageError("--quantize-mode static needs --dataset for calibration samples")
    if quantize and opset < INT8_MIN_OPSET:
        raise click.UsageError(f"--quantize int8 needs --opset {INT8_MIN_OPSET} or later, got {opset} (onnxruntime's "
                               f"quantiser would write the int8 file at opset {INT8_MIN_OPSET} anyway)")
    if quantize and mode == "static" and opset < STATIC_INT8_MIN_OPSET:
        raise click.UsageError(f"static int8 (per-channel QDQ) needs --opset {STATIC_INT8_MIN_OPSET} or later, "
                               f"got {opset}; use --quantize-mode dynamic or a newer opset")
    train = test = None
    if dataset:
        from fedal.data import load_dataset

        train, test = load_dataset(dataset)
        data_shape, data_classes = tuple(train.x.shape[1:]), int(train.num_classes)
        if input_shape and _parse_shape(input_shape) != data_shape:
            raise click.UsageError(f"--input-shape {input_shape} contradicts dataset {dataset} "
                                   f"(per-sample shape {data_shape})")
        if num_classes is not None and num_classes != data_classes:
            raise click.UsageError(f"--num-classes {num_classes} contradicts dataset {dataset} "
                                   f"({data_classes} classes)")
        shape, classes = data_shape, data_classes
    else:
        if not input_shape or num_classes is None:
            raise click.UsageError("without --dataset, both --input-shape and --num-classes are required")
        shape, classes = _parse_shape(input_shape), num_classes

    try:
        model = build_model(model_name, shape, classes)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    except (RuntimeError, MemoryError) as exc:  # a model too large for this machine's memory
        raise click.ClickException(_one_line(f"{model_name} for input {list(shape)}: {exc}")) from None
    if checkpoint:
        try:
            load_checkpoint(model, checkpoint)
        except (ValueError, FileNotFoundError) as exc:
            raise click.ClickException(_one_line(str(exc))) from None
    model.eval()

    out = Path(out)
    report_path = Path(os.fspath(out) + ".json")
    int8_path = out.with_name(out.stem + ".int8.onnx")
    try:  # what this command writes, before it writes anything: only its own earlier files are replaced
        check_replaceable(out, is_our_onnx, "model")
        check_replaceable(report_path, is_export_report, "export report")
        if quantize:
            check_replaceable(int8_path, is_our_onnx, "model")
    except ForeignFile as exc:
        raise click.UsageError(str(exc)) from None
    earlier_int8 = _is_earlier_int8_copy(report_path, int8_path)  # (read before this export replaces the report)
    if quantize and (int8_path.exists() or int8_path.is_symlink()) and not earlier_int8:
        raise click.UsageError(f"{int8_path} is not the int8 copy the earlier export of {out} wrote (another "
                               "export's --out, or a quantization of your own): it is never overwritten; move it "
                               "away, or give another --out")
    if not checkpoint:  # (after the refusals: a refused command exports nothing)
        click.echo("note: no --checkpoint, exporting untrained weights", err=True)
    gen = torch.Generator().manual_seed(0)
    random_x = torch.randn(PARITY_RANDOM_ROWS, *shape, generator=gen)
    if channel_multiple is not None and not has_1d_layers(model):  # else it was ignored without a word
        raise click.UsageError(f"--channel-multiple applies to models with 1-D convolutions; {model_name} has none")
    if has_1d_layers(model) and channel_multiple is None:
        channel_multiple = CHANNEL_MULTIPLE if nchwc_available() else 0
    try:  # everything is written and checked in a work folder beside --out first: a failed check or
        out.parent.mkdir(parents=True, exist_ok=True)  # export leaves the earlier files as they were
        stage = Path(procs.pid_dir(out.parent, STAGE_PREFIX))
    except OSError as exc:
        raise click.ClickException(_one_line(f"cannot write beside {out}: {exc.strerror or exc}")) from None
    try:
        job = ExportJob(model, model_name, shape, classes, checkpoint, dataset, out, opset, check, quantize, mode,
                        threads, channel_multiple, random_x, train, test)
        staged = _export_staged(job, stage)
        for path, final in staged:
            os.replace(path, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if not quantize and earlier_int8:
        int8_path.unlink()  # the earlier export's int8 copy of other weights: it no longer matches --out
        click.echo(f"removed {int8_path} (the earlier export's int8 copy; --quantize int8 writes a new one)")
    elif not quantize and (int8_path.exists() or int8_path.is_symlink()):
        click.echo(f"note: {int8_path} is not the int8 copy the earlier export of {out} wrote: left as it is")
    click.echo(f"wrote {out} ({out.stat().st_size} bytes) and {report_path}")


def _file_sha256(path: Path) -> str | None:
    """A regular file's digest (None: none there, a link, unreadable)."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None


def _is_earlier_int8_copy(report_path: Path, int8_path: Path) -> bool:
    """`int8_path` holds the int8 copy the earlier export's report says it wrote there: only that
    file is this command's to replace or remove (a file at that name may be another export's
    `--out`, or a user's own quantization, whose metadata carries the toolkit's mark across). By
    its SHA-256; a report written before digests were recorded, by its size."""
    try:
        entry = json.loads(report_path.read_bytes()).get("int8")
    except (OSError, ValueError, AttributeError, RecursionError):
        return False
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return False
    if Path(entry["path"]).name != int8_path.name or int8_path.is_symlink() or not int8_path.is_file():
        return False  # (the report sits beside it; the path as --out was given)
    if isinstance(entry.get("sha256"), str):
        return _file_sha256(int8_path) == entry["sha256"]
    return type(entry.get("bytes")) is int and int8_path.stat().st_size == entry["bytes"]


@dataclass(frozen=True)
class ExportJob:
    """What one `fedal export` writes and checks, as its options and the built model say."""

    model: Any
    model_name: str
    shape: tuple[int, ...]
    classes: int
    checkpoint: str | None
    dataset: str | None
    out: Path
    opset: int
    check: bool
    quantize: str | None
    mode: str
    threads: int | None
    channel_multiple: int | None
    random_x: Any  # the parity check's random rows (their first two: the export's example)
    train: Any  # the dataset's splits (None without --dataset): calibration, real parity rows, int8 accuracy
    test: Any


def _export_staged(job: ExportJob, stage: Path) -> list[tuple[Path, Path]]:
    """The model, its int8 copy and the report written into `stage` and checked: (staged, final) pairs."""
    import torch

    from export.layout import has_1d_layers
    from export.onnx_export import export_onnx, written_opset
    from export.parity import ParityError, check_parity
    from export.quantize import accuracy_delta, quantize_int8

    report_path = Path(os.fspath(job.out) + ".json")
    int8_path = job.out.with_name(job.out.stem + ".int8.onnx")
    onnx_file, int8_file, report_file = stage / job.out.name, stage / int8_path.name, stage / report_path.name
    try:
        export_onnx(job.model, job.random_x[:2], onnx_file, opset=job.opset, channel_multiple=job.channel_multiple)
    except Exception as exc:
        raise click.ClickException(_one_line(f"ONNX export of {job.model_name} failed: {exc}")) from None
    report: dict = {"model": job.model_name, "input_shape": list(job.shape), "num_classes": job.classes,
                    "checkpoint": job.checkpoint, "dataset": job.dataset,
                    # read back from the file, so the report cannot disagree with it
                    "opset": written_opset(onnx_file), "onnx": str(job.out),
                    "onnx_bytes": onnx_file.stat().st_size, "parity_max_diff": None, "int8": None,
                    # 1-D conv stacks are exported as 2-D; null: the model has none
                    "conv1d_channel_multiple": job.channel_multiple if has_1d_layers(job.model) else None}

    if job.check:
        try:
            diffs = [check_parity(job.model, onnx_file, job.random_x, atol=PARITY_ATOL, threads=job.threads)]
            if job.test is not None:
                diffs.append(check_parity(job.model, onnx_file, torch.from_numpy(job.test.x[:PARITY_REAL_ROWS]),
                                          atol=PARITY_ATOL, threads=job.threads))
        except ParityError as exc:
            raise click.ClickException(_one_line(f"parity check failed: {exc}".replace(str(stage / job.out.name),
                                                                                       str(job.out)))) from None
        report["parity_max_diff"] = max(diffs)
        click.echo(f"parity ok: max |onnx - torch| = {max(diffs):.2e} (atol {PARITY_ATOL:g})")

    staged = [(onnx_file, job.out)]
    if job.quantize:
        try:
            quantize_int8(onnx_file, int8_file, mode=job.mode, calibration=None if job.train is None else job.train.x)
        except Exception as exc:
            raise click.ClickException(_one_line(f"int8 quantization failed: {exc}")) from None
        report["int8"] = {"path": str(int8_path), "mode": job.mode, "bytes": int8_file.stat().st_size,
                          "sha256": _file_sha256(int8_file),
                          "opset": written_opset(int8_file), "accuracy": None}
        if job.test is not None:
            try:
                acc = accuracy_delta(onnx_file, int8_file, job.test.x, job.test.y, threads=job.threads)
            except Exception as exc:
                raise click.ClickException(_one_line(f"int8 accuracy check failed: {exc}")) from None
            report["int8"]["accuracy"] = acc
        click.echo(f"wrote {int8_path} ({job.mode}, {int8_file.stat().st_size} bytes)")
        if job.test is not None:
            acc = report["int8"]["accuracy"]
            click.echo(f"{job.dataset} test accuracy: fp32 {acc['fp32_acc']:.4f}, int8 {acc['int8_acc']:.4f} "
                       f"({acc['delta_points']:+.2f} points)")
        staged.append((int8_file, int8_path))
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    return [*staged, (report_file, report_path)]  # the report last: it describes the files before it
