"""A run that needs an extra that is not installed says which one, in a line: any missing
module was blamed on the `ray` extra by `fedal simulate`, and `fedal demo` gave a traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fedal_cli.extras import missing_module_message
from fedal_cli.main import cli


@pytest.mark.parametrize("module, extra", [("scipy.io", "sim"), ("PIL", "sim"), ("mnist1d", "sim"), ("ray", "ray"),
                                           ("opacus", "privacy"), ("onnxruntime", "export")])
def test_a_missing_module_names_the_extra_that_brings_it(module, extra):
    message = missing_module_message(ModuleNotFoundError(f"No module named '{module}'", name=module))
    assert f"pip install 'fedal-edge[{extra}]'" in message and "\n" not in message


def test_the_toolkits_own_advice_is_kept_and_an_unknown_module_gets_the_whole_set():
    own = ImportError("reading image datasets needs Pillow: pip install 'fedal-edge[sim]' (or pillow)")
    assert missing_module_message(own) == str(own)
    assert "fedal-edge[all]" in missing_module_message(ModuleNotFoundError("No module named 'x'", name="x"))


@pytest.mark.parametrize("command", ["simulate", "demo"])
def test_the_commands_say_it_in_a_line(command, monkeypatch, tmp_path):
    def missing(*_args, **_kwargs):
        raise ModuleNotFoundError("No module named 'scipy'", name="scipy")

    if command == "simulate":
        monkeypatch.setattr("fedal.sim.runner.simulate", missing)
        args = ["simulate", "--dataset", "digits", "--clients", "2", "--rounds", "1", "--out", str(tmp_path / "r.json")]
    else:
        monkeypatch.setattr("fedal_cli.demo.run_demo", missing)
        args = ["demo", "--dataset", "digits", "--clients", "2", "--rounds", "1", "--workdir", str(tmp_path / "w")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    assert "it comes with the `sim` extra (pip install 'fedal-edge[sim]')" in result.output
    assert "ray" not in result.output and isinstance(result.exception, SystemExit)


def test_a_file_put_at_out_during_the_run_is_left_alone(monkeypatch, tmp_path):
    """--out was checked before the run only: a file put there meanwhile was overwritten by the
    results (a checkpoint already left such a file alone)."""
    out = tmp_path / "r.json"

    def run(config, *_args, **_kwargs):  # the run, during which the user writes there
        out.write_text("my precious notes\n")
        return {"config": config.model_dump(mode="json"), "final": {"mean_acc": 0.5}, "rounds": []}

    monkeypatch.setattr("fedal.sim.runner.simulate", run)
    result = CliRunner().invoke(cli, ["simulate", "--dataset", "digits", "--clients", "2", "--rounds", "1",
                                      "--quiet", "--out", str(out)])
    assert result.exit_code == 1, result.output
    assert out.read_text() == "my precious notes\n"
    assert "is not a results file this toolkit wrote" in result.output and '"mean_acc": 0.5' in result.output
