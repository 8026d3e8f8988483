"""Outputs go where the user says, and never over a file the toolkit did not write: a results
file, a plot, an exported model or its report of an earlier run is replaced (a run repeated into
the same path); any other file there is refused before the run, untouched."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import numpy as np
import pytest
from click.testing import CliRunner

from fedal.owned import ForeignFile, check_replaceable, is_export_report, is_our_onnx, is_our_plot, is_results
from fedal_cli.main import cli

QUICK = ["--dataset", "digits", "--clients", "2", "--rounds", "1", "--strategy", "fedmd", "--public-size", "60", "--quiet"]


def test_simulate_replaces_its_own_outputs_and_refuses_anyone_elses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = CliRunner().invoke(cli, ["simulate", *QUICK, "--plot", "acc.png"])  # default --out results.json
    assert first.exit_code == 0, first.output
    assert is_results(tmp_path / "results.json") and is_our_plot(tmp_path / "acc.png")
    again = CliRunner().invoke(cli, ["simulate", *QUICK, "--seed", "3", "--plot", "acc.png"])  # its own: replaced
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "results.json").read_text())["config"]["seed"] == 3

    (tmp_path / "mine.json").write_text('{"user": "results of another tool"}\n')
    (tmp_path / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n a figure of the user's")
    for extra, option in ((["--out", "mine.json"], "--out"), (["--out", "r2.json", "--plot", "figure.png"], "--plot")):
        r = CliRunner().invoke(cli, ["simulate", *QUICK, *extra])
        assert r.exit_code == 2, r.output
        assert f"Invalid value for {option}" in r.stderr and "is not a" in r.stderr and "this toolkit wrote" in r.stderr
    assert (tmp_path / "mine.json").read_text() == '{"user": "results of another tool"}\n'
    assert (tmp_path / "figure.png").read_bytes() == b"\x89PNG\r\n\x1a\n a figure of the user's"
    assert not (tmp_path / "r2.json").exists()


def _export(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedal_cli.main", "export", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180)


def test_export_replaces_its_own_files_and_refuses_anyone_elses(tmp_path):
    args = ["--model", "mlp", "--input-shape", "40", "--num-classes", "10", "--out", "m.onnx", "--quantize", "int8"]
    assert _export(*args, cwd=tmp_path).returncode == 0
    assert is_our_onnx(tmp_path / "m.onnx") and is_our_onnx(tmp_path / "m.int8.onnx")
    assert is_export_report(tmp_path / "m.onnx.json")
    again = _export(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    for name in ("m.onnx", "m.int8.onnx", "m.onnx.json"):  # each alone is in the way
        kept = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(b"the user's own " + name.encode())
        r = _export(*args, cwd=tmp_path)
        assert r.returncode == 2 and "refusing to overwrite it" in r.stderr and name in r.stderr, r.stderr
        assert (tmp_path / name).read_bytes() == b"the user's own " + name.encode()
        (tmp_path / name).write_bytes(kept)


def test_the_coordinator_refuses_a_results_file_it_did_not_write(tmp_path):
    from coordinator.cli import check_files
    from coordinator.config import load_coordinator_config

    np.savez(tmp_path / "public.npz", x=np.zeros((20, 40), np.float32))
    state = tmp_path / "state"
    state.mkdir()
    (state / "results.json").write_text("my thesis numbers\n")
    config = load_coordinator_config(None, run_id="r", client_ids=["a", "b"], num_classes=10,
                                     public_file=tmp_path / "public.npz", state_dir=state)
    with pytest.raises(click.UsageError, match="results_file: .*results.json exists and is not a results file"):
        check_files(config)
    (state / "results.json").write_text(json.dumps({"config": {}, "rounds": [], "final": {}}))
    check_files(config)  # a run's results (an earlier run's): the next run may replace them


def test_what_is_not_a_file_of_ours_is_foreign(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "real.json").write_text(json.dumps({"config": {}, "rounds": [], "final": {}}))
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    check_replaceable(tmp_path / "new.json", is_results, "results file")  # nothing there
    check_replaceable(tmp_path / "real.json", is_results, "results file")
    for path in ("dir", "link.json"):  # a link is never written through
        with pytest.raises(ForeignFile):
            check_replaceable(tmp_path / path, is_results, "results file")


def test_a_file_in_a_demos_workspace_is_replaced_only_if_the_toolkit_wrote_it(tmp_path):
    """The demo's default outputs were taken as its own whatever they held: a results.json or an
    accuracy.png of the user's in the workspace was overwritten. Only files the toolkit wrote are
    replaced there, as anywhere (a plot from before plots carried the mark is refused once)."""
    import json

    from fedal import workspace
    from fedal_cli.simulate import check_outputs

    ws = workspace.claim(tmp_path / "ws", "fedal demo")
    check_outputs(ws / "results.json", ws / "accuracy.png", None)  # nothing there yet
    (ws / "results.json").write_text("my precious notes\n")
    (ws / "accuracy.png").write_bytes(b"\x89PNG\r\n\x1a\n not the toolkit's")
    with pytest.raises(click.BadParameter, match="this toolkit wrote"):
        check_outputs(ws / "results.json", tmp_path / "elsewhere.png", None)
    with pytest.raises(click.BadParameter, match="this toolkit wrote"):
        check_outputs(tmp_path / "elsewhere.json", ws / "accuracy.png", None)
    assert (ws / "results.json").read_text() == "my precious notes\n"
    (ws / "results.json").write_text(json.dumps({"config": {}, "rounds": [], "final": {}}))  # an earlier run's: replaced
    check_outputs(ws / "results.json", tmp_path / "elsewhere.png", None)


def test_plots_are_recognised_by_their_creator_not_by_the_letters_anywhere(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedal.owned import MARKED_PLOT_FORMATS
    from fedal.sim.plot import plot_accuracy

    results = {"config": {"strategy_params": {"tau": 5}}, "rounds": [{"round": 1, "mean_acc": 0.1}]}
    for fmt in MARKED_PLOT_FORMATS:
        assert is_our_plot(plot_accuracy({"x": results}, tmp_path / f"ours.{fmt}")), fmt
        fig, ax = plt.subplots()  # the user's own figure, whose name holds the mark's letters
        ax.plot([1, 2])
        fig.savefig(tmp_path / f"fedal-edge-figure.{fmt}")
        plt.close(fig)
        assert not is_our_plot(tmp_path / f"fedal-edge-figure.{fmt}"), fmt
    assert not is_our_plot(plot_accuracy({"x": results}, tmp_path / "ours.jpg"))  # no metadata there: never
    assert not is_our_onnx(tmp_path / "ours.png")
