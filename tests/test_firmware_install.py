"""firmware_scripts/install-agent.sh into a staging root: what it installs, that a second run
changes nothing, the unit passes systemd-analyze, architecture and constraint selection."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "firmware_scripts"
INSTALL = SCRIPTS / "install-agent.sh"

AGENT_TOML = """client_id = "pi-1"
run_id = "fleet"
model = "cnn1d"
data_file = "/var/lib/fedal-agent/train.npz"
workspace = "/var/lib/fedal-agent"

[broker]
url = "mqtts://broker.example.org:8883"
username = "pi-1"
password = "pw-1"
ca_file = "/etc/fedal-agent/ca.crt"
"""


def install(*args: str, arch: str | None = "aarch64", env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("FEDAL_ARCH", "DESTDIR")}
    if arch is not None:
        e["FEDAL_ARCH"] = arch
    e.update(env or {})
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, env=e, timeout=120)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root with its kind, mode, owner, content hash or link target, and mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            what = ("link", os.readlink(p))
        elif p.is_dir():
            what = ("dir",)
        else:
            what = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
        out[str(p.relative_to(root))] = (*what, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns)
    return out


@pytest.fixture()
def inputs(tmp_path):
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "agent.toml").write_text(AGENT_TOML)
    (d / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nnot checked here\n-----END CERTIFICATE-----\n")
    (d / "train.npz").write_bytes(b"private data")
    (d / "fedal_edge-0.1.0-py3-none-any.whl").write_bytes(b"a wheel")  # only hashed: pip is replaced below
    log = d / "pip.log"
    fake_pip = d / "fake-pip"
    fake_pip.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake_pip.chmod(0o755)
    return d


def base_root(root: Path) -> None:
    """The account files of a base system, so the installer can create its user in the staging root."""
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    for name, line in (("shadow", "root:*:19000:0:99999:7:::\n"), ("gshadow", "root:*::\n")):
        (root / "etc" / name).write_text(line)
        (root / "etc" / name).chmod(0o600)


def pip_calls(inputs: Path) -> list[list[str]]:
    log = inputs / "pip.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_second_install_changes_nothing(tmp_path, inputs):
    root = tmp_path / "root"
    base_root(root)
    args = ["--root", str(root), "--config", str(inputs / "agent.toml"), "--ca", str(inputs / "ca.crt"),
            "--data", str(inputs / "train.npz"), "--wheel", str(inputs / "fedal_edge-0.1.0-py3-none-any.whl"),
            "--pip", str(inputs / "fake-pip")]
    first = install(*args)
    assert first.returncode == 0, first.stderr + first.stdout
    calls = pip_calls(inputs)
    assert calls == [["install", "--disable-pip-version-check", "--no-input", "--no-cache-dir", "--no-compile",
                      "-c", f"{root}/opt/fedal-agent/fedal-constraints.txt",
                      f"{inputs}/fedal_edge-0.1.0-py3-none-any.whl[agent]"]]
    assert "skipped the self-check" in first.stdout  # the fake pip installed no agent to check
    before = snapshot(root)

    second = install(*args)
    assert second.returncode == 0, second.stderr
    assert "nothing changed" in second.stdout
    assert snapshot(root) == before  # same files, modes, owners, contents and mtimes
    assert pip_calls(inputs) == calls  # the same agent is not reinstalled

    etc = root / "etc" / "fedal-agent"
    assert (etc / "agent.toml").read_text() == AGENT_TOML
    assert stat.S_IMODE((etc / "agent.toml").stat().st_mode) == 0o640  # holds the broker password
    assert stat.S_IMODE(etc.stat().st_mode) == 0o750
    assert (etc / "ca.crt").read_bytes() == (inputs / "ca.crt").read_bytes()
    state = root / "var" / "lib" / "fedal-agent"
    assert (state / "train.npz").read_bytes() == b"private data" and stat.S_IMODE(state.stat().st_mode) == 0o750
    unit = root / "etc" / "systemd" / "system" / "fedal-agent.service"
    assert unit.read_bytes() == (SCRIPTS / "fedal-agent.service").read_bytes()
    assert os.readlink(root / "etc/systemd/system/multi-user.target.wants/fedal-agent.service") == \
        "/etc/systemd/system/fedal-agent.service"
    assert (root / "opt/fedal-agent/bin/python").exists()
    printed = install("--print-constraints").stdout
    assert (root / "opt/fedal-agent/fedal-constraints.txt").read_text() == printed
    if os.geteuid() == 0:  # the system user exists in the staging root and owns the state
        user = next(line for line in (root / "etc/passwd").read_text().splitlines() if line.startswith("fedal-agent:"))
        uid, gid, home, shell = user.split(":")[2], user.split(":")[3], user.split(":")[5], user.split(":")[6]
        assert (home, shell) == ("/var/lib/fedal-agent", "/usr/sbin/nologin")
        assert (state.stat().st_uid, state.stat().st_gid) == (int(uid), int(gid))
        assert ((etc / "agent.toml").stat().st_uid, (etc / "agent.toml").stat().st_gid) == (0, int(gid))
    else:
        assert "skipped the system user" in first.stdout

    # a changed config is installed again; the unchanged agent is not reinstalled
    (inputs / "agent.toml").write_text(AGENT_TOML.replace("pw-1", "pw-2"))
    third = install(*args)
    assert third.returncode == 0 and "installed /etc/fedal-agent/agent.toml" in third.stdout
    assert "pw-2" in (etc / "agent.toml").read_text() and pip_calls(inputs) == calls


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_installed_unit_passes_systemd_analyze_verify(tmp_path, inputs):
    root = tmp_path / "root"
    r = install("--root", str(root), "--config", str(inputs / "agent.toml"), "--skip-pip")
    assert r.returncode == 0, r.stderr
    assert "warning: the config expects a CA at /etc/fedal-agent/ca.crt" in r.stdout
    # verify resolves ExecStart on this host: point it at the staged virtualenv's interpreter
    unit = (root / "etc/systemd/system/fedal-agent.service").read_text()
    assert "ExecStart=/opt/fedal-agent/bin/python -m edge_agent --config /etc/fedal-agent/agent.toml" in unit
    check = tmp_path / "fedal-agent.service"
    check.write_text(unit.replace("ExecStart=/opt/fedal-agent/", f"ExecStart={root}/opt/fedal-agent/"))
    v = subprocess.run(["systemd-analyze", "verify", str(check)], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0, v.stderr
    # systemd < 254 does not know the backoff keys yet and says so; anything else is a finding
    problems = [line for line in v.stderr.splitlines()
                if line.strip() and "Unknown key 'RestartSteps'" not in line and "Unknown key 'RestartMaxDelaySec'" not in line]
    assert problems == []
    for key in ("Restart=always", "RestartPreventExitStatus=2", "User=fedal-agent", "NoNewPrivileges=yes",
                "ProtectSystem=strict", "PrivateTmp=yes",
                "StateDirectory=fedal-agent", "ReadWritePaths=/var/lib/fedal-agent", "StandardOutput=journal"):
        assert key in unit.splitlines()


def pins(text: str) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return {r.name.lower(): r for r in reqs}


def test_privacy_installs_the_privacy_extra_and_switching_reinstalls(tmp_path, inputs):
    root = tmp_path / "root"
    base_root(root)
    args = ["--root", str(root), "--config", str(inputs / "agent.toml"), "--wheel",
            str(inputs / "fedal_edge-0.1.0-py3-none-any.whl"), "--pip", str(inputs / "fake-pip")]
    assert install(*args).returncode == 0
    private = install(*args, "--privacy")
    assert private.returncode == 0, private.stderr + private.stdout
    specs = [call[-1] for call in pip_calls(inputs)]
    assert specs == [f"{inputs}/fedal_edge-0.1.0-py3-none-any.whl[agent]",
                     f"{inputs}/fedal_edge-0.1.0-py3-none-any.whl[agent,privacy]"]  # a new install, not "nothing changed"
    assert install(*args, "--privacy").returncode == 0 and len(pip_calls(inputs)) == 2  # the same again: nothing
    assert "opacus==1.6.0" in install("--print-constraints", arch="aarch64").stdout


def test_constraints_per_architecture():
    arm = install("--print-constraints", arch="aarch64")
    assert arm.returncode == 0, arm.stderr
    arm_pins = pins(arm.stdout)
    assert str(arm_pins["torch"].specifier) == "==2.10.0" and "from PyPI" in arm.stdout.splitlines()[0]
    x86 = install("--print-constraints", arch="x86_64")
    x86_pins = pins(x86.stdout)
    assert str(x86_pins["torch"].specifier) == "==2.13.0" and "download.pytorch.org/whl/cpu" in x86.stdout.splitlines()[0]
    assert "from PyPI" in install("--print-constraints", "--torch-index", "pypi", arch="x86_64").stdout
    cpu = install("--print-constraints", "--torch-index", "https://download.pytorch.org/whl/cpu", "--torch-version", "2.13.0")
    assert str(pins(cpu.stdout)["torch"].specifier) == "==2.13.0" and "whl/cpu" in cpu.stdout.splitlines()[0]
    assert install("--print-constraints", arch="arm64").stdout == arm.stdout  # dpkg's name for it
    assert install("--print-constraints", arch="amd64").stdout == x86.stdout

    assert {k: v for k, v in arm_pins.items() if k != "torch"} == {k: v for k, v in x86_pins.items() if k != "torch"}
    for name, req in arm_pins.items():
        version = str(req.specifier).removeprefix("==")
        assert str(req.specifier) == f"=={version}", f"{name} is not pinned"
    assert SpecifierSet("!=1.21.0").contains(str(arm_pins["onnxruntime"].specifier).removeprefix("=="))
    assert SpecifierSet(">=2,<3").contains(str(arm_pins["paho-mqtt"].specifier).removeprefix("=="))
    # the pins sit inside what the package itself declares
    import tomllib
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for line in declared["dependencies"] + declared["optional-dependencies"]["agent"]:
        req = Requirement(line)
        pinned = str(arm_pins[req.name.lower()].specifier).removeprefix("==")
        assert req.specifier.contains(pinned), f"{req.name} {pinned} outside {req.specifier}"
        if req.name == "torch":
            assert req.specifier.contains("2.13.0")


@pytest.mark.parametrize("arch", ["armv7l", "armhf", "armv6l", "i686"])
def test_32bit_userland_is_refused_with_the_reason(arch):
    r = install("--print-constraints", arch=arch)
    assert r.returncode == 3  # a refusal no retry changes: the first-boot installer does not retry it
    assert "32-bit" in r.stderr and "no 32-bit" in r.stderr and "64-bit Raspberry Pi OS" in r.stderr


def test_unknown_architecture_is_refused():
    r = install("--print-constraints", arch="riscv64")
    assert r.returncode == 3 and "unsupported architecture 'riscv64'" in r.stderr


def test_dry_run_changes_nothing(tmp_path, inputs):
    root = tmp_path / "root"
    root.mkdir()
    r = install("--root", str(root), "--config", str(inputs / "agent.toml"), "--dry-run", "--torch-index",
                "https://download.pytorch.org/whl/cpu", "--wheel", str(inputs / "fedal_edge-0.1.0-py3-none-any.whl"))
    assert r.returncode == 0, r.stderr
    assert list(root.iterdir()) == []
    assert "would run:" in r.stdout and "--index-url https://download.pytorch.org/whl/cpu torch==2.10.0" in r.stdout
    assert "would be made (dry run)" in r.stdout
    # what it reports is what it would do, never as done
    reported = [line for line in r.stdout.splitlines() if line.startswith("install-agent: ")
                and not line.startswith(("install-agent: would run:", "install-agent: not done (dry run): "))]
    assert not any(word in line for line in reported for word in ("installed", "created", "enabled", "removed")), reported
    assert "install-agent: not done (dry run): installed /etc/fedal-agent/agent.toml" in r.stdout
    # from the checkout (no --wheel): no copy of it is made, and the pip line names the checkout
    from_source = install("--root", str(root), "--config", str(inputs / "agent.toml"), "--dry-run")
    assert from_source.returncode == 0, from_source.stderr
    assert f"{REPO}[agent]" in from_source.stdout and "/src[agent]" not in from_source.stdout


def test_bad_inputs_fail_with_clear_messages(tmp_path, inputs):
    root = str(tmp_path / "root")
    cfg = str(inputs / "agent.toml")
    r = install("--root", root)
    assert r.returncode == 2 and "--config is required" in r.stderr
    r = install("--root", root, "--config", str(tmp_path / "missing.toml"))
    assert r.returncode == 3 and "config file not found" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("client_id = \n")
    r = install("--root", root, "--config", str(bad), "--skip-pip")
    assert r.returncode == 3 and "is not valid TOML" in r.stderr
    r = install("--root", root, "--config", cfg, "--wheel", str(tmp_path / "nope.whl"))
    assert r.returncode == 3 and "wheel not found" in r.stderr
    r = install("--root", root, "--config", cfg, "--wheel", cfg)
    assert r.returncode == 3 and "needs a .whl file" in r.stderr
    r = install("--root", root, "--config", cfg, "--bogus")
    assert r.returncode == 2 and "unknown argument: --bogus" in r.stderr
    r = install("--root", root, "--config", cfg, "--torch-version", "latest", "--print-constraints")
    assert r.returncode == 2 and "'latest' is not a version like 2.13.0" in r.stderr and "torch==" not in r.stdout
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.npz").write_bytes(folder.encode())
    r = install("--root", root, "--config", cfg, "--skip-pip", "--data", str(tmp_path / "a" / "train.npz"),
                "--data", str(tmp_path / "b" / "train.npz"))
    assert r.returncode == 2 and "two --data files are named train.npz" in r.stderr
    assert not (tmp_path / "root" / "var").exists()
    old = tmp_path / "python3.9"  # an interpreter that reports an old version
    old.write_text("#!/bin/sh\ncase \"$2\" in *version_info*) exit 1 ;; *python_version*) echo 3.9.2 ;; esac\n")
    old.chmod(0o755)
    r = install("--root", root, "--config", cfg, "--python", str(old))
    assert r.returncode == 3 and "Python >= 3.11 is needed" in r.stderr and "3.9.2" in r.stderr


def test_a_single_data_file_is_installed_as_the_configs_data_file(tmp_path, inputs):
    """`--data pi-1-train.npz` with `data_file = ".../train.npz"` (as `fedal fleet init` writes it):
    the agent finds its data under the name its config gives."""
    root = tmp_path / "root"
    (inputs / "pi-1-train.npz").write_bytes(b"pi-1's rows")
    r = install("--root", str(root), "--config", str(inputs / "agent.toml"), "--skip-pip",
                "--data", str(inputs / "pi-1-train.npz"))
    assert r.returncode == 0, r.stderr + r.stdout
    state = root / "var" / "lib" / "fedal-agent"
    assert (state / "train.npz").read_bytes() == b"pi-1's rows"
    assert not (state / "pi-1-train.npz").exists() and "the config's data_file" not in r.stdout
    # several files keep their names; a data_file none of them provides is said at once
    (inputs / "a.npz").write_bytes(b"a")
    (inputs / "b.npz").write_bytes(b"b")
    other = tmp_path / "other"
    r = install("--root", str(other), "--config", str(inputs / "agent.toml"), "--skip-pip",
                "--data", str(inputs / "a.npz"), "--data", str(inputs / "b.npz"))
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (other / "var/lib/fedal-agent").iterdir()) == ["a.npz", "b.npz"]
    assert "data_file /var/lib/fedal-agent/train.npz does not exist" in r.stdout


def test_a_ca_file_outside_the_agents_directory_is_never_replaced(tmp_path, inputs):
    root = tmp_path / "root"
    bundle = root / "etc" / "ssl" / "certs" / "ca-certificates.crt"
    bundle.parent.mkdir(parents=True)
    bundle.write_text("the system's CA bundle\n")
    cfg = inputs / "system-ca.toml"
    cfg.write_text(AGENT_TOML.replace("/etc/fedal-agent/ca.crt", "/etc/ssl/certs/ca-certificates.crt"))
    r = install("--root", str(root), "--config", str(cfg), "--skip-pip", "--ca", str(inputs / "ca.crt"))
    assert r.returncode == 3 and "exists and is not the --ca certificate" in r.stderr, r.stderr + r.stdout
    assert bundle.read_text() == "the system's CA bundle\n" and not (root / "etc" / "fedal-agent").exists()
    r = install("--root", str(root), "--config", str(cfg), "--skip-pip")  # without --ca: used as it is
    assert r.returncode == 0, r.stderr
    assert bundle.read_text() == "the system's CA bundle\n"
    # a missing file there is created
    cfg.write_text(AGENT_TOML.replace("/etc/fedal-agent/ca.crt", "/etc/ssl/private-broker-ca.crt"))
    r = install("--root", str(root), "--config", str(cfg), "--skip-pip", "--ca", str(inputs / "ca.crt"))
    assert r.returncode == 0, r.stderr
    assert (root / "etc/ssl/private-broker-ca.crt").read_bytes() == (inputs / "ca.crt").read_bytes()


def test_dry_run_does_not_create_its_root(tmp_path, inputs):
    root = tmp_path / "not-yet"
    r = install("--root", str(root), "--config", str(inputs / "agent.toml"), "--dry-run", "--skip-pip")
    assert r.returncode == 0, r.stderr
    assert not root.exists()


PI4_CPUINFO = "processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU part\t: 0xd08\n"
PI5_CPUINFO = ("processor\t: 0\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp "
               "asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU part\t: 0xd0b\n")


def test_a_cuda_torch_from_pypi_is_refused_on_aarch64():
    r = install("--print-constraints", "--torch-version", "2.13.0", arch="aarch64")
    assert r.returncode == 3 and "depends on the CUDA 13 toolkit" in r.stderr and "--torch-index" in r.stderr
    assert install("--print-constraints", "--torch-version", "2.13.0", "--torch-index", "pypi").returncode == 3
    assert install("--print-constraints", "--torch-version", "2.13.0", arch="x86_64").returncode == 0
    assert install("--print-constraints", "--torch-version", "2.9.1", arch="aarch64").returncode == 0


def test_an_armv8_0_board_is_told_which_torch_it_needs_before_any_download(tmp_path, inputs):
    """torch 2.10.0 (the aarch64 pin) dies with SIGILL at import on a Pi 4's cores (no LSE atomics)."""
    (tmp_path / "pi4").write_text(PI4_CPUINFO)
    (tmp_path / "pi5").write_text(PI5_CPUINFO)
    args = ["--root", str(tmp_path / "root"), "--config", str(inputs / "agent.toml"), "--skip-pip"]
    r = install(*args, env={"FEDAL_CPUINFO": str(tmp_path / "pi4")})
    assert r.returncode == 3, r.stdout  # for good: the first-boot installer does not retry it
    assert "no LSE atomics" in r.stderr and "torch 2.10.0 dies with 'Illegal instruction'" in r.stderr
    assert "--torch-index https://download.pytorch.org/whl/cpu --torch-version 2.13.0" in r.stderr
    assert not (tmp_path / "root").exists()
    ok = install(*args, "--torch-index", "https://download.pytorch.org/whl/cpu", "--torch-version", "2.13.0",
                 env={"FEDAL_CPUINFO": str(tmp_path / "pi4")})
    assert ok.returncode == 0, ok.stderr
    assert install(*args, env={"FEDAL_CPUINFO": str(tmp_path / "pi5")}).returncode == 0  # a Pi 5's cores run it


def test_a_config_without_data_file_and_a_test_set_keep_their_names(tmp_path, inputs):
    """data_file may come from the environment (FEDAL_AGENT_DATA_FILE): a config without it
    installs; a single --data that is the config's test set is not renamed to its data_file."""
    cfg = inputs / "env-data.toml"
    cfg.write_text(AGENT_TOML.replace('data_file = "/var/lib/fedal-agent/train.npz"\n', ""))
    r = install("--root", str(tmp_path / "a"), "--config", str(cfg), "--skip-pip")
    assert r.returncode == 0, r.stderr + r.stdout
    with_test = inputs / "with-test.toml"
    with_test.write_text(AGENT_TOML.replace('workspace =', 'test_file = "/var/lib/fedal-agent/test.npz"\nworkspace ='))
    (inputs / "test.npz").write_bytes(b"the common test set")
    r = install("--root", str(tmp_path / "b"), "--config", str(with_test), "--skip-pip", "--data", str(inputs / "test.npz"))
    assert r.returncode == 0, r.stderr
    state = tmp_path / "b" / "var" / "lib" / "fedal-agent"
    assert (state / "test.npz").read_bytes() == b"the common test set" and not (state / "train.npz").exists()


def test_a_ca_path_with_dot_dot_is_refused(tmp_path, inputs):
    cfg = inputs / "dotdot.toml"
    cfg.write_text(AGENT_TOML.replace("/etc/fedal-agent/ca.crt", "/etc/fedal-agent/../ssl/certs/ca-certificates.crt"))
    r = install("--root", str(tmp_path / "root"), "--config", str(cfg), "--skip-pip", "--ca", str(inputs / "ca.crt"))
    assert r.returncode == 3 and "must not contain . or .. components" in r.stderr, r.stderr


def test_an_existing_directory_that_is_not_a_virtualenv_is_never_cleared(tmp_path, inputs):
    """The virtualenv is made with `venv --clear`, which empties the directory: a /opt/fedal-agent
    the installer did not make (no pyvenv.cfg) is refused and left as it was."""
    root = tmp_path / "root"
    base_root(root)
    mine = root / "opt" / "fedal-agent"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    r = install("--root", str(root), "--config", str(inputs / "agent.toml"), "--skip-pip")
    assert r.returncode == 3 and "is not a virtualenv" in r.stderr, r.stderr
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_an_unknown_model_is_refused_before_pip_runs(tmp_path, inputs):
    """A hand install (no flash.sh to check the config first) said so only after pip had installed
    torch; the model is now checked against the names of the agent to be installed, first."""
    import zipfile

    cfg = inputs / "typo.toml"
    cfg.write_text(AGENT_TOML.replace('model = "cnn1d"', 'model = "cnn1d_wdie"'))
    pip = ["--pip", str(inputs / "fake-pip")]
    r = install("--root", str(tmp_path / "src"), "--config", str(cfg), *pip)  # the checkout's agent
    assert r.returncode == 3 and "unknown model 'cnn1d_wdie'; valid names: mlp, cnn1d, cnn1d_wide" in r.stderr, r.stderr
    wheel = inputs / "fedal_edge-0.2.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fedal/model_names.py", 'MODEL_NAMES: tuple[str, ...] = ("mlp", "cnn1d_wdie")\n')
    r = install("--root", str(tmp_path / "whl"), "--config", str(inputs / "agent.toml"), "--wheel", str(wheel), *pip)
    assert r.returncode == 3 and "unknown model 'cnn1d'; valid names: mlp, cnn1d_wdie" in r.stderr, r.stderr
    assert pip_calls(inputs) == []
    for root in ("src", "whl"):
        assert not any((tmp_path / root).rglob("*.toml"))  # nothing installed
    r = install("--root", str(tmp_path / "ok"), "--config", str(cfg), "--wheel", str(wheel), "--skip-pip")
    assert r.returncode == 0, r.stderr  # the wheel's own zoo has that name


def test_a_link_swapped_into_the_state_directory_is_never_followed(tmp_path, inputs):
    """The service user can write its state directory. A data file it replaced with a link (to
    the shadow file, say) is replaced by the installer, never chmod-ed or chown-ed through."""
    root = tmp_path / "root"
    base_root(root)
    args = ["--root", str(root), "--config", str(inputs / "agent.toml"), "--skip-pip",
            "--data", str(inputs / "train.npz")]
    assert install(*args).returncode == 0
    state = root / "var/lib/fedal-agent"
    shadow = root / "etc/shadow"
    before = shadow.stat()
    (state / "train.npz").unlink()
    (state / "train.npz").symlink_to(shadow)
    (inputs / "train.npz").write_bytes(shadow.read_bytes())  # identical content: only the metadata would be fixed
    r = install(*args)
    assert r.returncode == 0, r.stderr + r.stdout
    after = shadow.stat()
    assert (stat.S_IMODE(after.st_mode), after.st_uid, after.st_gid) == \
        (stat.S_IMODE(before.st_mode), before.st_uid, before.st_gid) == (0o600, before.st_uid, before.st_gid)
    assert not (state / "train.npz").is_symlink() and stat.S_IMODE((state / "train.npz").stat().st_mode) == 0o640
    # a link to a directory: `install` would have written the file into that directory
    (state / "train.npz").unlink()
    (state / "train.npz").symlink_to(root / "etc")
    r = install(*args)
    assert r.returncode == 0, r.stderr + r.stdout
    assert not (root / "etc" / "train.npz").exists() and not (state / "train.npz").is_symlink()
    assert (state / "train.npz").read_bytes() == shadow.read_bytes()


def put_in_the_way(path: Path, kind: str, target: Path) -> None:
    """What the service user could leave at `path`: a link to `target` (a symbolic or a hard one)
    or a FIFO."""
    if kind.startswith("symlink"):
        path.symlink_to(target)
    elif kind in ("hardlink", "hard link"):
        os.link(target, path)
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo"])
def test_fix_meta_refuses_what_a_name_could_redirect(tmp_path, kind):
    """The race the installer cannot close by checking first: the name is swapped after the
    install. fix-meta.py works on the descriptor it opened without following links."""
    target = tmp_path / "shadow"
    target.write_text("root:*:1::::::\n")
    target.chmod(0o600)
    path = tmp_path / "train.npz"
    put_in_the_way(path, kind, target)
    r = subprocess.run([sys.executable, str(SCRIPTS / "fix-meta.py"), str(path), "0644", f"{os.getuid()}:{os.getgid()}"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and str(path) in r.stderr and "left it as it is" in r.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    ok = tmp_path / "plain"
    ok.write_text("x")
    ok.chmod(0o600)
    r = subprocess.run([sys.executable, str(SCRIPTS / "fix-meta.py"), str(ok), "0640", "-"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == f"mode 0640: {ok}\n" and stat.S_IMODE(ok.stat().st_mode) == 0o640


def verified_with_dropin(root: Path, dropin: Path, tmp_path: Path, key: str) -> None:
    """systemd-analyze (where there is one) takes the installed unit with the drop-in, saying
    nothing of `key`."""
    if shutil.which("systemd-analyze"):
        unit = (root / "etc/systemd/system/fedal-agent.service").read_text()
        check = tmp_path / "fedal-agent.service"
        check.write_text(unit.replace("ExecStart=/opt/fedal-agent/", f"ExecStart={root}/opt/fedal-agent/")
                         + "\n" + dropin.read_text())
        v = subprocess.run(["systemd-analyze", "verify", str(check)], capture_output=True, text=True, timeout=60)
        assert v.returncode == 0 and key not in v.stderr, v.stderr


def test_files_outside_the_state_directory_are_mounted_before_the_agent_starts(tmp_path, inputs):
    """Data on a partition fstab mounts late (a USB drive): without RequiresMountsFor the agent found
    no data_file, exited 2, and the service waited for a restart that never came."""
    root = tmp_path / "root"
    args = ["--root", str(root), "--config", str(inputs / "agent.toml"), "--skip-pip"]
    dropin = root / "etc/systemd/system/fedal-agent.service.d/10-fedal-mounts.conf"
    assert install(*args).returncode == 0
    assert not dropin.exists()  # the fleet's configs: everything in /var/lib/fedal-agent and /etc/fedal-agent
    (inputs / "agent.toml").write_text(AGENT_TOML.replace('data_file = "/var/lib/fedal-agent/train.npz"',
                                                          'data_file = "/mnt/usb/train.npz"\n'
                                                          'test_file = "/srv/data/test.npz"\npublic_file = "public.npz"'))
    r = install(*args)
    assert r.returncode == 0, r.stderr + r.stdout
    assert dropin.read_text().splitlines()[1:] == ["[Unit]", "RequiresMountsFor=/mnt/usb/train.npz /srv/data/test.npz"]
    before = snapshot(root)
    assert "nothing changed" in install(*args).stdout and snapshot(root) == before
    verified_with_dropin(root, dropin, tmp_path, "RequiresMountsFor")
    (inputs / "agent.toml").write_text(AGENT_TOML)
    r = install(*args)
    assert r.returncode == 0 and "removed /etc/systemd/system/fedal-agent.service.d/10-fedal-mounts.conf" in r.stdout
    assert not dropin.parent.exists()


@pytest.mark.parametrize("kind", ["symlink to a file", "symlink to a directory", "hard link", "fifo"])
def test_fix_meta_install_replaces_the_name_never_what_it_points_at(tmp_path, kind):
    """What a name in the state directory may be when the installer reaches it (swapped in after
    any check it could make): the new file replaces the name; the target is never written, chmod-ed
    or chown-ed."""
    target = tmp_path / "shadow"
    target.write_text("root:*:1::::::\n")
    target.chmod(0o600)
    folder = tmp_path / "etc"
    folder.mkdir()
    src = tmp_path / "src"
    src.write_text(target.read_text())  # identical content: the path that only fixes metadata
    path = tmp_path / "state" / "train.npz"
    path.parent.mkdir()
    put_in_the_way(path, kind, folder if kind == "symlink to a directory" else target)
    r = subprocess.run([sys.executable, str(SCRIPTS / "fix-meta.py"), "--install", str(src), str(path), "0640",
                        f"{os.getuid()}:{os.getgid()}"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == f"installed {path}\n", r.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and target.stat().st_nlink == 1
    assert list(folder.iterdir()) == []
    assert path.is_file() and not path.is_symlink() and path.read_text() == src.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in path.parent.iterdir()] == ["train.npz"]  # no temporary file left


def test_fix_meta_install_fixes_an_identical_file_in_place_and_refuses_a_directory(tmp_path):
    src = tmp_path / "src"
    src.write_text("rows")
    path = tmp_path / "train.npz"
    path.write_text("rows")
    path.chmod(0o666)
    inode = path.stat().st_ino
    run = [sys.executable, str(SCRIPTS / "fix-meta.py"), "--install", str(src), str(path), "0640", "-"]
    r = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == f"mode 0640: {path}\n"
    assert path.stat().st_ino == inode and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert subprocess.run(run, capture_output=True, text=True, timeout=30).stdout == ""  # nothing left to change
    path.unlink()
    path.mkdir()
    r = subprocess.run(run, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "is a directory where the installer puts a file" in r.stderr


def test_a_failed_install_is_not_taken_for_the_one_before(tmp_path, inputs):
    """The stamp of the last good install stayed while pip changed the virtualenv: after a run
    that failed midway, a run with the first run's arguments found the stamp equal, skipped pip
    and reported success over the virtualenv the failed run had left."""
    root = tmp_path / "root"
    base_root(root)
    failing = inputs / "failing-pip"
    failing.write_text(f"#!/bin/sh\n{inputs / 'fake-pip'} \"$@\"\ncase \"$*\" in *2.99.0*) exit 1 ;; esac\n")
    failing.chmod(0o755)
    args = ["--root", str(root), "--config", str(inputs / "agent.toml"), "--arch", "x86_64",
            "--wheel", str(inputs / "fedal_edge-0.1.0-py3-none-any.whl"), "--pip", str(failing)]
    assert install(*args).returncode == 0
    assert install(*args, "--torch-version", "2.99.0").returncode != 0
    calls = len(pip_calls(inputs))
    again = install(*args)
    assert again.returncode == 0, again.stderr
    assert len(pip_calls(inputs)) > calls and "installed the agent" in again.stdout  # installed again, not skipped


def test_a_ca_the_config_names_outside_the_agents_folder_is_left_as_it_is(tmp_path, inputs):
    """A user's own CA file with the --ca certificate's content (broker.ca_file pointing at it)
    was chmod-ed 0644 and chown-ed to root: the installer replaces files only in /etc/fedal-agent."""
    root = tmp_path / "root"
    base_root(root)
    theirs = root / "home" / "alice" / "ca.pem"
    theirs.parent.mkdir(parents=True)
    theirs.write_bytes((inputs / "ca.crt").read_bytes())
    theirs.chmod(0o600)
    cfg = inputs / "alice.toml"
    cfg.write_text(AGENT_TOML.replace('ca_file = "/etc/fedal-agent/ca.crt"', 'ca_file = "/home/alice/ca.pem"'))
    r = install("--root", str(root), "--config", str(cfg), "--ca", str(inputs / "ca.crt"), "--skip-pip")
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o600


def test_two_installs_at_once_take_turns(tmp_path, inputs):
    """The first-boot service retries every minute: an install run by hand meanwhile had two pips
    rebuilding one virtualenv at once. The second waits for the first (and, its inputs being the
    same, then finds nothing to do)."""
    root = tmp_path / "root"
    base_root(root)
    log = inputs / "slow-pip.log"
    slow = inputs / "slow-pip"
    slow.write_text(f"#!/bin/sh\necho start >> {log}\nsleep 1.5\necho end >> {log}\n{inputs / 'fake-pip'} \"$@\"\n")
    slow.chmod(0o755)
    args = ["--root", str(root), "--config", str(inputs / "agent.toml"), "--arch", "x86_64", "--no-start",
            "--wheel", str(inputs / "fedal_edge-0.1.0-py3-none-any.whl"), "--pip", str(slow)]
    env = {k: v for k, v in os.environ.items() if k not in ("FEDAL_ARCH", "DESTDIR")}
    first = subprocess.Popen(["bash", str(INSTALL), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the first one's pip is under way
        second = install(*args, arch=None)
        out_first = first.communicate(timeout=60)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and second.returncode == 0, out_first + second.stdout + second.stderr
    assert "waiting for it to finish" in second.stdout
    assert log.read_text().split() == ["start", "end", "start", "end"]  # torch, then the agent: never two at once
    assert "nothing changed" in second.stdout


def test_an_offline_install_pins_what_the_wheelhouse_holds(tmp_path, inputs):
    """A wheelhouse built with other pins than the checkout's (`fedal fleet wheelhouse
    --constraints FILE`, another checkout) failed to install offline at first boot: pip was held
    to the checkout's pins, which it had no wheels for, and the card had to be flashed again."""
    wh = tmp_path / "wh"
    wh.mkdir()
    (wh / "fedal_edge-0.1.0-py3-none-any.whl").write_bytes(b"a wheel")
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    (wh / "fedal-wheelhouse.json").write_text(json.dumps({
        "arch": "aarch64", "python": python, "agent_wheel": "fedal_edge-0.1.0-py3-none-any.whl", "torch": "2.13.0",
        "versions": {"fedal_edge": "0.1.0", "numpy": "2.2.0", "onnxruntime": "1.22.0", "torch": "2.13.0"}}))
    root = tmp_path / "root"
    base_root(root)
    r = install("--root", str(root), "--config", str(inputs / "agent.toml"), "--wheelhouse", str(wh),
                "--pip", str(inputs / "fake-pip"), env={"FEDAL_CPUINFO": os.devnull})
    assert r.returncode == 0, r.stderr + r.stdout
    constraints = root / "opt/fedal-agent/fedal-constraints.txt"
    assert set(pins(constraints.read_text())) == {"numpy", "onnxruntime", "torch"}
    assert str(pins(constraints.read_text())["onnxruntime"].specifier) == "==1.22.0"
    (call,) = pip_calls(inputs)
    assert call[call.index("-c") + 1] == str(constraints) and "--no-index" in call


def test_files_the_services_sandbox_hides_are_refused_or_made_visible(tmp_path, inputs):
    """The unit's sandbox (PrivateTmp=yes, ProtectHome=yes) hid a data file under /tmp or /home
    that the installer had accepted: the agent then said it "does not exist" and exited 2."""
    root = tmp_path / "root"
    args = ["--root", str(root), "--config", str(inputs / "agent.toml"), "--skip-pip"]
    dropin = root / "etc/systemd/system/fedal-agent.service.d/10-fedal-mounts.conf"
    (inputs / "agent.toml").write_text(AGENT_TOML.replace('"/var/lib/fedal-agent/train.npz"', '"/tmp/train.npz"'))
    r = install(*args)
    assert r.returncode == 3 and "private /tmp" in r.stderr, r.stderr + r.stdout
    assert not (root.exists() and any(root.rglob("*")))  # refused before anything was installed
    (inputs / "agent.toml").write_text(AGENT_TOML.replace('"/var/lib/fedal-agent/train.npz"', '"/home/pi/train.npz"'))
    r = install(*args)
    assert r.returncode == 0, r.stderr + r.stdout
    assert dropin.read_text().splitlines()[1:] == ["[Unit]", "RequiresMountsFor=/home/pi/train.npz",
                                                   "[Service]", "ProtectHome=read-only"]
    verified_with_dropin(root, dropin, tmp_path, "ProtectHome")
