#!/usr/bin/env bash
# The agent on 64-bit Raspberry Pi OS, without a Pi: an arm64 Debian bookworm userland (what
# Pi OS Bookworm 64-bit is built on) made once with debootstrap and cached, run on this x86-64
# host through qemu-user (binfmt_misc). The agent is installed in it with install-agent.sh as on
# a Pi, then takes part in a short federated run next to x86 agents, against a coordinator and
# Mosquitto on the host's loopback (a chroot shares the host's network). Prints the virtualenv's
# size, the arm64 agent's peak RSS and the round it completed; writes docs/results/arm64_smoke.md.
#
# Opt-in (minutes; the first run installs torch under emulation, longer): not in the test suite
# unless asked for with `FEDAL_ARM64_SMOKE=1 pytest tests/test_arm64_smoke.py` (or -m arm64).
# Needs root (debootstrap, chroot, mount), a Debian mirror and PyPI; Debian's debootstrap,
# qemu-user-static and binfmt-support are installed with apt-get when missing (--prereqs-only
# does only that).
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: arm64-smoke.sh [options]

  --cache DIR          the arm64 userland (default ${XDG_CACHE_HOME:-~/.cache}/fedal/arm64-bookworm,
                       or FEDAL_ARM64_ROOTFS); built on first use, reused afterwards
  --mirror URL         Debian mirror for debootstrap (default http://deb.debian.org/debian)
  --rebuild            delete the cached userland and build it again
  --fresh-venv         delete the agent's virtualenv in the cached userland first: measure a first install
  --build-only         build (or check) the userland and binfmt, then stop
  --prereqs-only       install the missing host packages (debootstrap, qemu-user-static,
                       binfmt-support) with apt-get, then stop
  --torch-index URL    passed to install-agent.sh (default there on aarch64: torch 2.10.0 from PyPI)
  --rounds N           rounds of the run (default 2)
  --clients N          clients, one of them emulated (default 3)
  --strategy NAME      strategy (default fedal)
  --privacy SIGMA      train with differential privacy at this noise multiplier; the agent is
                       installed with the privacy extra (writes arm64_smoke_privacy.{md,json})
  --out DIR            where arm64_smoke.{md,json} go (default docs/results of this checkout)
  --keep               keep the run's workspace (printed at the end)
  -h, --help           this text

The host side (bench/arm64_smoke.py) runs with $FEDAL_PYTHON, else the active virtualenv, else
this checkout's .venv (found under sudo too): a Python with the toolkit and torch installed.
EOF
}

die() { echo "arm64-smoke: error: $*" >&2; exit 1; }
say() { echo "arm64-smoke: $*" >&2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROOTFS="${FEDAL_ARM64_ROOTFS:-${XDG_CACHE_HOME:-$HOME/.cache}/fedal/arm64-bookworm}"
MIRROR="${FEDAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
# Raspberry Pi OS Lite ships python3, python3-venv and python3-pip; ca-certificates: pip over
# HTTPS; procps and time: ps, free and /usr/bin/time for looking around inside
PACKAGES=python3,python3-venv,python3-pip,ca-certificates,procps,time
SRC=/opt/fedal-src
REBUILD=0 FRESH_VENV=0 BUILD_ONLY=0 PREREQS_ONLY=0 KEEP=0 OUT="$REPO/docs/results"
DRIVER_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cache) ROOTFS="${2:?--cache needs a directory}"; shift 2 ;;
    --mirror) MIRROR="${2:?--mirror needs a URL}"; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    --fresh-venv) FRESH_VENV=1; shift ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --prereqs-only) PREREQS_ONLY=1; shift ;;
    --torch-index|--rounds|--clients|--strategy|--privacy)
      DRIVER_ARGS+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; echo "arm64-smoke: error: unknown argument: $1" >&2; exit 2 ;;
  esac
done

STAMP=.fedal-arm64-rootfs        # in a finished userland this script built
PARTIAL_STAMP=.fedal-arm64-partial  # in one it started building
# Only what this script built is ever deleted: --cache (or FEDAL_ARM64_ROOTFS) may name any directory.
if [ "$REBUILD" -eq 1 ] && [ -e "$ROOTFS" ] && [ ! -f "$ROOTFS/$STAMP" ]; then
  die "--rebuild: $ROOTFS is not a userland this script built (no $STAMP in it): refusing to delete it"
fi

[ "$(id -u)" -eq 0 ] || die "run as root: debootstrap, chroot and bind mounts need it"
[ "$(uname -m)" = x86_64 ] || [ "$(uname -m)" = aarch64 ] || die "host $(uname -m): this script expects an x86-64 (or arm64) host"

# -- host prerequisites: Debian packages installed when missing, as scripts/install-test-tools.sh
# does for the test suite's; the emulation packages only where the host is not arm64 itself.
missing_packages() {
  command -v debootstrap >/dev/null 2>&1 || echo debootstrap
  if [ "$(uname -m)" != aarch64 ]; then
    command -v update-binfmts >/dev/null 2>&1 || echo binfmt-support
    command -v qemu-aarch64-static >/dev/null 2>&1 || echo qemu-user-static
  fi
}

install_prereqs() {
  local need tool
  mapfile -t need < <(missing_packages)
  if [ "${#need[@]}" -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || die "missing ${need[*]} and no apt-get to install them: install them by hand"
    say "installing ${need[*]} with apt-get"
    apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
      || die "apt-get install ${need[*]} failed"
    mapfile -t need < <(missing_packages)
    [ "${#need[@]}" -eq 0 ] || die "still missing after apt-get install: ${need[*]}"
  fi
  for tool in chroot mount umount flock mountpoint; do  # Debian's essential set: not installed here
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found"
  done
}

install_prereqs
if [ "$PREREQS_ONLY" -eq 1 ]; then
  say "host prerequisites present"
  exit 0
fi
# shellcheck source=scripts/host-python.sh
. "$REPO/scripts/host-python.sh"
HOST_PYTHON="$(fedal_host_python "$REPO")" || die "no host Python for bench/arm64_smoke.py"
ROOTFS="$(mkdir -p "$(dirname "$ROOTFS")" && cd "$(dirname "$ROOTFS")" && pwd)/$(basename "$ROOTFS")"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# One smoke run per userland at a time: the mounts below live inside it.
exec 9>"$ROOTFS.lock"
flock -n 9 || die "another arm64-smoke.sh is using $ROOTFS"

# -- binfmt: aarch64 ELF files run through qemu-aarch64-static -------------------------------
# With binfmt_misc every aarch64 program (dpkg's maintainer scripts, pip's subprocesses, the
# agent) runs transparently; running only the first program under qemu-aarch64-static -L is not
# enough, since its children would be exec'd natively. Debian's qemu-user-static registers the
# handler with the F (fix-binary) flag: the kernel opens the interpreter at registration, so it
# works inside a chroot that holds no qemu binary.
enable_binfmt() {
  local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
  if [ "$(uname -m)" = aarch64 ]; then return 0; fi
  if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null \
      || die "binfmt_misc is not available here (no /proc/sys/fs/binfmt_misc and it cannot be mounted): a privileged container or a VM is needed"
  fi
  if [ ! -e "$entry" ] || ! grep -qx enabled "$entry"; then
    command -v update-binfmts >/dev/null 2>&1 || die "update-binfmts not found: apt-get install binfmt-support qemu-user-static"
    [ -e /usr/share/binfmts/qemu-aarch64 ] || die "no qemu-aarch64 binfmt entry: apt-get install qemu-user-static"
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || die "update-binfmts --enable qemu-aarch64 failed"
  fi
  if [ ! -e "$entry" ] || ! grep -qx enabled "$entry"; then die "the qemu-aarch64 binfmt handler is not enabled"; fi
  grep -q '^flags:.*F' "$entry" \
    || die "the qemu-aarch64 handler lacks the F flag; Debian's qemu-user-static (>= 1:5.0) registers it with F"
}

# -- the userland: debootstrap once, cached -------------------------------------------------
build_rootfs() {
  local stamp="$ROOTFS/$STAMP"
  if [ "$REBUILD" -eq 1 ] && [ -d "$ROOTFS" ]; then
    [ -f "$stamp" ] || die "--rebuild: $ROOTFS is not a userland this script built (no $STAMP in it)"
    say "--rebuild: removing $ROOTFS"
    rm -rf --one-file-system "$ROOTFS"
  fi
  if [ -f "$stamp" ]; then
    say "userland: $ROOTFS (cached; $(cat "$stamp"))"
    return 0
  fi
  [ ! -e "$ROOTFS" ] || die "$ROOTFS exists but is not a finished userland: remove it or pass --rebuild"
  local partial="$ROOTFS.partial"
  if [ -e "$partial" ]; then  # an earlier build that did not finish: ours only if it has our stamp
    [ -f "$partial/$PARTIAL_STAMP" ] || die "$partial exists and is not an unfinished userland of this script: remove it"
    rm -rf --one-file-system "$partial"
  fi
  mkdir -p "$partial"
  echo "unfinished arm64 userland of arm64-smoke.sh" >"$partial/$PARTIAL_STAMP"
  say "building the arm64 $SUITE userland in $ROOTFS (debootstrap under emulation: ~15-30 min, once)"
  debootstrap --arch=arm64 --variant=minbase --include="$PACKAGES" "$SUITE" "$partial" "$MIRROR" >"$ROOTFS.debootstrap.log" 2>&1 \
    || die "debootstrap failed; see $ROOTFS.debootstrap.log"
  rm -f "$partial/$PARTIAL_STAMP"
  echo "debian $SUITE arm64, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $MIRROR" >"$partial/$STAMP"
  mv "$partial" "$ROOTFS"
}

# -- mounts inside the userland, undone on exit -----------------------------------------------
MOUNTS=()
WORKDIR=""
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTS[$i]}" 2>/dev/null || umount -l "${MOUNTS[$i]}" 2>/dev/null || say "could not unmount ${MOUNTS[$i]}"
  done
  if [ -n "$WORKDIR" ]; then
    rmdir "$ROOTFS$WORKDIR" 2>/dev/null || true
    if [ "$KEEP" -eq 1 ]; then say "workspace kept: $WORKDIR"; else rm -rf "$WORKDIR"; fi
  fi
}
trap cleanup EXIT
DRIVER_PID=""
stop_driver() {  # bash runs a trap only once its foreground command ends: the driver runs in the
  # background, and a signal reaches it at once; the EXIT trap unmounts once it has ended
  if [ -n "$DRIVER_PID" ]; then
    kill -TERM "$DRIVER_PID" 2>/dev/null || true
    wait "$DRIVER_PID" 2>/dev/null || true
  fi
  exit 130
}
trap stop_driver INT TERM

mount_in() {  # mount_in TARGET ARGS...: mount unless TARGET is already a mount point
  local target="$1"; shift
  mkdir -p "$target"
  if mountpoint -q "$target"; then return 0; fi
  mount "$@" "$target"
  MOUNTS+=("$target")
}

enable_binfmt
build_rootfs
chroot "$ROOTFS" /bin/true 2>/dev/null || die "cannot run programs in $ROOTFS (binfmt handler not working?)"
say "userland runs: $(chroot "$ROOTFS" /usr/bin/uname -m), $(chroot "$ROOTFS" /usr/bin/python3 --version)"
if [ "$BUILD_ONLY" -eq 1 ]; then
  exit 0
fi

# No /sys: the host's describes x86 CPUs, and onnxruntime's CPU detection (cpuinfo) crashes the
# emulated process reading it; without it cpuinfo reports a failure and onnxruntime carries on.
mount_in "$ROOTFS/proc" -t proc proc
mount_in "$ROOTFS/dev" --bind /dev
cp -L /etc/resolv.conf "$ROOTFS/etc/resolv.conf"  # pip inside reaches PyPI through the host's resolver
# Behind a TLS-inspecting proxy the host's pip trusts an extra CA bundle: pip inside gets the same.
HOST_CA="${PIP_CERT:-${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-}}}"
if [ -n "$HOST_CA" ] && [ -f "$HOST_CA" ]; then
  install -D -m 0644 "$HOST_CA" "$ROOTFS/usr/local/share/fedal-smoke/host-ca.pem"
  DRIVER_ARGS+=(--pip-cert /usr/local/share/fedal-smoke/host-ca.pem)
  say "pip in the userland trusts the host's CA bundle ($HOST_CA)"
fi

if [ "$FRESH_VENV" -eq 1 ] && [ -d "$ROOTFS/opt/fedal-agent" ]; then
  say "--fresh-venv: removing the agent's virtualenv from the userland"
  rm -rf --one-file-system "$ROOTFS/opt/fedal-agent"
fi

# The checkout, copied fresh (tracked files and new ones that are not ignored): install-agent.sh
# installs the agent from it as from a checkout on a Pi.
say "copying the checkout to $SRC in the userland"
rm -rf --one-file-system "${ROOTFS:?}$SRC"
mkdir -p "$ROOTFS$SRC"
if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
  (cd "$REPO" && git ls-files -z -c -o --exclude-standard | while IFS= read -r -d '' f; do
    if [ -f "$f" ]; then printf '%s\0' "$f"; fi  # tracked files deleted in the work tree are skipped
  done | tar --null -T - -cf -) | tar -xf - -C "$ROOTFS$SRC"
else
  (cd "$REPO" && tar --exclude=.git --exclude=runs --exclude=__pycache__ -cf - .) | tar -xf - -C "$ROOTFS$SRC"
fi

# The run's workspace, visible at the same path inside the userland (install-agent.sh reads the
# emulated client's config and data from it).
WORKDIR="$(mktemp -d /tmp/fedal-arm64-smoke.XXXXXX)"
mount_in "$ROOTFS$WORKDIR" --bind "$WORKDIR"

say "federated run: Mosquitto, coordinator and x86 agents on this host, one agent in the arm64 userland"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$HOST_PYTHON" "$REPO/bench/arm64_smoke.py" --rootfs "$ROOTFS" --source "$SRC" \
  --workdir "$WORKDIR" --out "$OUT" ${DRIVER_ARGS[@]+"${DRIVER_ARGS[@]}"} &
DRIVER_PID=$!
wait "$DRIVER_PID"  # (its status is the script's, through set -e)
