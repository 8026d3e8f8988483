"""Agent and coordinator configs: TOML, environment overrides, clear refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.config import load_coordinator_config
from edge_agent.config import load_agent_config
from fedal.settings import SettingsError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_example_configs_load():
    agent = load_agent_config(EXAMPLES / "agent.toml")
    assert agent.client_id == "pi-01" and agent.broker.url.startswith("mqtts://")
    coord = load_coordinator_config(EXAMPLES / "coordinator.toml")
    assert coord.client_ids == ["pi-01", "pi-02", "pi-03"]
    assert coord.run.resolved().strategy_params.tau == 5 and coord.phases.quorum == 0.5


def test_environment_overrides_the_file(monkeypatch):
    monkeypatch.setenv("FEDAL_AGENT_BROKER__URL", "mqtts://10.0.0.5:1884")
    monkeypatch.setenv("FEDAL_AGENT_CLIENT_ID", "pi-07")
    agent = load_agent_config(EXAMPLES / "agent.toml")
    assert agent.broker.url == "mqtts://10.0.0.5:1884" and agent.client_id == "pi-07"
    assert agent.broker.username == "pi-01"  # the rest of [broker] still comes from the file


@pytest.mark.parametrize(
    "text, needle",
    [
        ('client_id = "a b"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "x.npz"\n', "client_id"),
        ('client_id = "a"\nrun_id = "r"\nmodel = "mlp"\n', "data_file"),
        ('client_id = "a"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "x.npz"\n[broker]\nurl = "http://x"\n', "mqtt://"),
        ('client_id = "a"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "x.npz"\ncolour = "red"\n', "colour"),
        ("client_id = \n", "not valid TOML"),
    ],
)
def test_bad_agent_configs_are_refused(tmp_path, text, needle):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match=needle):
        load_agent_config(path)


def test_bad_coordinator_config_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('client_ids = ["only-one"]\nnum_classes = 10\n')
    with pytest.raises(SettingsError, match="at least two"):
        load_coordinator_config(path)


@pytest.mark.parametrize("module", ["edge_agent", "coordinator"])
def test_cli_exits_2_on_a_missing_config(module, tmp_path):
    proc = subprocess.run([sys.executable, "-m", module, "--config", str(tmp_path / "nope.toml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not found" in proc.stderr


def test_agent_needs_only_the_agent_extra():
    """The agent imports nothing from the web stack or the simulation extras."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'fastapi', 'uvicorn', 'amqtt', 'mnist1d', "
        "'sklearn', 'matplotlib', 'scipy', 'tomli_w'}:\n"
        "            raise ImportError(f'agent imported {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import edge_agent.agent, edge_agent.cli, edge_agent.inference\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_an_environment_override_that_is_not_json_is_one_line_naming_it(tmp_path):
    """FEDAL_AGENT_BROKER='{bad' was a pydantic-settings traceback, and a bad env value was blamed on the file."""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "FEDAL_AGENT_BROKER": "{bad"}
    r = subprocess.run([sys.executable, "-m", "edge_agent", "--config", str(repo / "examples" / "agent.toml")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "environment override" in r.stderr and '"broker"' in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    env = {**os.environ, "FEDAL_AGENT_THREADS": "abc"}
    r = subprocess.run([sys.executable, "-m", "edge_agent", "--config", str(repo / "examples" / "agent.toml")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "with environment overrides FEDAL_AGENT_THREADS" in r.stderr, r.stderr


@pytest.mark.parametrize("which, toml, needle", [
    ("agent", 'threads = true', "threads: Input should be a valid integer, not a boolean"),
    ("agent", 'exit_on_finish = "no"', "exit_on_finish: Input should be a valid boolean"),
    ("agent", 'seed = 1.5', "seed: Input should be a valid integer, not a float"),
    ("coordinator", 'threads = true', "threads: Input should be a valid integer, not a boolean"),
    ("coordinator", '[phases]\nquorum = true', "phases.quorum: Input should be a valid number, not a boolean"),
    ("coordinator", '[api]\nread_requires_token = "yes"', "api.read_requires_token: Input should be a valid boolean"),
])
def test_agent_and_coordinator_configs_coerce_no_value_the_run_config_refuses(tmp_path, which, toml, needle):
    """`exit_on_finish = "no"` became False and `threads = true` 1, while the run config refused both."""
    base = ('client_id = "c"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "x.npz"\n' if which == "agent"
            else 'run_id = "r"\n')
    path = tmp_path / f"{which}.toml"
    path.write_text(base + toml + "\n")
    load = load_agent_config if which == "agent" else load_coordinator_config
    with pytest.raises(SettingsError, match=needle):
        load(path)


def test_a_hil_profile_coerces_nothing_either():
    from hil.profiles import ProfileError, parse_profile

    with pytest.raises(ProfileError, match="latency_ms"):
        parse_profile("[default]\nlatency_ms = true")


def _examples_keys(text: str) -> set[str]:
    """Every `key =` of a TOML file, set or commented out ("# key = ..."), as table.key."""
    import re

    keys, table = set(), ""
    for line in text.splitlines():
        if m := re.match(r"^\[([\w.]+)\]", line):
            table = m[1] + "."
        elif m := re.match(r"^(?:# )?(\w+) = ", line):
            keys.add(table + m[1])
    return keys


@pytest.mark.parametrize("example, models", [
    ("agent.toml", {"": "edge_agent.config:AgentConfig", "broker.": "edge_agent.config:AgentBrokerSettings"}),
    ("coordinator.toml", {"": "coordinator.config:CoordinatorConfig", "broker.": "coordinator.config:CoordinatorBrokerSettings",
                          "api.": "coordinator.config:ApiSettings", "phases.": "fedal.engine.settings:PhaseSettings",
                          "health.": "coordinator.config:HealthSettings"}),
])
def test_the_example_configs_show_every_key_and_their_commented_values_load(tmp_path, example, models):
    """docs/runtime.md says the examples document every key; 18 were missing."""
    import importlib
    import re

    path = Path(__file__).resolve().parents[1] / "examples" / example
    text = path.read_text()
    keys = _examples_keys(text)
    for table, ref in models.items():
        module, name = ref.split(":")
        model = getattr(importlib.import_module(module), name)
        nested = {t.rstrip(".") for t in models if t}
        wanted = {table + f for f in model.model_fields if f not in nested and not (table == "" and f == "run")}
        assert wanted <= keys, sorted(wanted - keys)
    uncommented = tmp_path / example
    uncommented.write_text(re.sub(r"(?m)^# (\w+ = )", r"\1", text))  # every documented value, set
    if example == "agent.toml":
        load_agent_config(uncommented)
    else:
        load_coordinator_config(uncommented)


def test_an_agents_reconnect_backoff_that_shrinks_is_refused(tmp_path):
    """reconnect_min_s = 10 with reconnect_max_s = 1 was taken without a word (paho then waits the
    larger first)."""
    path = tmp_path / "agent.toml"
    path.write_text('client_id = "c"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "x.npz"\n'
                    '[broker]\nreconnect_min_s = 10\nreconnect_max_s = 1\n')
    with pytest.raises(SettingsError, match=r"reconnect_max_s \(1\) must be at least reconnect_min_s \(10\)"):
        load_agent_config(path)


@pytest.mark.parametrize("broker, complaint", [
    ("reconnect_max_s = 0.5", "reconnect_max_s"),  # paho's waits were cut to whole seconds: 0, a busy loop
    ("reconnect_min_s = 0.2\nreconnect_max_s = 0.4", "reconnect_min_s"),
    ("reconnect_max_s = inf", "reconnect_max_s"),
])
def test_an_agents_reconnect_backoff_under_a_second_is_refused(tmp_path, broker, complaint):
    """reconnect_max_s = 0.5 was accepted, and the link gave paho a cap of int(0.5) = 0: after the
    first wait every reconnect came at once, thousands a second, against a broker that was down."""
    path = tmp_path / "agent.toml"
    path.write_text('client_id = "c"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "x.npz"\n'
                    f'[broker]\n{broker}\n')
    with pytest.raises(SettingsError, match=complaint):
        load_agent_config(path)


def test_thread_counts_torch_cannot_take_are_refused_in_the_config(tmp_path):
    """threads = 100000000000 was valid; torch.set_num_threads then raised an overflow at start:
    a traceback and exit 1, which the service restarted for ever."""
    path = tmp_path / "agent.toml"
    path.write_text('client_id = "c"\nrun_id = "r"\nmodel = "mlp"\ndata_file = "x.npz"\nthreads = 100000000000\n')
    with pytest.raises(SettingsError, match="threads"):
        load_agent_config(path)
    coordinator = tmp_path / "coordinator.toml"
    coordinator.write_text("threads = 100000000000\n")
    with pytest.raises(SettingsError, match="threads"):
        load_coordinator_config(coordinator)


def test_an_api_port_of_zero_is_refused(tmp_path):
    """port = 0 was taken: uvicorn listened on a port of the system's choosing while the log and
    the manifest told agents `:0`, and the run stalled with every public-set download failing."""
    path = tmp_path / "coordinator.toml"
    path.write_text("[api]\nport = 0\n")
    with pytest.raises(SettingsError, match="port"):
        load_coordinator_config(path)
