"""`fedal fleet wheelhouse`: every wheel a device's agent install needs, for an install with no
package index (a Pi that reaches only the broker).

pip downloads for another platform with `--platform` and `--only-binary=:all:`, but evaluates
dependency markers against the machine it runs on: on an x86-64 workstation torch's aarch64 wheel
would pull the x86-only CUDA packages. So the agent's pinned closure (firmware_scripts/constraints/
<arch>.txt pins every package of the `agent` extra) is downloaded with --no-deps, and the result is
checked here against the device's marker environment: every requirement of every wheel, with the
toolkit's `agent` extra, must be met by a wheel in the directory, or the build fails naming what is
missing. A device extra the wheelhouse carries (`privacy`: its Opacus is pinned by default) is
checked the same way, so `install-agent.sh --privacy` installs offline too. MANIFEST marks a
wheelhouse this command wrote; only such a directory is ever emptied, and only of the files its
manifest lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.parser import Parser
from pathlib import Path
from typing import Any

from fedal import procs
from fedal.atomic import write_bytes_atomic

REPO = Path(__file__).resolve().parents[1]
MANIFEST = "fedal-wheelhouse.json"
WORK_PREFIX = ".fedal-wheelhouse-"  # a run's work directory inside --out, removed when it ends
FORMAT = 1
# glibc of the oldest supported device OS: Raspberry Pi OS Bookworm (Debian 12) has 2.36
GLIBC_MINOR = 36
ARCHES = ("aarch64", "x86_64")
AGENT_DIST = "fedal-edge"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
DEVICE_EXTRAS = ("privacy",)  # extras a device may add to `agent` (install-agent.sh --privacy)


class WheelhouseError(ValueError):
    """A wheelhouse that cannot be built as asked; the message says why and what to do."""


class UsageProblem(WheelhouseError):
    """The arguments are wrong (exit 2), as opposed to a build that failed."""


@dataclass
class WheelhouseSpec:
    out: Path
    arch: str = "aarch64"
    python_version: str = "3.11"
    constraints: Path | None = None
    wheel: Path | None = None
    index_url: str | None = None
    find_links: list[str] = field(default_factory=list)
    no_index: bool = False
    torch_index: str | None = None  # torch alone from this index (PyTorch's CPU wheels), as install-agent.sh does
    torch_version: str | None = None  # in place of the constraints' torch pin
    python: str = sys.executable  # whose pip downloads


def platforms(arch: str) -> list[str]:
    """The manylinux tags a device with glibc 2.GLIBC_MINOR accepts, newest first."""
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(GLIBC_MINOR, 16, -1)]
    return tags + [f"manylinux2014_{arch}"]


def marker_environment(arch: str, python_version: str) -> dict[str, str]:
    """The device's PEP 508 marker values (a 64-bit Debian with CPython)."""
    return {"implementation_name": "cpython", "implementation_version": f"{python_version}.0", "os_name": "posix",
            "platform_machine": arch, "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": f"{python_version}.0",
            "python_version": python_version, "sys_platform": "linux"}


def is_wheelhouse(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def read_manifest(path: Path) -> dict:
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise WheelhouseError(f"{path / MANIFEST} is not a readable wheelhouse manifest: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        raise WheelhouseError(f"{path / MANIFEST} is not a wheelhouse manifest of this toolkit (format {FORMAT})")
    return data


def verify(path: Path) -> dict:
    """The manifest of a complete wheelhouse: every listed file present with its size and hash."""
    data = read_manifest(path)
    for name, entry in data["files"].items():
        f = path / name
        if Path(name).name != name or not f.is_file():
            raise WheelhouseError(f"wheelhouse {path} lacks {name}, which its manifest lists: build it again")
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            raise WheelhouseError(f"{f} differs from the wheelhouse manifest (size or sha256): build it again")
    return data


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _claim(out: Path) -> dict[str, Any]:
    """Check that out is usable: new or empty, or a wheelhouse of ours holding only the files it
    lists; returns those files' entries (none for a new or empty one). Nothing is removed here: a
    rebuild that fails (no network, a pip error) leaves the wheelhouse that was there as it was."""
    if out.exists() and not out.is_dir():
        raise UsageProblem(f"--out {out} exists and is not a directory")
    if out.is_dir():  # the work directories of runs killed before they could remove theirs
        procs.reap_pid_dirs(out, WORK_PREFIX)
    if not out.is_dir() or not any(out.iterdir()):
        return {}
    if not is_wheelhouse(out):
        raise UsageProblem(f"--out {out} is not empty and is not a wheelhouse this command wrote (no {MANIFEST}): "
                           f"refusing to delete or overwrite anything in it; give a new or an empty directory")
    try:
        listed: dict[str, Any] = dict(read_manifest(out)["files"])
    except WheelhouseError as exc:
        raise UsageProblem(f"--out {out}: {exc}; refusing to touch it") from None
    ours = set(listed) | {MANIFEST}
    foreign = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if foreign:
        raise UsageProblem(f"--out {out} is a wheelhouse, but also holds files it did not write ({', '.join(foreign[:5])}): "
                           f"move them away first (they would be installed on the devices)")
    return listed


def _replace_files(out: Path, before: dict[str, Any], manifest: dict[str, Any], files: list[Path]) -> None:
    """The new wheels in place of the old: a manifest listing both first (whatever happens next,
    the directory says which files are ours), then the old files the new set lacks removed, the
    new ones moved in, and the manifest of the new set alone."""
    write_bytes_atomic(out / MANIFEST, _manifest_bytes({**manifest, "files": {**before, **manifest["files"]}}))
    for name in set(before) - set(manifest["files"]):
        target = out / name
        if Path(name).name == name and (target.is_file() or target.is_symlink()):
            target.unlink()
    for f in files:
        os.replace(f, out / f.name)
    write_bytes_atomic(out / MANIFEST, _manifest_bytes(manifest))


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2) + "\n").encode()


def pinned_requirements(constraints: Path, arch: str, python_version: str) -> list[str]:
    """The `name==version` lines of a constraints file that apply to the device."""
    from packaging.requirements import InvalidRequirement, Requirement

    env = marker_environment(arch, python_version)
    reqs = []
    try:
        text = constraints.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageProblem(f"constraints file {constraints} cannot be read as text: {exc}") from None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise UsageProblem(f"{constraints}:{number}: not a requirement: {exc}") from None
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:  # (==2.* is a range)
            raise UsageProblem(f"{constraints}:{number}: {line!r} must pin one version (name==version): "
                               f"a wheelhouse holds exactly what the device installs")
        if req.marker is None or req.marker.evaluate(env):
            reqs.append(f"{req.name}=={specs[0].version}")
    return reqs


def _pip(spec: WheelhouseSpec, *args: str, work: Path) -> None:
    """pip as a child that dies with this process (procs.spawn), and is ended with it when a
    stop signal or an error ends the wait. Its temporary files go under `work` (TMPDIR), which
    goes with the run: pip ended by a signal leaves its own behind."""
    cmd = [spec.python, "-m", "pip", *args, "--disable-pip-version-check", "--no-input"]
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    proc = procs.spawn(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)})
    try:
        output, _ = proc.communicate()
    except BaseException:
        procs.terminate([proc], grace_s=5)
        raise
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise WheelhouseError(f"pip {args[0]} failed (exit {proc.returncode}):\n{tail}")


def _index_args(spec: WheelhouseSpec) -> list[str]:
    args = []
    if spec.no_index:
        args.append("--no-index")
    if spec.index_url:
        args += ["--index-url", spec.index_url]
    for link in spec.find_links:
        args += ["--find-links", link]
    return args


def _agent_wheel(spec: WheelhouseSpec, dest: Path) -> Path:
    """The toolkit's own wheel: --wheel, or built from this checkout's tracked and new files."""
    if spec.wheel is not None:
        target = dest / spec.wheel.name
        shutil.copyfile(spec.wheel, target)
        return target
    if not (REPO / "pyproject.toml").is_file():
        raise UsageProblem("no checkout to build the agent's wheel from: give --wheel FILE")
    with tempfile.TemporaryDirectory(prefix="fedal-wheel-", dir=dest) as tmp:  # in the run's work dir: reaped
        src = Path(tmp) / "src"
        try:
            listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                                    capture_output=True)
        except OSError:  # no git on this machine: the copy below
            listed = subprocess.CompletedProcess([], 127, b"", b"")
        if listed.returncode == 0:  # a clean copy: no stale build/ leftovers end up in the wheel
            for name in filter(None, listed.stdout.decode().split("\0")):
                if (REPO / name).is_file():
                    (src / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / name, src / name)
        else:
            shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "runs", "__pycache__"))
        _pip(spec, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest), str(src), work=dest)
    (wheel,) = dest.glob("fedal_edge-*.whl")
    return wheel


Metadata = tuple[str, str, list[str]]  # a wheel's (name, version, Requires-Dist lines): _metadata


def _metadata(wheel: Path) -> Metadata:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    try:
        with zipfile.ZipFile(wheel) as z:
            meta = next((n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
            if meta is None:
                raise WheelhouseError(f"{wheel.name} has no .dist-info/METADATA: not a wheel")
            msg = Parser().parsestr(z.read(meta).decode("utf-8", "replace"), headersonly=True)
    except zipfile.BadZipFile:
        raise WheelhouseError(f"{wheel.name} is not a wheel (not a zip file)") from None
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def check_closure(wheels: dict[Path, Metadata], arch: str, python_version: str,
                  extras: dict[str, set[str]]) -> list[str]:
    """What the device's pip would miss: each requirement (markers evaluated for the device) that
    no wheel of `wheels` satisfies, as 'req (needed by dist)'."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    base = marker_environment(arch, python_version)
    found = {}
    for name, version, requires in wheels.values():
        found[canonicalize_name(name)] = (name, Version(version), requires)
    missing = []
    todo = [(key, set(extras.get(key, ()))) for key in found]
    seen: set[tuple[str, str]] = set()
    while todo:
        key, want = todo.pop()
        name, _version, requires = found[key]
        for line in requires:
            req = Requirement(line)
            active = req.marker is None or any(req.marker.evaluate({**base, "extra": e}) for e in (want or {""}))
            if not active:
                continue
            dep = canonicalize_name(req.name)
            have = found.get(dep)
            if have is None or not req.specifier.contains(have[1], prereleases=True):
                got = f" (the wheelhouse has {have[1]})" if have else ""
                missing.append(f"{req.name}{req.specifier}{got} (needed by {name})")
                continue
            for extra in req.extras:
                if (dep, extra) not in seen:
                    seen.add((dep, extra))
                    todo.append((dep, {extra}))
    return sorted(set(missing))


def carried_extras(agent: Path, wheels: dict[Path, Metadata], arch: str, python_version: str) -> list[str]:
    """The device extras whose own requirements (beyond the `agent` extra's) are in the wheelhouse."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = marker_environment(arch, python_version)
    present = {canonicalize_name(name) for name, _, _ in wheels.values()}
    requires = [Requirement(line) for line in wheels[agent][2]]
    carried = []
    for extra in DEVICE_EXTRAS:
        own = [r for r in requires if r.marker is not None and r.marker.evaluate({**env, "extra": extra})
               and not r.marker.evaluate({**env, "extra": "agent"})]
        if own and any(canonicalize_name(r.name) in present for r in own):
            carried.append(extra)
    return carried


def _torch_requirement(spec: WheelhouseSpec, reqs: list[str]) -> str | None:
    """`torch==V` the wheelhouse holds: --torch-version, else the constraints' pin (None: no torch)."""
    if spec.torch_version is not None:
        from packaging.version import InvalidVersion, Version

        try:
            version = Version(spec.torch_version)
        except InvalidVersion:
            raise UsageProblem(f"--torch-version {spec.torch_version!r} is not a version (e.g. 2.13.0)") from None
        if spec.torch_index is None and version.release >= (2, 11):
            raise UsageProblem(f"torch {spec.torch_version} from PyPI depends on the CUDA 13 toolkit (several GB): "
                               f"add --torch-index {CPU_TORCH_INDEX}")
        return f"torch=={spec.torch_version}"
    return next((r for r in reqs if r.lower().startswith("torch==")), None)


def build_wheelhouse(spec: WheelhouseSpec, progress=lambda msg: None) -> dict:
    """Download the device's wheels into spec.out, check them, write the manifest; returns it."""
    if spec.arch not in ARCHES:
        raise UsageProblem(f"--arch must be one of {', '.join(ARCHES)} (got {spec.arch}); 32-bit ARM is unsupported: "
                           f"torch and onnxruntime publish no armv7 wheels")
    parts = spec.python_version.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or (int(parts[0]), int(parts[1])) < (3, 11):
        raise UsageProblem(f"--python-version must be like 3.11 (3.11 or later; got {spec.python_version})")
    constraints = spec.constraints or REPO / "firmware_scripts" / "constraints" / f"{spec.arch}.txt"
    if not constraints.is_file():
        raise UsageProblem(f"constraints file not found: {constraints} (give --constraints FILE)")
    if spec.wheel is not None and (not spec.wheel.is_file() or spec.wheel.suffix != ".whl"):
        raise UsageProblem(f"--wheel {spec.wheel} is not a .whl file")
    for link in spec.find_links:
        if "://" not in link and not Path(link).exists():
            raise UsageProblem(f"--find-links {link} does not exist")
    reqs = pinned_requirements(constraints, spec.arch, spec.python_version)
    torch_req = _torch_requirement(spec, reqs)
    if spec.torch_index is not None:  # torch comes from its own index, the rest as pinned
        reqs = [r for r in reqs if not r.lower().startswith("torch==")]
    elif torch_req is not None:
        reqs = [torch_req if r.lower().startswith("torch==") else r for r in reqs]
    before = _claim(spec.out)

    out = spec.out
    created = _missing_dirs(out)  # removed again (when empty) if the wheelhouse is not written
    try:
        out.mkdir(parents=True, exist_ok=True)
        work = Path(procs.pid_dir(out, WORK_PREFIX))  # inside out: no leftovers elsewhere
    except OSError as exc:
        _remove_empty(created)
        raise UsageProblem(f"--out {out} cannot be used: {exc.strerror or exc}") from None
    written = False
    try:
        progress(f"the agent's wheel{'' if spec.wheel else ' (built from ' + str(REPO) + ')'}")
        agent = _agent_wheel(spec, work)
        agent_name, agent_version, _ = _metadata(agent)
        if agent_name.lower().replace("_", "-") != AGENT_DIST:
            raise UsageProblem(f"--wheel {agent.name} is not a {AGENT_DIST} wheel ({agent_name})")
        req_file = work / "requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        progress(f"pip download: {len(reqs)} pinned packages for {spec.arch}, CPython {spec.python_version}")
        downloads = work / "wheels"
        tags = [x for tag in platforms(spec.arch) for x in ("--platform", tag)]
        _pip(spec, "download", "-q", "--no-deps", "--only-binary=:all:", *tags, "--python-version", spec.python_version,
             "--implementation", "cp", "--abi", f"cp{spec.python_version.replace('.', '')}", "--abi", "abi3", "--abi", "none",
             "-d", str(downloads), *_index_args(spec), "-r", str(req_file), work=work)
        if spec.torch_index is not None and torch_req is not None:
            progress(f"pip download: {torch_req} from {spec.torch_index}")
            _pip(spec, "download", "-q", "--no-deps", "--only-binary=:all:", *tags, "--python-version",
                 spec.python_version, "--implementation", "cp", "--abi", f"cp{spec.python_version.replace('.', '')}",
                 "-d", str(downloads), "--index-url", spec.torch_index, torch_req, work=work)
        files = [agent, *sorted(downloads.glob("*.whl"))]
        wheels = {f: _metadata(f) for f in files}  # each wheel's metadata read once
        extras = ["agent", *carried_extras(agent, wheels, spec.arch, spec.python_version)]
        missing = check_closure(wheels, spec.arch, spec.python_version, {AGENT_DIST: set(extras)})
        if missing:
            hint = (f"PyPI's torch needs the CUDA libraries from 2.11 on: take torch from PyTorch's CPU index with "
                    f"--torch-index {CPU_TORCH_INDEX} --torch-version 2.13.0 (on aarch64 2.10.0, PyPI's last CPU-only "
                    f"one, dies on a Pi 3B+, Pi 4 and Zero 2 W)")
            raise WheelhouseError("the wheelhouse would not install offline; it lacks " + "; ".join(missing)
                                  + f". Pin what is missing in {constraints} ({hint})")
        entries: dict[str, dict[str, Any]] = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files}
        versions = {name: version for name, version, _ in wheels.values()}
        manifest = {
            "format": FORMAT,
            "created_by": "fedal fleet wheelhouse",
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "arch": spec.arch,
            "python": spec.python_version,
            "platforms": platforms(spec.arch),
            "agent_wheel": agent.name,
            "agent_version": agent_version,
            "extras": extras,  # what `install-agent.sh` may install from it offline
            "torch": versions.get("torch"),
            "bytes": sum(e["bytes"] for e in entries.values()),
            "versions": dict(sorted(versions.items(), key=lambda kv: kv[0].lower())),
            "files": dict(sorted(entries.items())),
        }
        _replace_files(out, before, manifest, files)
        written = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not written:
            _remove_empty(created)
    return manifest


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and its parents that do not exist yet, deepest first."""
    missing = []
    for d in (path, *path.parents):
        if d.exists() or d.is_symlink():
            break
        missing.append(d)
    return missing


def _remove_empty(dirs: list[Path]) -> None:
    """The directories this run created, deepest first, as long as each is empty (rmdir never
    removes anything that was put in one meanwhile)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return
