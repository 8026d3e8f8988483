#!/usr/bin/env bash
# A whole emulated Pi, without a Pi: builds (once, cached) a small bootable arm64 Debian bookworm
# image with Raspberry Pi OS's layout (pi-image.sh), flashes a copy with `flash.sh --wheelhouse`,
# boots it under qemu-system-aarch64 -M virt with a user-mode network that reaches only the host's
# broker and coordinator (restrict=on + guestfwd), and checks from the host that the first-boot
# hook ran once, the agent installed offline, its service started, the device finished a short
# run next to x86 agents, and a further boot does not run the hook again (bench/boot_test.py).
# Writes docs/results/boot_test.{md,json}.
#
# Opt-in (an hour or more under TCG emulation; the first image build adds ~30-60 min): not in the
# test suite unless asked for with `FEDAL_BOOT_TEST=1 pytest tests/test_boot_test.py`. Needs root
# (debootstrap, chroot), a Debian mirror and PyPI on the host (never in the guest); installs the
# missing host packages with apt-get.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: boot-test.sh [options]

  --workdir DIR        the run's workspace (default /tmp/fedal-boot-test; a FedAL workspace)
  --cache DIR          pi-image.sh's userland cache (default there)
  --wheelhouse DIR     reuse this wheelhouse instead of building one
  --rounds N           rounds of the run (default 2)
  --cpu MODEL          qemu CPU model (default cortex-a76, the Pi 5's core; cortex-a72 is the Pi 4's,
                       on which torch 2.10.0's aarch64 wheel dies with SIGILL on import)
  --timeout S          seconds for boot 1, the install and the run (default 10800)
  --out DIR            where boot_test.{md,json} go (default docs/results of this checkout)
  -h, --help           this text

The host side (bench/boot_test.py) runs with $FEDAL_PYTHON, else the active virtualenv, else
this checkout's .venv (found under sudo too): a Python with the toolkit and torch installed.
USAGE
}
die() { echo "boot-test: error: $*" >&2; exit 2; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKDIR=/tmp/fedal-boot-test CACHE_ARGS=() DRIVER=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workdir) WORKDIR="${2:?--workdir needs a directory}"; shift 2 ;;
    --cache) CACHE_ARGS=(--cache "${2:?--cache needs a directory}"); shift 2 ;;
    --wheelhouse|--rounds|--timeout|--out|--cpu) DRIVER+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[ "$(id -u)" -eq 0 ] || die "run as root: the image build needs debootstrap and chroot"
PATH="$PATH:/usr/sbin:/sbin"
# shellcheck source=scripts/host-python.sh
. "$REPO/scripts/host-python.sh"
HOST_PYTHON="$(fedal_host_python "$REPO")" || die "no host Python for bench/boot_test.py"

need=()
command -v qemu-system-aarch64 >/dev/null 2>&1 || need+=(qemu-system-arm)
command -v socat >/dev/null 2>&1 || need+=(socat)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v qemu-aarch64-static >/dev/null 2>&1 || need+=(qemu-user-static)
command -v update-binfmts >/dev/null 2>&1 || need+=(binfmt-support)
command -v mtype >/dev/null 2>&1 || need+=(mtools)
command -v mkfs.vfat >/dev/null 2>&1 || need+=(dosfstools)
command -v debugfs >/dev/null 2>&1 || need+=(e2fsprogs)
command -v mosquitto >/dev/null 2>&1 || need+=(mosquitto)
if [ "${#need[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || die "missing ${need[*]} and no apt-get to install them"
  echo "boot-test: installing ${need[*]} with apt-get" >&2
  apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || die "apt-get install ${need[*]} failed"
fi

mkdir -p "$WORKDIR"
IMAGE="$WORKDIR/base.img"
bash "$REPO/firmware_scripts/pi-image.sh" --out "$IMAGE" ${CACHE_ARGS[@]+"${CACHE_ARGS[@]}"}
# exec: a signal to this script (its PID) reaches the driver, which ends its VM, agents and broker;
# so does a SIGKILL (its children die with it)
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" exec nice -n 15 "$HOST_PYTHON" "$REPO/bench/boot_test.py" --image "$IMAGE" \
  --workdir "$WORKDIR/run" ${DRIVER[@]+"${DRIVER[@]}"}
