"""`fedal fleet wheelhouse` with the real pip against a local find-links directory of small
wheels shaped like the real ones (platform tags, versions, markers): it takes the pinned aarch64
builds, leaves out what the device's markers exclude (torch's x86-only CUDA packages), refuses an
incomplete closure, and never touches a directory it did not write."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CUDA_DEP = 'nvidia-cudnn-cu12==9.10.2.21; platform_system == "Linux" and platform_machine == "x86_64"'
SELF_CHECK = ('import json, sys\nif "--self-check" in sys.argv:\n'
              '    print(json.dumps({"status": "ok", "seconds": 0.0}))\n')


def fake_wheel(dest: Path, name: str, version: str, tag: str = "py3-none-any", requires: tuple[str, ...] = (),
               files: dict[str, str] | None = None, pad: int = 0, extras: tuple[str, ...] = ()) -> Path:
    """A valid wheel (METADATA, WHEEL, RECORD) holding `files` and `pad` incompressible bytes."""
    dist = name.replace("-", "_")
    path = dest / f"{dist}-{version}-{tag}.whl"
    info = f"{dist}-{version}.dist-info"
    entries = dict(files or {})
    if pad:
        entries[f"{dist}/pad.bin"] = os.urandom(pad)  # type: ignore[assignment]
    entries[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Provides-Extra: {e}\n" for e in extras)
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    py, abi, plats = tag.split("-")
    entries[f"{info}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                + "".join(f"Tag: {py}-{abi}-{p}\n" for p in plats.split(".")))
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for arc, data in entries.items():
            raw = data if isinstance(data, bytes) else data.encode()
            z.writestr(arc, raw, compress_type=zipfile.ZIP_STORED if pad else zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(raw).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(raw)}")
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return path


def agent_wheel(dest: Path) -> Path:
    """A stand-in for the toolkit's wheel: the agent extra's shape, an edge_agent that self-checks."""
    return fake_wheel(dest, "fedal-edge", "0.1.0",
                      requires=("numpy>=1.26", 'torch<2.14,>=2.10; extra == "agent"', 'paho-mqtt<3,>=2.0; extra == "agent"',
                                'uvicorn>=0.29; extra == "coordinator"'),
                      files={"edge_agent/__init__.py": "", "edge_agent/__main__.py": SELF_CHECK}, extras=("agent", "coordinator"))


def fake_index(dest: Path, arch_tag: str = "manylinux_2_28_aarch64") -> Path:
    """Wheels as PyPI holds them: torch 2.10 for both architectures, a newer torch, numpy, paho-mqtt."""
    dest.mkdir(parents=True, exist_ok=True)
    torch_requires = ("filelock", CUDA_DEP)
    fake_wheel(dest, "torch", "2.10.0", f"cp311-cp311-{arch_tag}", torch_requires, {"torch/__init__.py": ""})
    fake_wheel(dest, "torch", "2.10.0", "cp311-cp311-manylinux_2_28_x86_64", torch_requires, {"torch/__init__.py": ""})
    fake_wheel(dest, "torch", "2.13.0", f"cp311-cp311-{arch_tag}", torch_requires, {"torch/__init__.py": ""})
    for arch in ("aarch64", "x86_64"):
        tag = f"cp311-cp311-manylinux_2_17_{arch}.manylinux2014_{arch}"
        fake_wheel(dest, "numpy", "2.4.6", tag, files={"numpy/__init__.py": ""})
    fake_wheel(dest, "paho-mqtt", "2.2.0", files={"paho/__init__.py": ""})
    fake_wheel(dest, "filelock", "3.20.0", files={"filelock.py": ""})
    return dest


CONSTRAINTS = "# pins\ntorch==2.10.0\nnumpy==2.4.6\npaho-mqtt==2.2.0\nfilelock==3.20.0\n"


def hermetic_pip_env(only: Path) -> dict[str, str]:
    """No PIP_* settings, and `only` in place of the machine's configured find-links directories."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_FIND_LINKS"] = str(only)
    return env


def wheelhouse(*args: str) -> subprocess.CompletedProcess:
    env = hermetic_pip_env(Path(args[args.index("--find-links") + 1]) if "--find-links" in args else REPO / "tests")
    return subprocess.run([sys.executable, "-m", "fedal_cli.main", "fleet", "wheelhouse", *args], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture()
def inputs(tmp_path):
    idx = fake_index(tmp_path / "index")
    (tmp_path / "constraints.txt").write_text(CONSTRAINTS)
    wheels = tmp_path / "built"
    wheels.mkdir()
    return idx, tmp_path / "constraints.txt", agent_wheel(wheels)


def offline(idx: Path, constraints: Path, wheel: Path) -> list[str]:
    return ["--no-index", "--find-links", str(idx), "--constraints", str(constraints), "--wheel", str(wheel)]


def test_pinned_aarch64_closure_without_x86_only_dependencies(tmp_path, inputs):
    out = tmp_path / "wh"
    r = wheelhouse("--arch", "aarch64", "--out", str(out), *offline(*inputs))
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["fedal-wheelhouse.json", "fedal_edge-0.1.0-py3-none-any.whl", "filelock-3.20.0-py3-none-any.whl",
                     "numpy-2.4.6-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
                     "paho_mqtt-2.2.0-py3-none-any.whl", "torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl"]
    manifest = json.loads((out / "fedal-wheelhouse.json").read_text())
    assert (manifest["arch"], manifest["python"], manifest["torch"]) == ("aarch64", "3.11", "2.10.0")
    assert manifest["agent_wheel"] == "fedal_edge-0.1.0-py3-none-any.whl"
    for name, entry in manifest["files"].items():
        data = (out / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert manifest["bytes"] == sum(e["bytes"] for e in manifest["files"].values())
    assert "manylinux_2_36_aarch64" in manifest["platforms"] and "manylinux2014_aarch64" in manifest["platforms"]
    assert "6 wheels" not in r.stdout and "5 wheels" in r.stdout and "torch 2.10.0" in r.stdout
    assert manifest["extras"] == ["agent"] and "installs offline: agent\n" in r.stdout

    # a second build replaces its own wheelhouse
    again = wheelhouse("--arch", "aarch64", "--out", str(out), *offline(*inputs))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.iterdir()) == names

    # for x86_64 the same markers hold: PyPI's torch there needs the CUDA packages, which are not pinned
    x86 = wheelhouse("--arch", "x86_64", "--out", str(tmp_path / "wh-x86"), *offline(*inputs))
    assert x86.returncode == 1
    assert "lacks nvidia-cudnn-cu12==9.10.2.21 (needed by torch)" in x86.stderr
    assert "--torch-index https://download.pytorch.org/whl/cpu --torch-version 2.13.0" in x86.stderr


def test_an_incomplete_closure_is_refused_naming_what_is_missing(tmp_path, inputs):
    idx, constraints, wheel = inputs
    constraints.write_text(CONSTRAINTS.replace("filelock==3.20.0\n", ""))
    out = tmp_path / "new" / "wh"
    r = wheelhouse("--out", str(out), *offline(idx, constraints, wheel))
    assert r.returncode == 1, r.stdout
    assert "lacks filelock (needed by torch)" in r.stderr and "nvidia" not in r.stderr
    assert not (tmp_path / "new").exists()  # the directories it made go again: nothing half-written is left
    out.mkdir(parents=True)  # a directory the user made stays, empty
    r = wheelhouse("--out", str(out), *offline(idx, constraints, wheel))
    assert r.returncode == 1 and list(out.iterdir()) == []


def test_the_privacy_extra_it_carries_is_checked_complete_too(tmp_path, inputs):
    """The default constraints pin Opacus: a wheelhouse holding it must hold what Opacus needs, or
    `install-agent.sh --privacy` would fail offline on the device."""
    idx, constraints, _ = inputs
    wheel = fake_wheel(tmp_path / "built", "fedal-edge", "0.2.0",
                       requires=('torch<2.14,>=2.10; extra == "agent"', 'paho-mqtt<3,>=2.0; extra == "agent"',
                                 'numpy>=1.26', 'opacus==1.6.0; extra == "privacy"'),
                       files={"edge_agent/__init__.py": ""}, extras=("agent", "privacy"))
    fake_wheel(idx, "opacus", "1.6.0", requires=("scipy>=1.2", "torch>=2.0"), files={"opacus/__init__.py": ""})
    fake_wheel(idx, "scipy", "1.17.1", "cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64",
               files={"scipy/__init__.py": ""})
    constraints.write_text(CONSTRAINTS + "opacus==1.6.0\n")
    out = tmp_path / "wh"
    r = wheelhouse("--out", str(out), *offline(idx, constraints, wheel))
    assert r.returncode == 1, r.stdout
    assert "lacks scipy>=1.2 (needed by opacus)" in r.stderr
    assert not out.exists()

    constraints.write_text(CONSTRAINTS + "opacus==1.6.0\nscipy==1.17.1\n")
    r = wheelhouse("--out", str(out), *offline(idx, constraints, wheel))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "fedal-wheelhouse.json").read_text())["extras"] == ["agent", "privacy"]
    assert "installs offline: agent, privacy" in r.stdout

    # without Opacus pinned the wheelhouse serves the agent alone, as before
    constraints.write_text(CONSTRAINTS)
    r = wheelhouse("--out", str(out), *offline(idx, constraints, wheel))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "fedal-wheelhouse.json").read_text())["extras"] == ["agent"]


def test_foreign_directories_are_never_touched(tmp_path, inputs):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "chapter1.tex").write_text("mine")
    r = wheelhouse("--out", str(out), *offline(*inputs))
    assert r.returncode == 2
    assert "not empty and is not a wheelhouse" in r.stderr and (out / "chapter1.tex").read_text() == "mine"

    ours = tmp_path / "wh"
    assert wheelhouse("--out", str(ours), *offline(*inputs)).returncode == 0
    (ours / "notes.txt").write_text("mine too")
    r = wheelhouse("--out", str(ours), *offline(*inputs))
    assert r.returncode == 2 and "holds files it did not write (notes.txt)" in r.stderr
    assert (ours / "notes.txt").read_text() == "mine too" and (ours / "fedal-wheelhouse.json").exists()


@pytest.mark.parametrize("extra, message", [
    (["--arch", "armv7l"], "--arch must be one of aarch64, x86_64"),
    (["--python-version", "3"], "--python-version must be like 3.11"),
    (["--constraints", "missing.txt"], "constraints file not found"),
    (["--constraints", "loose.txt"], "must pin one version"),
    (["--constraints", "wildcard.txt"], "must pin one version"),  # ==2.* is a range: any 2.x (a CUDA torch too)
    (["--find-links", "nowhere"], "--find-links nowhere does not exist"),
    (["--wheel", "agent.tar.gz"], "is not a .whl file"),
])
def test_bad_arguments_exit_2_with_the_reason(tmp_path, inputs, extra, message):
    idx, constraints, wheel = inputs
    (tmp_path / "loose.txt").write_text("torch>=2.10\n")
    (tmp_path / "wildcard.txt").write_text("numpy==1.26.*\n")
    (tmp_path / "agent.tar.gz").write_bytes(b"x")
    extra = [str(tmp_path / e) if e in ("missing.txt", "loose.txt", "wildcard.txt", "agent.tar.gz") else e for e in extra]
    args = {"--constraints": str(constraints), "--wheel": str(wheel)}
    for i in range(0, len(extra), 2):
        args[extra[i]] = extra[i + 1]
    flat = [x for kv in args.items() for x in kv]
    r = wheelhouse("--out", str(tmp_path / "wh"), "--no-index", "--find-links", str(idx), *flat)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert not (tmp_path / "wh").exists()


def test_a_stopped_wheelhouse_ends_pip_and_leaves_nothing_in_out(tmp_path, inputs):
    """SIGTERM while pip downloads from an index that never answers: pip ends with the command
    (it ran on under init), the work directory inside --out goes, and the next run takes --out.
    A work directory left by a run killed outright (SIGKILL) is removed by the next one."""
    import signal
    import socket

    import psutil

    from tests.waiting import signal_when_ready

    idx, constraints, wheel = inputs
    out = tmp_path / "wh"
    out.mkdir()
    with socket.socket() as stalled:  # accepts connections, never answers: a stalled index
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(16)
        url = f"http://127.0.0.1:{stalled.getsockname()[1]}/simple"
        proc = subprocess.Popen([sys.executable, "-m", "fedal_cli.main", "fleet", "wheelhouse", "--arch", "aarch64",
                                 "--out", str(out), "--index-url", url, "--constraints", str(constraints),
                                 "--wheel", str(wheel)], cwd=REPO, env=hermetic_pip_env(tmp_path / "none"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        pips: list = []
        tmpdirs: list[Path] = []

        def downloading() -> bool:
            pips[:] = [c for c in psutil.Process(proc.pid).children(recursive=True) if "download" in " ".join(c.cmdline())]
            if pips and not tmpdirs:
                tmpdirs.append(Path(pips[0].environ()["TMPDIR"]))
            return bool(pips)

        _, err = signal_when_ready(proc, downloading, signal.SIGTERM, settle_s=1)
        pip_tmp = tmpdirs[0] if tmpdirs else None
    assert proc.returncode == 128 + signal.SIGTERM, err
    # pip's own temporary files (a partial download; pip ended by a signal leaves them) were in the
    # run's work directory, and went with it
    assert pip_tmp is not None and pip_tmp.is_relative_to(out), pip_tmp
    assert "stopped by SIGTERM: pip ended" in err and "Traceback" not in err
    psutil.wait_procs(pips, timeout=10)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in pips)
    assert list(out.iterdir()) == []

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    from fedal.procs import _where

    (out / f".fedal-wheelhouse-{gone.pid}-{_where()}-x1y2z3").mkdir()  # a run killed with SIGKILL left its work
    r = wheelhouse("--arch", "aarch64", "--out", str(out), *offline(idx, constraints, wheel))
    assert r.returncode == 0, r.stderr
    assert not list(out.glob(".fedal-wheelhouse-*"))


def cpu_torch_index(root: Path, arch_tag: str = "manylinux_2_28_aarch64") -> str:
    """A PEP 503 index of torch's CPU builds (no CUDA requirement), as PyTorch's CPU index holds them."""
    wheels = root / "wheels"
    wheels.mkdir(parents=True)
    wheel = fake_wheel(wheels, "torch", "2.13.0+cpu", f"cp311-cp311-{arch_tag}", ("filelock",), {"torch/__init__.py": ""})
    page = root / "simple" / "torch"
    page.mkdir(parents=True)
    page.joinpath("index.html").write_text(f'<html><body><a href="{wheel.as_uri()}">{wheel.name}</a></body></html>\n')
    return (root / "simple").as_uri()


def test_a_pi_4_wheelhouse_takes_torch_from_the_cpu_index(tmp_path, inputs):
    """A Pi 3B+, Pi 4 or Zero 2 W refuses PyPI's torch 2.10.0 (SIGILL on its cores) and PyPI's later
    ones pull the CUDA toolkit: --torch-index/--torch-version take a CPU build from PyTorch's index."""
    idx, constraints, wheel = inputs
    out = tmp_path / "wh"
    r = wheelhouse("--arch", "aarch64", "--out", str(out), *offline(idx, constraints, wheel),
                   "--torch-index", cpu_torch_index(tmp_path / "cpu"), "--torch-version", "2.13.0")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((out / "fedal-wheelhouse.json").read_text())
    assert manifest["torch"] == "2.13.0+cpu" and "torch 2.13.0+cpu" in r.stdout
    assert [n for n in manifest["files"] if n.startswith("torch-")] == ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_aarch64.whl"]


def test_a_newer_torch_without_the_cpu_index_is_refused_before_any_download(tmp_path, inputs):
    idx, constraints, wheel = inputs
    r = wheelhouse("--arch", "aarch64", "--out", str(tmp_path / "wh"), *offline(idx, constraints, wheel),
                   "--torch-version", "2.13.0")
    assert r.returncode == 2 and "depends on the CUDA 13 toolkit" in r.stderr and "--torch-index" in r.stderr
    assert not (tmp_path / "wh").exists()
    bad = wheelhouse("--arch", "aarch64", "--out", str(tmp_path / "wh"), *offline(idx, constraints, wheel),
                     "--torch-version", "latest")
    assert bad.returncode == 2 and "is not a version" in bad.stderr


def test_a_failed_rebuild_keeps_the_wheelhouse_that_was_there(tmp_path, inputs):
    """The old files went before the download: a rebuild in an offline lab that failed (no index,
    a pip error) left an empty directory where the working wheelhouse had been."""
    from fleet.wheelhouse import verify

    idx, constraints, wheel = inputs
    out = tmp_path / "wh"
    assert wheelhouse("--arch", "aarch64", "--out", str(out), *offline(idx, constraints, wheel)).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    empty = tmp_path / "empty-index"
    empty.mkdir()
    r = wheelhouse("--arch", "aarch64", "--out", str(out), *offline(empty, constraints, wheel))
    assert r.returncode != 0 and "pip download failed" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    verify(out)

    # a rebuild that succeeds replaces the files: the old agent wheel gone, the new one listed
    newer = fake_wheel(tmp_path / "built", "fedal-edge", "0.2.0",
                       requires=("numpy>=1.26", 'torch<2.14,>=2.10; extra == "agent"',
                                 'paho-mqtt<3,>=2.0; extra == "agent"'),
                       files={"edge_agent/__init__.py": "", "edge_agent/__main__.py": SELF_CHECK}, extras=("agent",))
    r = wheelhouse("--arch", "aarch64", "--out", str(out), *offline(idx, constraints, newer))
    assert r.returncode == 0, r.stderr
    manifest = verify(out)
    assert manifest["agent_version"] == "0.2.0" and newer.name in manifest["files"]
    assert wheel.name not in {p.name for p in out.iterdir()}
    assert {p.name for p in out.iterdir()} == set(manifest["files"]) | {"fedal-wheelhouse.json"}


def test_a_constraints_file_that_is_not_text_is_a_clear_error(tmp_path, inputs):
    idx, _, wheel = inputs
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"torch==2.10.0  # \xe9t\xe9\n")
    r = wheelhouse("--arch", "aarch64", "--out", str(tmp_path / "wh"), *offline(idx, bad, wheel))
    assert r.returncode == 2 and "cannot be read as text" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "wh").exists()


def test_the_agents_wheel_is_built_from_a_checkout_without_git_on_the_machine(tmp_path, monkeypatch):
    """Before: FileNotFoundError for `git` escaped as a traceback; the copy of the checkout it
    falls back to when git cannot list the files was never reached."""
    from fleet import wheelhouse as wh

    checkout = tmp_path / "checkout"
    (checkout / "edge_agent").mkdir(parents=True)
    (checkout / "edge_agent" / "__init__.py").write_text("")
    (checkout / "build" / "lib" / "stale").mkdir(parents=True)  # a leftover the copy leaves out
    (checkout / "build" / "lib" / "stale" / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text('[build-system]\nrequires = ["setuptools>=68"]\n'
                                             'build-backend = "setuptools.build_meta"\n'
                                             '[project]\nname = "fedal-edge"\nversion = "0.1.0"\n'
                                             '[tool.setuptools]\npackages = ["edge_agent"]\n')
    empty = tmp_path / "no-git"
    empty.mkdir()
    monkeypatch.setattr(wh, "REPO", checkout)
    monkeypatch.setenv("PATH", str(empty))
    dest = tmp_path / "work"
    dest.mkdir()
    wheel = wh._agent_wheel(wh.WheelhouseSpec(out=tmp_path / "wh"), dest)
    assert wheel.name == "fedal_edge-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        assert "edge_agent/__init__.py" in z.namelist() and not any("stale" in n for n in z.namelist())
    assert not (checkout / "fedal_edge.egg-info").exists()  # built from the copy
