"""The federated half of firmware_scripts/arm64-smoke.sh: an emulated arm64 agent in a real run.

arm64-smoke.sh has built the arm64 Debian userland, copied the checkout into it and bind-mounted
--workdir at the same path inside it. This script starts Mosquitto, then prepares a run; for the
emulated client it installs the agent with `install-agent.sh` inside the userland (that client's
config and data, as on a Pi), then starts the coordinator and the x86 agents on the host's
loopback and the arm64 agent with `chroot`, the way fedal-agent.service would start it (service
user, state directory, environment). Its aarch64 Python runs through qemu-user's binfmt handler;
a chroot shares the host's loopback. Reported: the virtualenv's size and torch build, the arm64
agent's peak RSS and start-up time, and the round it completed.

    python bench/arm64_smoke.py --rootfs ~/.cache/fedal/arm64-bookworm --workdir /tmp/smoke

Writes <out>/arm64_smoke.json and arm64_smoke.md; exits 1 if the arm64 agent did not finish the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from email.parser import Parser
from pathlib import Path

import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_footprint import REPO, Measured, guest_rss_kib, kept_reading, mib, run_fleet  # noqa: E402
from loopback_broker import loopback_broker  # noqa: E402

from fedal import procs  # noqa: E402

CHROOT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
              "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


def venv_report(rootfs: Path, venv: str) -> dict:
    """Size of the venv and what it holds, read from the files (no emulated process needed)."""
    root = rootfs / venv.lstrip("/")
    if not (root / "bin" / "python").exists():
        raise SystemExit(f"no virtualenv at {venv} inside {rootfs}: run install-agent.sh first")
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if not p.is_symlink():
                total += p.stat().st_size
    dists = {}
    for meta in root.glob("lib/python3*/site-packages/*.dist-info/METADATA"):
        msg = Parser().parsestr(meta.read_text(errors="replace"), headersonly=True)
        dists[msg["Name"]] = msg["Version"]
    cuda = sorted(n for n in dists if n.lower().startswith(("nvidia", "cuda", "triton")))
    torch_wheel = next(iter(root.glob("lib/python3*/site-packages/torch-*.dist-info/WHEEL")), None)
    tags = [] if torch_wheel is None else [ln.split(":", 1)[1].strip() for ln in torch_wheel.read_text().splitlines()
                                          if ln.startswith("Tag:")]
    bytecode = sum(p.stat().st_size for p in root.rglob("__pycache__/*.pyc"))
    check = root / "self-check.json"
    return {"path": venv, "bytes": total, "mb": round(total / 2**20, 1), "bytecode_mb": round(bytecode / 2**20, 1),
            "self_check": json.loads(check.read_text()) if check.exists() else None, "torch": dists.get("torch"),
            "torch_wheel_tags": tags, "cuda_packages": cuda,
            "distributions": dict(sorted(dists.items(), key=lambda kv: kv[0].lower()))}


def emulated_baseline(rootfs: Path, python: str, code: str, workdir: Path) -> dict:
    """The emulated `python -c code`: its peak RSS, its RSS without qemu's share once the code
    ran, and its seconds (qemu's share of the numbers, for scale)."""
    t0 = time.monotonic()
    waiting = f"{code}\nimport sys\nprint('ready', flush=True)\nsys.stdin.read()"
    m = Measured([shutil.which("chroot") or "/usr/sbin/chroot", str(rootfs), python, "-c", waiting],
                 workdir / f"emulated-{abs(hash(code))}.json", env=CHROOT_ENV, stdin=subprocess.PIPE,
                 stdout=subprocess.PIPE)
    ready = m.proc.stdout.readline().strip() == b"ready"
    seconds = time.monotonic() - t0
    guest = guest_rss_kib(m.pid) if ready else None
    m.proc.stdin.close()
    rc, peak = m.wait()
    if rc != 0 or peak is None or not ready:
        raise RuntimeError(f"emulated {python} -c {code!r} exited with {rc}")
    return {"peak_rss_mb": mib(peak), "rss_without_qemu_mb": mib(guest), "seconds": round(seconds, 1)}


# The agent side's torch-dependent paths on the userland's torch, beyond what the run exercises:
# ONNX export (the legacy exporter, dynamo=False) with a parity check on onnxruntime and int8 for
# every small zoo model, and a FedAL client half's checkpoint through torch.save/load(weights_only).
COMPAT_CHECK = r"""
import json, sys, tempfile, time
from pathlib import Path
import numpy as np
import torch
t0 = time.monotonic()
from edge_agent import checkpoint
from export import check_parity, export_onnx
from export.quantize import quantize_int8
from export.session import OrtModel
from fedal.data import ArrayDataset
from fedal.models import build_model
from fedal.strategies import StrategyParams, get_strategy

report = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "models": {}}
shapes = {"mlp": (40,), "cnn1d": (40,), "cnn1d_wide": (40,), "lenet5": (1, 8, 8), "smallcnn": (1, 8, 8)}
tmp = Path(tempfile.mkdtemp())
for name, shape in shapes.items():
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    x = torch.randn(8, *shape)
    path = export_onnx(model, x[:2], tmp / f"{name}.onnx")
    diff = check_parity(model, path, x)
    q = quantize_int8(path, tmp / f"{name}.int8.onnx", mode="dynamic")
    ok_int8 = OrtModel(q, threads=1)(x.numpy()).shape == (8, 10)
    report["models"][name] = {"onnx_parity_max_diff": diff, "int8": ok_int8}
rng = np.random.default_rng(0)
train = ArrayDataset(rng.normal(size=(64, 40)).astype(np.float32), rng.integers(0, 10, 64).astype(np.int64), 10, "t")
spec = get_strategy("fedal")
client = spec.client("c0", build_model("cnn1d", (40,), 10), train, rng.normal(size=(32, 40)).astype(np.float32),
                     StrategyParams(), seed=1)
checkpoint.save_atomic({"client": client.state_dict()}, tmp / "ckpt.pt")
back = checkpoint.load(tmp / "ckpt.pt")
report["checkpoint_roundtrip"] = sorted(back["client"]) == sorted(client.state_dict())
report["seconds"] = round(time.monotonic() - t0, 1)
print(json.dumps(report))
"""


def torch_compat(rootfs: Path, python: str) -> dict:
    cmd = [shutil.which("chroot") or "/usr/sbin/chroot", str(rootfs), "/usr/bin/env", "-i",
           *(f"{k}={v}" for k, v in CHROOT_ENV.items()), python, "-c", COMPAT_CHECK]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"ok": False, "error": proc.stderr[-2000:]}
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["ok"] = report["checkpoint_roundtrip"] and all(m["int8"] for m in report["models"].values())
    return report


PI_STATE = "/var/lib/fedal-agent"  # install-agent.sh's layout, which the systemd unit runs with
PI_CONFIG = "/etc/fedal-agent/agent.toml"


def install_agent(rootfs: Path, source: str, config: Path, data: list[Path], extra: list[str], log_path: Path,
                  pip_cert: str | None = None) -> float:
    """install-agent.sh inside the userland, as root, as one would on a Pi; returns its seconds."""
    env = {**CHROOT_ENV, **({"PIP_CERT": pip_cert} if pip_cert else {})}
    cmd = [shutil.which("chroot") or "/usr/sbin/chroot", str(rootfs), "/usr/bin/env", "-i",
           *(f"{k}={v}" for k, v in env.items()), "bash", f"{source}/firmware_scripts/install-agent.sh",
           "--config", str(config), *(x for f in data for x in ("--data", str(f))), *extra]
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        # it ends with this driver (a signal, a SIGKILL): the script unmounts the userland after us
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=procs.dies_with_this_process())
        try:
            for line in proc.stdout:  # shown as it goes: the first install takes a while under emulation
                log.write(line)
                sys.stderr.write("[install-agent] " + line.decode(errors="replace"))
            rc = proc.wait()
        except BaseException:  # a stop signal unwinding the run
            procs.terminate([proc], grace_s=10)
            raise
    if rc != 0:
        raise SystemExit(f"install-agent.sh failed with status {rc}; see {log_path}")
    return time.monotonic() - t0


def service_ids(rootfs: Path, user: str = "fedal-agent") -> tuple[int, int]:
    for line in (rootfs / "etc" / "passwd").read_text().splitlines():
        parts = line.split(":")
        if parts[0] == user:
            return int(parts[2]), int(parts[3])
    raise SystemExit(f"install-agent.sh created no user {user} in {rootfs}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rootfs", required=True, type=Path, help="the arm64 userland (arm64-smoke.sh's cache)")
    ap.add_argument("--source", default="/opt/fedal-src", help="the toolkit's checkout, as a path inside the rootfs")
    ap.add_argument("--venv", default="/opt/fedal-agent", help="install-agent.sh's virtualenv, inside the rootfs")
    ap.add_argument("--workdir", required=True, type=Path, help="run workspace, bind-mounted at the same path in the rootfs")
    ap.add_argument("--torch-index", help="passed to install-agent.sh (default there: PyPI on aarch64)")
    ap.add_argument("--pip-cert", help="CA bundle (path inside the rootfs) for pip, behind a TLS-inspecting proxy")
    ap.add_argument("--strategy", default="fedal")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--samples-per-client", type=int, default=200)
    ap.add_argument("--public-size", type=int, default=200)
    ap.add_argument("--arm64-client", type=int, default=1, help="index of the emulated client (1: the 1D CNN)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the run (the install not counted)")
    ap.add_argument("--privacy", type=float, metavar="SIGMA", help="run with differential privacy at this noise "
                    "multiplier; the agent is installed with install-agent.sh --privacy (writes arm64_smoke_privacy.*)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    args = ap.parse_args(argv)
    # arm64-smoke.sh waits for this driver and unmounts after it: a signal unwinds the run (its
    # broker, coordinator, agents and a pip in the userland end), and a killed script ends it too.
    # SIGINT as Ctrl-C: a background job of a script starts with it ignored
    procs.die_with_parent()
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not 0 <= args.arm64_client < args.clients:
        ap.error("--arm64-client must index one of the --clients")
    rootfs, workdir = args.rootfs.resolve(), args.workdir.resolve()
    if not (rootfs / ".fedal-arm64-rootfs").is_file():  # it installs into, and clears agent state in, that tree
        ap.error(f"{rootfs} is not a userland arm64-smoke.sh built (no .fedal-arm64-rootfs in it)")
    if not (rootfs / workdir.relative_to("/")).is_dir():
        ap.error(f"{workdir} is not visible inside {rootfs}: bind-mount it there first")
    if not (rootfs / args.source.lstrip("/") / "firmware_scripts" / "install-agent.sh").is_file():
        ap.error(f"no checkout at {args.source} inside {rootfs}")

    from fedal.sim import load_config
    from fedal.sim.runner import client_ids

    log = lambda msg: print(f"[arm64-smoke] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    config = load_config(None, dict(strategy=args.strategy, dataset="mnist1d", clients=args.clients, rounds=args.rounds,
                                    tau=args.tau, samples_per_client=args.samples_per_client,
                                    public_size=args.public_size, seed=0, eval_every=1,
                                    dp_noise_multiplier=args.privacy))
    name = "arm64_smoke_privacy" if args.privacy is not None else "arm64_smoke"
    arm_cid = client_ids(args.clients)[args.arm64_client]
    chroot = shutil.which("chroot") or "/usr/sbin/chroot"
    python = f"{args.venv}/bin/python"
    found: dict = {}

    def setup(agent_configs: dict[str, Path]) -> dict:
        """Install the arm64 client's config and data with install-agent.sh, then start it as the unit would."""
        ws = agent_configs[arm_cid].parent
        cfg = tomllib.loads(agent_configs[arm_cid].read_text())
        cfg.update(data_file=f"{PI_STATE}/train.npz", test_file=f"{PI_STATE}/test.npz", workspace=PI_STATE)
        pi_config = workdir / "pi-agent.toml"
        pi_config.write_text(tomli_w.dumps(cfg))
        state = rootfs / PI_STATE.lstrip("/")
        for stale in ("checkpoint.pt", "agent-status.json", "public.npz", "final", "snapshots"):
            target = state / stale  # what an earlier smoke run left; a Pi would keep it, the agent copes
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        log(f"install-agent.sh in the arm64 userland (config and data of {arm_cid})")
        extra = ["--torch-index", args.torch_index] if args.torch_index else []
        if args.privacy is not None:
            extra.append("--privacy")
        found["install_s"] = install_agent(rootfs, args.source, pi_config, [ws / "train.npz", ws / "test.npz"], extra,
                                           workdir / "install-agent.log", args.pip_cert)
        found["venv"] = venv_report(rootfs, args.venv)
        v = found["venv"]
        log(f"installed in {found['install_s']:.0f} s; venv {v['mb']} MB, torch {v['torch']} "
            f"({', '.join(v['torch_wheel_tags'])}), CUDA packages: {v['cuda_packages'] or 'none'}")
        log("emulated baselines (qemu's share of RSS and start-up)")
        found["base_pass"] = emulated_baseline(rootfs, python, "pass", workdir)
        found["base_torch"] = emulated_baseline(rootfs, python, "import torch", workdir)
        uid, gid = service_ids(rootfs)
        # fedal-agent.service's ExecStart, user, working directory and environment
        command = [chroot, f"--userspec={uid}:{gid}", f"--groups={gid}", str(rootfs), "/usr/bin/env",
                   f"--chdir={PI_STATE}", python, "-m", "edge_agent", "--config", PI_CONFIG]
        env = {**CHROOT_ENV, "HOME": PI_STATE, "FEDAL_CACHE_DIR": f"{PI_STATE}/cache"}
        log(f"starting {arm_cid} in the arm64 userland: {' '.join(command[4:])}")
        return {arm_cid: {"command": command, "env": env, "emulated": True, "final_dir": state / "final"}}

    with loopback_broker(workdir) as (broker, broker_name):
        log(f"broker: {broker_name} at {broker}")
        agents, results = run_fleet(config, workdir / "run", broker, setup=setup, timeout_s=args.timeout, progress=log)
    wall = sum(r.get("wall_s", 0) for r in results["rounds"])
    log("torch compatibility checks in the userland (export, parity, int8, checkpoint)")
    compat = torch_compat(rootfs, python)

    rows = []
    for a in agents:
        rows.append({"client": a.client_id, "arch": "arm64 (qemu-user)" if a.client_id == arm_cid else platform.machine(),
                     "model": a.model, "online_s": None if a.online_s is None else round(a.online_s, 1),
                     "rss_online_mb": mib(a.rss_online_kib), "training_rss_mb": mib(a.run_rss_kib),
                     "training_rss_without_qemu_mb": mib(a.guest_rss_kib) if a.emulated else None,
                     "peak_rss_mb": mib(a.peak_rss_kib), "last_round": a.last_round,
                     "accuracies": a.accuracies, "exit": a.returncode})
    arm = next(r for r in rows if r["client"] == arm_cid)
    ok = arm["exit"] == 0 and arm["last_round"] == args.rounds and compat["ok"]
    venv = found["venv"]
    final_dir = rootfs / PI_STATE.lstrip("/") / "final"
    report = {
        "ok": ok,
        "host": {"arch": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version()},
        "userland": {"os_release": _os_release(rootfs), "python": _userland_python(rootfs)},
        "venv": {k: v for k, v in venv.items() if k != "distributions"},
        "venv_distributions": venv["distributions"],
        "install_seconds": round(found["install_s"], 1),
        "settings": {"strategy": args.strategy, "dataset": "mnist1d", "clients": args.clients, "rounds": args.rounds,
                     "tau": args.tau, "samples_per_client": args.samples_per_client, "public_size": args.public_size,
                     "arm64_client": arm_cid, "torch_index": args.torch_index or "PyPI",
                     "privacy": None if args.privacy is None else {"noise_multiplier": args.privacy}},
        "run": {"wall_s": round(wall, 1), "completed_rounds": len(results["rounds"]),
                "final_mean_acc": results["final"].get("mean_acc"),
                "rejected": results.get("deployment", {}).get("counters", {}).get("rejected", 0),
                "epsilon": (results.get("privacy") or {}).get("final_epsilon")},
        "agents": rows,
        "torch_compat": compat,
        "arm64_artifacts": sorted(p.name for p in final_dir.iterdir()) if final_dir.is_dir() else [],
        "emulated_baselines": {"python -c pass": found["base_pass"], "python -c 'import torch'": found["base_torch"]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    md = render(report)
    (args.out / f"{name}.md").write_text(md + kept_reading(args.out / f"{name}.md"))
    print(f"venv size: {venv['mb']} MB ({args.venv}, torch {venv['torch']}, CUDA packages: {venv['cuda_packages'] or 'none'})")
    print(f"arm64 agent {arm_cid} ({arm['model']}): peak RSS {arm['peak_rss_mb']} MB under qemu-user, "
          f"online after {arm['online_s']} s, completed round {arm['last_round']} of {args.rounds}, exit {arm['exit']}")
    if args.privacy is not None:
        print(f"differential privacy (sigma {args.privacy:g}): epsilon per client {report['run']['epsilon']}")
    print(f"results: {args.out / (name + '.md')}")
    return 0 if ok else 1


def _userland_python(rootfs: Path) -> str | None:
    found = sorted(p.name for p in (rootfs / "usr" / "bin").glob("python3.*") if p.name[7:].isdigit())
    return found[-1] if found else None


def _os_release(rootfs: Path) -> str | None:
    try:
        lines = (rootfs / "etc" / "os-release").read_text().splitlines()
    except OSError:  # no os-release: the report just names no distribution
        return None
    for line in lines:
        if line.startswith("PRETTY_NAME="):
            return line.split("=", 1)[1].strip('"')
    return None


def _compat_line(c: dict) -> str:
    if not c.get("ok"):
        return f"- torch compatibility checks in the userland: **failed**: {c.get('error', c)}"
    diffs = ", ".join(f"{k} {v['onnx_parity_max_diff']:.1e}" for k, v in c["models"].items())
    return (f"- torch compatibility checks in the userland (torch {c['torch']}, CUDA available: {c['cuda_available']}): "
            f"ONNX export + onnxruntime parity (max abs diff: {diffs}), int8 for each, FedAL client checkpoint "
            f"round trip: passed ({c['seconds']} s)")


def _self_check_line(c: dict | None) -> str:
    if not c:
        return "- install-agent.sh's self-check: no report in the virtualenv"
    loaded = ", ".join(c["compiler_stack_loaded_while_training"]) or "none"
    return (f"- install-agent.sh's self-check (`python -m edge_agent --self-check`): {c['status']} in {c['seconds']} s under "
            f"emulation; torch {c['torch']}, onnxruntime {c['onnxruntime']}, ONNX max abs diff {c['onnx_max_abs_diff']:.1e}; "
            f"torch's compiler stack loaded while training: {loaded}")


def render(r: dict) -> str:
    s, v, run = r["settings"], r["venv"], r["run"]
    lines = [
        "# arm64 smoke run (firmware_scripts/arm64-smoke.sh)",
        "",
        f"{r['userland']['os_release'] or 'Debian arm64'} userland built with debootstrap, run through qemu-user "
        f"(binfmt_misc) on a {r['host']['arch']} host with {r['host']['cores']} shared cores. The agent was installed in it "
        f"with `firmware_scripts/install-agent.sh` as on a Pi (it took {r['install_seconds']:.0f} s under emulation in this "
        f"run) and started as `fedal-agent.service` would start it.",
        "",
        f"- virtualenv `{v['path']}`: **{v['mb']} MB**, torch **{v['torch']}** "
        f"(wheel tag {', '.join(v['torch_wheel_tags']) or '?'}), CUDA packages: {', '.join(v['cuda_packages']) or 'none'}; "
        f"{v.get('bytecode_mb', '?')} MB of it compiled bytecode",
        _self_check_line(v.get("self_check")),
        f"- run: {s['strategy']} on MNIST-1D, {s['clients']} clients ({s['samples_per_client']} rows each, public set "
        f"{s['public_size']}), {s['rounds']} rounds, tau = {s['tau']}; client {s['arm64_client']} is the arm64 agent, "
        f"the others run natively next to it; coordinator and Mosquitto on the host's loopback"
        + ("" if not s.get("privacy") else f"; **differential privacy** on (DP-SGD, noise multiplier "
           f"{s['privacy']['noise_multiplier']:g}, the agent installed with `--privacy`): epsilon per client at the "
           f"end {run.get('epsilon')}"),
        f"- result: {'**passed**' if r['ok'] else '**FAILED**'}: {run['completed_rounds']} rounds ({run['wall_s']} s of rounds), "
        f"final mean accuracy {run['final_mean_acc']}, rejected messages {run['rejected']}",
        f"- arm64 agent's final artifacts: {', '.join(r['arm64_artifacts']) or 'none'}",
        _compat_line(r["torch_compat"]),
        "",
        "| client | arch | model | spawn to `online` (s) | RSS online (MB) | RSS training (MB) | same without qemu's share (MB) | peak RSS (MB) | last round | accuracy per round | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for a in r["agents"]:
        accs = ", ".join("-" if x is None else f"{x:.3f}" for x in a["accuracies"])
        guest = a["training_rss_without_qemu_mb"] if a["training_rss_without_qemu_mb"] is not None else "-"
        lines.append(f"| {a['client']} | {a['arch']} | {a['model']} | {a['online_s']} | {a['rss_online_mb']} | "
                     f"{a['training_rss_mb']} | {guest} | {a['peak_rss_mb']} | {a['last_round']} | {accs} | {a['exit']} |")
    b = r["emulated_baselines"]
    lines += [
        "",
        "RSS under qemu-user is the emulator process's: the guest's memory plus qemu's translation cache (an",
        "anonymous executable mapping), its malloc heap and its binary. \"Without qemu's share\" subtracts those",
        "three, read from /proc/<pid>/smaps once a second: an estimate of the agent's RSS natively on arm64.",
        "For scale, under the same emulation: "
        + ", ".join(f"`{k}` peaks at {x['peak_rss_mb']} MB, {x['rss_without_qemu_mb']} MB without qemu's share, "
                    f"ready after {x['seconds']} s" for k, x in b.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
