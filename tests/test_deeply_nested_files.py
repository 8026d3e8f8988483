"""Files nested past what Python's JSON and TOML parsers take (a hostile or broken file) are bad
input like any other: a one-line error, never a RecursionError's traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from edge_agent.config import load_agent_config
from fedal.settings import SettingsError
from fedal_cli.main import cli

DEPTH = 200_000
DEEP_JSON = '{"config": ' + "[" * DEPTH + "]" * DEPTH + "}"
DEEP_TOML = "a = " + "[" * DEPTH + "]" * DEPTH + "\n"


@pytest.mark.parametrize("name, text, kind", [("deep.json", DEEP_JSON, "JSON"), ("deep.toml", DEEP_TOML, "TOML")])
def test_a_run_config_nested_too_deep_is_refused_in_a_line(tmp_path, name, text, kind):
    path = tmp_path / name
    path.write_text(text)
    result = CliRunner().invoke(cli, ["simulate", "--config", str(path), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 2 and f"is not valid {kind}: nested too deep" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "r.json").exists()


def test_an_out_file_nested_too_deep_is_not_taken_for_the_toolkits_own(tmp_path):
    out = tmp_path / "deep.json"
    out.write_text(DEEP_JSON)
    result = CliRunner().invoke(cli, ["simulate", "--rounds", "1", "--clients", "2", "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert out.read_text() == DEEP_JSON  # a file the toolkit did not write is left as it is


def test_an_agent_config_nested_too_deep_is_a_settings_error(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(DEEP_TOML)
    with pytest.raises(SettingsError, match="nested too deep"):
        load_agent_config(path)
