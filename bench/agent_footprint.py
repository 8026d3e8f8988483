"""What an edge agent costs a board: memory while training, start-up time, install size.

Real agent processes take part in a real run (coordinator process, Mosquitto or the embedded
broker, loopback), one process per zoo model, and each is measured from the outside:

* peak RSS: the kernel's ru_maxrss of the agent process, read with wait4() when it exits at the
  end of the run (so it covers start-up, every training phase, evaluation and the final export);
* RSS when online: VmRSS read from /proc the moment its retained `online` status arrives (torch
  imported and warmed up, nothing trained yet);
* time to online: from spawning the process to that status message reaching a subscriber;
* install size: the on-disk size of the `agent` extra's dependency closure as installed in this
  Python (the distributions' RECORD files), plus the toolkit's own packages. The 64-bit Pi
  figure (torch 2.10.0 aarch64) comes from firmware_scripts/arm64-smoke.sh.

    python bench/agent_footprint.py                  # writes docs/results/agent_footprint.{md,json}
    python bench/agent_footprint.py --rounds 1 --out /tmp/fp --json

The fleet runner here (`run_fleet`) is also what firmware_scripts/arm64-smoke.sh drives, with
one agent's command replaced by an emulated arm64 one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

GOAL_MB = 250  # peak RSS training the MNIST-1D CNN: what a 512 MB Pi Zero 2 W can spare
ZOO = {"mnist1d": ["mlp", "cnn1d", "cnn1d_wide"], "digits": ["lenet5", "smallcnn"]}
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable from a checkout without an install, like the other benchmarks
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from loopback_broker import loopback_broker  # noqa: E402
from report_text import kept_reading  # noqa: E402

from fedal import procs  # noqa: E402

# -- measuring one process ---------------------------------------------------------------------
# The kernel's peak RSS of a process (ru_maxrss) starts from its parent's at fork/exec: an agent
# spawned straight from this benchmark (torch imported, ~350 MB) would report at least that much.
# So every measured process is started by this small launcher (python -S, about 8 MB), which
# forks, execs the command, writes the child's pid at once and its wait4() rusage at the end.
LAUNCHER = r"""
import ctypes, json, os, signal, sys
out, cmd = sys.argv[1], sys.argv[2:]
parent = os.getpid()
pid = os.fork()
if pid == 0:
    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG: ends with this launcher
    if os.getppid() != parent:
        os._exit(1)
    os.execvp(cmd[0], cmd)
with open(out + ".pid", "w") as f:
    f.write(str(pid))
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, _f: os.kill(pid, n))
_, status, usage = os.wait4(pid, 0)
with open(out, "w") as f:
    json.dump({"pid": pid, "maxrss_kib": usage.ru_maxrss, "status": status}, f)
sys.exit(os.waitstatus_to_exitcode(status))
"""


class Measured:
    """A command started through LAUNCHER: its pid, live /proc readings, and its exact peak RSS."""

    def __init__(self, command: list[str], report: Path, **popen):
        self.report = report
        report.unlink(missing_ok=True)
        Path(f"{report}.pid").unlink(missing_ok=True)
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-S", "-E", "-c", LAUNCHER, str(report), *command],
                                     preexec_fn=procs.dies_with_this_process(), **popen)  # ends with the bench
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The measured process (the launcher's child), once it has been forked."""
        if self._pid is None:
            try:
                self._pid = int(Path(f"{self.report}.pid").read_text())
            except (OSError, ValueError):
                return None
        return self._pid

    def wait(self, timeout: float | None = None) -> tuple[int, int | None]:
        """(exit code, peak RSS in KiB; None if the launcher itself was killed)."""
        rc = self.proc.wait(timeout)
        try:
            return rc, int(json.loads(self.report.read_text())["maxrss_kib"])
        except (OSError, ValueError, KeyError):
            return rc, None

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher passes SIGTERM on to the agent


def proc_status_kib(pid: int | None, *fields: str) -> dict[str, int]:
    """Selected memory lines of /proc/<pid>/status, in KiB (empty once the process is gone)."""
    out: dict[str, int] = {}
    if pid is None:
        return out
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in fields:
                out[key] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return {}
    return out


ONE_STEP = ("import torch, edge_agent.agent; from fedal.strategies.optim import Adam; "
            "p = torch.zeros(1, requires_grad=True); o = Adam([p]); p.sum().backward(); o.step()")


def baseline_rss_kib(python: str, code: str, workdir: Path) -> int:
    """Peak RSS of `python -c code`: what importing alone costs."""
    m = Measured([python, "-c", code], workdir / f"baseline-{abs(hash(code))}.json", stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE)
    rc, peak = m.wait()
    if rc != 0 or peak is None:
        raise RuntimeError(f"{python} -c {code!r} failed: {m.proc.stderr.read().decode()[-500:]}")
    return peak


# -- a fleet on loopback -------------------------------------------------------------------------
@dataclass
class AgentMeasure:
    client_id: str
    model: str
    command: list[str]
    launcher: Measured | None = None
    online_s: float | None = None  # spawn to the retained `online` status reaching a subscriber
    rss_online_kib: int | None = None  # VmRSS then: imported, warmed up, nothing trained yet
    run_rss_kib: int = 0  # max sampled VmRSS until the agent began its final artifacts
    run_anon_kib: int = 0  # max sampled RssAnon (memory not backed by files) in that window
    peak_rss_kib: int | None = None  # exact lifetime peak (ru_maxrss), incl. the final ONNX export
    returncode: int | None = None
    final_dir: Path | None = None  # appears when the agent starts writing its final artifacts
    emulated: bool = False  # runs under qemu-user: guest_rss_kib estimates its native RSS
    guest_rss_kib: int = 0  # max sampled RSS without qemu's share, until the run finished
    accuracies: list = field(default_factory=list)
    last_round: int | None = None
    final_acc: float | None = None

    @property
    def pid(self) -> int | None:
        return None if self.launcher is None else self.launcher.pid


class StatusWatcher:
    """Records when each agent's first retained `online` status arrives, and its RSS then."""

    def __init__(self, broker_url: str, run_id: str, agents: dict[str, AgentMeasure]):
        import paho.mqtt.client as mqtt

        from fedal.protocol import parse_broker_url, topics

        self.agents = agents
        addr = parse_broker_url(broker_url)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fedal-footprint-{os.getpid()}")
        self.client.on_connect = lambda c, *_: c.subscribe(topics.status_filter(run_id), qos=1)
        self.client.on_message = self._on_message
        self.client.connect(addr.host, addr.port)
        self.client.loop_start()

    def _on_message(self, _c, _u, msg) -> None:
        now = time.monotonic()
        try:
            state = json.loads(msg.payload).get("state")
        except (ValueError, AttributeError):
            return
        a = self.agents.get(msg.topic.rsplit("/", 1)[-1])
        if state == "online" and a is not None and a.launcher is not None and a.online_s is None:
            a.online_s = now - a.launcher.started
            a.rss_online_kib = proc_status_kib(a.pid, "VmRSS").get("VmRSS")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def guest_rss_kib(pid: int | None) -> int | None:
    """For a process emulated by qemu-user: its RSS without qemu's own share, from smaps.

    qemu-user maps the guest's memory and files into its own address space 1:1, so what is left
    after removing qemu's translation cache (anonymous executable mappings, or the tcg-jit memfd
    in split-wx mode), qemu's malloc heap ([heap]: translation-block metadata; the guest's brk
    heap is an ordinary mapping) and qemu's binary is an estimate of the RSS the same program
    would have natively on arm64.
    """
    if pid is None:
        return None
    total = 0
    skip = False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                    perms, name = head[1], (head[5].strip() if len(head) > 5 else "")
                    skip = ((not name and "x" in perms) or name.startswith("/memfd:tcg-jit") or name == "[heap]"
                            or "qemu-" in name.rsplit("/", 1)[-1])
                elif head[0] == "Rss:" and not skip:
                    total += int(head[1])
    except (OSError, ValueError, IndexError):
        return None
    return total


class Sampler(threading.Thread):
    """Polls every agent's VmRSS and RssAnon while it trains (until its final/ directory
    appears), keeping the maxima; for emulated agents also the estimate without qemu's share
    (from smaps, once a second)."""

    def __init__(self, agents: dict[str, AgentMeasure], period_s: float = 0.2):
        super().__init__(name="rss-sampler", daemon=True)
        self.agents, self.period_s = agents, period_s
        self.stopped = threading.Event()

    def run(self) -> None:
        ticks = 0
        while not self.stopped.wait(self.period_s):
            ticks += 1
            for a in self.agents.values():
                if a.final_dir is not None and a.final_dir.exists():
                    continue  # training is over; the final export is only in the lifetime peak
                st = proc_status_kib(a.pid, "VmRSS", "RssAnon")
                a.run_rss_kib = max(a.run_rss_kib, st.get("VmRSS", 0))
                a.run_anon_kib = max(a.run_anon_kib, st.get("RssAnon", 0))
                if a.emulated and ticks % 5 == 0:
                    a.guest_rss_kib = max(a.guest_rss_kib, guest_rss_kib(a.pid) or 0)


def get_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def run_fleet(config, workdir: Path, broker: str, setup=None, phases: dict | None = None,
              timeout_s: float = 1800, progress=print) -> tuple[list[AgentMeasure], dict]:
    """One run: coordinator plus one agent process per client, each measured; (agents, results).

    `setup(agent_configs)`, called with {client id: its agent.toml} once the workspace is
    prepared and before anything starts, may return {client id: {"command": [...], "env": {...},
    "final_dir": Path, "emulated": bool}} to start some agents differently (the whole command
    line, config included; final_dir: where that agent writes its final artifacts). Phases close
    only when every client answered (quorum 1), so each agent takes part in every round.
    """
    from fedal_cli.demo import RUN_ID, free_port, prepare_workspace, spawn, terminate

    config = config.resolved()
    api_port = free_port()
    api = f"http://127.0.0.1:{api_port}"
    coord_path, agent_paths, _ = prepare_workspace(config, workdir, broker, api_port)
    coord = tomllib.loads(coord_path.read_text())
    coord["phases"] = {"quorum": 1.0, "deadline_s": timeout_s, "train_deadline_s": timeout_s,
                       "start_timeout_s": timeout_s, **(phases or {})}
    coord_path.write_text(tomli_w.dumps(coord))

    custom = setup({p.parent.name: p for p in agent_paths}) if setup is not None else {}
    agents: dict[str, AgentMeasure] = {}  # enrolment order = the order of each round's client_acc
    envs: dict[str, dict[str, str]] = {}
    for i, path in enumerate(agent_paths):
        cid = path.parent.name
        how = custom.get(cid) or {"command": [sys.executable, "-m", "edge_agent", "--config", str(path)],
                                  "env": {**os.environ, "PYTHONUNBUFFERED": "1"},
                                  "final_dir": Path(tomllib.loads(path.read_text())["workspace"]) / "final"}
        envs[cid] = how["env"]
        agents[cid] = AgentMeasure(cid, config.models[i % len(config.models)], how["command"],
                                   final_dir=how.get("final_dir"), emulated=how.get("emulated", False))

    watcher = StatusWatcher(broker, RUN_ID, agents)
    sampler = Sampler(agents)
    coordinator = spawn("coordinator", coord_path, workdir / "coordinator" / "coordinator.log")
    try:
        sampler.start()
        for path in agent_paths:
            a = agents[path.parent.name]
            with open(path.parent / "agent.log", "wb") as log:
                a.launcher = Measured(a.command, path.parent / "rusage.json", stdout=log, stderr=subprocess.STDOUT,
                                      env=envs[a.client_id], start_new_session=True)
        results = _wait_finished(api, RUN_ID, coordinator, agents, config.rounds, timeout_s, progress)
        sampler.stopped.set()
        for a in agents.values():  # agents exit by themselves once the run is finished
            a.returncode, a.peak_rss_kib = a.launcher.wait(timeout=300)
    finally:
        sampler.stopped.set()
        for a in agents.values():
            if a.launcher is not None and a.launcher.proc.poll() is None:
                a.launcher.terminate()
                a.returncode, a.peak_rss_kib = a.launcher.wait(timeout=60)
        terminate([coordinator])
        watcher.close()
    for j, a in enumerate(agents.values()):
        a.accuracies = [(r.get("client_acc") or [None] * len(agents))[j] for r in results["rounds"]]
        done = [r["round"] for r, acc in zip(results["rounds"], a.accuracies) if acc is not None]
        a.last_round = max(done) if done else None
        a.final_acc = a.accuracies[-1] if a.accuracies else None
    return list(agents.values()), results


def _wait_finished(api: str, run_id: str, coordinator: subprocess.Popen, agents: dict[str, AgentMeasure], rounds: int,
                   timeout_s: float, progress) -> dict:
    deadline = time.monotonic() + timeout_s
    seen = -1
    while time.monotonic() < deadline:
        if coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited with status {coordinator.returncode}; see its log")
        dead = [a.client_id for a in agents.values() if a.launcher is not None and a.launcher.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"agent(s) {', '.join(dead)} exited before the run finished; see their agent.log")
        try:
            run = get_json(f"{api}/api/v1/runs/{run_id}")
        except (urllib.error.URLError, OSError, ValueError):
            time.sleep(0.5)
            continue
        if run["completed_rounds"] != seen:
            seen = run["completed_rounds"]
            online = sum(1 for a in agents.values() if a.online_s is not None)
            progress(f"run {run['state']}: {seen}/{rounds} rounds, {online}/{len(agents)} agents seen online")
        if run["state"] == "finished":
            return get_json(f"{api}/api/v1/runs/{run_id}/results", timeout=30)
        if run["state"] in ("failed", "stopped"):
            raise RuntimeError(f"the run {run['state']}: {run.get('error')}")
        time.sleep(0.5)
    raise RuntimeError(f"the run did not finish within {timeout_s:.0f} s")


# -- install size ---------------------------------------------------------------------------------
def dependency_closure(project: str = "fedal-edge", extras: tuple[str, ...] = ("agent",)) -> list[str]:
    """Installed distributions that `project[extras]` needs, transitively (markers evaluated here)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, str] = {}
    todo = [(project, extras)]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not wanted:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise RuntimeError(f"{name} is not installed in this Python: install {project}[{','.join(extras)}]") from None
        seen[key] = dist.metadata["Name"]
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                continue
            if canonicalize_name(req.name) != key:
                todo.append((req.name, tuple(req.extras)))
    return sorted(seen.values(), key=str.lower)


def distribution_bytes(name: str) -> int:
    from importlib.metadata import distribution

    total = 0
    for f in distribution(name).files or []:
        p = Path(f.locate())
        if p.is_file():
            total += p.stat().st_size
    return total


def own_package_bytes() -> int:
    """The toolkit's packages as a wheel would install them (an editable install holds a .pth only)."""
    total = 0
    for pkg in ("fedal", "edge_agent", "export", "coordinator"):
        for p in (REPO / pkg).rglob("*.py"):
            total += p.stat().st_size
    return total


def install_size() -> dict:
    closure = dependency_closure()
    sizes = {name: distribution_bytes(name) for name in closure if name.lower() != "fedal-edge"}
    sizes["fedal-edge (source packages)"] = own_package_bytes()
    return {"total_bytes": sum(sizes.values()), "by_distribution": dict(sorted(sizes.items(), key=lambda kv: -kv[1]))}


# -- the benchmark ----------------------------------------------------------------------------------
def mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="fedal", help="fedal has the heaviest client half (references, feedback)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tau", type=int, default=5)
    ap.add_argument("--samples-per-client", type=int, default=700, help="MNIST-1D rows per client (the demo's)")
    ap.add_argument("--public-size", type=int, default=1000)
    ap.add_argument("--datasets", default=",".join(ZOO), help=f"comma-separated subset of {','.join(ZOO)}")
    ap.add_argument("--privacy", type=float, default=1.0, metavar="SIGMA",
                    help="also run the MNIST-1D agents with differential privacy at this noise multiplier (0: not)")
    ap.add_argument("--out", default=str(REPO / "docs" / "results"))
    ap.add_argument("--json", action="store_true", help="print the JSON report instead of the markdown")
    args = ap.parse_args(argv)
    datasets = [d for d in args.datasets.split(",") if d]
    unknown = [d for d in datasets if d not in ZOO]
    if unknown or not datasets:
        ap.error(f"--datasets: choose from {', '.join(ZOO)}")

    # agent and coordinator processes import the toolkit from this checkout too
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    workdir = Path(procs.pid_dir(tempfile.gettempdir(), "fedal-footprint-"))  # a killed run's: reaped by the next
    try:
        with procs.stop_signals_interrupt():  # SIGTERM/SIGHUP as Ctrl-C: the agents stopped, workdir removed
            report = measure(args, datasets, workdir)
    except procs.Stopped as exc:
        print(f"stopped by {exc}", file=sys.stderr)
        return exc.exit_status
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent_footprint.json").write_text(json.dumps(report, indent=2) + "\n")
    md = render({**report, "out": out})
    (out / "agent_footprint.md").write_text(md + kept_reading(out / "agent_footprint.md"))
    print(json.dumps(report, indent=2) if args.json else md)
    return 0


def measure(args, datasets: list[str], workdir: Path) -> dict:
    from fedal.sim import load_config

    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    rows: list[dict] = []
    with loopback_broker(workdir) as (broker, broker_name):
        for dataset in datasets:
            models = ZOO[dataset]
            config = load_config(None, dict(strategy=args.strategy, dataset=dataset, clients=len(models), models=models,
                                            rounds=args.rounds, tau=args.tau, public_size=args.public_size, seed=0,
                                            eval_every=1,
                                            samples_per_client=args.samples_per_client if dataset == "mnist1d" else None))
            log(f"{dataset}: {', '.join(models)}")
            agents, _ = run_fleet(config, workdir / dataset, broker, progress=log)
            for a in agents:
                rows.append({"dataset": dataset, "model": a.model, "rss_online_mb": mib(a.rss_online_kib),
                             "training_rss_mb": mib(a.run_rss_kib), "training_anon_mb": mib(a.run_anon_kib),
                             "peak_rss_mb": mib(a.peak_rss_kib),
                             "online_s": None if a.online_s is None else round(a.online_s, 2),
                             "final_acc": a.final_acc, "last_round": a.last_round, "exit": a.returncode})
    import torch

    baselines = {
        "python": mib(baseline_rss_kib(sys.executable, "pass", workdir)),
        "import torch": mib(baseline_rss_kib(sys.executable, "import torch", workdir)),
        "import edge_agent.agent + one optimizer step": mib(baseline_rss_kib(sys.executable, ONE_STEP, workdir)),
    }
    size = install_size()
    cnn = next((r for r in rows if r["model"] == "cnn1d"), {"training_rss_mb": None})
    if args.privacy > 0 and "mnist1d" in datasets:  # the same agents training with DP-SGD
        with loopback_broker(workdir) as (broker, broker_name):
            models = ZOO["mnist1d"]
            config = load_config(None, dict(strategy=args.strategy, dataset="mnist1d", clients=len(models), models=models,
                                            rounds=args.rounds, tau=args.tau, public_size=args.public_size, seed=0,
                                            eval_every=1, samples_per_client=args.samples_per_client,
                                            dp_noise_multiplier=args.privacy))
            log(f"mnist1d with differential privacy (sigma {args.privacy:g}): {', '.join(models)}")
            agents, _ = run_fleet(config, workdir / "mnist1d-dp", broker, progress=log)
            for a in agents:
                rows.append({"dataset": "mnist1d", "privacy": args.privacy, "model": a.model,
                             "rss_online_mb": mib(a.rss_online_kib), "training_rss_mb": mib(a.run_rss_kib),
                             "training_anon_mb": mib(a.run_anon_kib), "peak_rss_mb": mib(a.peak_rss_kib),
                             "online_s": None if a.online_s is None else round(a.online_s, 2),
                             "final_acc": a.final_acc, "last_round": a.last_round, "exit": a.returncode})
    private_closure = set(dependency_closure(extras=("agent", "privacy"))) - set(dependency_closure())
    report = {
        "machine": {"arch": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
                    "cores": os.cpu_count(), "broker": broker_name},
        "settings": {"strategy": args.strategy, "rounds": args.rounds, "tau": args.tau,
                     "samples_per_client_mnist1d": args.samples_per_client, "public_size": args.public_size,
                     "threads": 1},
        "agents": rows,
        "baselines_mb": baselines,
        "install": {"total_mb": round(size["total_bytes"] / 2**20, 1),
                    "by_distribution_mb": {k: round(v / 2**20, 2) for k, v in size["by_distribution"].items()},
                    "privacy_extra_mb": {name: round(distribution_bytes(name) / 2**20, 2) for name in sorted(private_closure)}},
        "goal": {"cnn1d_training_rss_mb_max": GOAL_MB, "cnn1d_training_rss_mb": cnn["training_rss_mb"],
                 "met": cnn["training_rss_mb"] is not None and cnn["training_rss_mb"] <= GOAL_MB},
    }
    return report


def render(r: dict) -> str:
    m, s = r["machine"], r["settings"]
    lines = [
        "# Agent footprint (bench/agent_footprint.py)",
        "",
        f"One real agent process per zoo model in a real {s['strategy']} run ({s['rounds']} rounds, tau = {s['tau']}, "
        f"MNIST-1D {s['samples_per_client_mnist1d']} rows per client, digits an equal share, public set "
        f"{s['public_size']}, 1 torch thread), coordinator process and {m['broker']} on loopback. "
        f"Machine: {m['arch']}, {m['cores']} shared cores, Python {m['python']}, torch {m['torch']}.",
        "",
        "- *online*: RSS when the agent's retained `online` status arrived (torch and the agent imported, connected);",
        "- *training*: the largest RSS (and anonymous, i.e. not file-backed, RSS) sampled every 0.2 s until the",
        "  agent began writing its final artifacts (every round's training, transfer and evaluation);",
        "- *lifetime peak*: the kernel's exact maximum (wait4 ru_maxrss), which also covers writing the final",
        "  model as ONNX after the run.",
        "",
        "| dataset | model | online (MB) | training (MB) | training, anon (MB) | lifetime peak (MB) | spawn to `online` (s) | final acc | exit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a in r["agents"]:
        acc = "-" if a["final_acc"] is None else f"{a['final_acc']:.3f}"
        model = a["model"] + (f" (DP, sigma {a['privacy']:g})" if a.get("privacy") else "")
        lines.append(f"| {a['dataset']} | {model} | {a['rss_online_mb']} | {a['training_rss_mb']} | "
                     f"{a['training_anon_mb']} | {a['peak_rss_mb']} | {a['online_s']} | {acc} | {a['exit']} |")
    g = r["goal"]
    lines += [
        "",
        f"Goal: RSS <= {g['cnn1d_training_rss_mb_max']} MB training the MNIST-1D CNN (cnn1d): "
        + (f"**{g['cnn1d_training_rss_mb']} MB, {'met' if g['met'] else 'not met'}**." if g["cnn1d_training_rss_mb"]
         else "not measured in this run (mnist1d left out)."),
        "",
        "Peak RSS of one-line processes for comparison: "
        + ", ".join(f"`{k}` {v} MB" for k, v in r["baselines_mb"].items()) + ".",
        "",
        f"Install size of the `agent` extra's closure in this Python: **{r['install']['total_mb']} MB**",
        "(largest first; the 64-bit Pi's torch 2.10.0 venv is measured by firmware_scripts/arm64-smoke.sh,",
        "see [arm64_smoke.md](arm64_smoke.md)):",
        "",
        "| distribution | MB |",
        "|---|---|",
    ]
    items = list(r["install"]["by_distribution_mb"].items())
    for name, size in items[:12]:
        lines.append(f"| {name} | {size} |")
    if len(items) > 12:
        lines.append(f"| {len(items) - 12} more | {round(sum(v for _, v in items[12:]), 2)} |")
    extra = r["install"].get("privacy_extra_mb") or {}
    if extra:
        lines += ["", f"The `privacy` extra (differential privacy, docs/privacy.md) adds {round(sum(extra.values()), 1)} MB: "
                  + ", ".join(f"{k} {v} MB" for k, v in extra.items()) + "."]
    lines += privacy_on_arm64(Path(r.get("out", REPO / "docs" / "results")))
    return "\n".join(lines) + "\n"


def privacy_on_arm64(out: Path) -> list[str]:
    """The emulated Pi's agent with and without differential privacy (firmware_scripts/arm64-smoke.sh
    and its --privacy run), from their reports, where both exist."""
    try:
        plain, private = (json.loads((out / f"{n}.json").read_text()) for n in ("arm64_smoke", "arm64_smoke_privacy"))
    except (OSError, ValueError):
        return []
    rows = []
    for label, rep in (("without privacy", plain), (f"DP-SGD, sigma {private['settings']['privacy']['noise_multiplier']:g}",
                                                      private)):
        arm = next(a for a in rep["agents"] if a["client"] == rep["settings"]["arm64_client"])
        rows.append(f"| {label} | {arm['model']} | {arm['training_rss_mb']} | {arm['training_rss_without_qemu_mb']} | "
                    f"{arm['peak_rss_mb']} | {rep['venv']['mb']} | {arm['last_round']} of {rep['settings']['rounds']} |")
    return ["", "On the emulated 64-bit Pi (firmware_scripts/arm64-smoke.sh, arm64 Debian bookworm under qemu-user, "
            "torch 2.10.0; [arm64_smoke.md](arm64_smoke.md), [arm64_smoke_privacy.md](arm64_smoke_privacy.md)), the "
            "agent without and with differential privacy:", "",
            "| run | model | RSS training (MB) | same without qemu's share (MB) | peak RSS (MB) | venv (MB) | rounds |",
            "|---|---|---|---|---|---|---|", *rows]


if __name__ == "__main__":
    sys.exit(main())
