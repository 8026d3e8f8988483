"""The per-client table `fedal demo` prints at the end."""

from fedal_cli.demo import summary_table


def results(final: dict) -> dict:
    return {"clients": [{"id": "c00", "model": "mlp"}, {"id": "c01", "model": "cnn1d"}],
            "deployment": {"clients": {"c00": {"answered": 7, "late": 1, "rejected": 2, "bytes_up": 2048, "bytes_down": 1024}}},
            "final": final}


def test_table_shows_each_devices_own_accuracy_when_reported():
    table = summary_table(results({"client_acc": [0.5, None], "client_local_acc": [0.75, 0.25], "mean_acc": 0.5,
                                   "min_acc": 0.5, "max_acc": 0.5, "local_mean_acc": 0.5}))
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["client", "model", "acc", "own", "acc"]
    assert lines[1].split() == ["c00", "mlp", "0.5000", "0.7500", "7", "1", "2", "2.0", "1.0"]
    assert lines[2].split()[:4] == ["c01", "cnn1d", "nan", "0.2500"]  # no answer on the common test set
    assert lines[-1] == "mean acc on the devices' own test splits 0.5000"


def test_table_without_local_splits_has_no_own_column():
    table = summary_table(results({"client_acc": [0.5, 0.25], "mean_acc": 0.375, "min_acc": 0.25, "max_acc": 0.5}))
    assert "own acc" not in table and "own test splits" not in table
    assert table.splitlines()[-1] == "mean acc 0.3750 (min 0.2500, max 0.5000)"


def test_the_demo_gives_its_coordinator_the_runs_thread_count(tmp_path):
    """The demo's coordinator shares the machine with its agents: with torch's default thread
    count its server-side steps spun against them (a FedAL transfer phase's compute went from
    about 4 ms to up to 500 ms on 2 busy cores), so it gets the run's `threads` as they do."""
    import tomllib

    from coordinator.config import load_coordinator_config
    from fedal.sim import load_config
    from fedal_cli.demo import prepare_workspace

    config = load_config(None, dict(strategy="fedmd", dataset="digits", clients=2, rounds=1, public_size=50, threads=3))
    coord_path, agent_paths, _ = prepare_workspace(config.resolved(), tmp_path, "mqtt://127.0.0.1:1", 8080)
    assert tomllib.loads(coord_path.read_text())["threads"] == 3
    assert load_coordinator_config(coord_path).threads == 3
    assert all(tomllib.loads(p.read_text())["threads"] == 3 for p in agent_paths)
