"""`fedal simulate --backend ray`: client halves in Ray actors, the round engine in the driver.

Each actor hosts a group of clients (their sessions, halves and private partitions, which it
builds itself from the run config: the driver ships no private data at all). The public set is
put into Ray's object store once by the driver and read from there by every actor (one shared,
read-only copy per node); what an actor builds from its node's dataset files is checked against
the driver's by the public set's content hash. The engine, the server half and the simulated clock stay in the
driver: `RayTransport` is the in-process transport's clock and faults (SimulatedTransport) with
the computing done by the actors, all of a phase's tasks at once, each actor its clients' in the
order sent. So a Ray run gives the in-process run's numbers.

An actor keeps each client's round-start state in a snapshot file (the session's store). When an
actor dies, the tasks it held get no answer (counted), Ray restarts it, and the restarted actor
loads its clients from their last round-start snapshots: the engine closes the round by its
quorum rules, re-sends, and the clients take part again from the next round on.

Before any actor is made, what the actors ask (actors x each of --client-resources) is checked
against the cluster's resources, and the wait for the actors to start is bounded: a run the
cluster cannot host stops with one line (RayClusterError) instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedal.atomic import torch_save_atomic
from fedal.engine.inprocess import (
    Answer,
    ClientStatesUnavailable,
    Faults,
    Pending,
    SimulatedTransport,
    Stacking,
    answer_tasks,
    check_states_cover,
    client_states,
    count_refusals,
    load_client_states,
    simulated_round_engine,
)
from fedal.engine.rounds import RoundEngine
from fedal.engine.settings import PhaseSettings
from fedal.ports import unreachable
from fedal.procs import pid_dir
from fedal.protocol import Message, Packet
from fedal.session import ClientSession, evaluation_reply
from fedal.sim.build import build_clients, build_data, client_ids, client_tests
from fedal.sim.config import ConfigError, RunConfig, parse_resources

log = logging.getLogger("fedal.sim.ray")

# how long the actors may take to be placed and started (their clients are built after that, unbounded):
# past it, the run stops instead of waiting for resources that other work holds (FEDAL_RAY_START_TIMEOUT_S sets it)
ACTOR_START_TIMEOUT_S = 120.0
RESTART_WAIT_S = ACTOR_START_TIMEOUT_S  # a restarted actor is as slow to come back as a new one to start
# what --client-resources calls a resource -> what Ray's cluster_resources() calls it
RAY_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU"}
# the counts a run's `backend` results always carry (0: nothing of the kind happened)
BACKEND_COUNTS = ("actor_failures", "lost_tasks", "refused_tasks")
# how long a head's host:port may take to accept a connection before the run says nothing is there
GCS_PROBE_TIMEOUT_S = 10.0


class RayClusterError(ConfigError):
    """What was asked of Ray cannot run there: no cluster at --ray-address, no Ray Client for a
    ray:// address, or actors that ask more than the cluster has. One line that says what to
    change; a usage error (of --ray-address, --ray-actors, --client-resources)."""


class SnapshotStore:
    """A client's round-start state in a file: what a restarted actor resumes from."""

    def __init__(self, path: Path):
        self.path = path

    def save_round_start(self, round_no: Any, client_state: dict[str, Any]) -> None:
        try:  # into the directory made when the actor built its clients, never made again here
            torch_save_atomic({"round": round_no, "state": client_state}, self.path, parents=False)
        except FileNotFoundError:  # removed: the run is ending (its actors are being ended)
            log.warning("no snapshot directory %s: %s's round start is not saved", self.path.parent, self.path.stem)

    def load_round_start(self) -> tuple[Any, dict[str, Any]] | None:
        if not self.path.exists():
            return None
        saved = torch.load(self.path, weights_only=False)
        return saved["round"], saved["state"]

    def after_task(self, session: ClientSession) -> None:
        return None


class ClientGroup:
    """A Ray actor's clients: built from the run config, each behind its own session.

    The public set comes from Ray's object store (put there once by the driver; on one node every
    actor reads the same shared, read-only copy). Its reference rides along with each call, nested
    in a list (`public`), instead of being a constructor argument: Ray warns about every
    restartable actor whose constructor arguments live in the object store (ray#53727). So the
    clients are built on the first call, also after a restart."""

    def __init__(self, config: dict, indices: list[int], snapshot_dir: str, run_id: str):
        self.config = config
        self.indices = indices
        self.snapshot_dir = snapshot_dir
        self.run_id = run_id
        self.vectorize = RunConfig(**config).vectorized
        self.restored = 0
        self.public_hash = ""
        self.sessions: dict[str, ClientSession] = {}

    def _build(self, public: list[Any]) -> None:
        """The sessions, once: this actor's partitions built here, the public set from the store."""
        if self.sessions:
            return
        import warnings

        import ray

        cfg = RunConfig(**self.config).resolved()
        torch.set_num_threads(cfg.threads)
        data = build_data(cfg)  # this actor's clients' partitions (the driver ships no data at all)
        self.public_hash = data.public_hash  # built from this node's files: checked against the driver's
        public_x = ray.get(public[0])
        data.public_x = public_x  # the store's copy only: the one built here is freed
        with warnings.catch_warnings():  # the store's array is read-only, and nothing writes to the public set
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            clients = build_clients(cfg, data, self.indices, public_x=public_x)
        Path(self.snapshot_dir).mkdir(parents=True, exist_ok=True)  # on this actor's node, if not the driver's
        for i, (cid, client) in zip(self.indices, clients.items()):
            test, local_test = client_tests(data, i)
            store = SnapshotStore(Path(self.snapshot_dir) / f"{cid}.pt")
            session = ClientSession(self.run_id, cid, client, instance=self.run_id, store=store,
                                    evaluate=functools.partial(evaluation_reply, client, test=test, local_test=local_test))
            start = store.load_round_start()
            if start is not None:  # a restart: back to the last round start
                client.load_state_dict(start[1])
                session.restore(None, None, start[0], set())
                self.restored += 1
            self.sessions[cid] = session

    def started(self) -> int:
        """Answers once the actor is placed and its process is up (nothing built yet)."""
        return os.getpid()

    def ready(self, public: list[Any]) -> dict[str, Any]:
        import resource

        self._build(public)
        return {"pid": os.getpid(), "restored": self.restored, "public_hash": self.public_hash,
                "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}

    def forget(self) -> int:
        """Remove this actor's clients' snapshots, and their directory once it is empty; how many
        went. On a node other than the driver's nobody else would: the driver removes the directory
        on its own node only, and a client's state derives from its private data."""
        folder = Path(self.snapshot_dir)
        gone = 0
        for cid in self.sessions:
            with contextlib.suppress(FileNotFoundError):
                (folder / f"{cid}.pt").unlink()
                gone += 1
        with contextlib.suppress(OSError):  # not empty: other actors' clients on this node, or the driver's node
            folder.rmdir()
        return gone

    def outputs(self, public: list[Any], x: np.ndarray) -> dict[str, np.ndarray]:
        """Each hosted client's current outputs on `x` (to compare a run with another)."""
        self._build(public)
        return {cid: s.client.predict(x).numpy() for cid, s in self.sessions.items()}

    def states(self, public: list[Any]) -> dict[str, dict[str, Any]]:
        """Each hosted client's state and its session's (a checkpoint of the run: fedal/sim/checkpoint.py)."""
        self._build(public)
        return client_states(self.sessions)

    def load_states(self, public: list[Any], states: dict[str, dict[str, Any]]) -> None:
        """The hosted clients and their sessions as `states` holds them (a resumed run)."""
        self._build(public)
        load_client_states(self.sessions, states)
        for session in self.sessions.values():  # what a restart of this actor goes back to, from now on
            assert session.store is not None  # (every session of an actor has its snapshot store)
            session.store.save_round_start(session.round_no, session.client.state_dict())

    def on_group(self, public: list[Any], items: list[tuple[str, Message]]) -> tuple[list[Answer], Stacking]:
        """Each task's result and, for a refused one, why (answer_tasks, as in-process)."""
        self._build(public)
        return answer_tasks(self.sessions, items, self.vectorize)


class RayTransport(SimulatedTransport):
    def __init__(self, run_id: str, client_ids: Sequence[str], actors: dict[str, Any], public: list[Any],
                 phases: PhaseSettings, phase_kinds: dict[str, str], faults: Faults | None = None):
        super().__init__(run_id, client_ids, phases, phase_kinds, faults)
        self.actors = actors  # client id -> the actor hosting it
        self.public = public  # [the public set's object ref], for every call (ClientGroup)

    def client_states(self) -> dict[str, dict[str, Any]]:
        import ray

        states: dict[str, dict[str, Any]] = {}
        for actor in dict.fromkeys(self.actors.values()):
            for attempt in (1, 2):  # an actor that died is restarted by Ray from its round-start snapshots
                try:
                    states.update(ray.get(actor.states.remote(self.public)))
                    break
                except ray.exceptions.RayActorError as exc:
                    self.counters["actor_failures"] += 1
                    if attempt == 2:
                        raise ClientStatesUnavailable(f"an actor died twice while asked for its clients' states "
                                                      f"({exc})") from None
                    log.warning("an actor died while asked for its clients' states (%s); asked again once Ray "
                                "restarts it", type(exc).__name__)
        return states

    def load_client_states(self, states: Mapping[str, dict[str, Any]]) -> None:
        import ray

        check_states_cover(self.actors, states)  # before any actor loads anything
        parts: dict[Any, dict[str, dict[str, Any]]] = {}
        for cid, actor in self.actors.items():
            parts.setdefault(actor, {})[cid] = states[cid]
        ray.get([actor.load_states.remote(self.public, part) for actor, part in parts.items()])

    def _compute(self, items: list[Pending]) -> list[Packet | None]:
        import ray

        by_actor: dict[Any, list[int]] = {}
        for k, (cid, *_rest) in enumerate(items):
            by_actor.setdefault(self.actors[cid], []).append(k)
        calls = {actor: actor.on_group.remote(self.public, [items[k][:2] for k in ks]) for actor, ks in by_actor.items()}
        results: list[Packet | None] = [None] * len(items)
        for actor, ref in calls.items():
            try:
                answers, stacking = ray.get(ref)
            except ray.exceptions.RayActorError as exc:  # the actor died: its tasks get no answer
                self.counters["actor_failures"] += 1
                self.counters["lost_tasks"] += len(by_actor[actor])
                log.warning("an actor died with %d tasks (%s); Ray restarts it from its clients' round-start "
                            "snapshots", len(by_actor[actor]), type(exc).__name__)
                self._await_restart(actor)
                continue
            self.stacking.add(stacking)
            ks = by_actor[actor]
            for k, result in zip(ks, count_refusals(self.counters, [items[k] for k in ks], answers)):
                results[k] = result
        return results


    def _await_restart(self, actor: Any) -> None:
        """Wait (in real time, at most RESTART_WAIT_S) for Ray to have the actor back: the engine
        re-sends its lost tasks after a re-send period of simulated time, and a restart slower
        than a few of those (a busy machine: a new worker imports torch and rebuilds its clients)
        would let the phase's deadline close without clients that only their actor's restart
        kept from answering."""
        import ray

        try:
            ray.get(actor.ready.remote(self.public), timeout=RESTART_WAIT_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # still away: the engine's rules decide
            log.warning("the actor is not back after %.0f s (%s): its clients miss what the phase's deadline "
                        "leaves them", RESTART_WAIT_S, type(exc).__name__)


def start_ray(address: str | None, num_cpus: int | None, verbose: bool) -> bool:
    """Join `address` or start a local instance on loopback; True if this call started it. A
    stop signal's handler set before (procs.stop_signals_interrupt) is kept: ray.init puts its
    own SIGTERM handler in place, which would end the run without its clean-up."""
    if address == "local":
        address = None
    if not address:  # a local instance: every Ray process on 127.0.0.1 (read when ray is imported)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    on_sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    before = _descendants() if not address else set()
    started = time.time()
    try:
        with _sigterm_kept():
            _init(ray, address, num_cpus, verbose)
    except BaseException:  # a local instance stopped or failed midway: what it had started goes too
        if not address:
            from fedal.sim.ray_reaper import end

            end(_descendants() - before)
            for session in Path(tempfile.gettempdir(), "ray").glob(f"session_*_{os.getpid()}"):
                with contextlib.suppress(OSError):
                    if session.stat().st_mtime >= started - 1:  # this attempt's, not an earlier driver's with our PID
                        shutil.rmtree(session, ignore_errors=True)
        raise
    finally:
        if on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)
    if not address:
        _local_processes.update(_descendants() - before)
        _start_reaper()
    return True


def _start_reaper() -> None:
    """fedal/sim/ray_reaper.py, told this instance's processes and session directory: it ends
    them if this driver dies without shutting the instance down (SIGKILL). Its own session, so a
    terminal's Ctrl-C to this driver's group does not end it first."""
    global _reaper
    try:
        _reaper = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ray_reaper.py"))],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert _reaper.stdin is not None
        assert _reaper.stdout is not None
        ready, _, _ = select.select([_reaper.stdout], [], [], 15)
        if not ready or _reaper.stdout.readline().strip() != b"ready":
            raise OSError(f"it did not start (exit status {_reaper.poll()}; is psutil installed?)")
        lines = [f"session {_local_session}"] if _local_session else []
        lines += [f"proc {pid} {ticks}" for pid, ticks in sorted(_local_processes)]
        _reaper.stdin.write(("\n".join(lines) + "\n").encode())
        _reaper.stdin.flush()
    except OSError as exc:  # without it only a killed driver leaves Ray's agents behind, for a minute or two
        log.warning("the Ray instance's reaper %s: a driver killed outright would leave Ray's agents running", exc)
        if _reaper is not None:
            _reaper.kill()
            _reaper.wait()
        _reaper = None


def _stop_reaper() -> None:
    global _reaper
    reaper, _reaper = _reaper, None
    if reaper is None or reaper.stdin is None:
        return
    with contextlib.suppress(OSError):
        reaper.stdin.write(b"done\n")
        reaper.stdin.close()
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()
    if reaper.stdout is not None:
        reaper.stdout.close()


@contextlib.contextmanager
def _sigterm_kept() -> Iterator[None]:
    """ray.init sets its own SIGTERM handler (sys.exit) at its start, through this module
    attribute: a stop signal during the seconds it takes would end the driver without its
    clean-up. Kept as it is for the call instead (the stop handler then raises as anywhere)."""
    try:
        from ray._private import utils as ray_utils
    except ImportError:  # another Ray layout: its own handler stays
        yield
        return
    original = getattr(ray_utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    ray_utils.set_sigterm_handler = lambda *_args, **_kwargs: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def _descendants() -> set[Process]:
    import psutil

    from fedal.sim.ray_reaper import identify

    out: set[Process] = set()
    for proc in psutil.Process().children(recursive=True):
        who = identify(proc.pid)
        if who is not None:
            out.add(who)
    return out


def _init(ray: Any, address: str | None, num_cpus: int | None, verbose: bool) -> None:
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": verbose,
                               "logging_level": logging.INFO if verbose else logging.ERROR}
    if address:
        client = address.startswith("ray://")
        if client and importlib.util.find_spec("grpc") is None:  # what Ray Client needs (ray[client])
            raise RayClusterError(_no_ray_client(address))
        if not client and address != "auto":  # host:port of a cluster's head: ray.init waits forever for no one
            problem = _unreachable(address)
            if problem is not None:
                raise RayClusterError(f"no Ray cluster at {address} ({problem}): start one there with "
                                      "`ray start --head`, or leave --ray-address out for a local instance")
        try:
            ray.init(address=address, **options)
        except ConnectionError:
            raise RayClusterError(f"no Ray cluster at {address}: start one with `ray start --head`, or leave "
                                  "--ray-address out for a local instance") from None
        except ValueError as exc:
            if client and "ray[client]" in str(exc):
                raise RayClusterError(_no_ray_client(address)) from None
            raise
    else:  # "local": always a new instance, never one RAY_ADDRESS or a `ray start --head` here names
        context = ray.init(address="local", num_cpus=num_cpus, _node_ip_address="127.0.0.1", **options)
        session = getattr(context, "address_info", {}).get("session_dir") or ""
        if session.rstrip("/").endswith(f"_{os.getpid()}"):  # named after the driver that started it: ours
            global _local_session
            _local_session = session


Process = tuple[int, int]  # (PID, start ticks): fedal/sim/ray_reaper.py
_local_session: str | None = None  # the session directory of the local instance start_ray started
_local_processes: set[Process] = set()  # the processes it started (gcs, raylet, their agents)
_reaper: subprocess.Popen | None = None  # ends them if this driver is killed (fedal/sim/ray_reaper.py)


def shutdown_local_ray() -> None:
    """`ray.shutdown()` of the instance start_ray started, then an end to any of its processes
    left, and its session directory removed. Shut down while a call was interrupted (a stop
    signal), Ray leaves its dashboard and runtime-env agents to notice on their own, a minute or
    two later. Its processes are those that appeared under this driver while ray.init ran, and
    theirs now (workers come later): no other process is touched, not even another child of the
    driver's."""
    import ray

    global _local_session
    session, _local_session = _local_session, None
    from fedal.sim.ray_reaper import end, family

    ours = family(_local_processes)
    _local_processes.clear()
    ray.shutdown()
    end(ours)
    if session and Path(session).is_dir():  # named after this driver (see _init): its own
        shutil.rmtree(session, ignore_errors=True)
    _stop_reaper()


def _unreachable(address: str, timeout_s: float = GCS_PROBE_TIMEOUT_S) -> str | None:
    """Why nothing answers at a head's host:port (None when something listens there)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return "not host:port, auto or ray://host:port"
    return unreachable(host, int(port_text), timeout_s)


def _start_timeout() -> float:
    """FEDAL_RAY_START_TIMEOUT_S, or ACTOR_START_TIMEOUT_S where it is not set."""
    text = os.environ.get("FEDAL_RAY_START_TIMEOUT_S", "").strip()
    if not text:
        return ACTOR_START_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"FEDAL_RAY_START_TIMEOUT_S: seconds (a number > 0), got {text!r}")
    return value


def _no_ray_client(address: str) -> str:
    import ray

    return (f"--ray-address {address} needs Ray Client, which the `ray` extra does not install: "
            f"pip install 'ray[client]=={ray.__version__}' into this toolkit's virtualenv ({sys.prefix})")


def _resource_text(resources: dict[str, float]) -> str:
    return ",".join(f"{name}={value:g}" for name, value in resources.items())


def actors_that_fit(resources: dict[str, float], cluster: dict[str, float]) -> int:
    """How many actors of `resources` each the cluster's total resources hold at once (its CPUs
    when the actors ask for nothing)."""
    asked = [(RAY_RESOURCE_NAMES.get(name, name), each) for name, each in resources.items() if each > 0]
    if not asked:
        return int(cluster.get("CPU", 1))
    return min(int(math.floor(float(cluster.get(key, 0.0)) / each + 1e-9)) for key, each in asked)


def check_cluster_fits(n_actors: int, resources: dict[str, float], cluster: dict[str, float]) -> None:
    """Refuse `n_actors` actors of `resources` each (--client-resources) when the cluster's total
    resources (ray.cluster_resources()) cannot hold them all at once: Ray would never place the rest."""
    need = {RAY_RESOURCE_NAMES.get(name, name): n_actors * each for name, each in resources.items() if each > 0}
    short = {key: amount for key, amount in need.items() if amount > float(cluster.get(key, 0.0)) + 1e-9}
    if not short:
        return
    fit = actors_that_fit(resources, cluster)
    asked = ", ".join(f"{key}={amount:g}" for key, amount in short.items())
    has = ", ".join(f"{key}={float(cluster.get(key, 0.0)):g}" for key in short)
    asks = (f"1 Ray actor of {_resource_text(resources)} needs {asked}" if n_actors == 1 else
            f"{n_actors} Ray actors of {_resource_text(resources)} each need {asked} in all")
    fix = f"use --ray-actors {fit} or fewer, or ask less in --client-resources" if fit >= 1 else \
        "ask less in --client-resources, or join a cluster that has it (--ray-address)"
    raise RayClusterError(f"{asks}, but the Ray cluster has {has}: {fix}")


SNAPSHOT_PREFIX = "fedal-ray-snapshots-"


def snapshot_dir(parent: str | None = None) -> str:
    """A new directory for the actors' round snapshots (procs.pid_dir: those of drivers killed
    before they could remove theirs are removed first)."""
    return pid_dir(parent or tempfile.gettempdir(), SNAPSHOT_PREFIX)


class RayClients:
    """The actors of one run and what it takes to end them (and the snapshots) afterwards."""

    def __init__(self, config: RunConfig, data, run_id: str = "sim", address: str | None = None,
                 actors: int | None = None, resources: dict[str, float] | None = None, verbose: bool = False):
        import ray

        self.handles: list[Any] = []
        self.actor_of: dict[str, Any] = {}
        self.snapshot_dir: str | None = None
        try:
            self.started = start_ray(address, None, verbose)
        except BaseException:  # e.g. a stop signal within ray.init: ray.shutdown() for what it started
            if not address or address == "local":
                shutdown_local_ray()
            raise
        try:
            self._start(ray, config, data, run_id, actors, resources or {"num_cpus": 1.0})
        except BaseException:
            self.close(forget=False)  # actors not placed, or still building their clients: nothing saved yet
            raise

    def _start(self, ray: Any, config: RunConfig, data, run_id: str, actors: int | None,
               resources: dict[str, float]) -> None:
        cluster = ray.cluster_resources()
        n_actors = actors or actors_that_fit(resources, cluster)  # as many as the cluster holds at once
        n_actors = max(1, min(n_actors, config.clients))
        check_cluster_fits(n_actors, resources, cluster)  # before any actor waits for what is not there
        timeout_s = _start_timeout()
        self.snapshot_dir = snapshot_dir()
        self.public = [ray.put(data.public_x)]  # once; every actor reads it from the store
        ids = client_ids(config.clients)
        remote: Any = ray.remote(max_restarts=-1, max_task_retries=0)(ClientGroup)
        cpus = resources.get("num_cpus", 1.0)
        gpus = resources.get("num_gpus", 0.0)
        memory = {"memory": resources["memory"]} if "memory" in resources else {}  # bytes: Ray's keyword, no custom one
        custom = {k: v for k, v in resources.items() if k not in ("num_cpus", "num_gpus", "memory")}
        cfg = config.model_dump(mode="json")
        for a in range(n_actors):
            indices = list(range(a, config.clients, n_actors))
            handle = remote.options(num_cpus=cpus, num_gpus=gpus, resources=custom or None, **memory).remote(
                cfg, indices, self.snapshot_dir, run_id)
            self.handles.append(handle)
            for i in indices:
                self.actor_of[ids[i]] = handle
        self._wait_started(ray, resources, timeout_s)
        ready = ray.get([h.ready.remote(self.public) for h in self.handles])
        self.pids = [r["pid"] for r in ready]
        if any(r["public_hash"] != data.public_hash for r in ready):  # a worker node with other data files
            raise ConfigError("a Ray actor built another public set than the driver (different dataset files on "
                              "its node?); every node needs the same data")

    def _wait_started(self, ray: Any, resources: dict[str, float], timeout_s: float) -> None:
        """Every actor placed and up within `timeout_s`, or a one-line error (the cluster has the
        resources in all, but other work holds them now)."""
        pending = [h.started.remote() for h in self.handles]
        deadline = time.monotonic() + timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
            ray.get(done)  # an actor that failed to start says why
            if pending and time.monotonic() >= deadline:
                free = ", ".join(f"{key}={amount:g}" for key, amount in _free(ray, resources).items())
                raise ConfigError(
                    f"only {len(self.handles) - len(pending)} of {len(self.handles)} Ray actors "
                    f"({_resource_text(resources)} each) started within {timeout_s:g} s; the cluster "
                    f"has {free} free now (other work holds the rest?): use fewer --ray-actors or less "
                    "--client-resources, or raise FEDAL_RAY_START_TIMEOUT_S")

    def restored(self) -> int:
        """Clients the actors brought back from a snapshot (after Ray restarted them)."""
        import ray

        return sum(r["restored"] for r in ray.get([h.ready.remote(self.public) for h in self.handles]))

    def close(self, forget: bool = True) -> None:
        """End the actors and remove the snapshots. `forget`: each actor first removes its own
        (those on other nodes of a cluster); False for a run stopped midway, whose actors may still
        be working (asking them would wait for that), so snapshots on other nodes may stay."""
        import ray

        try:
            if forget and self.handles:
                try:
                    ray.get([h.forget.remote() for h in self.handles], timeout=30)
                except Exception as exc:  # noqa: BLE001 (an actor gone or stuck: the kill below ends it all the same)
                    log.warning("not every Ray actor removed its clients' snapshots (%s)", type(exc).__name__)
        finally:  # a stop signal while they remove them included
            self._end_actors()

    def _end_actors(self) -> None:
        import ray

        try:
            for handle in self.handles:
                ray.kill(handle, no_restart=True)
        finally:
            try:
                if self.snapshot_dir:  # also when a kill failed (a remote cluster's connection lost)
                    shutil.rmtree(self.snapshot_dir, ignore_errors=True)
            finally:
                if self.started:
                    shutdown_local_ray()  # every process of the instance ended
                    if self.snapshot_dir:  # again: a killed actor may have been saving a snapshot until then
                        shutil.rmtree(self.snapshot_dir, ignore_errors=True)


def _free(ray: Any, resources: dict[str, float]) -> dict[str, float]:
    """What the cluster has free now of the resources the actors ask."""
    available = ray.available_resources()
    keys = [RAY_RESOURCE_NAMES.get(name, name) for name, each in resources.items() if each > 0]
    return {key: float(available.get(key, 0.0)) for key in keys}


def ray_engine(config: RunConfig, data, server, phase_kinds: dict[str, str], clients: RayClients,
               global_metrics=None) -> RoundEngine:
    phases = PhaseSettings()
    faults = Faults(config.dropout, config.stragglers, config.straggle_every, seed=config.seed)
    ids = list(server.client_ids)
    transport = RayTransport("sim", ids, clients.actor_of, clients.public, phases, phase_kinds, faults)
    return simulated_round_engine(server, transport, phases, phase_kinds, config.rounds, config.eval_every,
                                  global_metrics)


def ray_run(config: RunConfig, global_metrics_of, verbose: bool = False):
    """(data, server half, engine, close) of a Ray-backed simulation of `config` (resolved); call
    close() at the end, whatever happened: it ends the actors (and Ray, if started here) and
    returns what the backend did, for the results."""
    from fedal.sim.build import build_server
    from fedal.strategies import get_strategy

    data = build_data(config)
    build_clients(config, data, _one_per_model(config))  # refuses models of mixed feature widths early
    ids = client_ids(config.clients)
    server = build_server(config, data, ids)
    clients = RayClients(config, data, address=config.ray_address, actors=config.ray_actors,
                         resources=parse_resources(config.client_resources), verbose=verbose)
    try:
        engine = ray_engine(config, data, server, dict(get_strategy(config.strategy).phases), clients,
                            global_metrics=global_metrics_of(config, data, server))
    except BaseException:
        clients.close(forget=False)  # no task ran: nothing saved yet
        raise

    def close(finished: bool = True) -> dict[str, Any]:
        """`finished` False (a run stopped midway: a stop signal, an error): the actors are ended at
        once, without asking them anything, which would wait for the work they still do (each takes
        one call at a time)."""
        transport = engine.transport
        info: dict[str, Any] = {"name": "ray", "actors": len(clients.handles), **dict.fromkeys(BACKEND_COUNTS, 0),
                                **dict(getattr(transport, "counters", {}))}
        try:
            if finished:
                info["restored_clients"] = clients.restored()
        finally:
            clients.close(forget=finished)
        return info

    return data, server, engine, close


def _one_per_model(config: RunConfig) -> list[int]:
    models = config.resolved_models()
    return list(range(min(len(models), config.clients)))

