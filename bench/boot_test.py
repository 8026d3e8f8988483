"""The federated half of firmware_scripts/boot-test.sh: a whole emulated Pi, booted from its disk.

boot-test.sh has built a Raspberry Pi OS-shaped arm64 Debian image (firmware_scripts/pi-image.sh).
This script builds a wheelhouse (`fedal fleet wheelhouse --arch aarch64`), starts Mosquitto and
prepares a short run; for one client it copies the image, flashes it with `flash.sh --wheelhouse`
and boots it under `qemu-system-aarch64 -M virt` with qemu's user-mode network restricted
(`restrict=on`): the guest reaches the host's broker and coordinator through two `guestfwd`
rules and nothing else, so the agent can only install from the wheelhouse. Each boot reads
cmdline.txt from the image's FAT partition, as a Pi's firmware does; `systemd.run_success_action=
reboot` ends a boot (qemu runs with -no-reboot) and the next one starts. Boot 1 runs firstrun.sh,
boot 2 installs the agent and takes part in the run next to x86 agents, boot 3 must start the
agent without the first-boot hook. Checked from the host (serial console logs, the coordinator's
API, the image's files read with debugfs and mtools); times and sizes go to <out>/boot_test.{md,json}.

    python bench/boot_test.py --image pi.img --workdir /tmp/boot-test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_footprint import REPO, run_fleet  # noqa: E402
from loopback_broker import loopback_broker  # noqa: E402

from fedal import procs  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTED_AGENT = "Started fedal-agent.servic"  # systemd may cut the name short on the console
GUEST_HOST = "10.0.2.100"  # the address the guest's broker and coordinator URLs name
PI_STATE = "/var/lib/fedal-agent"
MTOOLS = {**os.environ, "MTOOLS_SKIP_CHECK": "1", "MTOOLSRC": "/dev/null"}


def log(msg: str) -> None:
    print(f"[boot-test] {msg}", file=sys.stderr, flush=True)


def partitions(image: Path) -> tuple[int, int]:
    """Byte offsets of the FAT boot and the ext4 root partition (sfdisk --json)."""
    table = json.loads(subprocess.run(["sfdisk", "--json", str(image)], capture_output=True, text=True, check=True).stdout)
    parts = table["partitiontable"]["partitions"]
    sector = table["partitiontable"].get("sectorsize", 512)
    return parts[0]["start"] * sector, parts[1]["start"] * sector


def fat_read(image: Path, name: str) -> str | None:
    boot, _ = partitions(image)
    proc = subprocess.run(["mtype", "-i", f"{image}@@{boot}", f"::/{name}"], capture_output=True, text=True, env=MTOOLS)
    return proc.stdout if proc.returncode == 0 else None


def root_cmd(image: Path, command: str) -> str:
    _, root = partitions(image)
    # -c (read-only, bitmaps not read): a guest that had to be killed leaves them inconsistent
    return subprocess.run(["debugfs", "-c", "-R", command, f"{image}?offset={root}"], capture_output=True, text=True).stdout


def root_exists(image: Path, path: str) -> bool:
    return "Inode:" in root_cmd(image, f"stat {path}")


# -- the virtual machine ------------------------------------------------------------------------
class VM:
    """qemu-system-aarch64 booting the image; the console goes to a file, QMP to a socket."""

    def __init__(self, image: Path, console: Path, forwards: dict[int, int], memory_mb: int, smp: int, cpu: str):
        self.image, self.console = image, console
        cmdline = (fat_read(image, "cmdline.txt") or "").strip()
        if not cmdline:
            raise RuntimeError(f"no cmdline.txt on the boot partition of {image}")
        self.cmdline = cmdline
        self.qmp = console.with_suffix(".qmp")
        self.qmp.unlink(missing_ok=True)
        fwd = ",".join(f"guestfwd=tcp:{GUEST_HOST}:{guest}-cmd:socat - TCP:127.0.0.1:{host}" for guest, host in forwards.items())
        self.command = [
            "nice", "-n", "15", "qemu-system-aarch64", "-M", "virt", "-cpu", cpu, "-smp", str(smp),
            "-m", str(memory_mb), "-display", "none", "-no-reboot", "-serial", f"file:{console}",
            "-monitor", "none", "-qmp", f"unix:{self.qmp},server=on,wait=off",
            "-kernel", f"{image}.vmlinuz", "-initrd", f"{image}.initrd", "-append", cmdline,
            "-drive", f"file={image},format=raw,if=virtio,cache=unsafe",
            "-netdev", f"user,id=n0,restrict=on,{fwd}", "-device", "virtio-net-pci,netdev=n0",
        ]
        self.started = time.monotonic()
        # its own session (a Ctrl-C in the terminal goes to the driver, which powers it off), and it
        # ends with this process, even one killed by SIGKILL (then with SIGTERM, not a clean power-off)
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=open(f"{console}.stderr", "wb"),
                                     start_new_session=True, preexec_fn=procs.dies_with_this_process())

    def text(self) -> str:
        """The console so far, without systemd's colours (its status lines also shorten unit names:
        "Started fedal-agent.servic… (…)", so look for a prefix)."""
        try:
            return ANSI.sub("", self.console.read_text(errors="replace"))
        except OSError:
            return ""

    def wait_for(self, needle: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if needle in self.text():
                return True
            if self.proc.poll() is not None:
                return needle in self.text()
            time.sleep(2)
        return False

    def wait_exit(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def powerdown(self, timeout_s: float = 180) -> str:
        """The power button (QMP system_powerdown), pressed again every 20 s (a press before
        systemd-logind listens is lost), then a kill if the guest does not halt."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(10)
                    s.connect(str(self.qmp))
                    s.recv(4096)
                    for cmd in ("qmp_capabilities", "system_powerdown"):
                        s.sendall(json.dumps({"execute": cmd}).encode() + b"\n")
                        s.recv(4096)
            except OSError as exc:
                log(f"QMP: {exc}")
            if self.wait_exit(min(20.0, max(1.0, deadline - time.monotonic()))) is not None:
                return "powered off"
        if self.proc.poll() is not None:
            return "powered off"
        self.kill()
        return "killed"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def run_state(api_port: int, run_id: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api_port}/api/v1/runs/{run_id}", timeout=5) as resp:
            return json.loads(resp.read())["state"]
    except (OSError, ValueError, KeyError):  # the API is not up (yet): no state to act on
        return None


def vm_main(args) -> int:
    """The Pi as run_fleet's agent process: boot 1 (firstrun, then its reboot), then boot 2 until
    the run is over (as an agent process exits at the end of a run) or SIGTERM; either presses
    the power button."""
    forwards = json.loads(args.forwards)
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    vm = None
    try:
        times = {}
        for boot in (1, 2):
            vm = VM(args.vm, args.console_dir / f"boot{boot}.log", {int(k): v for k, v in forwards.items()},
                    args.memory, args.smp, args.cpu)
            log(f"boot {boot}: {' '.join(vm.command[3:])}")
            polled = 0.0
            while vm.proc.poll() is None and not stop["flag"]:
                time.sleep(1)
                if boot == 2 and time.monotonic() - polled >= 10:
                    polled = time.monotonic()
                    if run_state(args.api_port, args.run_id) in ("finished", "failed", "stopped"):
                        stop["flag"] = True
            times[f"boot{boot}_s"] = round(time.monotonic() - vm.started, 1)
            (args.console_dir / "times.json").write_text(json.dumps(times))
            if stop["flag"]:
                times[f"boot{boot}_powerdown"] = vm.powerdown()
                (args.console_dir / "times.json").write_text(json.dumps(times))
                return 0
            log(f"boot {boot} ended after {times[f'boot{boot}_s']} s (exit {vm.proc.returncode})")
        return 1  # boot 2 ended by itself: the guest rebooted or halted mid-run
    finally:
        if vm is not None:
            vm.kill()


# -- the run ------------------------------------------------------------------------------------------
class Interrupted(BaseException):
    """A signal to stop: not one of the run's failures, which the report records."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", type=Path, help="pi-image.sh's image (with IMAGE.vmlinuz and IMAGE.initrd next to it)")
    ap.add_argument("--workdir", type=Path, help="run workspace (a FedAL workspace: new, empty or an earlier one)")
    ap.add_argument("--wheelhouse", type=Path, help="reuse this wheelhouse (default: build one in the workdir)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--memory", type=int, default=2048, help="guest memory in MiB")
    ap.add_argument("--smp", type=int, default=2, help="guest CPUs")
    # torch 2.10.0's aarch64 wheel dies with SIGILL on import on ARMv8.0 cores (Cortex-A72 of the
    # Pi 4, Cortex-A53 of the Pi 3B+ and Zero 2 W; pytorch/pytorch#176993): cortex-a72 shows it
    ap.add_argument("--cpu", default="cortex-a76", help="qemu CPU model (cortex-a76: the Pi 5's; cortex-a72: the Pi 4's)")
    ap.add_argument("--timeout", type=float, default=10800, help="seconds for boot 1 + install + run")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    ap.add_argument("--vm", type=Path, help=argparse.SUPPRESS)  # internal: the Pi process of the run
    ap.add_argument("--console-dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--forwards", help=argparse.SUPPRESS)
    ap.add_argument("--api-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vm:
        return vm_main(args)
    # SIGTERM/SIGINT unwind like an error: run_fleet's finally ends the agents, the coordinator and
    # the VM (its power button), the broker's context ends Mosquitto
    def interrupted(signum, _frame):
        raise Interrupted(f"signal {signum}")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, interrupted)
    if args.image is None or args.workdir is None:
        ap.error("--image and --workdir are required")
    for tool in ("qemu-system-aarch64", "socat", "debugfs", "mtype", "sfdisk"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists() and not Path(f"/sbin/{tool}").exists():
            ap.error(f"{tool} not found (boot-test.sh installs the host packages)")
    os.environ["PATH"] += ":/usr/sbin:/sbin"
    from fedal import workspace
    from fedal.sim import load_config
    from fedal.sim.runner import client_ids

    workdir = workspace.claim(args.workdir.resolve(), "boot_test.py")
    workspace.clear(workdir, ("pi.img", "pi.img.vmlinuz", "pi.img.initrd", "console", "run", "pi-agent.toml"))
    report: dict = {"host": {"arch": platform.machine(), "cores": os.cpu_count()},
                    "settings": {"cpu": args.cpu, "smp": args.smp, "memory_mb": args.memory, "rounds": args.rounds,
                                 "clients": args.clients}}
    t0 = time.monotonic()
    wheelhouse = args.wheelhouse or workdir / "wheelhouse"
    if args.wheelhouse is None:
        log("building the wheelhouse (fedal fleet wheelhouse --arch aarch64)")
        subprocess.run([sys.executable, "-m", "fedal_cli.main", "fleet", "wheelhouse", "--arch", "aarch64", "--out",
                        str(wheelhouse)], cwd=REPO, check=True)
    manifest = json.loads((wheelhouse / "fedal-wheelhouse.json").read_text())
    report["wheelhouse"] = {"wheels": len(manifest["files"]), "mib": round(manifest["bytes"] / 2**20, 1),
                            "torch": manifest["torch"], "build_s": round(time.monotonic() - t0, 1)}
    image = workdir / "pi.img"
    subprocess.run(["cp", "--sparse=always", str(args.image), str(image)], check=True)
    for ext in ("vmlinuz", "initrd"):
        shutil.copyfile(f"{args.image}.{ext}", f"{image}.{ext}")
    console = workdir / "console"
    console.mkdir()

    config = load_config(None, dict(strategy="fedal", dataset="mnist1d", clients=args.clients, rounds=args.rounds, tau=2,
                                    samples_per_client=200, public_size=200, seed=0, eval_every=1))
    pi = client_ids(args.clients)[1]
    found: dict = {}

    def setup(agent_configs: dict[str, Path]) -> dict:
        """Flash the Pi's image with its config, data and the wheelhouse; its process is the VM."""
        ws = agent_configs[pi].parent
        cfg = tomllib.loads(agent_configs[pi].read_text())
        host_port = int(cfg["broker"]["url"].rsplit(":", 1)[1])
        coord = tomllib.loads(next((workdir / "run").glob("coordinator/coordinator.toml")).read_text())
        # the public set goes on the card: the manifest's public_url names the coordinator's own
        # loopback address, which is the guest's own loopback inside the VM
        public = workdir / "run" / "coordinator" / "public.npz"
        cfg.update(data_file=f"{PI_STATE}/train.npz", test_file=f"{PI_STATE}/test.npz", workspace=PI_STATE,
                   public_file=f"{PI_STATE}/public.npz")
        cfg.pop("local_test_file", None)
        cfg["broker"]["url"] = f"mqtt://{GUEST_HOST}:1883"
        guest_cfg = workdir / "pi-agent.toml"
        guest_cfg.write_text(tomli_w.dumps(cfg))
        t = time.monotonic()
        flashed = subprocess.run(["bash", str(REPO / "firmware_scripts" / "flash.sh"), "--image", str(image), "--config",
                                  str(guest_cfg), "--wheelhouse", str(wheelhouse), "--hostname", pi, "--data",
                                  str(ws / "train.npz"), "--data", str(ws / "test.npz"), "--data", str(public)],
                                 capture_output=True, text=True)
        if flashed.returncode != 0:
            raise SystemExit(f"flash.sh failed: {flashed.stderr}")
        found["flash_s"] = round(time.monotonic() - t, 1)
        found["flash_out"] = flashed.stdout
        log(flashed.stdout.strip())
        forwards = {1883: host_port, 8080: coord["api"]["port"]}
        command = [sys.executable, str(Path(__file__).resolve()), "--vm", str(image), "--console-dir", str(console),
                   "--forwards", json.dumps(forwards), "--memory", str(args.memory), "--smp", str(args.smp), "--cpu", args.cpu,
                   "--api-port", str(coord["api"]["port"]), "--run-id", coord["run_id"]]
        found["forwards"] = forwards
        return {pi: {"command": command, "env": {**os.environ}, "emulated": True, "final_dir": None}}

    ok = False
    results: dict = {}
    with loopback_broker(workdir) as (broker, _name):
        try:
            t = time.monotonic()
            agents, results = run_fleet(config, workdir / "run", broker, setup=setup, timeout_s=args.timeout, progress=log)
            report["run_s"] = round(time.monotonic() - t, 1)
            arm = next(a for a in agents if a.client_id == pi)
            report["pi"] = {"client": pi, "last_round": arm.last_round, "accuracies": arm.accuracies,
                            "online_s": None if arm.online_s is None else round(arm.online_s, 1)}
        except (RuntimeError, SystemExit, subprocess.TimeoutExpired) as exc:
            report["error"] = str(exc)
            log(f"the run failed: {exc}")
        # boot 2 ends with the power button (or a kill): the image is not touched before that
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "boot2_powerdown" not in _times(console):
            time.sleep(2)
        # boot 3: the agent starts again, the first-boot hook does not run
        if "error" not in report:
            vm = VM(image, console / "boot3.log", found["forwards"], args.memory, args.smp, args.cpu)
            try:
                report["boot3_agent_started"] = vm.wait_for(STARTED_AGENT, 1800)
                vm.wait_for(" login:", 600)  # booted to the end: the power button is handled
                report["boot3_powerdown"] = vm.powerdown()
            finally:
                vm.kill()
    times = _times(console)
    boots = {n: ANSI.sub("", (console / f"boot{n}.log").read_text(errors="replace")) if (console / f"boot{n}.log").exists()
             else "" for n in (1, 2, 3)}
    firstrun_log = root_cmd(image, "cat /var/log/fedal-firstrun.log")
    report["checks"] = checks = {
        "boot1: firstrun.sh ran (kernel-command-line.service) and rebooted": "fedal firstrun: finished; rebooting" in firstrun_log,
        "firstrun.sh ran exactly once": firstrun_log.count("fedal firstrun: started") == 1,
        "boot2: installed offline from the wheelhouse": "installing offline from the wheelhouse" in boots[2],
        "boot2: self-check passed": "self-check passed" in boots[2],
        "boot2: fedal-agent.service started": STARTED_AGENT in boots[2],
        "the Pi finished every round": report.get("pi", {}).get("last_round") == args.rounds,
        "payload gone from the boot partition": fat_read(image, "fedal/agent.toml") is None,
        "hook gone from cmdline.txt": "systemd.run" not in (fat_read(image, "cmdline.txt") or "systemd.run"),
        "root partition's wheelhouse removed": not root_exists(image, "/opt/fedal-wheelhouse"),
        "first-boot marker": root_exists(image, f"{PI_STATE}/.firstboot-done"),
        "boot3: agent started": bool(report.get("boot3_agent_started")),
        "boot3: no first-boot hook": bool(boots[3]) and "fedal firstboot" not in boots[3] and "firstrun" not in boots[3],
    }
    ok = all(checks.values())
    check = root_cmd(image, "cat /opt/fedal-agent/self-check.json")
    report.update(ok=ok, times=times, flash_s=found.get("flash_s"), flash=found.get("flash_out"),
                  self_check=json.loads(check) if check.strip().startswith("{") else None,
                  image_mib=round(image.stat().st_size / 2**20), image_used_mib=round(os.stat(image).st_blocks * 512 / 2**20),
                  run={"completed_rounds": len(results.get("rounds", [])), "final_mean_acc": results.get("final", {}).get("mean_acc")})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "boot_test.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "boot_test.md").write_text(render(report))
    for name, passed in checks.items():
        print(f"{'ok  ' if passed else 'FAIL'} {name}")
    print(f"results: {args.out / 'boot_test.md'}")
    return 0 if ok else 1


def _times(console: Path) -> dict:
    try:
        return json.loads((console / "times.json").read_text())
    except (OSError, ValueError):  # not written yet (or being written): no times so far
        return {}


def render(r: dict) -> str:
    wh, t = r["wheelhouse"], r.get("times", {})
    lines = [
        "# Full-system boot test (firmware_scripts/boot-test.sh)",
        "",
        "An arm64 Debian bookworm disk image with Raspberry Pi OS's layout (firmware_scripts/pi-image.sh), flashed",
        "with `flash.sh --wheelhouse` and booted under `qemu-system-aarch64 -M virt` (TCG, no KVM) with a",
        "user-mode network restricted to the host's broker and coordinator (`restrict=on` + two `guestfwd`).",
        f"Host: {r['host']['arch']}, {r['host']['cores']} shared cores; guest: `-cpu {r['settings']['cpu']}`, "
        f"{r['settings']['smp']} CPUs, {r['settings']['memory_mb']} MiB.",
        "",
        f"- result: {'**passed**' if r.get('ok') else '**FAILED**'}" + (f" ({r['error']})" if r.get("error") else ""),
        f"- wheelhouse: {wh['wheels']} wheels, {wh['mib']} MiB, torch {wh['torch']}",
        f"- image: {r.get('image_mib')} MiB (sparse, {r.get('image_used_mib')} MiB allocated); flash.sh took {r.get('flash_s')} s",
        f"- boot 1 (firstrun.sh, then its reboot): {t.get('boot1_s')} s; boot 2 (offline install, then the run): "
        f"{t.get('boot2_s')} s until the power button ({t.get('boot2_powerdown', '-')})",
        f"- run: {r.get('run', {}).get('completed_rounds')} rounds, Pi {r.get('pi', {})}",
        "",
        "| check | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {'ok' if v else 'FAILED'} |" for k, v in r.get("checks", {}).items()]
    check = r.get("self_check") or {}
    if check:
        lines += ["", f"The device's self-check (in the install): torch {check.get('torch')}, onnxruntime {check.get('onnxruntime')}, "
                      f"ONNX max abs diff {check.get('onnx_max_abs_diff')}, {check.get('seconds')} s under emulation."]
    lines += [
        "",
        "With `--cpu cortex-a72` (the Pi 4's core) the same boot gets as far as the install's self-check, which dies",
        "with `Illegal instruction` at `import torch`: torch 2.10.0's aarch64 wheel from PyPI needs more than ARMv8.0",
        "(also under qemu-user with cortex-a72 and cortex-a53; fine with cortex-a76, neoverse-n1, max;",
        "pytorch/pytorch#176993). The offline install then stops without retrying (exit 3), as designed.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
