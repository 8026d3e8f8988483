"""firmware_scripts/flash.sh on synthetic disk images shaped like Raspberry Pi OS (DOS label, FAT32
boot partition with cmdline.txt and config.txt, ext4 root), built with sfdisk/mkfs without loop
mounts; then the written first-boot hook run against a staging root, as the device would."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "firmware_scripts"
SECTOR = 512
BOOT_START, BOOT_SECTORS, ROOT_START = 8192, 131072, 139264
OFFSET = BOOT_START * SECTOR
CMDLINE = ("console=serial0,115200 console=tty1 root=PARTUUID=1234abcd-02 rootfstype=ext4 fsck.repair=yes rootwait quiet "
           "init=/usr/lib/raspberrypi-sys-mods/firstboot")
MTOOLS = {**os.environ, "MTOOLS_SKIP_CHECK": "1", "MTOOLSRC": "/dev/null"}
AGENT_TOML = """client_id = "pi-7"
run_id = "lab"
model = "cnn1d"
data_file = "/var/lib/fedal-agent/train.npz"
workspace = "/var/lib/fedal-agent"

[broker]
url = "mqtts://broker.example.org:8883"
username = "pi-7"
password = "device-secret"
ca_file = "/etc/fedal-agent/ca.crt"
"""
CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyForTestsOnly0000000000000000000000 test@example\n"


def tool(name: str) -> str:
    """sfdisk, mkfs.vfat and mke2fs live in /usr/sbin, which a user's PATH may lack."""
    found = shutil.which(name) or next((f"{d}/{name}" for d in ("/usr/sbin", "/sbin") if os.access(f"{d}/{name}", os.X_OK)), None)
    if found is None:
        pytest.fail(f"{name} is not installed: run scripts/install-test-tools.sh")
    return found


def sh(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([tool(args[0]), *args[1:]], check=True, capture_output=True, env=kw.pop("env", MTOOLS), **kw)


def make_image(path: Path, boot_files: dict[str, str], fat: bool = True, part_type: str = "c") -> Path:
    """A 72 MiB sparse disk: DOS label, FAT32 'bootfs' partition with boot_files, ext4 root."""
    with open(path, "wb") as f:
        f.truncate(72 * 1024 * 1024)
    table = (f"label: dos\nlabel-id: 0x1234abcd\nstart={BOOT_START}, size={BOOT_SECTORS}, type={part_type}\n"
             f"start={ROOT_START}, type=83\n")
    sh("sfdisk", "-q", str(path), input=table.encode())
    if fat:
        sh("mkfs.vfat", "-F", "32", "-s", "1", "-n", "bootfs", "--offset", str(BOOT_START), str(path), str(BOOT_SECTORS // 2))
    sh("mke2fs", "-q", "-t", "ext4", "-E", f"offset={ROOT_START * SECTOR}", str(path), "4M")
    src = path.parent / f"{path.name}.files"
    src.mkdir()
    for name, text in boot_files.items():
        (src / name).write_text(text)
        sh("mcopy", "-i", f"{path}@@{OFFSET}", str(src / name), f"::/{name}")
    return path


def rpi_image(tmp_path: Path, name: str = "rpi.img", **extra: str) -> Path:
    return make_image(tmp_path / name, {"cmdline.txt": CMDLINE + "\n", "config.txt": "arm_64bit=1\n", **extra})


def fat_files(img: Path) -> set[str]:
    out = sh("mdir", "-/", "-b", "-i", f"{img}@@{OFFSET}", "::/").stdout.decode()
    return {line.removeprefix("::/") for line in out.splitlines()}


def fat_read(img: Path, name: str, tmp_path: Path) -> bytes:
    dest = tmp_path / "fat-read"
    dest.unlink(missing_ok=True)
    sh("mcopy", "-n", "-i", f"{img}@@{OFFSET}", f"::/{name}", str(dest))
    return dest.read_bytes()


def root_fs_hash(img: Path) -> str:
    with open(img, "rb") as f:
        f.seek(ROOT_START * SECTOR)
        return hashlib.sha256(f.read()).hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture()
def device(tmp_path):
    """A device's files as `fedal fleet init` writes them: agent.toml with ca.crt next to it."""
    d = tmp_path / "devices" / "pi-7"
    d.mkdir(parents=True)
    (d / "agent.toml").write_text(AGENT_TOML)
    (d / "ca.crt").write_text(CA)
    (tmp_path / "id.pub").write_text(KEY)
    (tmp_path / "fedal_edge-0.1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    (tmp_path / "train.npz").write_bytes(b"private data")
    return d


def flash(*args: str, image_arch: str | None = None, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k not in ("FEDAL_ARCH", "FEDAL_IMAGE_ARCH")}, **(env or {})}
    if image_arch is not None:
        env["FEDAL_IMAGE_ARCH"] = image_arch
    return subprocess.run(["bash", str(SCRIPTS / "flash.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=300, input=stdin)


def test_firstrun_image_gets_config_credentials_and_hook(tmp_path, device):
    img = rpi_image(tmp_path)
    table, root_before = sh("sfdisk", "--dump", str(img)).stdout, root_fs_hash(img)
    args = ["--image", str(img), "--config", str(device / "agent.toml"), "--hostname", "pi-7", "--wifi-ssid", "Lab Net",
            "--wifi-psk", "correct horse", "--wifi-country", "gb", "--ssh-key", str(tmp_path / "id.pub"),
            "--data", str(tmp_path / "train.npz")]
    r = flash(*args)  # no --wheel: built from this checkout
    assert r.returncode == 0, r.stderr + r.stdout
    assert "firstrun" in r.stdout

    cmdline = fat_read(img, "cmdline.txt", tmp_path).decode()
    assert cmdline.count("\n") == 1 and cmdline.endswith("\n")  # still one line
    assert cmdline.split() == CMDLINE.split() + ["cfg80211.ieee80211_regdom=GB", "systemd.run=/boot/firmware/firstrun.sh",
                                                 "systemd.run_success_action=reboot", "systemd.unit=kernel-command-line.target"]
    assert fat_read(img, "firstrun.sh", tmp_path) == (SCRIPTS / "boot" / "firstrun.sh").read_bytes()
    assert fat_read(img, "config.txt", tmp_path) == b"arm_64bit=1\n"
    assert fat_read(img, "fedal/agent.toml", tmp_path).decode() == AGENT_TOML
    assert fat_read(img, "fedal/ca.crt", tmp_path).decode() == CA  # found next to the config
    assert fat_read(img, "fedal/data/train.npz", tmp_path) == b"private data"
    for name in ("install-agent.sh", "prune-venv.py", "fix-meta.py", "fedal-agent.service",
                 "constraints/aarch64.txt", "constraints/x86_64.txt"):
        assert fat_read(img, f"fedal/{name}", tmp_path) == (SCRIPTS / name).read_bytes()
    for name in ("stage.sh", "firstboot.sh", "fedal-firstboot.service"):
        assert fat_read(img, f"fedal/{name}", tmp_path) == (SCRIPTS / "boot" / name).read_bytes()
    settings = {n: fat_read(img, f"fedal/settings/{n}", tmp_path).decode() for n in
                ("hostname", "wifi-ssid", "wifi-psk", "wifi-country", "ssh-user", "authorized_keys")}
    assert settings == {"hostname": "pi-7\n", "wifi-ssid": "Lab Net\n", "wifi-psk": "correct horse\n", "wifi-country": "GB\n",
                        "ssh-user": "pi\n", "authorized_keys": KEY}
    wheels = [n for n in fat_files(img) if n.startswith("fedal/") and n.endswith(".whl")]
    assert len(wheels) == 1
    (tmp_path / "agent.whl").write_bytes(fat_read(img, wheels[0], tmp_path))
    with zipfile.ZipFile(tmp_path / "agent.whl") as z:
        names = set(z.namelist())
    assert {"edge_agent/agent.py", "fleet/cli.py", "fedal/protocol/topics.py"} <= names
    assert sh("sfdisk", "--dump", str(img)).stdout == table and root_fs_hash(img) == root_before  # only the FAT changed

    # flashing the card again replaces the payload and keeps one hook; our own firstrun.sh is not chained
    r = flash(*args[:4], "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"))
    assert r.returncode == 0, r.stderr
    cmdline = fat_read(img, "cmdline.txt", tmp_path).decode()
    assert cmdline.count("systemd.run=") == 1 and "cfg80211" not in cmdline
    files = fat_files(img)
    assert "fedal/firstrun-previous.sh" not in files and "fedal/settings/wifi-psk" not in files
    assert "fedal/data/train.npz" not in files and "fedal/fedal_edge-0.1.0-py3-none-any.whl" in files


@pytest.mark.skipif(os.geteuid() != 0, reason="creating users in a staging root (useradd --prefix) needs root")
def test_first_boot_hook_installs_the_agent_in_a_staging_root(tmp_path, device):
    previous = '#!/bin/bash\ntouch "$FEDAL_TARGET_ROOT/previous-firstrun-ran"\n'  # e.g. one Raspberry Pi Imager wrote
    img = rpi_image(tmp_path, **{"firstrun.sh": previous})
    (tmp_path / "psk").write_text("correct horse\r\n")  # kept out of argv; a Windows line end is not the passphrase's
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--hostname", "pi-7", "--wifi-ssid", "Lab Net",
              "--wifi-psk-file", str(tmp_path / "psk"), "--wifi-country", "DE", "--ssh-key", str(tmp_path / "id.pub"),
              "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"), "--data", str(tmp_path / "train.npz"),
              "--torch-index", "https://download.pytorch.org/whl/cpu")
    assert r.returncode == 0, r.stderr
    assert "kept the card's previous firstrun.sh" in r.stdout

    boot = tmp_path / "boot"  # the boot partition as the device mounts it
    boot.mkdir()
    sh("mcopy", "-s", "-n", "-i", f"{img}@@{OFFSET}", "::/*", str(boot))
    root = tmp_path / "root"
    env = staging_root(root)
    stubs = tmp_path / "stubs"  # shred, logging what it is given: the passphrase is overwritten, not just unlinked
    stubs.mkdir()
    (stubs / "shred").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "shred.log"}\nexec {shutil.which("shred")} "$@"\n')
    (stubs / "shred").chmod(0o755)
    env["PATH"] = f"{stubs}:{env.get('PATH', os.environ['PATH'])}"

    run = subprocess.run(["bash", str(boot / "firstrun.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, (boot / "fedal" / "firstrun.log").read_text()
    assert f"-u -- {boot}/fedal/settings/wifi-psk" in (tmp_path / "shred.log").read_text().splitlines()
    assert (root / "previous-firstrun-ran").exists()
    assert (root / "etc/hostname").read_text() == "pi-7\n"
    assert "127.0.1.1\tpi-7" in (root / "etc/hosts").read_text().splitlines()
    user = next(line.split(":") for line in (root / "etc/passwd").read_text().splitlines() if line.startswith("pi:"))
    keys = root / user[5].lstrip("/") / ".ssh" / "authorized_keys"
    assert keys.read_text() == KEY and stat.S_IMODE(keys.stat().st_mode) == 0o600
    assert (keys.stat().st_uid, keys.stat().st_gid) == (int(user[2]), int(user[3]))
    assert "sudo:x:27:pi" in (root / "etc/group").read_text()
    assert (root / "etc/ssh/sshd_config.d/10-fedal-keys-only.conf").read_text() == "PasswordAuthentication no\n"
    assert os.readlink(root / "etc/systemd/system/multi-user.target.wants/ssh.service") == "/lib/systemd/system/ssh.service"
    conn = root / "etc/NetworkManager/system-connections/fedal-wifi.nmconnection"
    assert stat.S_IMODE(conn.stat().st_mode) == 0o600
    assert {"ssid=Lab Net", "psk=correct horse", "key-mgmt=wpa-psk", "type=wifi"} <= set(conn.read_text().splitlines())
    assert (boot / "cmdline.txt").read_text().split() == CMDLINE.split() + ["cfg80211.ieee80211_regdom=DE"]
    assert not (boot / "firstrun.sh").exists() and not (boot / "fedal" / "settings").exists()
    assert "correct horse" not in (boot / "fedal" / "firstrun.log").read_text()
    assert (root / "var/log/fedal-firstrun.log").read_text() == (boot / "fedal" / "firstrun.log").read_text()
    assert (root / "etc/systemd/system/fedal-firstboot.service").read_bytes() == \
        (SCRIPTS / "boot/fedal-firstboot.service").read_bytes()
    assert os.readlink(root / "etc/systemd/system/multi-user.target.wants/fedal-firstboot.service") == \
        "/etc/systemd/system/fedal-firstboot.service"
    defaults = (root / "etc/default/fedal-firstboot").read_text()
    assert defaults == f"FEDAL_PAYLOAD={boot / 'fedal'}\n"

    # the next boot, with network: fedal-firstboot.service runs the staged installer (pip replaced)
    pip_log = tmp_path / "pip.log"
    fake_pip = tmp_path / "fake-pip"
    fail_once = tmp_path / "pip-fails-once"  # e.g. no network yet: the install is retried a minute later
    fake_pip.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        f"if os.path.exists({str(fail_once)!r}):\n    os.remove({str(fail_once)!r}); sys.exit(1)\n"
                        f"open({str(pip_log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake_pip.chmod(0o755)
    with open(boot / "fedal" / "install-args", "a") as f:
        f.write(f"--pip\n{fake_pip}\n")
    env2 = {**env, "FEDAL_PAYLOAD": str(boot / "fedal"), "FEDAL_ARCH": "aarch64"}
    (boot / "fedal" / "meta-data.orig").write_text("instance-id: iid-1\n")  # as a cloud-init flash keeps it
    fail_once.write_text("")
    run = subprocess.run([str(root / "usr/local/sbin/fedal-firstboot")], env=env2, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "retrying in a minute" in run.stdout + run.stderr, run.stdout + run.stderr
    # from the first attempt on, the broker password is off the FAT partition (vfat: readable by all)
    assert not (boot / "fedal" / "agent.toml").exists()
    assert (root / "root" / ".fedal-firstboot" / "agent.toml").read_text() == AGENT_TOML
    pip_log.unlink(missing_ok=True)
    # on a Pi 4's cores torch 2.10 cannot run: refused for good (exit 3: the unit does not retry it)
    (tmp_path / "pi4-cpuinfo").write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm crc32 cpuid\n")
    pi4 = {**env2, "FEDAL_CPUINFO": str(tmp_path / "pi4-cpuinfo")}
    run = subprocess.run([str(root / "usr/local/sbin/fedal-firstboot")], env=pi4, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "not retrying" in run.stdout + run.stderr and not pip_log.exists() and (boot / "fedal").exists()
    # the broker password does not stay on the FAT partition of a card that waits to be reflashed
    kept = root / "root" / ".fedal-firstboot" / "agent.toml"
    assert not (boot / "fedal" / "agent.toml").exists() and kept.read_text() == AGENT_TOML
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600 and stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
    # a config the installer cannot use is refused for good too: no retry every minute would change it
    kept.write_text("client_id = [\n")
    run = subprocess.run([str(root / "usr/local/sbin/fedal-firstboot")], env=env2, capture_output=True, text=True, timeout=120)
    assert run.returncode == 3 and "not valid TOML" in run.stderr, run.stdout + run.stderr
    assert "not retrying" in run.stdout + run.stderr and not pip_log.exists()
    kept.write_text(AGENT_TOML)
    run = subprocess.run([str(root / "usr/local/sbin/fedal-firstboot")], env=env2, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    calls = [json.loads(line) for line in pip_log.read_text().splitlines()]
    assert calls[0][-3:] == ["--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.10.0"]
    assert calls[1][-1] == f"{boot}/fedal/fedal_edge-0.1.0-py3-none-any.whl[agent]"
    assert (root / "etc/fedal-agent/agent.toml").read_text() == AGENT_TOML
    assert (root / "etc/fedal-agent/ca.crt").read_text() == CA
    assert (root / "var/lib/fedal-agent/train.npz").read_bytes() == b"private data"
    assert os.readlink(root / "etc/systemd/system/multi-user.target.wants/fedal-agent.service") == \
        "/etc/systemd/system/fedal-agent.service"
    assert any(line.startswith("fedal-agent:") for line in (root / "etc/passwd").read_text().splitlines())
    # done for good: the credentials left the FAT partition, the installer will not run again
    assert not (boot / "fedal").exists() and not kept.parent.exists()
    assert (root / "var/lib/fedal-firstboot/done").exists()  # in root's directory, not the agent's
    # the Imager's firstrun.sh that flash.sh replaced is the card owner's: kept, root's only
    originals = root / "var/lib/fedal-firstboot/card-originals"
    assert (originals / "firstrun-previous.sh").read_text() == previous
    assert (originals / "meta-data.orig").read_text() == "instance-id: iid-1\n"
    assert stat.S_IMODE(originals.stat().st_mode) == 0o700
    assert stat.S_IMODE((originals / "firstrun-previous.sh").stat().st_mode) == 0o600
    assert not (root / "var/lib/fedal-agent/.firstboot-done").exists()
    assert not (root / "etc/systemd/system/multi-user.target.wants/fedal-firstboot.service").exists()


def staging_root(root: Path) -> dict[str, str]:
    """A Raspberry Pi OS root as the first boot finds it, for FEDAL_TARGET_ROOT; the environment."""
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\nsudo:x:27:\nadm:x:4:\n")
    for name, line in (("shadow", "root:*:19000:0:99999:7:::\n"), ("gshadow", "root:*::\nsudo:*::\nadm:*::\n")):
        (root / "etc" / name).write_text(line)
    (root / "etc/hostname").write_text("raspberrypi\n")
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\traspberrypi\n")
    return {**os.environ, "FEDAL_TARGET_ROOT": str(root)}


def test_a_setting_that_fails_is_named_and_the_others_still_apply(tmp_path, device):
    """Before: a failed Wi-Fi set-up (or hostname, or SSH) went unnoticed; the log said `wi-fi Lab
    Net` and the hook was removed. Now the failed step is logged as FAILED, named in
    fedal-firstrun-FAILED.txt at the top of the boot partition, and the other steps still run;
    the hook still goes (the same settings would fail again at every boot)."""
    img = rpi_image(tmp_path)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--hostname", "pi-7", "--wifi-ssid", "Lab Net",
              "--wifi-psk-file", "-", "--wifi-country", "DE", "--ssh-key", str(tmp_path / "id.pub"),
              "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"), "--data", str(tmp_path / "train.npz"),
              stdin="correct horse\n")
    assert r.returncode == 0, r.stderr
    boot = tmp_path / "boot"
    boot.mkdir()
    sh("mcopy", "-s", "-n", "-i", f"{img}@@{OFFSET}", "::/*", str(boot))
    (boot / "fedal-firstrun-FAILED.txt").write_text("from an earlier flash of this card\n")
    root = tmp_path / "root"
    env = staging_root(root)
    (root / "etc/NetworkManager").write_text("a file where the connections' folder goes\n")  # Wi-Fi cannot be written

    run = subprocess.run(["bash", str(boot / "firstrun.sh")], env=env, capture_output=True, text=True, timeout=60)
    log = (boot / "fedal" / "firstrun.log").read_text()
    assert run.returncode == 0, log
    assert "FAILED: wi-fi" in log and "wi-fi Lab Net" not in log
    assert "finished with failed steps: wi-fi; rebooting" in log
    assert (boot / "fedal-firstrun-FAILED.txt").read_text().startswith("The first boot could not apply: wi-fi.\n")
    # the other settings were applied, the installer staged, the hook and the secrets gone
    assert (root / "etc/hostname").read_text() == "pi-7\n"
    assert any(line.startswith("pi:") for line in (root / "etc/passwd").read_text().splitlines())
    assert (root / "etc/systemd/system/fedal-firstboot.service").exists()
    assert not (boot / "firstrun.sh").exists() and not (boot / "fedal" / "settings").exists()
    assert "systemd.run" not in (boot / "cmdline.txt").read_text()
    assert "correct horse" not in log

    # a first boot where every step works leaves no FAILED file (an earlier one is removed)
    img2 = rpi_image(tmp_path, name="ok.img")
    assert flash("--image", str(img2), "--config", str(device / "agent.toml"), "--hostname", "pi-8",
                 "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl")).returncode == 0
    boot2 = tmp_path / "boot2"
    boot2.mkdir()
    sh("mcopy", "-s", "-n", "-i", f"{img2}@@{OFFSET}", "::/*", str(boot2))
    (boot2 / "fedal-firstrun-FAILED.txt").write_text("from an earlier flash of this card\n")
    env2 = staging_root(tmp_path / "root2")
    run = subprocess.run(["bash", str(boot2 / "firstrun.sh")], env=env2, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and not (boot2 / "fedal-firstrun-FAILED.txt").exists()
    assert "finished; rebooting" in (boot2 / "fedal" / "firstrun.log").read_text()


def test_cloud_init_image_is_prepared_the_cloud_init_way(tmp_path, device):
    original_user_data = "#cloud-config\n# Raspberry Pi OS default: no changes\n"
    original_meta = "instance-id: rpios-image\r\nlocal-hostname: raspberrypi\r\n"
    img = rpi_image(tmp_path, **{"user-data": original_user_data, "meta-data": original_meta,
                                 "network-config": "network:\n  version: 2\n"})
    (tmp_path / "psk").write_text("correct horse\n")
    # every Python flash.sh starts logs its arguments: the passphrase must never be one of them
    argv_log = tmp_path / "python-argv.log"
    shim = tmp_path / "python-shim"
    shim.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$*\" >>{argv_log}\nexec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--hostname", "pi-7", "--wifi-ssid", 'Lab "5G"',
              "--wifi-psk-file", str(tmp_path / "psk"), "--wifi-country", "fr", "--ssh-key", str(tmp_path / "id.pub"),
              "--user", "ops", "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"),
              "--torch-index", "https://download.pytorch.org/whl/cpu", "--torch-version", "2.13.0", "--privacy",
              env={"FEDAL_PYTHON": str(shim)})
    assert r.returncode == 0, r.stderr
    assert "cloud-init" in r.stdout
    assert argv_log.read_text() and "correct horse" not in argv_log.read_text()
    files = fat_files(img)
    assert "firstrun.sh" not in files and not any(f.startswith("fedal/settings") for f in files)

    user_data = fat_read(img, "user-data", tmp_path).decode()
    assert user_data.startswith("#cloud-config\n")
    ud = yaml.safe_load(user_data)
    assert ud["hostname"] == "pi-7" and ud["manage_etc_hosts"] is True
    assert ud["ssh_pwauth"] is False and ud["enable_ssh"] is True
    assert len(ud["users"]) == 1
    u = ud["users"][0]
    assert (u["name"], u["lock_passwd"], u["ssh_authorized_keys"]) == ("ops", True, [KEY.strip()])
    assert "sudo" in u["groups"].split(",")
    assert ud["runcmd"] == [["bash", "/boot/firmware/fedal/stage.sh", "--start"]]
    net = yaml.safe_load(fat_read(img, "network-config", tmp_path))["network"]
    wlan = net["wifis"]["wlan0"]
    assert wlan["access-points"] == {'Lab "5G"': {"password": "correct horse"}} and wlan["regulatory-domain"] == "FR"
    assert net["ethernets"]["eth0"]["dhcp4"] is True
    # a new instance-id (a card booted with the image's before would never run runcmd), the
    # image's other keys carried over, its meta-data kept
    meta = yaml.safe_load(fat_read(img, "meta-data", tmp_path))
    assert meta["instance-id"].startswith("fedal-") and meta["local-hostname"] == "raspberrypi" and len(meta) == 2
    assert fat_read(img, "fedal/meta-data.orig", tmp_path).decode() == original_meta
    assert fat_read(img, "fedal/user-data.orig", tmp_path).decode() == original_user_data
    assert fat_read(img, "fedal/network-config.orig", tmp_path) == b"network:\n  version: 2\n"  # kept, as user-data
    assert fat_read(img, "fedal/install-args", tmp_path) == \
        b"--torch-index\nhttps://download.pytorch.org/whl/cpu\n--torch-version\n2.13.0\n--privacy\n"
    assert fat_read(img, "fedal/agent.toml", tmp_path).decode() == AGENT_TOML
    cmdline = fat_read(img, "cmdline.txt", tmp_path).decode().split()
    assert cmdline == CMDLINE.split() + ["cfg80211.ieee80211_regdom=FR"]  # no systemd.run hook

    # the same card forced into firstrun mode
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--mode", "firstrun",
              "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"))
    assert r.returncode == 0, r.stderr
    assert "systemd.run=/boot/firmware/firstrun.sh" in fat_read(img, "cmdline.txt", tmp_path).decode()
    # the image's own user-data and network-config, kept by the first flash, survive the second (the card's are ours now)
    assert fat_read(img, "fedal/user-data.orig", tmp_path).decode() == original_user_data
    assert fat_read(img, "fedal/network-config.orig", tmp_path) == b"network:\n  version: 2\n"
    assert fat_read(img, "fedal/meta-data.orig", tmp_path).decode() == original_meta


def test_flashing_twice_keeps_the_imager_settings_the_first_flash_saved(tmp_path, device):
    imager = "#!/bin/bash\n# Raspberry Pi Imager: user, locale, Wi-Fi\nset +e\necho imager-settings\n"
    img = rpi_image(tmp_path, **{"firstrun.sh": imager})
    wheel = ["--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl")]
    for attempt in (1, 2, 3):
        r = flash("--image", str(img), "--config", str(device / "agent.toml"), *wheel)
        assert r.returncode == 0, (attempt, r.stderr)
        assert fat_read(img, "fedal/firstrun-previous.sh", tmp_path).decode() == imager, attempt
        assert fat_read(img, "firstrun.sh", tmp_path) == (SCRIPTS / "boot" / "firstrun.sh").read_bytes()


def bad_image(kind: str, tmp_path: Path) -> Path:
    if kind == "no table":
        path = tmp_path / "blank.img"
        path.write_bytes(b"\0" * (2 * 1024 * 1024))
        return path
    if kind == "no fat partition":
        return make_image(tmp_path / "linux-only.img", {}, fat=False, part_type="83")
    if kind == "fat type, no fat":
        return make_image(tmp_path / "unformatted.img", {}, fat=False)
    if kind == "no cmdline.txt":
        return make_image(tmp_path / "other.img", {"config.txt": "x\n"})
    return rpi_image(tmp_path)


# exit 2: arguments no flash can use (a usage error); exit 1: the card, the files or the config
@pytest.mark.parametrize("kind, extra, message, code", [
    ("missing", [], "image not found", 1),
    ("no table", [], "has no partition table", 1),
    ("no fat partition", [], "no FAT boot partition", 1),
    ("fat type, no fat", [], "holds no FAT file system", 1),
    ("no cmdline.txt", [], "no cmdline.txt: not a Raspberry Pi OS boot partition", 1),
    ("ok", ["--hostname", "pi_7"], "invalid --hostname", 2),
    ("ok", ["--wifi-ssid", "Lab"], "needs --wifi-country", 2),
    ("ok", ["--wifi-ssid", "Lab", "--wifi-country", "DE", "--wifi-psk", "short"], "8-63 characters", 2),
    ("ok", ["--wifi-ssid", "Lab", "--wifi-country", "DE", "--wifi-psk-file", "short.psk"], "8-63 characters", 2),
    ("ok", ["--wifi-ssid", "Lab", "--wifi-country", "DE", "--wifi-psk-file", "missing.psk"], "is not a readable file", 1),
    ("ok", ["--wifi-ssid", "Lab", "--wifi-country", "DE", "--wifi-psk-file", "empty.psk"], "is empty", 1),
    ("ok", ["--wifi-ssid", "Lab", "--wifi-country", "DE", "--wifi-psk-file", "-"], "nothing on standard input", 1),
    ("ok", ["--wifi-ssid", "Lab", "--wifi-country", "DE", "--wifi-psk", "correct horse", "--wifi-psk-file", "-"],
     "give the passphrase once", 2),
    ("ok", ["--wifi-country", "Germany"], "two-letter code", 2),
    ("ok", ["--ssh-key", "PRIVATE"], "is a private key", 1),
    ("ok", ["--mode", "auto-magic"], "--mode must be", 2),
    ("ok", ["--wheel", "missing.whl"], "wheel not found", 1),
    # a card that cannot boot (the kernel splits systemd.run= at the space), a pin pip cannot take
    ("ok", ["--boot-mount", "/boot/my fw"], "may hold only letters, digits", 2),
    ("ok", ["--torch-version", "latest"], "is not a version like 2.13.0", 2),
    ("ok", ["--data", "a/train.npz", "--data", "b/train.npz"], "two --data files are named train.npz", 2),
])
def test_bad_inputs_are_refused_and_leave_the_image_alone(tmp_path, device, kind, extra, message, code):
    img = tmp_path / "missing.img" if kind == "missing" else bad_image(kind, tmp_path)
    before = file_hash(img) if img.exists() else None
    if "PRIVATE" in extra:
        (tmp_path / "id").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nxx\n-----END OPENSSH PRIVATE KEY-----\n")
        extra = ["--ssh-key", str(tmp_path / "id")]
    (tmp_path / "short.psk").write_text("short\n")
    (tmp_path / "empty.psk").write_text("")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.npz").write_bytes(folder.encode())
    extra = [str(tmp_path / e) if e in ("missing.whl", "short.psk", "missing.psk", "empty.psk", "a/train.npz",
                                        "b/train.npz") else e for e in extra]
    r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--wheel",
              str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"), *extra)
    assert r.returncode == code, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert r.stderr.startswith("flash: error:")
    if before is not None:
        assert file_hash(img) == before


def test_invalid_config_and_missing_ca_are_refused(tmp_path, device):
    img = rpi_image(tmp_path)
    before = file_hash(img)
    wheel = ["--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl")]
    bad = tmp_path / "bad.toml"
    bad.write_text(AGENT_TOML.replace('client_id = "pi-7"', 'client_id = "pi 7"'))
    r = flash("--image", str(img), "--config", str(bad), *wheel)
    assert r.returncode == 1 and "invalid agent config" in r.stderr and "client_id" in r.stderr
    bad.write_text("client_id = [\n")
    r = flash("--image", str(img), "--config", str(bad), *wheel)
    assert r.returncode == 1 and "not valid TOML" in r.stderr
    lonely = tmp_path / "lonely" / "agent.toml"  # expects a CA, none beside it
    lonely.parent.mkdir()
    shutil.copy(device / "agent.toml", lonely)
    r = flash("--image", str(img), "--config", str(lonely), *wheel)
    assert r.returncode == 1 and "give --ca FILE" in r.stderr
    r = flash("--image", str(img), "--config", str(tmp_path / "nope.toml"), *wheel)
    assert r.returncode == 1 and "config file not found" in r.stderr
    assert file_hash(img) == before


def test_a_config_using_the_devices_own_ca_bundle_needs_no_ca_file(tmp_path, device):
    """A broker with a publicly signed certificate: ca_file is the device's system bundle, which
    neither flash.sh nor the installer provides or replaces."""
    img = rpi_image(tmp_path)
    cfg = tmp_path / "public-broker" / "agent.toml"
    cfg.parent.mkdir()
    cfg.write_text(AGENT_TOML.replace("/etc/fedal-agent/ca.crt", "/etc/ssl/certs/ca-certificates.crt"))
    r = flash("--image", str(img), "--config", str(cfg), "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"))
    assert r.returncode == 0, r.stderr
    assert "/etc/ssl/certs/ca-certificates.crt as the device has it" in r.stdout
    assert "fedal/ca.crt" not in fat_files(img)


def mounted_block_device() -> str | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        source = line.split()[0]
        if source.startswith("/dev/") and Path(source).is_block_device():
            return source
    return None


def test_a_mounted_card_is_refused_under_any_of_its_names(tmp_path, device):
    """A symlink (as /dev/disk/by-id/... is) to a mounted device is refused before anything else
    about the card is read; the unknown --mode behind it is the next check, so even a check that
    missed it would stop there, before the card is opened."""
    mounted = mounted_block_device()
    if mounted is None:
        pytest.skip("no block device is mounted on this machine")
    alias = tmp_path / "usb-SD_Card_Reader-0:0"
    alias.symlink_to(mounted)
    r = flash("--image", str(alias), "--config", str(device / "agent.toml"), "--mode", "not-a-mode")
    assert r.returncode == 1
    assert f"has mounted partitions ({os.path.realpath(mounted)})" in r.stderr, r.stderr


def test_staging_a_new_payload_clears_the_marker_of_the_install_before(tmp_path):
    """A card flashed again after its agent was installed (a reissued password, a new config):
    the earlier install's marker kept fedal-firstboot from ever running (ConditionPathExists), so
    the new config with its password stayed on the FAT partition and was never installed."""
    root = tmp_path / "root"
    for marker in ("var/lib/fedal-firstboot/done", "var/lib/fedal-agent/.firstboot-done"):
        (root / marker).parent.mkdir(parents=True, exist_ok=True)
        (root / marker).write_text("")
    r = subprocess.run(["bash", str(REPO / "firmware_scripts" / "boot" / "stage.sh")],
                       env={**os.environ, "FEDAL_TARGET_ROOT": str(root)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not (root / "var/lib/fedal-firstboot/done").exists()
    assert not (root / "var/lib/fedal-agent/.firstboot-done").exists()
    assert (root / "etc/systemd/system/multi-user.target.wants/fedal-firstboot.service").is_symlink()


def test_a_cloud_init_card_flashed_again_gets_a_new_instance_id(tmp_path, device):
    """cloud-init runs runcmd once per instance-id: a card flash.sh prepared before kept its
    meta-data, so flashed again (a new config) it never staged the new payload; nor did a card
    booted with the image's own meta-data before its first flash."""
    image_meta = "instance-id: iid-raspberrypi\n"
    img = rpi_image(tmp_path, **{"user-data": "#cloud-config\n", "meta-data": image_meta})
    ids = []
    for _ in range(2):
        r = flash("--image", str(img), "--config", str(device / "agent.toml"), "--hostname", "pi-7",
                  "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"))
        assert r.returncode == 0, r.stderr
        ids.append(fat_read(img, "meta-data", tmp_path).decode())
        # the image's own, kept by the first flash, survives the second (the card's is flash.sh's then)
        assert fat_read(img, "fedal/meta-data.orig", tmp_path).decode() == image_meta
    assert all(x.startswith("instance-id: fedal-") and x.count("instance-id") == 1 for x in ids)
    assert len({image_meta, *ids}) == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="pi-image.sh runs as root (debootstrap, chroot)")
@pytest.mark.parametrize("name", ["card.img.vmlinuz", "card.img.initrd"])
def test_pi_image_refuses_a_kernel_file_beside_its_out_that_it_did_not_make(tmp_path, name):
    """Only --out was checked: a file named --out.vmlinuz or --out.initrd was overwritten with the
    image's kernel, and --out.partial deleted (the image is now built in a file of its own)."""
    (tmp_path / name).write_text("mine\n")
    r = subprocess.run(["bash", str(REPO / "firmware_scripts" / "pi-image.sh"), "--out", str(tmp_path / "card.img"),
                        "--cache", str(tmp_path / "rootfs")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and f"{tmp_path / name} exists and {tmp_path / 'card.img'} does not" in r.stderr, r.stderr
    assert (tmp_path / name).read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == [name]


def interrupting(tmp_path: Path, tool_name: str, when: str) -> dict:
    """An env whose `tool_name` (an mtools command) kills flash.sh outright (a pulled card, a power
    cut) instead of running when its arguments hold `when`."""
    bin_dir = tmp_path / "interrupting-bin"
    bin_dir.mkdir(exist_ok=True)
    real = tool(tool_name)
    wrapper = bin_dir / tool_name
    wrapper.write_text(f'#!/bin/bash\ncase "$*" in *"{when}"*) kill -9 "$PPID"; exit 1 ;; esac\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("tool_name, when", [("mcopy", "-s -o -i"), ("mmove", "::/fedal.new ::/fedal")],
                         ids=["writing_the_new_payload", "between_the_renames"])
def test_a_flash_interrupted_anywhere_leaves_a_card_that_boots_and_flashes_again(tmp_path, device, tool_name, when):
    """flash.sh deleted the old fedal/ and then copied the new one: a flash stopped in between left
    a card whose boot hook pointed at a missing or half-written installer, and a folder the next
    flash.sh refused as someone else's. The new payload is staged beside the old one and swapped in."""
    imager = "#!/bin/bash\n# Raspberry Pi Imager: user, locale, Wi-Fi\necho imager-settings\n"
    img = rpi_image(tmp_path, **{"firstrun.sh": imager})
    wheel = ["--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl")]
    first = flash("--image", str(img), "--config", str(device / "agent.toml"), *wheel)
    assert first.returncode == 0, first.stderr
    first_payload = {name: fat_read(img, name, tmp_path) for name in fat_files(img) if name.startswith("fedal/")
                     and not name.endswith("/")}
    assert "fedal/firstboot.sh" in first_payload
    (device / "agent.toml").write_text(AGENT_TOML.replace('model = "cnn1d"', 'model = "mlp"'))
    cut = flash("--image", str(img), "--config", str(device / "agent.toml"), *wheel,
                env=interrupting(tmp_path, tool_name, when))
    assert cut.returncode != 0
    files = fat_files(img)
    if tool_name == "mcopy":  # stopped while writing the new one: the old payload is whole, where it was
        assert {name: fat_read(img, name, tmp_path) for name in first_payload} == first_payload
    else:  # stopped between the renames: the old one aside, the new one complete beside it
        assert "fedal/" not in files and "fedal.old/firstboot.sh" in files and "fedal.new/firstboot.sh" in files
    again = flash("--image", str(img), "--config", str(device / "agent.toml"), *wheel)
    assert again.returncode == 0, again.stderr
    files = fat_files(img)
    assert not any(name.startswith(("fedal.new", "fedal.old")) for name in files), sorted(files)
    assert "fedal/flash-staging.txt" not in files and "fedal/firstboot.sh" in files
    assert 'model = "mlp"' in fat_read(img, "fedal/agent.toml", tmp_path).decode()
    assert fat_read(img, "fedal/firstrun-previous.sh", tmp_path).decode() == imager  # the Imager's settings kept


def test_folders_named_like_flash_sh_s_staging_but_not_its_own_are_refused(tmp_path, device):
    img = rpi_image(tmp_path)
    sh("mmd", "-i", f"{img}@@{OFFSET}", "::/fedal.new")
    (tmp_path / "mine.txt").write_text("someone's file")
    sh("mcopy", "-i", f"{img}@@{OFFSET}", str(tmp_path / "mine.txt"), "::/fedal.new/mine.txt")
    before = file_hash(img)
    r = flash("--image", str(img), "--config", str(device / "agent.toml"),
              "--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl"))
    assert r.returncode != 0 and "fedal.new/ folder that flash.sh did not write" in r.stderr
    assert file_hash(img) == before


def test_hidden_files_in_the_old_payload_and_look_alike_names_do_not_stop_a_flash(tmp_path, device):
    """A card looked at on Windows or a Mac gets hidden files (Thumbs.db, .DS_Store) in fedal/:
    the old payload must still go whole. A folder the user named fedal_old (moving a foreign fedal/
    away, as flash.sh asks) is not taken for flash.sh's fedal.old/, and stays."""
    img = rpi_image(tmp_path)
    fat = f"{img}@@{OFFSET}"
    wheel = ["--wheel", str(tmp_path / "fedal_edge-0.1.0-py3-none-any.whl")]
    assert flash("--image", str(img), "--config", str(device / "agent.toml"), *wheel).returncode == 0
    (tmp_path / "ds").write_bytes(b"\0\0\0\1Bud1")
    sh("mcopy", "-i", fat, str(tmp_path / "ds"), "::/fedal/.DS_Store")
    sh("mattrib", "-i", fat, "+h", "::/fedal/.DS_Store")
    sh("mmd", "-i", fat, "::/fedal_old")
    sh("mcopy", "-i", fat, str(tmp_path / "ds"), "::/fedal_old/mine")
    for attempt in (1, 2):
        r = flash("--image", str(img), "--config", str(device / "agent.toml"), *wheel)
        assert r.returncode == 0, (attempt, r.stderr)
        files = fat_files(img)
        assert "fedal/firstboot.sh" in files and not any(f.startswith(("fedal.new", "fedal.old")) for f in files)
        assert fat_read(img, "fedal_old/mine", tmp_path) == b"\0\0\0\1Bud1"
