"""flash.sh --wheelhouse on synthetic Raspberry Pi OS-shaped disk images (read back with mtools
and debugfs): the wheelhouse goes to the boot partition when it fits, else to the root partition;
then the first-boot installer installs from it with the real pip in a network namespace that has
no network at all, and an offline failure is not retried."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_firmware_flash import (
    AGENT_TOML,
    CA,
    CMDLINE,
    MTOOLS,
    SCRIPTS,
    SECTOR,
    fat_read,
    file_hash,
    flash,
    root_fs_hash,
    rpi_image,
    sh,
    tool,
)
from tests.test_fleet_wheelhouse import agent_wheel, fake_index, fake_wheel, hermetic_pip_env

REPO = Path(__file__).resolve().parents[1]
SMALL_BOOT, SMALL_ROOT = 8192, 16384  # sectors: a 4 MiB FAT16 boot partition, a root partition from there


def small_boot_image(path: Path, root_mb: int = 96) -> tuple[Path, str]:
    """A Raspberry Pi OS layout whose boot partition is too small for a wheelhouse of some MiB."""
    with open(path, "wb") as f:
        f.truncate(SMALL_ROOT * SECTOR + root_mb * 1024 * 1024)
    sh("sfdisk", "-q", str(path), input=f"label: dos\nstart={SMALL_BOOT}, size={SMALL_ROOT - SMALL_BOOT}, type=e\n"
                                        f"start={SMALL_ROOT}, type=83\n".encode())
    kib = (SMALL_ROOT - SMALL_BOOT) // 2
    sh("mkfs.vfat", "-F", "16", "-s", "1", "-n", "bootfs", "--offset", str(SMALL_BOOT), str(path), str(kib))
    sh("mke2fs", "-q", "-t", "ext4", "-E", f"offset={SMALL_ROOT * SECTOR}", str(path), f"{root_mb}M")
    src = path.parent / "boot-files"
    src.mkdir(exist_ok=True)
    for name, text in {"cmdline.txt": CMDLINE + "\n", "config.txt": "arm_64bit=1\n"}.items():
        (src / name).write_text(text)
        sh("mcopy", "-i", f"{path}@@{SMALL_BOOT * SECTOR}", str(src / name), f"::/{name}")
    return path, f"{path}?offset={SMALL_ROOT * SECTOR}"


def debugfs(fs: str, *commands: str, write: bool = False) -> str:
    args = [tool("debugfs"), *(["-w"] if write else []), *(x for c in commands for x in ("-R", c)), fs]
    return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout


def root_listing(fs: str, path: str) -> dict[str, tuple[str, str, str, int]]:
    """name -> (mode, uid, gid, size) of a directory in the root file system (debugfs ls -p)."""
    out = {}
    for line in debugfs(fs, f"ls -p {path}").splitlines():
        parts = line.split("/")
        if len(parts) >= 7 and parts[5] not in (".", ".."):
            out[parts[5]] = (parts[2], parts[3], parts[4], int(parts[6]))
    return out


def build_wheelhouse(tmp_path: Path, arch: str = "aarch64", pad: int = 0, name: str = "wh",
                     privacy: bool = False) -> Path:
    """A wheelhouse from `fedal fleet wheelhouse` (small wheels from a local directory); pad grows torch;
    privacy: with the privacy extra's pins too (as the default constraints have them)."""
    idx = fake_index(tmp_path / f"index-{name}")
    version = {"aarch64": "2.10.0", "x86_64": "2.13.0"}[arch]
    for old in idx.glob(f"torch-{version}-*{arch}.whl"):
        old.unlink()
    # the pinned torch, as big as asked; on x86-64 a CPU-only one (PyTorch's +cpu build has no CUDA dependencies)
    fake_wheel(idx, "torch", version, f"cp311-cp311-manylinux_2_28_{arch}", ("filelock",), {"torch/__init__.py": ""}, pad=pad)
    fake_wheel(idx, "filelock", "4.2.11", files={"filelock.py": ""})
    pins = {"aarch64": "torch==2.10.0\nfilelock==3.20.0\n", "x86_64": "torch==2.13.0\nfilelock==4.2.11\n"}[arch]
    constraints = tmp_path / f"constraints-{name}.txt"
    extra = ""
    if privacy:
        for dist, version in (("opacus", "1.6.0"), ("opt-einsum", "3.4.0"), ("scipy", "1.17.1")):
            fake_wheel(idx, dist, version, files={f"{dist.replace('-', '_')}/__init__.py": ""})
            extra += f"{dist}=={version}\n"
    constraints.write_text(pins + "numpy==2.4.6\npaho-mqtt==2.2.0\n" + extra)
    built = tmp_path / f"built-{name}"
    built.mkdir()
    out = tmp_path / name
    env = hermetic_pip_env(idx)
    r = subprocess.run([sys.executable, "-m", "fedal_cli.main", "fleet", "wheelhouse", "--arch", arch, "--out", str(out),
                        "--no-index", "--find-links", str(idx), "--constraints", str(constraints),
                        "--wheel", str(agent_wheel(built))], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture()
def device(tmp_path):
    d = tmp_path / "devices" / "pi-7"
    d.mkdir(parents=True)
    (d / "agent.toml").write_text(AGENT_TOML)
    (d / "ca.crt").write_text(CA)
    return d


def test_a_wheelhouse_that_fits_goes_on_the_boot_partition(tmp_path, device):
    wh = build_wheelhouse(tmp_path)
    img = rpi_image(tmp_path)
    root_before = root_fs_hash(img)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheelhouse", str(wh))
    assert r.returncode == 0, r.stderr
    assert "in fedal/wheelhouse on the boot partition" in r.stdout
    manifest = json.loads((wh / "fedal-wheelhouse.json").read_text())
    for name in [*manifest["files"], "fedal-wheelhouse.json"]:
        assert fat_read(img, f"fedal/wheelhouse/{name}", tmp_path) == (wh / name).read_bytes()
    # the agent wheel is the wheelhouse's (no build from the checkout), and the installer is told where to look
    assert fat_read(img, f"fedal/{manifest['agent_wheel']}", tmp_path) == (wh / manifest["agent_wheel"]).read_bytes()
    assert fat_read(img, "fedal/install-args", tmp_path) == b"--wheelhouse\n/boot/firmware/fedal/wheelhouse\n"
    assert root_fs_hash(img) == root_before


def test_a_private_device_gets_the_privacy_extra_from_the_wheelhouse(tmp_path, device):
    wh = build_wheelhouse(tmp_path, privacy=True)
    img = rpi_image(tmp_path)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheelhouse", str(wh), "--privacy")
    assert r.returncode == 0, r.stderr
    assert fat_read(img, "fedal/install-args", tmp_path) == b"--privacy\n--wheelhouse\n/boot/firmware/fedal/wheelhouse\n"


def test_too_big_for_the_boot_partition_goes_to_the_root_partition(tmp_path, device):
    wh = build_wheelhouse(tmp_path, pad=6 * 1024 * 1024)
    img, fs = small_boot_image(tmp_path / "small.img")
    boot = f"{img}@@{SMALL_BOOT * SECTOR}"
    imager = tmp_path / "firstrun.sh"  # Raspberry Pi Imager's settings on the card
    imager.write_text("#!/bin/bash\necho imager-settings\n")
    subprocess.run([tool("mcopy"), "-i", boot, str(imager), "::/firstrun.sh"], env=MTOOLS, check=True)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheelhouse", str(wh))
    assert r.returncode == 0, r.stderr
    assert "in /opt/fedal-wheelhouse on the root partition" in r.stdout
    # kept, not overwritten: writing the root partition's wheelhouse once made flash.sh forget the
    # boot partition's listing
    kept = tmp_path / "kept-firstrun.sh"
    subprocess.run([tool("mcopy"), "-n", "-i", boot, "::/fedal/firstrun-previous.sh", str(kept)], env=MTOOLS, check=True)
    assert kept.read_text() == imager.read_text()
    manifest = json.loads((wh / "fedal-wheelhouse.json").read_text())
    listing = root_listing(fs, "/opt/fedal-wheelhouse")
    assert set(listing) == {*manifest["files"], "fedal-wheelhouse.json"}
    for name, (mode, uid, gid, size) in listing.items():
        assert (mode, uid, gid, size) == ("100644", "0", "0", (wh / name).stat().st_size)
    torch = next(n for n in listing if n.startswith("torch-"))
    dumped = tmp_path / "dumped.whl"
    debugfs(fs, f"dump /opt/fedal-wheelhouse/{torch} {dumped}")
    assert dumped.read_bytes() == (wh / torch).read_bytes()
    boot = f"{img}@@{SMALL_BOOT * SECTOR}"
    out = tmp_path / "install-args"
    subprocess.run([tool("mcopy"), "-n", "-i", boot, "::/fedal/install-args", str(out)], env=MTOOLS, check=True)
    assert out.read_text() == "--wheelhouse\n/opt/fedal-wheelhouse\n"

    # flashing again replaces it: one copy, the same files
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheelhouse", str(wh))
    assert r.returncode == 0, r.stderr
    assert root_listing(fs, "/opt/fedal-wheelhouse") == listing


def test_what_flash_sh_did_not_write_on_the_root_partition_is_refused(tmp_path, device):
    wh = build_wheelhouse(tmp_path, pad=6 * 1024 * 1024)
    img, fs = small_boot_image(tmp_path / "small.img")
    debugfs(fs, "mkdir /opt", write=True)
    debugfs(fs, "mkdir /opt/fedal-wheelhouse", write=True)
    before = file_hash(img)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheelhouse", str(wh))
    assert r.returncode == 1 and "which flash.sh did not write" in r.stderr, r.stderr
    assert file_hash(img) == before

    tiny, _ = small_boot_image(tmp_path / "tiny.img", root_mb=16)  # 6 MiB + the 64 MiB kept free do not fit
    before = file_hash(tiny)
    r = flash("--image", str(tiny), "--config", str(device / "agent.toml"), "--wheelhouse", str(wh))
    assert r.returncode == 1 and "fits neither the boot partition" in r.stderr, r.stderr
    assert file_hash(tiny) == before


def test_bad_wheelhouses_are_refused_and_leave_the_image_alone(tmp_path, device):
    wh = build_wheelhouse(tmp_path)
    img = rpi_image(tmp_path)
    before = file_hash(img)
    plain = tmp_path / "downloads"
    plain.mkdir()
    (plain / "torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl").write_bytes(b"x")
    x86 = build_wheelhouse(tmp_path, arch="x86_64", name="wh-x86")
    cases = [(["--wheelhouse", str(plain)], "is not a wheelhouse (no fedal-wheelhouse.json)"),
             (["--wheelhouse", str(tmp_path / "nowhere")], "wheelhouse not found"),
             (["--wheelhouse", str(wh), "--torch-index", "https://download.pytorch.org/whl/cpu"], "exclude each other"),
             # what the device's installer would refuse at first boot, refused before the card is written
             (["--wheelhouse", str(x86)], "is for x86_64; a Raspberry Pi (64-bit OS) needs one built with --arch aarch64"),
             # its offline install at first boot would fail, for good: this test wheelhouse pins no opacus
             (["--wheelhouse", str(wh), "--privacy"], "--privacy needs the privacy extra's wheels"),
             (["--torch-version", "2.13.0"], "without --torch-index: PyPI's aarch64 torch from 2.11 on depends on the CUDA")]
    for extra, message in cases:
        r = flash("--image", str(img), "--config", str(device / "agent.toml"), *extra)
        assert r.returncode == 1 and message in r.stderr, (extra, r.stderr)
    torch = next(wh.glob("torch-*.whl"))
    torch.write_bytes(torch.read_bytes() + b"tampered")
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheelhouse", str(wh))
    assert r.returncode == 1 and "differs from the wheelhouse manifest" in r.stderr, r.stderr
    assert file_hash(img) == before


def staging_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\n")
    (root / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    (root / "etc/gshadow").write_text("root:*::\n")
    return root


@pytest.mark.skipif(os.geteuid() != 0, reason="useradd --prefix and a network namespace (unshare --net) need root")
def test_first_boot_installs_offline_from_the_root_partition_wheelhouse(tmp_path, device):
    # this host is the device: pip really installs the wheels; 6 MiB do not fit the 4 MiB boot partition
    wh = build_wheelhouse(tmp_path, arch="x86_64", pad=6 * 1024 * 1024)
    img, fs = small_boot_image(tmp_path / "pi.img")
    cfg = tmp_path / "agent.toml"
    cfg.write_text(AGENT_TOML.split("[broker]")[0] + '[broker]\nurl = "mqtt://10.0.2.100:1883"\n')
    r = flash("--image", str(img), "--config", str(cfg), "--wheelhouse", str(wh), image_arch="x86_64")  # this host's
    assert r.returncode == 0, r.stderr
    assert "on the root partition" in r.stdout

    boot = tmp_path / "boot"
    boot.mkdir()
    sh("mcopy", "-s", "-n", "-i", f"{img}@@{SMALL_BOOT * SECTOR}", "::/*", str(boot))
    root = staging_root(tmp_path)
    (root / "opt").mkdir()  # the root partition's wheelhouse, as the device sees it
    debugfs(fs, f"rdump /opt/fedal-wheelhouse {root / 'opt'}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "DESTDIR")}
    env["FEDAL_TARGET_ROOT"] = str(root)
    run = subprocess.run(["bash", str(boot / "firstrun.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, (boot / "fedal" / "firstrun.log").read_text()
    env2 = {**env, "FEDAL_PAYLOAD": str(boot / "fedal"), "FEDAL_ARCH": "x86_64"}
    firstboot = [tool("unshare"), "--net", "--", str(root / "usr/local/sbin/fedal-firstboot")]

    # a wheelhouse missing a wheel: the offline install fails and says it will not retry (exit 3)
    numpy = next((root / "opt/fedal-wheelhouse").glob("numpy-*.whl"))
    kept = numpy.read_bytes()
    numpy.unlink()
    failed = subprocess.run(firstboot, env=env2, capture_output=True, text=True, timeout=600)
    assert failed.returncode == 3, failed.stdout + failed.stderr
    assert "not retrying" in failed.stdout
    # its broker password off the boot partition while it waits; the next start takes it from there
    moved = root / "root" / ".fedal-firstboot" / "agent.toml"
    assert not (boot / "fedal" / "agent.toml").exists() and moved.exists()
    assert not (root / "var/lib/fedal-firstboot/done").exists()
    numpy.write_bytes(kept)

    done = subprocess.run(firstboot, env=env2, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "offline, from the wheelhouse" in done.stdout and "installing offline from the wheelhouse" in done.stdout
    site = next((root / "opt/fedal-agent").glob("lib/python3*/site-packages"))
    installed = {p.name for p in site.glob("*.dist-info")}
    assert {"torch-2.13.0.dist-info", "numpy-2.4.6.dist-info", "paho_mqtt-2.2.0.dist-info", "filelock-4.2.11.dist-info",
            "fedal_edge-0.1.0.dist-info"} <= installed
    assert json.loads((root / "opt/fedal-agent/self-check.json").read_text())["status"] == "ok"
    assert (root / "etc/fedal-agent/agent.toml").exists()
    # done: the payload and the wheelhouse are gone, the hook is off
    assert not (boot / "fedal").exists() and not (root / "opt/fedal-wheelhouse").exists() and not moved.parent.exists()
    assert (root / "var/lib/fedal-firstboot/done").exists()
    assert not (root / "etc/systemd/system/multi-user.target.wants/fedal-firstboot.service").exists()


def test_the_unit_does_not_restart_a_failed_offline_install():
    unit = (SCRIPTS / "boot" / "fedal-firstboot.service").read_text().splitlines()
    assert "RestartPreventExitStatus=3" in unit and "Restart=on-failure" in unit


def test_a_payload_that_cannot_fit_is_refused_before_the_card_is_touched(tmp_path, device):
    """It fits only in the old payload's place: the old goes first (said). It does not fit at
    all: refused before anything is written (the old payload and the boot hook were gone before
    the copy failed with a full disk)."""
    img, _ = small_boot_image(tmp_path / "small.img")
    small, big = tmp_path / "small" / "train.npz", tmp_path / "big" / "train.npz"
    small.parent.mkdir()
    big.parent.mkdir()
    small.write_bytes(os.urandom(1_500_000))
    big.write_bytes(os.urandom(4_500_000))
    args = ["--image", str(img), "--config", str(device / "agent.toml")]
    assert flash(*args, "--data", str(small)).returncode == 0
    again = flash(*args, "--data", str(small))  # the 4 MiB partition holds one copy, not two
    assert again.returncode == 0 and "fits the boot partition only without the old one" in again.stdout, again.stderr
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    r = flash(*args, "--data", str(big))
    assert r.returncode != 0 and "does not fit the boot partition" in r.stderr, r.stderr
    assert hashlib.sha256(img.read_bytes()).hexdigest() == before
