"""The README's set-up on a machine whose only Python is externally managed (PEP 668, as on
Debian 12, Ubuntu 23.04+ and Raspberry Pi OS): scripts/install.sh makes and uses a project
virtualenv instead of installing into that Python, and reuses an active virtualenv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.test_firmware_install_real import checkout_copy

REPO = Path(__file__).resolve().parents[1]


def externally_managed_python(dest: Path) -> Path:
    """A Python installation of its own whose stdlib carries the EXTERNALLY-MANAGED marker: the
    base interpreter's binary, its stdlib linked entry by entry, pip in its site-packages."""
    base_prefix = Path(sys.base_prefix)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    stdlib = Path(sysconfig.get_paths(vars={"base": sys.base_prefix, "installed_base": sys.base_prefix})["stdlib"])
    (dest / "bin").mkdir(parents=True)
    lib = dest / "lib" / version
    lib.mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages", "EXTERNALLY-MANAGED"):
            (lib / entry.name).symlink_to(entry)
    site = lib / "site-packages"
    site.mkdir()
    base_site = Path(sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"])
    for entry in base_site.glob("pip*"):
        (site / entry.name).symlink_to(entry)
    (lib / "EXTERNALLY-MANAGED").write_text("[externally-managed]\nError=this Python is managed by the system\n")
    exe = dest / "bin" / version
    real = Path(os.path.realpath(base_prefix / "bin" / version))
    exe.write_bytes(real.read_bytes())
    exe.chmod(0o755)
    (dest / "bin" / "python3").symlink_to(version)
    return dest / "bin"


def clean_env(path_first: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHON", "FEDAL_PYTHON", "PYTHONPATH", "PYTHONHOME", "FEDAL_VENV")}
    env["PATH"] = f"{path_first}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return env


def test_install_on_an_externally_managed_python_uses_a_project_venv(tmp_path):
    bindir = externally_managed_python(tmp_path / "system")
    env = clean_env(bindir)
    # the premise: pip refuses this Python, as on Debian 12's
    refused = subprocess.run([str(bindir / "python3"), "-m", "pip", "install", "--dry-run", "six"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr + refused.stdout

    src = checkout_copy(tmp_path / "src")
    first = subprocess.run(["bash", "scripts/install.sh", "none"], cwd=src, capture_output=True, text=True,
                           env=env, timeout=1200)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    venv = src / ".venv"
    assert "creating the project virtualenv" in first.stderr
    assert f"source {venv}/bin/activate" in first.stderr
    cfg = (venv / "pyvenv.cfg").read_text()
    assert f"home = {bindir}" in cfg  # made from the externally managed Python, not installed into it
    imported = subprocess.run([str(venv / "bin/python"), "-c", "import fedal, torch; print(torch.__version__)"],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert imported.returncode == 0 and imported.stdout.startswith("2.13.0"), imported.stderr
    assert (venv / "bin/fedal").exists()
    assert not list((tmp_path / "system/lib").glob("python3*/site-packages/fedal*"))

    # again: the same virtualenv, not a new one; and with no package index (an offline machine runs
    # scripts/demo.sh, which installs first): the editable build takes the virtualenv's setuptools
    offline = {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    second = subprocess.run(["bash", "scripts/install.sh", "none"], cwd=src, capture_output=True, text=True,
                            env=offline, timeout=1200)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "creating the project virtualenv" not in second.stderr


def chosen_python(env: dict[str, str]) -> str:
    out = subprocess.run(["bash", "-c", "source scripts/python-env.sh && echo \"$PYTHON\""], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_an_active_virtualenv_or_an_explicit_python_is_used_as_it_is(tmp_path):
    active = tmp_path / "active"
    (active / "bin").mkdir(parents=True)
    (active / "bin/python").symlink_to(sys.executable)
    env = clean_env(tmp_path)
    assert chosen_python({**env, "VIRTUAL_ENV": str(active)}) == f"{active}/bin/python"
    assert chosen_python({**env, "VIRTUAL_ENV": str(active), "FEDAL_PYTHON": "/some/python"}) == "/some/python"
    # a PYTHON other toolchains export (node-gyp's, say: a system Python) is not taken
    assert chosen_python({**env, "VIRTUAL_ENV": str(active), "PYTHON": "/usr/bin/python3"}) == f"{active}/bin/python"
    # neither: the project's virtualenv (or the one FEDAL_VENV names), made once
    made = tmp_path / "venv"
    assert chosen_python({**env, "FEDAL_VENV": str(made)}) == f"{made}/bin/python"
    assert (made / "pyvenv.cfg").is_file()


@pytest.mark.parametrize("machine, resolves_to, cpu_index_first", [
    ("aarch64", "torch", True),
    ("x86_64", "torch", False),  # a CPU wheel from the configured sources (a local wheelhouse, as CI's)
    ("x86_64", "nvidia-cudnn-cu13", True),  # PyPI's x86-64 torch: the CUDA toolkit would come with it
    # and with a report much longer after the match (grep -q then stops reading while pip writes)
    ("x86_64", "nvidia-cudnn-cu13 + 200 KB", True),
])
def test_install_takes_torch_from_the_cpu_index_where_it_would_bring_cuda(tmp_path, machine, resolves_to,
                                                                          cpu_index_first):
    """PyPI's torch from 2.11 on depends on the CUDA 13 toolkit (several GB): scripts/install.sh
    takes the pinned torch from PyTorch's CPU index first on 64-bit ARM always, and on x86-64
    when pip's dry run says the configured sources would bring the CUDA packages."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    (bindir / "uname").write_text(f"#!/bin/sh\necho {machine}\n")
    name, _, padded = resolves_to.partition(" + ")
    rest = [{"metadata": {"name": f"pkg-{i}", "version": "1"}} for i in range(5000)] if padded else []
    (tmp_path / "report.json").write_text(json.dumps({"install": [{"metadata": {"name": name, "version": "1"}}, *rest]},
                                                     indent=2))
    report_file = tmp_path / "report.json"
    (bindir / "python").write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && exit 0\n"
                                   f"case \"$*\" in *--dry-run*) exec cat {report_file} ;; esac\n"
                                   f"echo \"$*\" >> {log}\n")
    for tool in ("uname", "python"):
        (bindir / tool).chmod(0o755)
    env = {**clean_env(bindir), "FEDAL_PYTHON": str(bindir / "python")}
    out = subprocess.run(["bash", "scripts/install.sh", "dev"], cwd=REPO, capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    # (this stand-in's `-c` probes all succeed: its setuptools counts as new enough to build with)
    last = ("-m pip install --quiet --disable-pip-version-check --no-build-isolation torch==2.13.0 "
            "setuptools>=70.1 -e .[dev]")
    if cpu_index_first:
        assert calls == ["-m pip install --quiet --disable-pip-version-check --index-url "
                         "https://download.pytorch.org/whl/cpu torch==2.13.0", last]
    else:
        assert calls == [last]


def test_no_python_new_enough_stops_before_anything_is_installed(tmp_path):
    """Only an older Python on PATH: the set-up says so and stops; it neither asks apt-get for a
    venv package of no version nor tries to make a virtualenv with no interpreter."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    (bindir / "python3").write_text("#!/bin/sh\nexit 1\n")  # a 3.10: fails the version probe
    for tool in ("apt-get", "sudo", "id"):
        (bindir / tool).write_text(f"#!/bin/sh\necho {tool} \"$@\" >> {log}\n")
    for tool in bindir.iterdir():
        tool.chmod(0o755)
    env = {**clean_env(bindir), "PATH": str(bindir), "FEDAL_VENV": str(tmp_path / "venv")}
    out = subprocess.run(["/bin/bash", "-c", "source scripts/python-env.sh && echo \"chose $PYTHON\""], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode != 0
    assert "needs Python 3.11 or newer" in out.stderr
    assert "chose" not in out.stdout and "creating the project virtualenv" not in out.stderr
    assert not log.exists(), log.read_text()
    assert not (tmp_path / "venv").exists()
