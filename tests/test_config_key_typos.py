"""A mistyped key in any config the toolkit reads (a simulation's TOML, an agent's or a
coordinator's config, a run spec over the API, a fault profile) is named as unknown, with the
key it most likely meant; pydantic's own words were "Extra inputs are not permitted"."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from coordinator.config import load_coordinator_config
from coordinator.runs import InvalidRunSpec, RunManager
from edge_agent.config import load_agent_config
from fedal.settings import SettingsError
from fedal_cli.main import cli
from hil.profiles import ProfileError, parse_profile


def test_a_simulation_config(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text('strategy = "fedal"\nround = 2\n[strategy_params]\nlamda_kd = 0.5\n')
    result = CliRunner().invoke(cli, ["simulate", "--config", str(path), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert "round: unknown key (did you mean 'rounds'?)" in result.output
    assert "strategy_params.lamda_kd: unknown key (did you mean 'lambda_kd'?)" in result.output
    assert "Extra inputs" not in result.output


def test_agent_and_coordinator_configs(tmp_path):
    agent = tmp_path / "agent.toml"
    agent.write_text('client_id = "c1"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "d.npz"\n[broker]\nurll = "mqtt://h"\n')
    with pytest.raises(SettingsError, match=r"broker\.urll: unknown key \(did you mean 'url'\?\)"):
        load_agent_config(agent)
    coordinator = tmp_path / "coordinator.toml"
    coordinator.write_text('run_id = "r"\nclient_ids = ["a", "b"]\n[phases]\nresend = 2\n')
    with pytest.raises(SettingsError, match=r"phases\.resend: unknown key \(did you mean 'resend_s'\?\)"):
        load_coordinator_config(coordinator)


def test_a_key_like_none_gets_no_guess(tmp_path):
    path = tmp_path / "sim.toml"
    path.write_text('strategy = "fedal"\nzzzzqq = 1\n')
    result = CliRunner().invoke(cli, ["simulate", "--config", str(path)])
    assert result.exit_code == 2 and "zzzzqq: unknown key" in result.output and "did you mean" not in result.output


def test_a_run_spec_over_the_api(unstarted_run):
    manager = RunManager.of(unstarted_run)
    with pytest.raises(InvalidRunSpec, match=r"run\.round: unknown key \(did you mean 'rounds'\?\)"):
        manager.create({"run_id": "typo", "client_ids": ["a", "b"], "num_classes": 10,
                        "run": {"strategy": "fedal", "round": 2}})


def test_a_fault_profile():
    with pytest.raises(ProfileError, match=r"default\.dorp: unknown key \(did you mean 'drop'\?\)"):
        parse_profile('description = "x"\n[default]\ndorp = 0.1\n')
