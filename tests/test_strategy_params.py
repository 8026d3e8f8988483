"""Each strategy declares its own parameters: a knob of another strategy set to a value of its
own is refused with the valid names; a saved, fully resolved config still loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedal.sim import ConfigError, load_config
from fedal.strategies import STRATEGIES
from fedal.strategies.params import COMMON_PARAMS


def test_a_parameter_of_another_strategy_is_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"strategy": "fedavg", "hkd_lambda": 0.3})
    assert "hkd_lambda" in str(err.value) and "'fedavg'" in str(err.value)
    assert "local_epochs" in str(err.value) and "lr" in str(err.value)
    with pytest.raises(ConfigError, match="lambda_adv"):
        load_config(None, {"strategy": "fedhkd", "lambda_adv": 1.0})
    with pytest.raises(ConfigError, match="akd_beta"):
        load_config(None, {"strategy": "fedal", "akd_beta": 0.5})


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_own_and_common_parameters_are_accepted_and_a_resolved_config_reloads(name):
    spec = STRATEGIES[name]
    assert set(spec.params).isdisjoint(COMMON_PARAMS)
    resolved = load_config(None, {"strategy": name, "lr": 0.01}).resolved()
    again = load_config(None, resolved.model_dump(mode="json"))  # what results.json holds
    assert again.strategy_params == resolved.strategy_params


def test_the_command_line_exits_2_on_a_foreign_parameter(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('strategy = "local"\n[strategy_params]\nlambda_kd = 2.0\n')
    out = subprocess.run([sys.executable, "-m", "fedal_cli.main", "simulate", "--config", str(cfg), "--quiet",
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "lambda_kd" in out.stderr and "do not apply to strategy 'local'" in out.stderr
