"""The Ray backend: client halves in Ray actors, the engine in the driver, the same numbers as the
in-process per-client path; an actor that dies is restarted from its clients' round-start
snapshots and the run finishes. A local Ray instance on loopback with 2 CPUs, started here."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only
ray = pytest.importorskip("ray")

from fedal.sim import load_config, simulate  # noqa: E402
from fedal.sim.config import ConfigError, parse_resources  # noqa: E402
from fedal.strategies import STRATEGIES, STRATEGY_NAMES  # noqa: E402
from tests.helpers import without_timings  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def local_ray(ray_may_start_in_module):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             logging_level="ERROR")
    yield
    ray.shutdown()


def _config(strategy: str, **extra):
    base = dict(strategy=strategy, dataset="mnist1d", clients=5, samples_per_client=100, public_size=150,
                rounds=2, seed=4, mnist1d_samples=2000, vectorize=False)  # the per-client path
    if extra.get("backend") == "ray":
        base["ray_actors"] = 2  # unless `extra` says otherwise
    if strategy in ("fedal", "fedmd"):
        base["models"] = ["mlp", "cnn1d"]
    return load_config(None, {**base, **extra})


def _same(a: dict, b: dict) -> None:
    a, b = without_timings(a), without_timings(b)
    assert a["rounds"] == b["rounds"]
    assert a["final"] == b["final"] and a["data"] == b["data"] and a["clients"] == b["clients"]


@pytest.mark.parametrize("strategy", ["fedal", "fedmd", "fedavg"])
def test_ray_gives_the_in_process_results(strategy):
    local = simulate(_config(strategy))
    remote = simulate(_config(strategy, backend="ray"))
    _same(local, remote)
    assert remote["backend"] == {"name": "ray", "actors": 2, "actor_failures": 0, "lost_tasks": 0, "refused_tasks": 0,
                                 "restored_clients": 0}
    assert remote["config"]["backend"] == "ray" and "backend" not in local


@pytest.mark.parametrize("strategy", [s for s in STRATEGY_NAMES if s not in ("fedal", "fedmd", "fedavg")])
def test_every_other_strategy_gives_the_in_process_results_on_ray(strategy):
    """The transport does not depend on the strategy: every strategy's results on Ray are the
    in-process per-client ones (one round; heterogeneous models where the strategy allows them)."""
    extra = {} if STRATEGIES[strategy].homogeneous_models else {"models": ["mlp", "cnn1d_wide"]}  # one feature width
    local = simulate(_config(strategy, rounds=1, clients=4, **extra))
    # one actor hosting every client (clients spread over actors: the tests above)
    remote = simulate(_config(strategy, rounds=1, clients=4, backend="ray", ray_actors=1, **extra))
    _same(local, remote)


@pytest.mark.parametrize("strategy", ["fedal", "fedmd", "fedavg"])
def test_ray_clients_end_with_the_in_process_outputs(strategy):
    """Not only the reported numbers: every client's final outputs on the public set agree."""
    from fedal.sim.ray_backend import ray_run
    from fedal.sim.runner import global_metrics_of
    from tests.helpers import simulated_run

    config = _config(strategy).resolved()
    data, local_clients, _ = simulated_run(config)
    _, _, engine, close = ray_run(config.model_copy(update={"backend": "ray"}), global_metrics_of)
    try:
        for r in range(config.rounds):
            engine.run_round(r)
        remote = {}
        for handle in set(engine.transport.actors.values()):
            remote.update(ray.get(handle.outputs.remote(engine.transport.public, data.public_x)))
    finally:
        close()
    assert sorted(remote) == sorted(local_clients)
    for cid, client in local_clients.items():
        assert np.max(np.abs(remote[cid] - client.predict(data.public_x).numpy())) <= 1e-6, cid


def test_faults_work_on_ray_too():
    faults = dict(dropout=0.2, stragglers=0.4, rounds=3)
    local = simulate(_config("fedal", **faults))
    # and a memory request, Ray's own keyword (it was passed as a custom resource, which Ray refuses)
    remote = simulate(_config("fedal", backend="ray", client_resources="num_cpus=1,memory=50000000", **faults))
    _same(local, remote)
    assert remote["deployment"] == local["deployment"] and local["deployment"]["faults"]["dropped_tasks"] > 0


def test_vectorized_clients_in_actors():
    per_client = simulate(_config("fedal", clients=6))
    remote = simulate(_config("fedal", clients=6, backend="ray", vectorize=True))
    # 6 clients, 2 actors, mlp / cnn1d alternating: each actor holds a pair of each, stacked
    assert remote["vectorized"]["stacked_tasks"] > 0 and remote["vectorized"]["per_client_tasks"] == 0
    for x, y in zip(per_client["final"]["client_acc"], remote["final"]["client_acc"]):
        assert abs(x - y) <= 2 / 400


def test_a_killed_actor_is_restarted_from_snapshots_and_the_run_finishes():
    from fedal.sim.ray_backend import ray_run
    from fedal.sim.runner import global_metrics_of

    config = _config("fedal", rounds=3).resolved()
    config = config.model_copy(update={"backend": "ray"})
    data, server, engine, close = ray_run(config, global_metrics_of)
    try:
        engine.run_round(0)
        actor = engine.transport.actors["c00"]
        os.kill(ray.get(actor.ready.remote(engine.transport.public))["pid"], signal.SIGKILL)  # its worker process dies
        records = [engine.run_round(r) for r in (1, 2)]
    finally:
        info = close()
    assert info["actor_failures"] >= 1 and info["lost_tasks"] >= 1
    assert info["restored_clients"] >= 2  # c00's actor hosts c00, c02, c04: back from their round-0 snapshots
    # the engine re-sent the lost tasks and the restarted actor answered them: no client missed a phase
    assert all(p["participation"] == 1.0 for r in records for p in r["phases"].values())
    assert "mean_acc" in records[-1] and all(a is not None for a in records[-1]["client_acc"])


def test_a_run_stopped_midway_ends_its_actors_without_waiting_for_their_work():
    """A stop (Ctrl-C, a signal) reaching the driver while an actor computes: the run's close ends
    the actors at once. Asking them their counts first waited for the work each still had (an
    actor takes one call at a time): here a task of a million local steps, minutes of work."""
    from fedal.protocol import Message
    from fedal.sim.ray_backend import ray_run
    from fedal.sim.runner import global_metrics_of
    from fedal.strategies.params import MAX_STEPS

    config = _config("fedal", rounds=1).resolved().model_copy(update={"backend": "ray"})
    _, _, engine, close = ray_run(config, global_metrics_of)
    try:
        task = Message({"instance": "sim", "epoch": 0, "seq": 1, "round": 0, "phase": "local_train", "steps": MAX_STEPS})
        busy = engine.transport.actors["c00"].on_group.remote(engine.transport.public, [("c00", task)])
        done, _ = ray.wait([busy], timeout=2)
        assert not done  # under way
    finally:
        started = time.monotonic()
        info = close(False)  # what the run does when it is stopped midway
        took = time.monotonic() - started
    assert took < 60, took
    assert "restored_clients" not in info  # not asked: the actors were busy
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(busy, timeout=30)


def test_client_resources_are_parsed_and_bad_ones_refused():
    assert parse_resources("num_cpus=1,num_gpus=0.25") == {"num_cpus": 1.0, "num_gpus": 0.25}
    assert parse_resources(None) == {"num_cpus": 1.0}
    # an actor that asks other resources still takes one CPU unless it says otherwise (as Ray places it)
    assert parse_resources("num_gpus=0.5") == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert parse_resources("num_cpus=0,num_gpus=1") == {"num_cpus": 0.0, "num_gpus": 1.0}
    for bad in ("num_cpus", "num_cpus=x", "num_gpus=-1", "num_cpus=nan", "num_gpus=inf", "=1",
                "num_cpus=1,num_cpus=3"):
        with pytest.raises(ConfigError, match="client_resources"):
            parse_resources(bad)
    # what Ray itself refused at start (exit 1, in its own words): refused with the config (exit 2)
    for bad, says in (("CPU=1", "num_cpus"), ("GPU=1", "num_gpus"), ("object_store_memory=1", "object_store_memory"),
                      ("num_cpus=0.00001", "0.0001")):
        with pytest.raises(ConfigError, match=says):
            parse_resources(bad)
    assert parse_resources("num_cpus=0.25,memory=1e9") == {"num_cpus": 0.25, "memory": 1e9}
    with pytest.raises(ValueError, match="client_resources") as refused:
        load_config(None, {"backend": "ray", "client_resources": "cpus=many"})
    assert str(refused.value).count("client_resources") == 1  # the field named once
    # a name like one of Ray's own is said at start (it asks the cluster for a custom resource)
    for typo, meant in (("num_cpu=1", "num_cpus"), ("numgpus=0.5", "num_gpus"), ("memroy=1e9", "memory")):
        notes = load_config(None, {"backend": "ray", "client_resources": typo}).notes()
        assert any(f"did you mean {meant!r}" in n for n in notes), notes
    for custom in ("accelerator_tpu=1", "memory_gb=2", "num_tpus=1,num_cpus=1"):  # custom resources stay possible
        assert parse_resources(custom) and not [n for n in load_config(
            None, {"backend": "ray", "client_resources": custom}).notes() if "client_resources" in n]


def test_the_cluster_check_and_the_default_actor_count_count_every_resource():
    from fedal.sim.ray_backend import RayClusterError, actors_that_fit, check_cluster_fits

    gpu_half = parse_resources("num_gpus=0.5")
    # 8 actors of half a GPU fit 4 GPUs, not 4 CPUs: the CPU each also takes is what is short
    with pytest.raises(RayClusterError, match=r"need CPU=8.*has CPU=4: use --ray-actors 4 or fewer"):
        check_cluster_fits(8, gpu_half, {"CPU": 4.0, "GPU": 4.0})
    check_cluster_fits(4, gpu_half, {"CPU": 4.0, "GPU": 4.0})
    # the default count is what the cluster holds of every resource asked (16 CPUs, 1 GPU: 2)
    assert actors_that_fit(parse_resources("num_cpus=1,num_gpus=0.5"), {"CPU": 16.0, "GPU": 1.0}) == 2
    assert actors_that_fit(parse_resources(None), {"CPU": 16.0}) == 16
    assert actors_that_fit({"num_cpus": 0.0}, {"CPU": 3.0}) == 3  # asking nothing: one per CPU
    assert actors_that_fit(parse_resources("num_gpus=1"), {"CPU": 16.0}) == 0  # no GPU: the check says so


def test_an_actor_killed_mid_round_misses_the_rest_of_it_and_the_round_closes_by_quorum():
    """Killed during the transfer stage: the tasks it held are lost (counted), the phase closes at its
    deadline by quorum (0.5) with the other clients, its clients come back at their round start and
    take part again."""
    from fedal.sim.ray_backend import ray_run
    from fedal.sim.runner import global_metrics_of

    config = _config("fedal", rounds=2).resolved().model_copy(update={"backend": "ray"})
    data, server, engine, close = ray_run(config, global_metrics_of)
    transport = engine.transport
    compute, killed = transport._compute, []

    def kill_then_compute(items):
        if not killed and any(task.phase == "transfer" and task.integer("iteration") == 2 for _, task, *_ in items):
            pid = ray.get(transport.actors["c00"].ready.remote(transport.public))["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return compute(items)

    transport._compute = kill_then_compute
    try:
        first = engine.run_round(0)
        second = engine.run_round(1)
    finally:
        info = close()
    assert killed and info["actor_failures"] >= 1 and info["lost_tasks"] >= 1 and info["restored_clients"] >= 2
    assert first["phases"]["transfer"]["participation"] < 1.0  # closed at the deadline, by quorum
    assert all(p["participation"] == 1.0 for p in second["phases"].values())  # all back the next round
    assert all(a is not None for a in second["client_acc"])


def test_a_client_group_answers_refused_tasks_with_the_reason(tmp_path):
    """What an actor does with a task its client cannot apply: feedback for logits it never
    uploaded (as after a restart) it declines, as an agent does; any other refusal (non-finite
    feedback) gets no result and the reason; the other tasks are still answered."""
    from fedal.protocol import Message, decode
    from fedal.sim.build import build_data
    from fedal.sim.ray_backend import ClientGroup

    config = _config("fedal").resolved()
    group = ClientGroup(config.model_dump(mode="json"), [0, 2], str(tmp_path), "sim")
    public = [ray.put(build_data(config).public_x)]
    meta = {"instance": "sim", "epoch": 0, "seq": 1, "round": 0, "iteration": 0}
    fbar = np.zeros((config.strategy_params.public_batch_size, 10), dtype=np.float32)
    missed = Message({**meta, "phase": "transfer", "n_avg": 2}, {"fbar": fbar})
    nan = Message({**meta, "seq": 2, "phase": "transfer", "n_avg": 2}, {"fbar": np.full_like(fbar, np.nan)})
    good = Message({**meta, "phase": "local_train", "steps": 1})
    out, _ = group.on_group(public, [("c00", missed), ("c00", nan), ("c02", good)])
    assert out[0][1] is None and decode(out[0][0].payload).meta == {"declined": "missed_step", "epoch": 0, "seq": 1}
    assert out[1][0] is None and "finite" in out[1][1]
    assert out[2][0] is not None and out[2][1] is None
    assert (tmp_path / "c02.pt").exists()  # the round-start snapshot a restart resumes from
    # at the run's end each actor removes its own clients' snapshots (on another node of a cluster
    # nobody else would), and the directory once it is empty
    (tmp_path / "c01.pt").write_bytes(b"another actor's client")
    assert group.forget() == 2  # c00's (its round opened before the decline) and c02's
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c01.pt"]
    (tmp_path / "c01.pt").unlink()
    assert group.forget() == 0 and not tmp_path.exists()


def test_a_refused_task_costs_only_itself_on_either_backend(monkeypatch):
    """A task a client cannot apply (feedback that is not finite, here the first one c01 gets) is
    refused on either backend the same way, as on an agent: it gets no answer, is counted (each
    copy the engine re-sends too), and the
    run goes on to the same numbers (the phase closes by quorum at its deadline). The in-process
    run stopped with the refusal while the Ray run went on."""
    from fedal.strategies.fedal import FedALServer

    feedback = FedALServer._feedback

    def poisoned(self, results):
        out = feedback(self, results)
        if not getattr(self, "_poisoned", False) and "c01" in out:
            self._poisoned = True
            out["c01"]["fbar"] = np.full_like(out["c01"]["fbar"], np.nan)
        return out

    monkeypatch.setattr(FedALServer, "_feedback", poisoned)
    local = simulate(_config("fedal"))
    remote = simulate(_config("fedal", backend="ray"))
    _same(local, remote)
    # the task and its re-send before the deadline, refused alike
    assert local["refused_tasks"] == remote["backend"]["refused_tasks"] >= 1
    assert remote["backend"]["lost_tasks"] == 0
    vectorized = simulate(_config("fedal", vectorize=True))  # a refusal inside a stacked group
    assert vectorized["refused_tasks"] == local["refused_tasks"] and vectorized["vectorized"]["stacked_tasks"] > 0
    monkeypatch.undo()
    assert "refused_tasks" not in simulate(_config("fedal", rounds=1))  # none refused: not said


def test_actors_take_the_public_set_from_the_object_store(tmp_path):
    """The driver puts the public set into the store once; the clients an actor builds use that
    copy (marked here so it differs from what the actor's own build would give), read-only and
    shared, while the content hash the driver checks is the one of the actor's own dataset files."""
    from fedal.data import content_hash
    from fedal.sim.build import build_data
    from fedal.sim.ray_backend import ClientGroup

    config = _config("fedmd").resolved()
    data = build_data(config)
    marked = data.public_x + 1.0
    group = ClientGroup(config.model_dump(mode="json"), [1, 3], str(tmp_path), "sim")
    report = group.ready([ray.put(marked)])
    assert report["public_hash"] == data.public_hash != content_hash(marked)
    for session in group.sessions.values():
        public = session.client.public_x.numpy()
        assert np.array_equal(public, marked)


def test_a_checkpointed_run_resumes_on_the_other_backend(tmp_path):
    """Client states travel between a checkpoint and the actors: a run stopped in-process goes on
    on Ray, stopped there goes on in-process, to the numbers of a run never stopped."""
    from fedal.sim.checkpoint import completed_rounds

    class Stop(Exception):
        """Stands for Ctrl-C, a crash or a job's time limit after some rounds."""

    def stop_after(rounds):
        def progress(done, _entry):
            if done == rounds:
                raise Stop
        return progress

    path = tmp_path / "run.ckpt"
    local = _config("fedal", rounds=3, dropout=0.2)
    with pytest.raises(Stop):
        simulate(local, stop_after(1), checkpoint=path)
    with pytest.raises(Stop):
        simulate(_config("fedal", rounds=3, dropout=0.2, backend="ray"), stop_after(2), checkpoint=path, resume=True)
    assert completed_rounds(path) == 2
    resumed = simulate(local, checkpoint=path, resume=True)
    assert resumed["resumed_from_round"] == 2
    _same(simulate(local), resumed)


def test_a_client_group_loaded_from_a_checkpoint_restarts_from_it(tmp_path):
    """An actor that loads its clients from a checkpoint writes their snapshots at once: restarted
    (a new ClientGroup on the same directory, as Ray restarts it) before their next round's first
    task, the clients are the loaded ones, not freshly built."""
    import torch

    from fedal.sim.build import build_data
    from fedal.sim.ray_backend import ClientGroup

    config = _config("fedal").resolved()
    public = [ray.put(build_data(config).public_x)]
    group = ClientGroup(config.model_dump(mode="json"), [0, 2], str(tmp_path), "sim")
    states = group.states(public)
    for state in states.values():  # a checkpoint's: weights of a later round
        state["client"]["model"] = {k: v + 0.5 for k, v in state["client"]["model"].items()}
        state["session"]["round"] = 6
    group.load_states(public, states)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c00.pt", "c02.pt"]
    restarted = ClientGroup(config.model_dump(mode="json"), [0, 2], str(tmp_path), "sim")
    assert restarted.ready(public)["restored"] == 2
    for cid, session in restarted.sessions.items():
        assert session.round_no == 6
        assert all(torch.equal(v, states[cid]["client"]["model"][k]) for k, v in session.client.model.state_dict().items())
