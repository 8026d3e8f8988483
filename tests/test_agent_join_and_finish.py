"""The agent's join and finish when a file operation fails: a join that fails leaves nothing
half-restored attached (the next try starts from the files again), a full card at the end
checkpoint is the exit-75 failure a restart recovers from, and `final/` is never written through
a link."""

from __future__ import annotations

import errno
import os
import shutil

import pytest

from edge_agent import agent as agent_module
from edge_agent.checkpoint import Journal
from fedal.protocol import RunManifest
from tests.test_agent_journal import fresh_client, make_agent, run_hosted


def manifest(state: str = "finished") -> RunManifest:
    return RunManifest(run_id="sim", strategy="fedal", strategy_params={}, num_classes=10, clients=["c0", "c1"],
                       rounds=1, state=state, instance="sim")


def test_a_join_whose_restore_fails_leaves_nothing_attached(tmp_path, monkeypatch, one_torch_thread):
    """Before: the client stayed attached, half restored (its checkpoint without the journal's
    tasks); the agent never tried again, and the next round's first task overwrote the
    checkpoint and reset the journal: the journaled tasks were lost."""
    live, _ = run_hosted("fedal", tmp_path / "live", rounds=1)
    shutil.copytree(tmp_path / "live", tmp_path / "copy")
    agent = make_agent(tmp_path / "copy")
    monkeypatch.setattr(agent, "_setup", lambda m: agent.host(fresh_client("fedal"), m.instance))
    real_read = Journal.read

    def unreadable(self, *args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(Journal, "read", unreadable)
    checkpoint_before = (tmp_path / "copy" / "checkpoint.pt").read_bytes()
    assert agent._join(manifest("running")) is False
    assert agent.client is None and agent.session is None  # so the worker tries again
    assert (tmp_path / "copy" / "checkpoint.pt").read_bytes() == checkpoint_before
    monkeypatch.setattr(Journal, "read", real_read)
    assert agent._join(manifest("running")) is True
    assert agent.session.last_key == live.session.last_key  # the journal's tasks replayed


def test_a_checkpoint_of_another_model_is_kept_aside_and_the_next_join_starts_afresh(tmp_path, caplog,
                                                                                     one_torch_thread):
    """The config's model changed under a run's checkpoint: the join failed on torch's size
    mismatch, and was tried again with backoff for ever, saying only that."""
    from tests.helpers import toy_federation

    run_hosted("fedal", tmp_path / "ws", rounds=1)
    agent = make_agent(tmp_path / "ws")
    agent._setup = lambda m: agent.host(toy_federation("fedal", tau=2, k=5)[1]["c0"], m.instance)
    assert agent._join(manifest("running")) is False
    assert agent.client is None and agent.counters["checkpoint_unfit"] == 1
    kept = [p.name for p in (tmp_path / "ws").iterdir() if p.name.startswith("checkpoint.pt.unfit-")]
    assert len(kept) == 1 and not (tmp_path / "ws" / "checkpoint.pt").exists()
    assert "does not fit this device's mlp model" in caplog.text and "kept as" in caplog.text
    assert agent._join(manifest("running")) is True  # a new model, and a checkpoint of its own
    assert (tmp_path / "ws" / "checkpoint.pt").is_file() and agent.counters["checkpoint_unfit"] == 1


def test_a_full_card_at_a_rounds_start_is_a_durability_error_not_a_refused_task(tmp_path, monkeypatch,
                                                                                 one_torch_thread):
    """Before: the failed write of the round's start was counted as a rejected task ("task
    local_train r1 i0 refused: [Errno 28] ..."), and the agent did not go back to its disk state."""
    from fedal.protocol import decode

    agent, through = run_hosted("fedal", tmp_path / "ws", rounds=1)
    _, reference = run_hosted("fedal", tmp_path / "reference", rounds=2)
    following = reference.payloads[len(through.payloads)]  # round 1's first task
    assert decode(following).meta["round"] == 1

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(agent_module.checkpoint, "save_checkpoint", full)
    assert agent.apply_task(following) is None
    assert agent.counters["durability_errors"] == 1 and sum(agent.rejects.values()) == 0
    assert agent.client is None and agent.retry_at == 0.0  # rejoins from the disk at once


def test_a_full_card_at_the_end_checkpoint_exits_75(tmp_path, monkeypatch, one_torch_thread):
    """Before: the error escaped before the handled block: logged, exit status 0, no final model,
    and with exit_on_finish the service never started the agent again."""
    agent, _ = run_hosted("fedal", tmp_path / "ws", rounds=1)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(agent_module.checkpoint, "save_checkpoint", full)
    agent._finish(manifest())
    assert agent.exit_status == agent_module.FINAL_WRITE_FAILED and agent.stop_requested
    assert not (tmp_path / "ws" / "final").exists()


def test_test_rows_the_model_cannot_take_leave_the_final_model_written(tmp_path, one_torch_thread):
    """Before: the model's refusal of the test rows was taken for a failed write: exit 75, and a
    restart that failed the same way, for ever, with no final model."""
    import numpy as np

    from fedal.data.arrays import ArrayDataset

    agent, _ = run_hosted("fedal", tmp_path / "ws", rounds=1)
    width = agent.client.train_data.x.shape[1]
    agent.test = ArrayDataset(np.zeros((4, width // 2), np.float32), np.zeros(4, np.int64), 10, "test")
    errors = agent.counters["errors"]
    agent._finish(manifest())
    assert agent.exit_status != agent_module.FINAL_WRITE_FAILED and not agent.stop_requested
    final = tmp_path / "ws" / "final"
    assert (final / "model.pt").is_file() and (final / agent_module.FINISHED_MARK).is_file()
    assert not (final / "test_logits.npy").exists()
    assert agent.counters["errors"] == errors + 1


def test_an_onnxruntime_refusal_of_the_test_rows_leaves_the_final_model_written(tmp_path, monkeypatch,
                                                                               one_torch_thread):
    """onnxruntime's errors (InvalidArgument) are plain Exceptions, not RuntimeErrors."""
    import numpy as np

    from fedal.data.arrays import ArrayDataset

    agent, _ = run_hosted("fedal", tmp_path / "ws", rounds=1)
    invalid_argument = type("InvalidArgument", (Exception,), {})

    def refused(_x):
        raise invalid_argument("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions")

    monkeypatch.setattr(agent.client, "predict", refused)
    width = agent.client.train_data.x.shape[1]
    agent.test = ArrayDataset(np.zeros((4, width), np.float32), np.zeros(4, np.int64), 10, "test")
    agent._finish(manifest())
    assert agent.exit_status != agent_module.FINAL_WRITE_FAILED and not agent.stop_requested
    assert (tmp_path / "ws" / "final" / "model.pt").is_file()


@pytest.mark.parametrize("kind", ["link", "file"])
def test_final_is_never_written_through_a_link(tmp_path, one_torch_thread, kind):
    agent, _ = run_hosted("fedal", tmp_path / "ws", rounds=1)
    theirs = tmp_path / "users-models"
    theirs.mkdir()
    (theirs / "model.onnx").write_bytes(b"USER")
    final = tmp_path / "ws" / "final"
    if kind == "link":
        final.symlink_to(theirs)
    else:
        final.write_bytes(b"USER")
    agent._finish(manifest())
    assert agent.exit_status == agent_module.FINAL_WRITE_REFUSED and agent.stop_requested
    assert [p.name for p in theirs.iterdir()] == ["model.onnx"] and (theirs / "model.onnx").read_bytes() == b"USER"
    assert final.is_symlink() if kind == "link" else final.read_bytes() == b"USER"
