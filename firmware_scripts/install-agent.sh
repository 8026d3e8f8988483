#!/usr/bin/env bash
# Installs the FedAL Edge agent on a Raspberry Pi (64-bit Raspberry Pi OS, Bookworm or later) or
# any Debian arm64/amd64: a system user, a virtualenv under /opt (Bookworm refuses system-wide
# pip), the config under /etc, a sandboxed systemd unit. Idempotent: a second run with the same
# inputs changes nothing. With --root DIR (or DESTDIR) it installs into a staging root instead.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: install-agent.sh --config agent.toml [options]

  --config FILE         agent TOML; installed as /etc/fedal-agent/agent.toml, readable by the agent only
  --ca FILE             CA certificate for mqtts://, installed where the config's broker.ca_file says
                        (default /etc/fedal-agent/ca.crt); outside /etc/fedal-agent only if no file is there
  --data FILE           a private data file for the state dir /var/lib/fedal-agent (repeatable); a single
                        one is installed as the config's data_file when that names a file there
  --wheel FILE          install the agent from this wheel
  --source DIR          install the agent from this source tree (default: the checkout holding this script)
  --torch-index URL     take torch from this pip index, e.g. https://download.pytorch.org/whl/cpu;
                        "pypi" takes it from PyPI (default: PyPI on aarch64, PyTorch's CPU index on x86_64)
  --torch-version V     torch version (default: the pin in constraints/<arch>.txt); on aarch64 a
                        torch >= 2.11 needs --torch-index (PyPI's pulls the CUDA toolkit), and a Pi 3B+,
                        4 or Zero 2 W (ARMv8.0) needs one >= 2.11 (2.10 dies there with SIGILL)
  --wheelhouse DIR      install offline from this wheelhouse (`fedal fleet wheelhouse`): pip install
                        --no-index --find-links DIR, no package index contacted; the agent wheel is
                        the wheelhouse's unless --wheel or --source is given
  --privacy             also install the `privacy` extra (Opacus): runs with differential privacy need
                        it, and an agent without it refuses them
  --arch ARCH           skip detection: aarch64 or x86_64 (also FEDAL_ARCH)
  --python PY           interpreter for the virtualenv (default: python3, needs >= 3.11)
  --root DIR            install below DIR instead of / (staging, tests; also DESTDIR)
  --pip CMD             run CMD instead of the virtualenv's pip (tests)
  --skip-pip            do not install Python packages (the virtualenv is still created)
  --no-start            enable the service but do not (re)start it
  --print-constraints   print the pip constraints for this machine and exit
  --dry-run             print what would change, change nothing
  -h, --help            this text

Exit status: 0 installed; 1 failed where another attempt may succeed (no network, pip); 2 an
argument it does not take; 3 refused for good (this device's CPU or OS, or a config, CA, data
file, wheel or wheelhouse it cannot use). The first-boot installer retries only 1.
EOF
}

die() { echo "install-agent: error: $*" >&2; exit 1; }
# a refusal that another attempt on this device cannot change (its CPU, the torch asked for, the
# config and files it was given): exit 3, which the first-boot installer does not retry
refuse() { echo "install-agent: error: $*" >&2; exit 3; }
# arguments this script does not take: exit 2 (not retried either)
usage_error() { usage >&2; echo "install-agent: error: $*" >&2; exit 2; }
say() { echo "install-agent: $*"; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SERVICE=fedal-agent
SVC_USER=fedal-agent
VENV=/opt/fedal-agent
ETC=/etc/fedal-agent
STATE=/var/lib/fedal-agent
UNIT_DIR=/etc/systemd/system
CPU_INDEX=https://download.pytorch.org/whl/cpu

CONFIG="" CA="" WHEEL="" SOURCE="" TORCH_INDEX="" TORCH_INDEX_SET=0 TORCH_VERSION="" WHEELHOUSE=""
ARCH="${FEDAL_ARCH:-}" PY=python3 ROOT="${DESTDIR:-}" PIP_CMD="" SKIP_PIP=0 NO_START=0 PRINT=0 DRY=0 EXTRAS=agent
DATA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config) CONFIG="${2:?--config needs a file}"; shift 2 ;;
    --ca) CA="${2:?--ca needs a file}"; shift 2 ;;
    --data) DATA+=("${2:?--data needs a file}"); shift 2 ;;
    --wheel) WHEEL="${2:?--wheel needs a file}"; shift 2 ;;
    --source) SOURCE="${2:?--source needs a directory}"; shift 2 ;;
    --torch-index) TORCH_INDEX="${2:?--torch-index needs a URL}"; TORCH_INDEX_SET=1; shift 2 ;;
    --torch-version) TORCH_VERSION="${2:?--torch-version needs a version}"; shift 2 ;;
    --wheelhouse) WHEELHOUSE="${2:?--wheelhouse needs a directory}"; shift 2 ;;
    --privacy) EXTRAS=agent,privacy; shift ;;
    --arch) ARCH="${2:?--arch needs a value}"; shift 2 ;;
    --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
    --root) ROOT="${2:?--root needs a directory}"; shift 2 ;;
    --pip) PIP_CMD="${2:?--pip needs a command}"; shift 2 ;;
    --skip-pip) SKIP_PIP=1; shift ;;
    --no-start) NO_START=1; shift ;;
    --print-constraints) PRINT=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage_error "unknown argument: $1" ;;
  esac
done

# -- architecture: 64-bit userland only ---------------------------------------------------
ARCH_DETECTED=0
[ -n "$ARCH" ] || ARCH_DETECTED=1
if [ -n "$ARCH" ]; then
  raw_arch="$ARCH"
elif command -v dpkg >/dev/null 2>&1; then
  raw_arch="$(dpkg --print-architecture)"  # the userland: a 32-bit Pi OS may run a 64-bit kernel
else
  raw_arch="$(uname -m)"
fi
case "$raw_arch" in
  aarch64|arm64) ARCH=aarch64 ;;
  x86_64|amd64) ARCH=x86_64 ;;
  armhf|armel|armv7l|armv6l|armv8l|arm|i386|i686)
    refuse "32-bit userland ($raw_arch) is not supported: torch and onnxruntime publish no 32-bit ARM or x86 wheels. Install the 64-bit Raspberry Pi OS (arm64) instead." ;;
  *) refuse "unsupported architecture '$raw_arch': the agent runs on 64-bit ARM (aarch64) or x86-64" ;;
esac

CONSTRAINTS_FILE="$SCRIPT_DIR/constraints/$ARCH.txt"
[ -f "$CONSTRAINTS_FILE" ] || refuse "missing $CONSTRAINTS_FILE"
for helper in prune-venv.py fix-meta.py; do
  [ -f "$SCRIPT_DIR/$helper" ] || refuse "missing $SCRIPT_DIR/$helper (it ships next to install-agent.sh)"
done
if [ -n "${TORCH_VERSION:-}" ] && ! printf '%s' "$TORCH_VERSION" | grep -Eq '^[0-9]+\.[0-9]+(\.[0-9]+)?(\+[A-Za-z0-9.]+)?$'; then
  usage_error "--torch-version '$TORCH_VERSION' is not a version like 2.13.0 (or 2.13.0+cpu)"
fi
seen_data=" "
for f in ${DATA[@]+"${DATA[@]}"}; do  # they all go into the state directory: two of one name would be one file
  case "$seen_data" in *" $(basename "$f") "*) usage_error "two --data files are named $(basename "$f"): they would be one file in the state directory" ;; esac
  seen_data+="$(basename "$f") "
done
PINNED_TORCH="$(sed -n 's/^torch==\([^ ;#]*\).*/\1/p' "$CONSTRAINTS_FILE")"
[ -n "$PINNED_TORCH" ] || refuse "$CONSTRAINTS_FILE pins no torch version"
TORCH_VERSION="${TORCH_VERSION:-$PINNED_TORCH}"
if [ "$TORCH_INDEX_SET" -eq 0 ] && [ "$ARCH" = x86_64 ]; then
  TORCH_INDEX="$CPU_INDEX"  # PyPI's x86-64 torch pulls the CUDA libraries (GBs) an agent never uses
fi
[ "$TORCH_INDEX" = pypi ] && TORCH_INDEX=""
torch_minor() {  # 2.10.0 -> 2010, 2.13.0+cpu -> 2013
  printf '%s\n' "$1" | awk -F'[.+]' '{ printf "%d", $1 * 1000 + $2 }'
}
if [ "$ARCH" = aarch64 ] && [ -z "$TORCH_INDEX" ] && [ -z "$WHEELHOUSE" ] && [ "$(torch_minor "$TORCH_VERSION")" -ge 2011 ]; then
  refuse "torch $TORCH_VERSION for aarch64 from PyPI depends on the CUDA 13 toolkit (a 4.7 GB virtualenv, 15+ minutes to install): take it from PyTorch's CPU index (--torch-index $CPU_INDEX), or keep the pinned $PINNED_TORCH"
fi

wheelhouse_pins() {
  # offline, the versions the wheelhouse holds, whatever pins it was built with (fedal fleet
  # wheelhouse --constraints FILE, another checkout): the checkout's own would not resolve there
  "$PY" - "$WHEELHOUSE/fedal-wheelhouse.json" <<'PYEOF'
import json, re, sys
try:
    versions = json.load(open(sys.argv[1]))["versions"]
    pins = [f"{name}=={version}" for name, version in versions.items()
            if re.sub(r"[-_.]+", "-", name).lower() != "fedal-edge"]
except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
    sys.exit(f"install-agent: error: {sys.argv[1]} lists no versions: {exc}")
print("\n".join(pins))
PYEOF
}

effective_constraints() {
  if [ -n "$WHEELHOUSE" ]; then
    echo "# fedal agent constraints: arch $ARCH, the versions of the wheelhouse $WHEELHOUSE"
    wheelhouse_pins
    return
  fi
  echo "# fedal agent constraints: arch $ARCH, torch $TORCH_VERSION from ${TORCH_INDEX:-PyPI}"
  sed "s/^torch==.*/torch==$TORCH_VERSION/" "$CONSTRAINTS_FILE"
}

if [ "$PRINT" -eq 1 ]; then
  effective_constraints
  exit 0
fi

# -- inputs ------------------------------------------------------------------------------
command -v "$PY" >/dev/null 2>&1 || die "python interpreter '$PY' not found (Raspberry Pi OS: apt-get install python3)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || refuse "Python >= 3.11 is needed, $PY is $("$PY" -c 'import platform; print(platform.python_version())') (Raspberry Pi OS Bookworm or later has it)"
if [ -z "${FEDAL_ARCH:-}" ] && [ "$("$PY" -c 'import struct; print(struct.calcsize("P") * 8)')" != 64 ]; then
  refuse "$PY is a 32-bit interpreter: a 64-bit Python (64-bit OS) is required"
fi
[ -n "$CONFIG" ] || usage_error "--config is required"
[ -f "$CONFIG" ] || refuse "config file not found: $CONFIG"
[ -z "$CA" ] || [ -f "$CA" ] || refuse "CA file not found: $CA"
for f in ${DATA[@]+"${DATA[@]}"}; do [ -f "$f" ] || refuse "data file not found: $f"; done
if [ -n "$WHEELHOUSE" ]; then
  # what `fedal fleet wheelhouse` wrote: its manifest names the platform and the agent's wheel
  [ -f "$WHEELHOUSE/fedal-wheelhouse.json" ] \
    || refuse "--wheelhouse $WHEELHOUSE is not a wheelhouse (no fedal-wheelhouse.json): build one with fedal fleet wheelhouse"
  [ "$TORCH_INDEX_SET" -eq 0 ] || usage_error "--torch-index and --wheelhouse exclude each other: the wheelhouse holds torch"
  WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"
  wh_facts="$("$PY" - "$WHEELHOUSE/fedal-wheelhouse.json" <<'PYEOF'
import json, sys
try:
    m = json.load(open(sys.argv[1]))
    print(m["arch"], m["python"], m["agent_wheel"], m.get("torch") or "?")
except (OSError, ValueError, KeyError, TypeError) as exc:
    sys.exit(f"install-agent: error: {sys.argv[1]} is not a wheelhouse manifest: {exc}")
PYEOF
)" || exit 3
  read -r wh_arch wh_python wh_agent wh_torch <<<"$wh_facts"
  [ "$wh_arch" = "$ARCH" ] || refuse "the wheelhouse $WHEELHOUSE is for $wh_arch, this machine is $ARCH: build it with --arch $ARCH"
  py_ver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  [ "$wh_python" = "$py_ver" ] \
    || refuse "the wheelhouse $WHEELHOUSE is for Python $wh_python, $PY is $py_ver: build it with --python-version $py_ver"
  TORCH_INDEX=""  # torch comes from the wheelhouse too
  [ "$wh_torch" = "?" ] || TORCH_VERSION="$wh_torch"
  if [ -z "$WHEEL" ] && [ -z "$SOURCE" ]; then WHEEL="$WHEELHOUSE/$wh_agent"; fi
fi
# torch up to 2.10 (PyPI's newest CPU-only aarch64 wheel) dies with SIGILL at import on ARMv8.0
# cores without LSE atomics (Pi 3B+, Pi 4, Zero 2 W; pytorch/pytorch#176993, fixed in 2.11):
# said before a download, not as a crash after it. Checked on the machine installing onto itself
# (FEDAL_CPUINFO: another cpuinfo, for tests).
CPUINFO="${FEDAL_CPUINFO:-/proc/cpuinfo}"
if [ "$ARCH" = aarch64 ] && { [ -n "${FEDAL_CPUINFO:-}" ] || { [ "$ARCH_DETECTED" -eq 1 ] && [ -z "$ROOT" ]; }; } \
    && [ -r "$CPUINFO" ] && grep -q '^Features' "$CPUINFO" && ! grep -Eq '^Features.*[[:space:]]atomics([[:space:]]|$)' "$CPUINFO" \
    && [ "$(torch_minor "$TORCH_VERSION")" -le 2010 ]; then
  refuse "this CPU has no LSE atomics (ARMv8.0: Pi 3B+, Pi 4, Zero 2 W), on which torch $TORCH_VERSION dies with 'Illegal instruction' at import (pytorch/pytorch#176993, fixed in torch 2.11): install torch 2.11 or later from PyTorch's CPU index: --torch-index $CPU_INDEX --torch-version 2.13.0$([ -n "$WHEELHOUSE" ] && echo ' (not with --wheelhouse: build one with a newer torch)')"
fi
if [ -n "$WHEEL" ]; then
  [ -f "$WHEEL" ] || refuse "wheel not found: $WHEEL"
  case "$WHEEL" in *.whl) ;; *) refuse "--wheel needs a .whl file: $WHEEL" ;; esac
  WHEEL="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
elif [ -z "$SOURCE" ] && [ -f "$SCRIPT_DIR/../pyproject.toml" ]; then
  SOURCE="$(cd "$SCRIPT_DIR/.." && pwd)"
fi
if [ -z "$WHEEL" ]; then
  [ -n "$SOURCE" ] || die "give --wheel FILE or --source DIR (no checkout next to this script)"
  [ -f "$SOURCE/pyproject.toml" ] || die "--source $SOURCE has no pyproject.toml"
  SOURCE="$(cd "$SOURCE" && pwd)"
fi
ROOT="${ROOT%/}"
if [ -n "$ROOT" ]; then
  [ "$DRY" -eq 1 ] || mkdir -p "$ROOT" 2>/dev/null || die "cannot create --root $ROOT"
  ROOT="$(cd "$ROOT" 2>/dev/null && pwd || echo "$ROOT")"
elif [ "$(id -u)" -ne 0 ] && [ "$DRY" -eq 0 ]; then
  die "run as root (sudo $0 ...), or stage the install into a directory with --root DIR"
fi

# -- one install at a time on a system ------------------------------------------------------------
# The first-boot service retries every minute, and an install run by hand meanwhile would have two
# pips rebuild one virtualenv. Taken before the checks of what is installed. The lock: a staging
# root's directory itself (nothing created in it); on the system, a file in /run, which only root
# writes (gone at reboot, as any holder is).
if [ "$DRY" -eq 0 ]; then
  if ! command -v flock >/dev/null 2>&1; then
    say "warning: flock (util-linux) is missing: another install running at the same time is not waited for"
  else
    if [ -n "$ROOT" ]; then
      exec 8<"$ROOT"
      lock_name="$ROOT"
    else
      lock_name=/run/fedal-agent-install.lock
      [ -d /run ] || lock_name=/var/lib/fedal-agent-install.lock
      exec 8>>"$lock_name" || die "cannot open the install lock $lock_name"
    fi
    lock_rc=0
    flock -n -E 75 8 || lock_rc=$?
    if [ "$lock_rc" -eq 75 ]; then
      say "another install-agent.sh is installing here (lock: $lock_name): waiting for it to finish"
      flock 8
    elif [ "$lock_rc" -ne 0 ]; then  # e.g. a file system without locks: as before there was one
      say "warning: cannot lock $lock_name (flock exit $lock_rc): another install running at the same time is not waited for"
    fi
  fi
fi

# The config must be TOML; where it expects the CA and its data decides where --ca and --data go.
# Its model is checked here, before pip, against the zoo's names of the agent to be installed
# (fedal/model_names.py, plain Python); the whole config after pip, with the agent's config model.
config_paths="$("$PY" - "$CONFIG" "$WHEEL" "$SOURCE" <<'PYEOF'
import ast, sys, tomllib, zipfile
try:
    with open(sys.argv[1], "rb") as f:
        cfg = tomllib.load(f)
except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
    sys.exit(f"install-agent: error: config {sys.argv[1]} is not valid TOML: {exc}")
wheel, source = sys.argv[2], sys.argv[3]
try:
    if wheel:
        with zipfile.ZipFile(wheel) as z:
            text = z.read("fedal/model_names.py").decode()
    else:
        with open(f"{source}/fedal/model_names.py", encoding="utf-8") as f:
            text = f.read()
    names = next(ast.literal_eval(n.value) for n in ast.parse(text).body
                 if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "MODEL_NAMES")
except (OSError, KeyError, StopIteration, ValueError, SyntaxError, zipfile.BadZipFile):
    names = None  # an agent without the list: the check after pip says it
if names is not None and "model" in cfg and cfg["model"] not in names:
    sys.exit(f"install-agent: error: config {sys.argv[1]}: unknown model {cfg['model']!r}; valid names: "
             f"{', '.join(names)}")
broker = cfg.get("broker") if isinstance(cfg.get("broker"), dict) else {}
for value in (broker.get("ca_file"), cfg.get("data_file"), cfg.get("test_file"), cfg.get("local_test_file"),
              cfg.get("public_file")):
    print(value if isinstance(value, str) and "\n" not in value else "")
print(".")  # the end: $(...) drops trailing empty lines
PYEOF
)" || exit 3
{ IFS= read -r CA_PATH; IFS= read -r DATA_PATH; IFS= read -r TEST_PATH; IFS= read -r LOCAL_TEST_PATH
  IFS= read -r PUBLIC_PATH; } <<<"$config_paths"
if [ -n "$CA" ] && [ -z "$CA_PATH" ]; then
  CA_PATH="$ETC/ca.crt"
  say "note: the config sets no broker.ca_file; installing the CA at $CA_PATH (set ca_file to use it)"
fi
case "$CA_PATH" in ""|/*) ;; *) refuse "broker.ca_file in $CONFIG must be an absolute path: $CA_PATH" ;; esac
case "$CA_PATH/" in *"/../"*|*"/./"*) refuse "broker.ca_file in $CONFIG must not contain . or .. components: $CA_PATH" ;; esac
# outside /etc/fedal-agent a CA file is the system's or the user's (e.g. the system CA bundle):
# --ca never replaces one there, it only creates a missing one
if [ -n "$CA" ] && [ "${CA_PATH#"$ETC"/}" = "$CA_PATH" ] && [ -e "$ROOT$CA_PATH" ] && ! cmp -s "$CA" "$ROOT$CA_PATH"; then
  refuse "broker.ca_file is $CA_PATH, which exists and is not the --ca certificate: the installer replaces a CA only in $ETC. Point ca_file at $ETC/ca.crt, or leave --ca out to use $CA_PATH as it is"
fi
# The service's sandbox (fedal-agent.service) gives it a private /tmp and hides the home
# directories: a file the config names there would pass the checks here and be missing for the
# agent (exit 2). /tmp is refused (emptied at boot as well); home directories are made readable
# (ProtectHome=read-only in the drop-in below).
HOME_FILES=0
for p in "$CA_PATH" "$DATA_PATH" "$TEST_PATH" "$LOCAL_TEST_PATH" "$PUBLIC_PATH"; do
  case "$p" in
    /tmp|/tmp/*|/var/tmp|/var/tmp/*)
      refuse "$CONFIG names $p: the agent's service has a private /tmp (PrivateTmp=yes) and would not find it; put the file in $STATE (--data FILE copies it there)" ;;
    /home/*|/root/*|/run/user/*) HOME_FILES=1 ;;
  esac
done
# a single --data file goes where the config's data_file expects it, if that is in the state dir
# and the file is not one of the config's other files by name (a test set stays a test set)
other_names=" "
for p in "$TEST_PATH" "$LOCAL_TEST_PATH" "$PUBLIC_PATH"; do [ -z "$p" ] || other_names+="$(basename "$p") "; done
DATA_DEST=()
for f in ${DATA[@]+"${DATA[@]}"}; do
  if [ "${#DATA[@]}" -eq 1 ] && [ -n "$DATA_PATH" ] && [ "${DATA_PATH#"$STATE"/}" != "$DATA_PATH" ] \
      && [ "${DATA_PATH#"$STATE"/}" = "$(basename "$DATA_PATH")" ] && [ "${other_names#* "$(basename "$f")" }" = "$other_names" ]; then
    DATA_DEST+=("$DATA_PATH")
  else
    DATA_DEST+=("$STATE/$(basename "$f")")
  fi
done

# -- helpers -------------------------------------------------------------------------------
CHANGES=0
changed() {  # a change made; under --dry-run one that would be (its `would run:` lines said how)
  CHANGES=$((CHANGES + 1))
  if [ "$DRY" -eq 1 ]; then say "not done (dry run): $*"; else say "$*"; fi
}
run() {
  if [ "$DRY" -eq 1 ]; then echo "install-agent: would run: $*"; else "$@"; fi
}

# uid:gid of a user in the target root's /etc/passwd (empty if it does not exist there yet)
ids_of() {
  if [ -f "$ROOT/etc/passwd" ]; then awk -F: -v u="$1" '$1 == u { print $3 ":" $4 }' "$ROOT/etc/passwd"; fi
}
CAN_CHOWN=0
[ "$(id -u)" -eq 0 ] && CAN_CHOWN=1

# owner_of root|svc|group: the uid:gid a path of that kind gets ("-": leave the owner as it is)
owner_of() {
  local want
  [ "$CAN_CHOWN" -eq 1 ] || { echo -; return; }
  [ "$1" != root ] || { echo 0:0; return; }
  want="$(ids_of "$SVC_USER")"
  if [ -z "$want" ]; then echo -; elif [ "$1" = svc ]; then echo "$want"; else echo "0:${want#*:}"; fi  # group: root:<service group>
}

# fix_meta [--install SRC] PATH MODE OWNER: fix-meta.py, its changes counted. It works through
# descriptors that follow no link: the state directory is the service user's, and a chmod, chown
# or write by name there would follow a link swapped in between two commands.
fix_meta() {
  local out line dry=()
  [ "$DRY" -eq 0 ] || dry=(--dry-run)
  local inst=()
  if [ "$1" = --install ]; then inst=(--install "$2"); shift 2; fi
  out="$("$PY" -I "$SCRIPT_DIR/fix-meta.py" ${dry[@]+"${dry[@]}"} ${inst[@]+"${inst[@]}"} "$1" "$2" "$(owner_of "$3")")" || exit 2
  while IFS= read -r line; do
    [ -z "$line" ] || changed "${line/"$ROOT"/}"
  done <<<"$out"
}

# put_file SRC DEST MODE OWNER: install SRC as DEST unless it is already identical
put_file() {
  local src="$1" dest="$ROOT$2" mode="$3" who="$4"
  if [ "${2#"$STATE"/}" != "$2" ]; then  # the service user's directory: one descriptor at a time
    fix_meta --install "$src" "$dest" "$mode" "$who"
    return 0
  fi
  if [ -L "$dest" ] && cmp -s "$src" "$dest"; then
    return 0  # a link with this content (a CA in the system's store): the system's file, left as it is
  elif [ ! -L "$dest" ] && [ -f "$dest" ] && cmp -s "$src" "$dest"; then
    if [ "${2#"$ETC"/}" != "$2" ]; then  # ours: its mode and owner as they must be; a file elsewhere
      fix_meta "$dest" "$mode" "$who"  # with this content (a CA the config names) is the user's, left as it is
    fi
    return 0
  fi
  run install -D -T -m "$mode" "$src" "$dest"
  changed "installed $2"
  [ "$DRY" -eq 1 ] || fix_meta "$dest" "$mode" "$who"
}

put_dir() {
  local dest="$ROOT$1" mode="$2" who="$3"
  if [ ! -d "$dest" ]; then
    run install -d -m "$mode" "$dest"
    changed "created $1/"
    [ "$DRY" -eq 1 ] && return 0
  fi
  fix_meta "$dest" "$mode" "$who"
}

# the installed agent trains, exports ONNX and runs onnxruntime here; as root it also leaves the
# bytecode of exactly the modules the agent imports (pip ran with --no-compile)
self_check() {
  # -I: the virtualenv alone (not the current directory, which may be a checkout, nor PYTHON* variables)
  if ! "$VPY" -I -c 'import edge_agent' 2>/dev/null; then
    [ -n "$PIP_CMD" ] || die "the agent does not import in $VENV after pip: $("$VPY" -I -c 'import edge_agent' 2>&1 | tail -1)"
    say "skipped the self-check: $VENV cannot import edge_agent (--pip $PIP_CMD)"
    return 0
  fi
  say "self-check: training, ONNX export and onnxruntime in $VENV"
  "$VPY" -I -m edge_agent --self-check >"$TMP/self-check.json" \
    || die "the agent's self-check failed on this device (see above); nothing was started"
  install -m 0644 "$TMP/self-check.json" "$ROOT$VENV/self-check.json"
  say "self-check passed: $(tr -d '\n ' <"$TMP/self-check.json" | cut -c1-160)"
}

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# -- 1. system user --------------------------------------------------------------------------
if [ -n "$(ids_of "$SVC_USER")" ]; then
  :
elif [ ! -f "$ROOT/etc/passwd" ]; then
  say "skipped the system user: $ROOT/etc/passwd does not exist (staging root without a base system)"
elif [ "$(id -u)" -ne 0 ] && [ "$DRY" -eq 0 ]; then
  say "skipped the system user: creating $SVC_USER in $ROOT needs root"
else
  run useradd ${ROOT:+--prefix "$ROOT"} --system --user-group --home-dir "$STATE" --no-create-home \
    --shell /usr/sbin/nologin --comment "FedAL Edge agent" "$SVC_USER"
  changed "created system user $SVC_USER"
fi

# -- 2. config, CA, state dir, data ----------------------------------------------------------
put_dir "$ETC" 0750 group
put_file "$CONFIG" "$ETC/agent.toml" 0640 group
if [ -n "$CA" ]; then
  put_file "$CA" "$CA_PATH" 0644 root
elif [ -n "$CA_PATH" ] && [ ! -f "$ROOT$CA_PATH" ]; then
  say "warning: the config expects a CA at $CA_PATH, which does not exist: give --ca FILE"
fi
put_dir "$STATE" 0750 svc
for i in ${DATA[@]+"${!DATA[@]}"}; do
  put_file "${DATA[$i]}" "${DATA_DEST[$i]}" 0640 svc
done
if [ -n "$DATA_PATH" ] && [ ! -e "$ROOT$DATA_PATH" ] && [ "$DRY" -eq 0 ]; then
  say "warning: the config's data_file $DATA_PATH does not exist: the agent will not start until it does (it exits 2 and the service waits; give --data FILE, which restarts it)"
fi

# -- 3. virtualenv and the agent ----------------------------------------------------------------
VPY="$ROOT$VENV/bin/python"
want_ver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
have_ver=""
if [ -x "$VPY" ]; then have_ver="$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"; fi
venv_args=()
if [ "$SKIP_PIP" -eq 1 ] || [ -n "$PIP_CMD" ]; then venv_args+=(--without-pip); fi
if [ "$have_ver" != "$want_ver" ]; then
  if [ "${#venv_args[@]}" -eq 0 ] && ! "$PY" -c 'import ensurepip' 2>/dev/null; then
    [ -z "$WHEELHOUSE" ] || die "$PY cannot create virtualenvs with pip and an offline install cannot fetch python3-venv: install it first"
    if [ -z "$ROOT" ] && command -v apt-get >/dev/null 2>&1; then
      run apt-get update -q
      run apt-get install -y -q python3-venv
    else
      die "$PY cannot create virtualenvs with pip (Debian: apt-get install python3-venv)"
    fi
  fi
  # --clear empties the directory: only a virtualenv (an older one of ours) or nothing is replaced
  if [ -d "$ROOT$VENV" ] && [ ! -f "$ROOT$VENV/pyvenv.cfg" ] && [ -n "$(ls -A "$ROOT$VENV" 2>/dev/null)" ]; then
    refuse "$VENV exists and is not a virtualenv (no pyvenv.cfg): it is left as it is; move it away to install the agent there"
  fi
  run "$PY" -m venv --clear ${venv_args[@]+"${venv_args[@]}"} "$ROOT$VENV"
  changed "created virtualenv $VENV (Python $want_ver)"
elif [ "${#venv_args[@]}" -eq 0 ] && ! "$VPY" -m pip --version >/dev/null 2>&1; then
  run "$VPY" -m ensurepip --default-pip >/dev/null
  changed "added pip to $VENV"
fi

effective_constraints >"$TMP/constraints.txt"
put_file "$TMP/constraints.txt" "$VENV/fedal-constraints.txt" 0644 root

if [ "$SKIP_PIP" -eq 1 ]; then
  say "skipped pip (--skip-pip): the agent is not installed into $VENV"
else
  if [ -n "$WHEEL" ]; then
    spec="${WHEEL}[${EXTRAS}]"
    origin="wheel $(sha256sum "$WHEEL" | cut -d' ' -f1)"
  else
    spec="${SOURCE}[${EXTRAS}]"
    origin="source $(cd "$SOURCE" && find . \( -name .git -o -name build -o -name runs -o -name __pycache__ -o -name '*.egg-info' \) -prune \
      -o -type f \( -name '*.py' -o -name '*.toml' \) -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
  fi
  stamp="$ROOT$VENV/.fedal-install"
  printf '%s\nextras %s\nconstraints %s\n' "$origin" "$EXTRAS" "$(sha256sum <"$TMP/constraints.txt" | cut -d' ' -f1)" >"$TMP/stamp"
  if [ -f "$stamp" ] && cmp -s "$TMP/stamp" "$stamp"; then
    :  # this exact agent with these constraints is installed already
  else
    # from here the virtualenv changes: the stamp of what was there goes first, so that a run that
    # fails midway is never taken for the install before it (the next run installs again)
    [ "$DRY" -eq 1 ] || rm -f "$stamp"
    pip=("$VPY" -m pip)
    [ -z "$PIP_CMD" ] || read -r -a pip <<<"$PIP_CMD"
    # no second copy of torch on the SD card (cache); no bytecode for the thousands of modules a
    # device never imports (the self-check below compiles the ~1,500 the agent does)
    opts=(install --disable-pip-version-check --no-input --no-cache-dir --no-compile)
    if [ -n "$WHEELHOUSE" ]; then
      # offline: the wheelhouse alone, whatever pip's configuration names as index or find-links
      opts+=(--isolated --no-index --find-links "$WHEELHOUSE" --only-binary=:all:)
      say "installing offline from the wheelhouse $WHEELHOUSE (no package index)"
    fi
    if [ -n "$TORCH_INDEX" ]; then
      # torch alone from the CPU index; its dependencies come with the agent from PyPI below
      run "${pip[@]}" "${opts[@]}" --no-deps --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
    fi
    pip_spec="$spec"
    if [ -z "$WHEEL" ] && [ "$DRY" -eq 0 ]; then
      # pip builds in the directory it is given: a copy, so that the user's checkout gets no build/
      # or egg-info (owned by root, under sudo) and no stale build/ of its own ends up in the agent
      src="$TMP/src"
      mkdir "$src"
      if git -C "$SOURCE" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        (cd "$SOURCE" && git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) \
          | tar -xf - -C "$src"
      else
        tar -C "$SOURCE" --exclude=./.git --exclude=./build --exclude=./runs --exclude=./.venv --exclude='*.egg-info' \
          --exclude=__pycache__ -cf - . | tar -xf - -C "$src"
      fi
      pip_spec="${src}[${EXTRAS}]"
    fi
    run "${pip[@]}" "${opts[@]}" -c "$ROOT$VENV/fedal-constraints.txt" "$pip_spec"
    if [ "$DRY" -eq 0 ]; then
      site="$("$VPY" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      "$VPY" -I "$SCRIPT_DIR/prune-venv.py" "$site" | sed 's/^prune-venv: /install-agent: /'
      self_check
    fi
    run install -m 0644 "$TMP/stamp" "$stamp"
    changed "installed the agent ($spec) into $VENV"
  fi
  if [ "$DRY" -eq 0 ] && "$VPY" -I -c 'import edge_agent.config, fleet.cli' 2>/dev/null; then
    "$VPY" -I -m fedal_cli.main fleet check "$ROOT$ETC/agent.toml" >/dev/null || refuse "the installed config is invalid (see above)"
  fi
fi

# -- 4. systemd unit -------------------------------------------------------------------------------
unit_before="$CHANGES"
put_file "$SCRIPT_DIR/$SERVICE.service" "$UNIT_DIR/$SERVICE.service" 0644 root
# The files the agent reads at start, outside its state directory (systemd mounts that one first
# already) and the installer's /etc directory: systemd mounts what they need before it starts the agent. A data partition that
# fstab mounts late would otherwise make the agent exit 2, and the service wait for a restart.
DROPIN="$UNIT_DIR/$SERVICE.service.d/10-fedal-mounts.conf"
DROPIN_HEAD="# written by install-agent.sh from agent.toml's file paths; it replaces or removes this file"
mounts=""
for p in "$CA_PATH" "$DATA_PATH" "$TEST_PATH" "$LOCAL_TEST_PATH" "$PUBLIC_PATH"; do
  case "$p" in /*) ;; *) continue ;; esac  # relative: inside the workspace
  if [ "${p#"$STATE"/}" != "$p" ] || [ "${p#"$ETC"/}" != "$p" ]; then continue; fi
  if printf '%s' "$p" | grep -q "[[:space:]\"'%\\]"; then
    say "warning: $p holds a space, quote, % or backslash: systemd is not told to mount it before the agent starts"
    continue
  fi
  mounts+=" $p"
done
if [ -n "$mounts" ] || [ "$HOME_FILES" -eq 1 ]; then
  echo "$DROPIN_HEAD" >"$TMP/mounts.conf"
  [ -z "$mounts" ] || printf '[Unit]\nRequiresMountsFor=%s\n' "${mounts# }" >>"$TMP/mounts.conf"
  if [ "$HOME_FILES" -eq 1 ]; then  # the unit hides /home, /root and /run/user (ProtectHome=yes)
    printf '[Service]\nProtectHome=read-only\n' >>"$TMP/mounts.conf"
  fi
  put_file "$TMP/mounts.conf" "$DROPIN" 0644 root
elif [ -f "$ROOT$DROPIN" ] && [ "$(head -n 1 "$ROOT$DROPIN")" = "$DROPIN_HEAD" ]; then
  run rm -f "$ROOT$DROPIN"
  run rmdir --ignore-fail-on-non-empty "$ROOT$UNIT_DIR/$SERVICE.service.d"
  changed "removed $DROPIN (the config names no file outside $STATE and $ETC)"
fi
unit_changed=$((CHANGES - unit_before))
wants="$ROOT$UNIT_DIR/multi-user.target.wants/$SERVICE.service"
if [ "$(readlink "$wants" 2>/dev/null || true)" != "$UNIT_DIR/$SERVICE.service" ]; then
  run mkdir -p "$(dirname "$wants")"
  run ln -sfn "$UNIT_DIR/$SERVICE.service" "$wants"
  changed "enabled $SERVICE.service (multi-user.target)"
fi

if [ -z "$ROOT" ] && [ -d /run/systemd/system ]; then
  [ "$unit_changed" -eq 0 ] || run systemctl daemon-reload
  if [ "$NO_START" -eq 1 ]; then
    say "not starting the agent (--no-start): systemctl start $SERVICE"
  elif [ "$CHANGES" -gt 0 ]; then
    run systemctl restart "$SERVICE"
    say "agent (re)started: journalctl -u $SERVICE -f"
  else
    run systemctl start "$SERVICE"
  fi
elif [ -n "$ROOT" ]; then
  say "staged into $ROOT: the agent starts when a system booted from it reaches multi-user.target"
else
  say "systemd is not running here: the agent starts at the next boot (or: systemctl start $SERVICE)"
fi

if [ "$CHANGES" -eq 0 ]; then
  say "nothing changed: the agent was already installed as configured"
else
  say "$CHANGES change(s)$([ "$DRY" -eq 1 ] && echo ' would be made (dry run)')"
fi
