"""`fedal demo` and `fedal simulate` offer every registered strategy (FedDF-AL's chunked weights
and parity over Mosquitto: tests/test_strategy_contract.py)."""

from __future__ import annotations


def test_demo_and_simulate_offer_every_strategy(tmp_path):
    from click.testing import CliRunner

    from fedal.strategies import STRATEGY_NAMES
    from fedal_cli.demo import demo_cmd
    from fedal_cli.simulate import simulate_cmd

    assert {"fedavg", "fedmd", "fedmd-lf", "feddf-al", "feddf"} <= set(STRATEGY_NAMES)
    for cmd in (demo_cmd, simulate_cmd):
        (opt,) = [p for p in cmd.params if p.name == "strategy"]
        assert tuple(opt.type.choices) == STRATEGY_NAMES
    # parameter averaging of one model for all clients: refused with heterogeneous models before anything starts
    res = CliRunner().invoke(demo_cmd, ["--strategy", "fedavg", "--dataset", "mnist1d", "--models", "mlp,cnn1d",
                                       "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "r.json"), "--quiet"])
    assert res.exit_code == 2 and "one model for all clients" in res.output
    assert not (tmp_path / "w").exists()
