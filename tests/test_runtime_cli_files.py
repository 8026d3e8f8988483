"""`fedal agent` / `fedal coordinator` (and their `python -m` forms) on the command line: -h as
--help, and a config naming a missing CA file or a missing or unusable public set is a one-line
usage error before anything starts or is created (they were tracebacks, the coordinator's after
it had made its state directory)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from coordinator.cli import coordinator_cmd
from edge_agent.cli import agent_cmd

CONFIG = """client_id = "c00"
run_id = "lab"
model = "mlp"
data_file = "{data}"
workspace = "{workspace}"

[broker]
url = "mqtts://127.0.0.1:8883"
ca_file = "{ca}"
"""


def test_dash_h_is_help():
    for module in ("edge_agent", "coordinator"):
        out = subprocess.run([sys.executable, "-m", module, "-h"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.startswith(f"Usage: python -m {module}")


def test_a_missing_ca_file_is_a_usage_error(tmp_path):
    config = tmp_path / "agent.toml"
    config.write_text(CONFIG.format(data=tmp_path / "train.npz", workspace=tmp_path / "ws", ca=tmp_path / "missing-ca.crt"))
    r = CliRunner().invoke(agent_cmd, ["--config", str(config)])
    assert r.exit_code == 2, r.output
    assert f"broker.ca_file {tmp_path / 'missing-ca.crt'} does not exist" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not (tmp_path / "ws").exists()  # nothing started


COORDINATOR = """run_id = "lab"
client_ids = ["c00", "c01"]
state_dir = "{state}"
public_file = "{public}"

[run]
strategy = "fedmd"
dataset = "digits"
clients = 2

[broker]
url = "mqtt://127.0.0.1:1883"
"""


def test_a_coordinator_config_with_a_missing_or_unusable_public_set_starts_nothing(tmp_path):
    config = tmp_path / "coordinator.toml"
    state = tmp_path / "state"
    config.write_text(COORDINATOR.format(state=state, public=tmp_path / "public.npz"))
    r = CliRunner().invoke(coordinator_cmd, ["--config", str(config)])
    assert r.exit_code == 2, r.output
    assert f"public_file {tmp_path / 'public.npz'}: No such file or directory" in r.output
    (tmp_path / "public.npz").write_bytes(b"not an npz")
    r = CliRunner().invoke(coordinator_cmd, ["--config", str(config)])
    assert r.exit_code == 2 and "is not a readable .npz file" in r.output, r.output
    assert not state.exists()


@pytest.mark.parametrize("url, complaint", [
    ("mqtt://coordinator:s3cretPassw0rd@broker:99999", "has an invalid port"),
    ("tcp://pi-1:s3cretPassw0rd@broker", "must start with mqtt:// or mqtts://"),
])
def test_a_broker_password_is_never_quoted_in_a_config_error(tmp_path, url, complaint):
    """It reached stderr, the journal and flash.sh's output in the URL the message quoted."""
    config = tmp_path / "agent.toml"
    config.write_text(CONFIG.format(data=tmp_path / "train.npz", workspace=tmp_path / "ws", ca=tmp_path / "ca.crt")
                      .replace('url = "mqtts://127.0.0.1:8883"', f'url = "{url}"'))
    r = CliRunner().invoke(agent_cmd, ["--config", str(config)])
    assert r.exit_code == 2 and complaint in r.output and ":***@broker" in r.output, r.output
    assert "s3cretPassw0rd" not in r.output


def test_a_missing_data_file_is_a_usage_error_not_a_join_retried_for_ever(tmp_path):
    config = tmp_path / "agent.toml"
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    config.write_text(CONFIG.format(data=tmp_path / "typo.npz", workspace=tmp_path / "ws", ca=tmp_path / "ca.crt"))
    r = CliRunner().invoke(agent_cmd, ["--config", str(config)])
    assert r.exit_code == 2 and f"data_file {tmp_path / 'typo.npz'} does not exist" in r.output, r.output
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("extra, complaint", [
    ('state_dir = "{tmp}/a-file"', "state_dir {tmp}/a-file is not a directory"),
    ('state_dir = "/proc/fedal-state"', "state_dir /proc/fedal-state cannot be created"),
    ('state_dir = "{tmp}/s"\nstore_url = "garbage://x"', "the run store garbage://x cannot be opened"),
    ('state_dir = "{tmp}/s"\ndevice = "tpu"', "device: 'tpu' is not a torch device"),
    ('state_dir = "{tmp}/s"\ndevice = "cuda:7"', "device cuda:7: torch sees"),
    ('state_dir = "{tmp}/s"\nresults_file = "/proc/r.json"', "results_file: /proc/r.json is not writable here"),
    ('state_dir = "{tmp}/s"\n[run]\nrounds = 2\n[phases]\npause_at = [{{round = 3}}]',
     "the configured run cannot start: phases.pause_at: round 3 is past the run's 2 rounds"),
    ('state_dir = "{tmp}/s"\n[run]\ndataset = "digits"\npublic_size = 100000',
     "the configured run cannot start: public_size must be at most"),
])
def test_coordinator_config_values_it_cannot_use_are_one_line_errors(tmp_path, extra, complaint):
    """They were tracebacks (a state_dir that is a file, a store URL no driver takes, a GPU this
    torch has not), or a results file lost at the run's end."""
    (tmp_path / "a-file").write_text("")
    config = tmp_path / "c.toml"
    from fedal.ports import free_port

    config.write_text('run_id = "r"\nclient_ids = ["a", "b"]\n' + extra.format(tmp=tmp_path)
                      + f"\n[api]\nport = {free_port()}\n")  # (not 8080: this machine's may be taken)
    r = CliRunner().invoke(coordinator_cmd, ["--config", str(config)])  # in process: no torch import per case
    assert r.exit_code in (1, 2) and complaint.format(tmp=tmp_path) in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception


def test_a_coordinator_api_port_in_use_is_a_usage_error_before_the_run_starts(tmp_path):
    """uvicorn exited with status 3 after the coordinator had started its run."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = tmp_path / "c.toml"
        config.write_text(f'run_id = "r"\nclient_ids = ["a", "b"]\nstate_dir = "{tmp_path / "s"}"\n'
                          f'[api]\nhost = "127.0.0.1"\nport = {port}\n')
        r = subprocess.run([sys.executable, "-m", "coordinator", "--config", str(config)], capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 2 and f"api 127.0.0.1:{port} cannot be served: Address already in use" in r.stderr, r.stderr


@pytest.mark.parametrize("key", ["test_file", "local_test_file"])
def test_a_test_file_of_other_rows_than_the_data_file_is_a_usage_error(tmp_path, key):
    """Test rows of another shape than the training rows were taken at start; then every
    evaluation was refused and the end of the run, which runs them through the model, exited 75
    for a restart that failed the same way, for ever."""
    import numpy as np

    np.savez(tmp_path / "train.npz", x=np.zeros((6, 40), np.float32), y=np.arange(6))
    np.savez(tmp_path / "test.npz", x=np.zeros((6, 20), np.float32), y=np.arange(6))
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    config = tmp_path / "agent.toml"
    text = CONFIG.format(data=tmp_path / "train.npz", workspace=tmp_path / "ws", ca=tmp_path / "ca.crt")
    config.write_text(text.replace("[broker]", f'{key} = "{tmp_path / "test.npz"}"\n\n[broker]'))
    r = CliRunner().invoke(agent_cmd, ["--config", str(config)])
    assert r.exit_code == 2, r.output
    assert f"{key} {tmp_path / 'test.npz'} holds rows of shape [20], but data_file's are [40]" in r.output
