"""`fedal export` and the agent's final ONNX files: a file at the deploy path is always one that
passed every step, the report beside it describes it, and no copy of other weights stays beside
it. Bad weights and options that would be ignored are refused."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fedal.models import build_model
from fedal_cli.main import cli

MLP = ["--model", "mlp", "--input-shape", "40", "--num-classes", "10"]


def export(*args: str):
    return CliRunner().invoke(cli, ["export", *args])


def checkpoint(path: Path, poison: float | None = None, dtype: torch.dtype | None = None, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    state = build_model("mlp", (40,), 10).state_dict()
    name = next(iter(state))
    if poison is not None:
        state[name].view(-1)[0] = poison
    if dtype is not None:
        state[name] = state[name].to(dtype)
    torch.save(state, path)
    return path


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_rerun_whose_check_fails_leaves_the_earlier_export_as_it_was(tmp_path, monkeypatch):
    """The new model was written over --out before the checks: a failed parity check left it at
    the deploy path, beside the earlier report (which said its parity passed) and int8 copy."""
    out = tmp_path / "deploy" / "mlp.onnx"
    first = export(*MLP, "--checkpoint", str(checkpoint(tmp_path / "a.pt")), "--out", str(out), "--check",
                   "--quantize", "int8")
    assert first.exit_code == 0, first.output
    before = files(out.parent)
    assert set(before) == {"mlp.onnx", "mlp.onnx.json", "mlp.int8.onnx"}

    import export.parity as parity

    def fails(*_args, **_kwargs):
        raise parity.ParityError(f"ONNX and torch outputs differ by up to 3 > atol=0.0001 ({out.parent}/x)")

    monkeypatch.setattr(parity, "check_parity", fails)
    again = export(*MLP, "--checkpoint", str(checkpoint(tmp_path / "b.pt", seed=1)), "--out", str(out), "--check",
                   "--quantize", "int8")
    assert again.exit_code == 1 and "parity check failed" in again.output
    assert files(out.parent) == before  # no work folder left either

    import export.quantize as quantize

    monkeypatch.setattr(parity, "check_parity", lambda *a, **k: 0.0)
    monkeypatch.setattr(quantize, "quantize_int8", lambda *a, **k: (_ for _ in ()).throw(ValueError("scale issue")))
    third = export(*MLP, "--checkpoint", str(checkpoint(tmp_path / "c.pt", seed=2)), "--out", str(out), "--check",
                   "--quantize", "int8")
    assert third.exit_code == 1 and "int8 quantization failed: scale issue" in third.output
    assert files(out.parent) == before


def test_an_export_without_quantize_removes_the_earlier_int8_copy(tmp_path):
    out = tmp_path / "mlp.onnx"
    assert export(*MLP, "--out", str(out), "--quantize", "int8").exit_code == 0
    int8 = tmp_path / "mlp.int8.onnx"
    assert int8.is_file()
    result = export(*MLP, "--checkpoint", str(checkpoint(tmp_path / "a.pt", seed=3)), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert not int8.exists() and f"removed {int8}" in result.output
    assert json.loads((tmp_path / "mlp.onnx.json").read_text())["int8"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "mlp.onnx", "mlp.onnx.json"]


def test_an_int8_file_the_earlier_export_did_not_write_is_left_alone(tmp_path):
    """Only the int8 copy the earlier export's report names (by its digest) goes: a file at that
    name may be another export's --out, or a user's own quantization (whose metadata carries the
    toolkit's mark across), and neither is this command's to remove."""
    own = tmp_path / "mlp.int8.onnx"
    assert export(*MLP, "--out", str(own)).exit_code == 0  # an export of its own, at that name
    result = export(*MLP, "--out", str(tmp_path / "mlp.onnx"))
    assert result.exit_code == 0 and own.is_file() and "left as it is" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.int8.onnx", "mlp.int8.onnx.json", "mlp.onnx",
                                                          "mlp.onnx.json"]

    refused = export(*MLP, "--out", str(tmp_path / "mlp.onnx"), "--quantize", "int8")  # nor written over
    assert refused.exit_code == 2 and "is never overwritten" in refused.output and own.is_file(), refused.output
    own.unlink()  # (moved away by its owner)
    (tmp_path / "mlp.int8.onnx.json").unlink()
    assert export(*MLP, "--out", str(tmp_path / "mlp.onnx"), "--quantize", "int8").exit_code == 0
    users = (tmp_path / "mlp.onnx").read_bytes()  # the user's own int8 copy: other bytes, the mark kept
    own.write_bytes(users)
    result = export(*MLP, "--checkpoint", str(checkpoint(tmp_path / "a.pt", seed=3)), "--out", str(tmp_path / "mlp.onnx"))
    assert result.exit_code == 0 and own.read_bytes() == users and "left as it is" in result.output, result.output
    # with --quantize the same file is not written over either (it was, carrying the mark)
    again = export(*MLP, "--out", str(tmp_path / "mlp.onnx"), "--quantize", "int8")
    assert again.exit_code == 2 and "is never overwritten" in again.output and own.read_bytes() == users


def test_the_int8_copy_named_by_a_report_without_its_digest_is_still_removed(tmp_path):
    """A report written before digests were recorded names its int8 copy by path and size."""
    out = tmp_path / "mlp.onnx"
    assert export(*MLP, "--out", str(out), "--quantize", "int8").exit_code == 0
    report = json.loads((tmp_path / "mlp.onnx.json").read_text())
    del report["int8"]["sha256"]
    (tmp_path / "mlp.onnx.json").write_text(json.dumps(report))
    result = export(*MLP, "--checkpoint", str(checkpoint(tmp_path / "a.pt", seed=3)), "--out", str(out))
    assert result.exit_code == 0 and f"removed {tmp_path / 'mlp.int8.onnx'}" in result.output, result.output


@pytest.mark.parametrize("poison, dtype, message", [
    (float("nan"), None, "holds NaN or infinite values"),
    (float("inf"), None, "holds NaN or infinite values"),
    (None, torch.int64, "not a floating-point tensor"),
    (None, torch.complex64, "not a floating-point tensor"),
])
def test_weights_that_are_not_finite_floats_are_refused(tmp_path, poison, dtype, message):
    result = export(*MLP, "--checkpoint", str(checkpoint(tmp_path / "bad.pt", poison, dtype)), "--out",
                    str(tmp_path / "mlp.onnx"))
    assert result.exit_code == 1 and message in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt"]


@pytest.mark.parametrize("args, message", [
    (["--opset", "9", "--quantize", "int8"], "--quantize int8 needs --opset 11"),
    (["--channel-multiple", "16"], "--channel-multiple applies to models with 1-D convolutions"),
])
def test_options_that_would_not_hold_are_usage_errors(tmp_path, args, message):
    result = export(*MLP, "--out", str(tmp_path / "mlp.onnx"), *args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert list(tmp_path.iterdir()) == []


def test_threads_apply_to_the_parity_check(tmp_path, monkeypatch):
    import export.parity as parity

    asked: list[int] = []
    real = parity.session_options

    def recording(threads):
        asked.append(threads)
        return real(threads)

    monkeypatch.setattr(parity, "session_options", recording)
    result = export(*MLP, "--out", str(tmp_path / "mlp.onnx"), "--check", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert asked == [1]


def test_a_full_disk_is_not_retried_with_the_other_exporter(tmp_path, monkeypatch):
    import export.onnx_export as onnx_export

    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(onnx_export, "_export_legacy", full)
    monkeypatch.setattr(onnx_export, "_export_dynamo", lambda *a: pytest.fail("retried with dynamo"))
    model = build_model("mlp", (40,), 10)
    with pytest.raises(OSError):
        onnx_export.export_onnx(model, torch.zeros(2, 40), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []  # nor a temporary file


def test_node_times_refuses_zero_runs(tmp_path):
    from export import export_onnx
    from export.session import node_times

    path = export_onnx(build_model("mlp", (40,), 10), torch.zeros(2, 40), tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="runs must be >= 1"):
        node_times(path, np.zeros((2, 40), np.float32), runs=0)


def test_the_agents_final_onnx_files_are_this_runs_or_none(tmp_path, monkeypatch):
    """An earlier run's model.int8.onnx stayed beside this run's model.pt when this run wrote no
    int8 copy; a full card mid-export was logged as 'could not export' and the run marked complete."""
    from edge_agent.inference import write_final_onnx

    final = tmp_path / "final"
    final.mkdir()
    model = build_model("mlp", (40,), 10)
    example = np.random.default_rng(0).normal(size=(64, 40)).astype(np.float32)
    assert [p.name for p in write_final_onnx(model, example, final, int8=True)] == ["model.onnx", "model.int8.onnx"]
    written = write_final_onnx(build_model("mlp", (40,), 10), example, final, int8=False)
    assert [p.name for p in written] == ["model.onnx"] and sorted(p.name for p in final.iterdir()) == ["model.onnx"]

    import export.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "_export_legacy",
                        lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(OSError):  # the agent exits 75 and its restart writes them
        write_final_onnx(model, example, final, int8=False)
    assert list(final.iterdir()) == []  # neither the earlier run's model nor a torn one


def test_an_exported_model_gets_a_plain_writes_mode_or_keeps_the_one_it_replaces(tmp_path):
    """It was always 0600 (the temporary file's), beside an int8 copy and a report of 0644: the
    model shipped to devices was unreadable to an agent's service account or a web server, and a
    re-export made a 0644 model 0600."""
    from export import export_onnx

    model, example = build_model("mlp", (40,), 10), torch.zeros(2, 40)
    old = os.umask(0o022)
    try:
        path = export_onnx(model, example, tmp_path / "m.onnx")
        assert oct(path.stat().st_mode & 0o777) == "0o644"
        path.chmod(0o640)
        export_onnx(model, example, path)
        assert oct(path.stat().st_mode & 0o777) == "0o640"
    finally:
        os.umask(old)


def test_a_refused_out_says_only_why(tmp_path):
    """A refused --out printed "note: no --checkpoint, exporting untrained weights" first, for an
    export that was not going to happen."""
    mine = tmp_path / "mine.onnx"
    mine.write_bytes(b"a user's file")
    refused = export(*MLP, "--out", str(mine))
    assert refused.exit_code == 2 and "untrained" not in refused.output, refused.output
    assert mine.read_bytes() == b"a user's file"
    made = export(*MLP, "--out", str(tmp_path / "m.onnx"))
    assert made.exit_code == 0 and "note: no --checkpoint, exporting untrained weights" in made.output, made.output
