#!/usr/bin/env bash
# Prepares a Raspberry Pi OS (64-bit, Bookworm or later) image file or SD card so that the device
# installs and starts the FedAL Edge agent by itself: writes the agent config, credentials and a
# first-boot hook into the boot (FAT) partition, as Raspberry Pi Imager does -- firstrun.sh via
# `systemd.run=` in cmdline.txt, or cloud-init user-data/network-config on images that use
# cloud-init. No mounting and no root needed for an image file: the partition is found with
# sfdisk and edited with mtools. See docs/deploy-raspberry-pi.md.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: flash.sh --image IMG_OR_DEVICE --config agent.toml [options]

  --image PATH          Raspberry Pi OS image file (.img, decompressed) or SD card device (/dev/sdX)
  --config FILE         this device's agent config (e.g. from `fedal fleet init`)
  --ca FILE             CA certificate for mqtts:// (default: ca.crt next to the config, if the
                        config sets broker.ca_file)
  --hostname NAME       the device's hostname
  --wifi-ssid SSID      Wi-Fi network to join (with --wifi-psk and --wifi-country)
  --wifi-psk-file FILE  its passphrase, the file's first line (8-63 characters, or 64 hex digits;
                        an empty line for an open network); - reads it from standard input
  --wifi-psk PSK        the passphrase on the command line instead (other users of this machine
                        can read a process's arguments while it runs: prefer --wifi-psk-file)
  --wifi-country CC     two-letter country code (Wi-Fi stays off without one)
  --ssh-key FILE        public key(s) allowed to log in over SSH (passwords stay off)
  --user NAME           login user for --ssh-key (default: pi)
  --wheel FILE          the agent wheel to install (default: built from this checkout)
  --data FILE           private data file for /var/lib/fedal-agent (repeatable)
  --torch-index URL     passed to install-agent.sh on the device
  --privacy             the device also installs the `privacy` extra (Opacus): a run with differential
                        privacy needs it (a --wheelhouse holds its wheels already)
  --torch-version V     passed to install-agent.sh on the device (a Pi 3B+, 4 or Zero 2 W needs torch
                        >= 2.11, from PyTorch's CPU index: --torch-index https://download.pytorch.org/whl/cpu)
  --wheelhouse DIR      a wheelhouse from `fedal fleet wheelhouse`: the device installs from it with no
                        package index (in fedal/ on the boot partition if it fits, else in
                        /opt/fedal-wheelhouse on the root partition); its agent wheel unless --wheel
  --mode MODE           auto (default), firstrun or cloud-init
  --boot-mount PATH     where the device mounts the boot partition (default: /boot/firmware)
  -h, --help            this text
EOF
}

die() { echo "flash: error: $*" >&2; exit 1; }
usage_error() { echo "flash: error: $*" >&2; exit 2; }  # arguments no flash can use: the usage's exit status
say() { echo "flash: $*"; }

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
PY="${FEDAL_PYTHON:-python3}"

IMAGE="" CONFIG="" CA="" HOST="" SSID="" PSK="" COUNTRY="" SSH_KEY="" LOGIN=pi WHEEL="" TORCH_INDEX="" TORCH_VERSION="" WHEELHOUSE=""
MODE=auto BOOT_MOUNT=/boot/firmware PSK_SET=0 PSK_FILE="" PRIVACY=0
DATA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --image) IMAGE="${2:?--image needs a path}"; shift 2 ;;
    --config) CONFIG="${2:?--config needs a file}"; shift 2 ;;
    --ca) CA="${2:?--ca needs a file}"; shift 2 ;;
    --hostname) HOST="${2:?--hostname needs a name}"; shift 2 ;;
    --wifi-ssid) SSID="${2:?--wifi-ssid needs a value}"; shift 2 ;;
    --wifi-psk) PSK="${2?--wifi-psk needs a value}"; PSK_SET=$((PSK_SET + 1)); shift 2 ;;
    --wifi-psk-file) PSK_FILE="${2:?--wifi-psk-file needs a file (- for standard input)}"; PSK_SET=$((PSK_SET + 1)); shift 2 ;;
    --wifi-country) COUNTRY="${2:?--wifi-country needs a code}"; shift 2 ;;
    --ssh-key) SSH_KEY="${2:?--ssh-key needs a file}"; shift 2 ;;
    --user) LOGIN="${2:?--user needs a name}"; shift 2 ;;
    --wheel) WHEEL="${2:?--wheel needs a file}"; shift 2 ;;
    --data) DATA+=("${2:?--data needs a file}"); shift 2 ;;
    --torch-index) TORCH_INDEX="${2:?--torch-index needs a URL}"; shift 2 ;;
    --torch-version) TORCH_VERSION="${2:?--torch-version needs a version}"; shift 2 ;;
    --privacy) PRIVACY=1; shift ;;
    --wheelhouse) WHEELHOUSE="${2:?--wheelhouse needs a directory}"; shift 2 ;;
    --mode) MODE="${2:?--mode needs a value}"; shift 2 ;;
    --boot-mount) BOOT_MOUNT="${2:?--boot-mount needs a path}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; usage_error "unknown argument: $1" ;;
  esac
done

# -- check everything before touching the image ---------------------------------------------
[ -n "$IMAGE" ] || { usage >&2; usage_error "--image is required"; }
[ -n "$CONFIG" ] || { usage >&2; usage_error "--config is required"; }
for tool in sfdisk mcopy mdir mmd mdeltree; do
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || [ -x "/sbin/$tool" ] \
    || die "$tool is missing (Debian/Ubuntu: apt-get install fdisk mtools)"
done
PATH="$PATH:/usr/sbin:/sbin"
[ -e "$IMAGE" ] || die "image not found: $IMAGE"
case "$IMAGE" in
  *.xz|*.gz|*.zip|*.zst|*.7z|*.bz2) die "$IMAGE is compressed: decompress it first (e.g. xz -dk $IMAGE)" ;;
esac
if [ -b "$IMAGE" ]; then
  # /proc/mounts names the kernel's devices (/dev/sdb1, /dev/mmcblk0p1) whatever name was given
  # here (/dev/disk/by-id/..., a symlink): compared resolved, the device or any partition of it
  dev="$(readlink -f "$IMAGE")"
  while read -r source _; do
    case "$source" in /dev/*) ;; *) continue ;; esac
    real="$(readlink -f "$source" 2>/dev/null || printf '%s' "$source")"
    case "$real" in
      "$dev"|"$dev"[0-9]*|"$dev"p[0-9]*) die "$IMAGE ($dev) has mounted partitions ($real): unmount them first" ;;
    esac
  done </proc/mounts
elif [ ! -f "$IMAGE" ]; then
  die "$IMAGE is neither an image file nor a block device"
fi
if [ ! -r "$IMAGE" ] || [ ! -w "$IMAGE" ]; then die "cannot read and write $IMAGE (an SD card needs root: sudo)"; fi
case "$MODE" in auto|firstrun|cloud-init) ;; *) usage_error "--mode must be auto, firstrun or cloud-init (got $MODE)" ;; esac
case "$BOOT_MOUNT" in /*) BOOT_MOUNT="${BOOT_MOUNT%/}" ;; *) usage_error "--boot-mount must be an absolute path" ;; esac
case "$BOOT_MOUNT" in  # it goes into cmdline.txt's systemd.run=, which the kernel splits at spaces
  *[!A-Za-z0-9/._-]*) usage_error "--boot-mount '$BOOT_MOUNT' may hold only letters, digits, '/', '.', '_' and '-' (it goes on the kernel's command line)" ;;
esac
if [ -n "$TORCH_VERSION" ] && ! printf '%s' "$TORCH_VERSION" | grep -Eq '^[0-9]+\.[0-9]+(\.[0-9]+)?(\+[A-Za-z0-9.]+)?$'; then
  usage_error "--torch-version '$TORCH_VERSION' is not a version like 2.13.0 (or 2.13.0+cpu)"
fi
seen_data=" "
for f in ${DATA[@]+"${DATA[@]}"}; do  # they all go into one folder on the card: two of one name would be one file
  case "$seen_data" in *" $(basename "$f") "*) usage_error "two --data files are named $(basename "$f"): the card keeps them in one folder" ;; esac
  seen_data+="$(basename "$f") "
done

if [ -n "$HOST" ] && ! printf '%s' "$HOST" | grep -Eq '^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$'; then
  usage_error "invalid --hostname '$HOST': letters, digits and '-', 1-63 characters, no '-' at either end"
fi
[ "$PSK_SET" -le 1 ] || usage_error "give the passphrase once: --wifi-psk or --wifi-psk-file"
if [ -n "$PSK_FILE" ]; then
  if [ "$PSK_FILE" = - ]; then
    if [ -t 0 ]; then  # typed: not echoed
      printf 'Wi-Fi passphrase: ' >&2
      IFS= read -rs PSK || true
      echo >&2
    else
      IFS= read -r PSK || [ -n "$PSK" ] || die "--wifi-psk-file -: nothing on standard input"
    fi
  else
    if [ ! -f "$PSK_FILE" ] || [ ! -r "$PSK_FILE" ]; then die "--wifi-psk-file $PSK_FILE is not a readable file"; fi
    IFS= read -r PSK <"$PSK_FILE" || [ -n "$PSK" ] || [ -s "$PSK_FILE" ] || die "--wifi-psk-file $PSK_FILE is empty (an open network: a file holding one empty line)"
  fi
  PSK="${PSK%$'\r'}"
  [ -n "$PSK" ] || say "the passphrase from --wifi-psk-file is empty: the Wi-Fi network is taken to be open"
fi
if [ -n "$SSID" ]; then
  [ "${#SSID}" -le 32 ] || usage_error "--wifi-ssid is longer than 32 bytes"
  [ -n "$COUNTRY" ] || usage_error "--wifi-ssid needs --wifi-country (Raspberry Pi OS keeps Wi-Fi off until the country is set)"
  [ "$PSK_SET" -eq 1 ] || usage_error "--wifi-ssid needs --wifi-psk-file (or --wifi-psk; '' for an open network)"
  if [ -n "$PSK" ] && ! { [ "${#PSK}" -ge 8 ] && [ "${#PSK}" -le 63 ]; } && ! printf '%s' "$PSK" | grep -Eq '^[0-9A-Fa-f]{64}$'; then
    usage_error "the Wi-Fi passphrase must be 8-63 characters (or 64 hex digits)"
  fi
  case "$SSID$PSK" in *$'\n'*) usage_error "--wifi-ssid and --wifi-psk cannot contain newlines" ;; esac
elif [ "$PSK_SET" -eq 1 ]; then
  usage_error "--wifi-psk and --wifi-psk-file need --wifi-ssid"
fi
if [ -n "$COUNTRY" ]; then
  printf '%s' "$COUNTRY" | grep -Eq '^[A-Za-z]{2}$' || usage_error "--wifi-country must be a two-letter code like GB or DE (got $COUNTRY)"
  COUNTRY="$(printf '%s' "$COUNTRY" | tr '[:lower:]' '[:upper:]')"
fi
if [ -n "$SSH_KEY" ]; then
  [ -f "$SSH_KEY" ] || die "ssh key file not found: $SSH_KEY"
  if grep -q "PRIVATE KEY" "$SSH_KEY"; then die "$SSH_KEY is a private key: give the public one (.pub)"; fi
  grep -Eq '^(ssh-|ecdsa-|sk-)' "$SSH_KEY" || die "$SSH_KEY holds no SSH public key (ssh-ed25519 ..., ssh-rsa ...)"
  printf '%s' "$LOGIN" | grep -Eq '^[a-z_][a-z0-9_-]{0,31}$' || usage_error "invalid --user '$LOGIN'"
fi
for f in ${DATA[@]+"${DATA[@]}"}; do [ -f "$f" ] || die "data file not found: $f"; done
if [ -n "$WHEEL" ]; then
  [ -f "$WHEEL" ] || die "wheel not found: $WHEEL"
  case "$WHEEL" in *.whl) ;; *) die "--wheel needs a .whl file: $WHEEL" ;; esac
fi
WH_MANIFEST=fedal-wheelhouse.json
WH_ROOT_DIR=/opt/fedal-wheelhouse  # on the root partition, when the boot partition is too small
if [ -n "$WHEELHOUSE" ]; then
  [ -d "$WHEELHOUSE" ] || die "wheelhouse not found: $WHEELHOUSE"
  [ -f "$WHEELHOUSE/$WH_MANIFEST" ] \
    || die "$WHEELHOUSE is not a wheelhouse (no $WH_MANIFEST): build one with fedal fleet wheelhouse --arch aarch64 --out DIR"
  [ -z "$TORCH_INDEX" ] || die "--torch-index and --wheelhouse exclude each other: the wheelhouse holds torch"
  [ -z "$TORCH_VERSION" ] || die "--torch-version and --wheelhouse exclude each other: the wheelhouse holds torch"
fi
# what the device's installer would refuse at first boot (the card then needs flashing again), refused here
if [ -n "$TORCH_VERSION" ] && [ -z "$TORCH_INDEX" ] \
    && [ "$(printf '%s\n' "$TORCH_VERSION" | awk -F'[.+]' '{ printf "%d", $1 * 1000 + $2 }')" -ge 2011 ]; then
  die "--torch-version $TORCH_VERSION without --torch-index: PyPI's aarch64 torch from 2.11 on depends on the CUDA 13 toolkit, which the device's installer refuses; add --torch-index https://download.pytorch.org/whl/cpu"
fi

# -- the boot partition ----------------------------------------------------------------------------
dump="$(sfdisk --dump "$IMAGE" 2>/dev/null)" || die "$IMAGE has no partition table: not a disk image"
sector="$(printf '%s\n' "$dump" | sed -n 's/^sector-size: *//p')"
sector="${sector:-512}"
# first partition with a FAT type: DOS 0x01/04/06/0b/0c/0e/ef, GPT basic data or EFI system
part="$(printf '%s\n' "$dump" | awk -F'[:,]' '/start=/ {
  type = ""; start = ""
  for (i = 2; i <= NF; i++) {
    f = $i; gsub(/ /, "", f)
    if (f ~ /^start=/) start = substr(f, 7)
    if (f ~ /^type=/) type = toupper(substr(f, 6))
  }
  if (type ~ /^(1|4|6|B|C|E|EF|EBD0A0A2-B9E5-4433-87C0-68B6B72699C7|C12A7328-F81F-11D2-BA4B-00A0C93EC93B)$/) {
    gsub(/ /, "", $1); print $1 " " start; exit
  }
}')"
[ -n "$part" ] || die "no FAT boot partition in $IMAGE (partitions: $(printf '%s\n' "$dump" | grep -c 'start=' || true), none FAT)"
OFFSET=$(( ${part#* } * sector ))
FAT="$IMAGE@@$OFFSET"
export MTOOLS_SKIP_CHECK=1 MTOOLS_NO_VFAT=0 MTOOLSRC=/dev/null
mdir -b -i "$FAT" ::/ >/dev/null 2>&1 || die "partition ${part%% *} of $IMAGE is marked FAT but holds no FAT file system"
# -a: hidden and system files too (a card looked at on Windows or a Mac gets some)
listing="$(mdir -a -b -i "$FAT" ::/ 2>/dev/null | sed 's|^::/||')" || true
has() { printf '%s\n' "$listing" | sed 's|/$||' | grep -qixF -- "$1"; }
has cmdline.txt || die "the FAT partition of $IMAGE has no cmdline.txt: not a Raspberry Pi OS boot partition"
has config.txt || die "the FAT partition of $IMAGE has no config.txt: not a Raspberry Pi OS boot partition"
# fedal/ is replaced below only if an earlier flash.sh wrote it (its first-boot installer is in it):
# a folder of that name that someone else put on the card is never deleted.
ours() {  # fedal/ holds the first-boot installer an earlier flash.sh wrote; fedal_listing keeps what mdir said
  fedal_listing="$(mdir -a -b -i "$FAT" ::/fedal 2>&1)" || return 1
  printf '%s\n' "$fedal_listing" | grep -qixF '::/fedal/firstboot.sh'
}
if has fedal; then
  # looked at twice at most: a card reader's hiccup is not taken for a folder someone else wrote
  ours || { sleep 1; ours; } \
    || die "the boot partition of $IMAGE holds a fedal/ folder that flash.sh did not write (no fedal/firstboot.sh; mdir lists: $(printf '%s\n' "$fedal_listing" | sed 's|^::/fedal/||' | head -5 | tr '\n' ' ')): move it away first"
fi
# A new payload is written into fedal.new/ (its marker first) and swapped in by renames, the old one
# going as fedal.old/ (firstboot.sh last): a flash.sh interrupted anywhere leaves these, empty or
# with their marker, and the next one removes them. Folders of these names without are someone else's.
staged_ours() {  # NAME MARKER: the folder is empty (but for what a desktop leaves) or holds MARKER
  local names
  names="$(mdir -a -b -i "$FAT" "::/$1" 2>&1)" || return 1
  names="$(printf '%s\n' "$names" | grep -viE '/(\.DS_Store|\._[^/]*|desktop\.ini|Thumbs\.db)$' || true)"
  [ -z "$names" ] || printf '%s\n' "$names" | grep -qixF -- "::/$1/$2"
}
for staged in fedal.new:flash-staging.txt fedal.old:firstboot.sh; do
  if has "${staged%%:*}" && ! staged_ours "${staged%%:*}" "${staged#*:}"; then
    die "the boot partition of $IMAGE holds a ${staged%%:*}/ folder that flash.sh did not write (not empty, no ${staged#*:}): move it away first"
  fi
done
if [ "$MODE" = auto ]; then
  MODE=firstrun
  if has user-data || has meta-data || has network-config; then MODE=cloud-init; fi
fi

# -- the config: checked with the agent's own config model ----------------------------------
[ -f "$CONFIG" ] || die "config file not found: $CONFIG"
command -v "$PY" >/dev/null 2>&1 || die "$PY is needed to check the config (set FEDAL_PYTHON)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if ! facts="$("$PY" -m fedal_cli.main fleet check "$CONFIG" 2>&1)"; then
  case "$facts" in
    *ModuleNotFoundError*|*"needs an extra"*)
      die "cannot check the config: $PY must import this checkout's fedal-edge and its dependencies (bash $REPO/scripts/install.sh fleet, then FEDAL_PYTHON=$REPO/.venv/bin/python; under sudo too)" ;;
  esac
  die "invalid agent config: ${facts#Error: }"
fi
fact() { printf '%s\n' "$facts" | sed -n "s/^$1=//p"; }
WH_FILES=()
if [ -n "$WHEELHOUSE" ]; then
  # complete and unchanged since `fedal fleet wheelhouse` wrote it (sizes and sha256 of its manifest)
  wh_facts="$("$PY" - "$WHEELHOUSE" <<'PYEOF' 2>&1
import sys
from pathlib import Path
from fleet.wheelhouse import WheelhouseError, verify
try:
    m = verify(Path(sys.argv[1]))
except WheelhouseError as exc:
    sys.exit(str(exc))
print(f"arch={m['arch']}\nbytes={m['bytes']}\nagent={m['agent_wheel']}\ntorch={m['torch']}")
for name in m["files"]:
    print(f"file={name}")
PYEOF
)" || die "--wheelhouse: ${wh_facts}"
  whf() { printf '%s\n' "$wh_facts" | sed -n "s/^$1=//p"; }
  WH_ARCH="$(whf arch)" WH_BYTES="$(whf bytes)"
  # the card's architecture: a Raspberry Pi's 64-bit OS (FEDAL_IMAGE_ARCH=x86_64 for an amd64 image)
  IMAGE_ARCH="${FEDAL_IMAGE_ARCH:-aarch64}"
  [ "$WH_ARCH" = "$IMAGE_ARCH" ] || die "--wheelhouse $WHEELHOUSE is for $WH_ARCH; a Raspberry Pi (64-bit OS) needs one built with --arch $IMAGE_ARCH"
  mapfile -t WH_FILES < <(whf file)
  if [ -z "$WHEEL" ]; then WHEEL="$WHEELHOUSE/$(whf agent)"; fi
  if [ "$PRIVACY" -eq 1 ]; then  # the offline install's pip would fail at first boot, for good
    for dist in opacus opt_einsum scipy; do
      printf '%s\n' "${WH_FILES[@]}" | grep -qi "^${dist}-" \
        || die "--privacy needs the privacy extra's wheels, and --wheelhouse $WHEELHOUSE holds no $dist: build it with the default constraints (they pin opacus, opt-einsum and scipy)"
    done
  fi
fi
CLIENT="$(fact client_id)"
CA_FILE="$(fact ca_file)"
if [ -n "$CA_FILE" ] && [ -z "$CA" ]; then
  case "$CA_FILE" in
    /etc/fedal-agent/*)  # where the installer puts the fleet's own CA (`fedal fleet init --tls`)
      CA="$(dirname "$CONFIG")/ca.crt"
      [ -f "$CA" ] || die "the config expects a CA at $CA_FILE on the device, and there is no ca.crt next to it: give --ca FILE" ;;
    *)  # another CA file of the device (e.g. the system bundle for a broker with a public certificate)
      say "the device checks the broker against $CA_FILE as the device has it (--ca FILE would create it if missing)" ;;
  esac
fi
[ -z "$CA" ] || grep -q "BEGIN CERTIFICATE" "$CA" 2>/dev/null || die "--ca $CA is not a PEM certificate"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
put() { mcopy -o -i "$FAT" "$1" "$2" || die "writing $2 to the boot partition failed (is it full?)"; }

# -- the root partition (ext4), written with debugfs when the wheelhouse does not fit the boot one --
ROOT_FS=""
root_fs() {  # the first Linux partition as debugfs's "image?offset=N"; empty if none
  local start
  start="$(printf '%s\n' "$dump" | awk -F'[:,]' '/start=/ {
    type = ""; start = ""
    for (i = 2; i <= NF; i++) {
      f = $i; gsub(/ /, "", f)
      if (f ~ /^start=/) start = substr(f, 7)
      if (f ~ /^type=/) type = toupper(substr(f, 6))
    }
    if (type ~ /^(83|0FC63DAF-8483-4772-8E79-3D69D8477DE4|B921B045-1DF0-41C3-AF44-4C6F280D3FAE)$/) { print start; exit }
  }')"
  if [ -n "$start" ]; then echo "$IMAGE?offset=$((start * sector))"; fi
}
dbg() { debugfs "$@" 2>&1; }
root_wh_names() {  # the files in the root partition's wheelhouse directory, one a line
  dbg -R "ls -p $WH_ROOT_DIR" "$ROOT_FS" | awk -F/ 'NF >= 7 && $6 != "." && $6 != ".." { print $6 }'
}
root_has() { dbg -R "stat $1" "$ROOT_FS" | grep -q '^Inode:'; }
# an earlier flash.sh's wheelhouse on the root partition goes; anything else of that name stays
root_wh_ours() { root_has "$WH_ROOT_DIR/$WH_MANIFEST"; }
root_wh_remove() {
  if ! root_has "$WH_ROOT_DIR" || ! root_wh_ours; then return 0; fi
  { root_wh_names | while IFS= read -r name; do printf 'rm %s/%s\n' "$WH_ROOT_DIR" "$name"; done
    printf 'rmdir %s\n' "$WH_ROOT_DIR"; } >"$TMP/debugfs-rm"
  dbg -w -f "$TMP/debugfs-rm" "$ROOT_FS" >"$TMP/debugfs-rm.log"
  ! root_has "$WH_ROOT_DIR" || die "could not remove the earlier wheelhouse $WH_ROOT_DIR from the root partition: $(tail -3 "$TMP/debugfs-rm.log")"
}

# -- the payload: boot/fedal/ --------------------------------------------------------------------------
if [ -z "$WHEEL" ]; then
  say "building the agent wheel from $REPO"
  src="$REPO"
  if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    src="$TMP/src"  # a clean copy: no stale build/ leftovers end up in the wheel
    mkdir "$src"
    (cd "$REPO" && git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) | tar -xf - -C "$src"
  fi
  isolation=()
  if "$PY" -c 'import setuptools' 2>/dev/null; then isolation=(--no-build-isolation); fi
  "$PY" -m pip wheel -q --no-deps ${isolation[@]+"${isolation[@]}"} -w "$TMP/wheel" "$src" >"$TMP/wheel.log" 2>&1 \
    || { cat "$TMP/wheel.log" >&2; die "building the agent wheel failed: pass --wheel FILE"; }
  WHEEL="$(ls "$TMP"/wheel/*.whl)"
fi

P="$TMP/fedal"
mkdir -p "$P/constraints" "$P/data"
cp "$CONFIG" "$P/agent.toml"
if [ -n "$CA" ]; then cp "$CA" "$P/ca.crt"; fi
cp "$WHEEL" "$P/"
for f in ${DATA[@]+"${DATA[@]}"}; do cp "$f" "$P/data/"; done
cp "$SCRIPT_DIR/install-agent.sh" "$SCRIPT_DIR/prune-venv.py" "$SCRIPT_DIR/fix-meta.py" "$SCRIPT_DIR/fedal-agent.service" "$P/"
cp "$SCRIPT_DIR"/constraints/*.txt "$P/constraints/"
cp "$SCRIPT_DIR/boot/stage.sh" "$SCRIPT_DIR/boot/firstboot.sh" "$SCRIPT_DIR/boot/fedal-firstboot.service" "$P/"
: >"$P/install-args"
if [ -n "$TORCH_INDEX" ]; then printf -- '--torch-index\n%s\n' "$TORCH_INDEX" >>"$P/install-args"; fi
if [ -n "$TORCH_VERSION" ]; then printf -- '--torch-version\n%s\n' "$TORCH_VERSION" >>"$P/install-args"; fi
if [ "$PRIVACY" -eq 1 ]; then printf -- '--privacy\n' >>"$P/install-args"; fi

# -- the boot partition's room: free bytes, and what an earlier flash.sh's folders hold (fedal/, and
# an interrupted one's fedal.new/ and fedal.old/: they go; mdu counts clusters) ----------------------
fat_info="$(minfo -i "$FAT" :: 2>/dev/null)" || fat_info=""
fat_cluster="$(printf '%s\n' "$fat_info" | sed -n 's/^cluster size: *\([0-9]*\) sectors.*/\1/p')"
fat_ssize="$(printf '%s\n' "$fat_info" | sed -n 's/^sector size: *\([0-9]*\) bytes.*/\1/p')"
# "N bytes free", digits grouped with spaces (FAT16 has no free-cluster count in minfo)
fat_free="$(mdir -i "$FAT" ::/ 2>/dev/null | sed -n 's/ bytes free.*//p' | tr -dc '0-9')" || fat_free=""
ROOM_KNOWN=0
if [ -n "$fat_free" ] && [ -n "$fat_cluster" ] && [ -n "$fat_ssize" ]; then
  ROOM_KNOWN=1
  cbytes=$((fat_cluster * fat_ssize))
  staged_bytes() {
    local clusters=""
    if has "$1"; then clusters="$(mdu -s -i "$FAT" "::/$1" 2>/dev/null | awk '{ print $NF }')" || clusters=""; fi
    echo $(( ${clusters:-0} * cbytes ))
  }
  old_bytes="$(staged_bytes fedal)"
  left_bytes=$(( $(staged_bytes fedal.new) + $(staged_bytes fedal.old) ))
fi
# what the payload in $P takes there, plus extra files: every file rounds up to whole clusters;
# 1 MiB for directories and what cmdline.txt grows by
payload_bytes() { echo $(( $(du -sb "$P" | cut -f1) + ($(find "$P" -type f | wc -l) + $1) * cbytes + 1048576 )); }

# -- the wheelhouse: on the boot partition if it fits there, else on the root partition ----------
WH_WHERE=""
if [ -n "$WHEELHOUSE" ]; then
  [ "$ROOM_KNOWN" -eq 1 ] || die "cannot read the boot partition's free space (minfo, mdir)"
  avail=$((fat_free + old_bytes + left_bytes))
  need=$((WH_BYTES + $(payload_bytes $((${#WH_FILES[@]} + 1)))))
  if [ "$need" -le "$avail" ]; then
    WH_WHERE=boot
    printf -- '--wheelhouse\n%s\n' "$BOOT_MOUNT/fedal/wheelhouse" >>"$P/install-args"
  else
    ROOT_FS="$(root_fs)"
    [ -n "$ROOT_FS" ] || die "the wheelhouse ($((WH_BYTES / 1048576)) MiB) does not fit the boot partition ($((avail / 1048576)) MiB free) and $IMAGE has no Linux root partition"
    command -v debugfs >/dev/null 2>&1 || die "debugfs is missing, needed to put the wheelhouse on the root partition (Debian: apt-get install e2fsprogs)"
    stats="$(dbg -R stats "$ROOT_FS")"
    # here-strings, not pipes: grep -q stops reading early, and under pipefail the writer's SIGPIPE
    # (debugfs's stats of a large root partition are some 100 KB) would read as no match
    grep -q '^Block size:' <<<"$stats" || die "the root partition of $IMAGE is not an ext4 file system debugfs can read"
    if grep -q '^Filesystem features:.*needs_recovery' <<<"$stats"; then
      die "the root file system of $IMAGE was not cleanly unmounted (journal to replay): run e2fsck on it first"
    fi
    bsize="$(printf '%s\n' "$stats" | sed -n 's/^Block size: *//p')"
    bfree="$(printf '%s\n' "$stats" | sed -n 's/^Free blocks: *//p')"
    root_free=$((bsize * bfree))
    root_need=$((WH_BYTES + 64 * 1048576))
    [ "$root_need" -le "$root_free" ] || die "the wheelhouse ($((WH_BYTES / 1048576)) MiB) fits neither the boot partition ($((avail / 1048576)) MiB free) nor the root partition ($((root_free / 1048576)) MiB free, 64 MiB kept)"
    if root_has "$WH_ROOT_DIR" && ! root_wh_ours; then
      die "the root partition of $IMAGE holds $WH_ROOT_DIR, which flash.sh did not write (no $WH_MANIFEST): remove it first"
    fi
    WH_WHERE=root
    printf -- '--wheelhouse\n%s\n' "$WH_ROOT_DIR" >>"$P/install-args"
  fi
fi

if [ "$MODE" = firstrun ]; then
  mkdir -p "$P/settings"
  if [ -n "$HOST" ]; then printf '%s\n' "$HOST" >"$P/settings/hostname"; fi
  if [ -n "$SSID" ]; then
    printf '%s\n' "$SSID" >"$P/settings/wifi-ssid"
    printf '%s\n' "$PSK" >"$P/settings/wifi-psk"
    printf '%s\n' "$COUNTRY" >"$P/settings/wifi-country"
  fi
  if [ -n "$SSH_KEY" ]; then
    grep -E '^(ssh-|ecdsa-|sk-)' "$SSH_KEY" >"$P/settings/authorized_keys"
    printf '%s\n' "$LOGIN" >"$P/settings/ssh-user"
  fi
fi

# -- room: the new payload beside the old one, or only in its place (the old then goes first), or not
# at all (refused here, before anything is written)
OLD_FIRST=0
if [ "$ROOM_KNOWN" -eq 1 ]; then
  new_bytes="$(payload_bytes 4)"
  if [ "$WH_WHERE" = boot ]; then new_bytes=$((new_bytes + WH_BYTES + (${#WH_FILES[@]} + 1) * cbytes)); fi
  room=$((fat_free + left_bytes))
  if [ "$new_bytes" -gt "$((room + old_bytes))" ]; then
    die "the payload ($((new_bytes / 1048576)) MiB) does not fit the boot partition of $IMAGE ($(((room + old_bytes) / 1048576)) MiB free with an earlier payload's room): fewer or smaller --data files"
  fi
  if [ "$new_bytes" -gt "$room" ]; then OLD_FIRST=1; fi
elif has fedal; then
  OLD_FIRST=1  # the room is unknown: the old payload goes first, as it had to before
fi

# -- the staging folder: the card owner's kept settings first, then an interrupted flash's leftovers go --
fat_list() { mdir -a -b -i "$FAT" "::/$1" 2>/dev/null || true; }
fat_has() { mdir -a -b -i "$FAT" ::/ 2>/dev/null | sed -e 's|^::/||' -e 's|/$||' | grep -qixF -- "$1"; }
# empty_staged NAME [KEEP...]: remove what folder NAME holds, but the files named KEEP (lower case)
empty_staged() {
  local name="$1" entry base k skip
  shift
  while IFS= read -r entry; do
    [ -n "$entry" ] || continue
    if [ "${entry%/}" != "$entry" ]; then
      mdeltree -i "$FAT" "${entry%/}" >/dev/null || die "cannot remove ${entry#::/} from the boot partition"
      continue
    fi
    base="$(printf '%s' "${entry##*/}" | tr '[:upper:]' '[:lower:]')"
    skip=0
    for k in "$@"; do if [ "$base" = "$k" ]; then skip=1; fi; done
    [ "$skip" -eq 1 ] || mdel -i "$FAT" "$entry" || die "cannot remove ${entry#::/} from the boot partition"
  done < <(fat_list "$name")
}
# remove_staged NAME MARKER: what the folder holds, then its marker, then the folder (staged_ours
# still knows it for flash.sh's own should this be interrupted)
remove_staged() {
  empty_staged "$1" "$2"
  empty_staged "$1"
  mrd -i "$FAT" "::/$1" || die "cannot remove $1/ from the boot partition"
}
# what an earlier flash.sh kept of the card's own first-boot settings (Raspberry Pi Imager's
# firstrun.sh, the image's user-data) moves into the new payload: the card's hook is flash.sh's own
# since then, so they could not be saved again below. They are on the card at every moment: in
# fedal/, or in an interrupted flash's fedal.new/ or fedal.old/, and written into the new fedal.new/
# before any of these goes.
KEPT_FILES=(firstrun-previous.sh user-data.orig network-config.orig meta-data.orig)
for kept in "${KEPT_FILES[@]}"; do
  for from in fedal fedal.new fedal.old; do
    if has "$from" && fat_list "$from" | grep -qixF -- "::/$from/$kept"; then
      mcopy -n -i "$FAT" "::/$from/$kept" "$P/$kept" || die "cannot read $from/$kept from the boot partition"
      break
    fi
  done
done
if has fedal.new; then
  empty_staged fedal.new flash-staging.txt "${KEPT_FILES[@]}"  # an interrupted flash's: filled again
else
  mmd -i "$FAT" ::/fedal.new || die "cannot create fedal.new/ on the boot partition"
fi
echo "flash.sh writes this folder; it becomes fedal/ once complete" >"$TMP/flash-staging.txt"
put "$TMP/flash-staging.txt" ::/fedal.new/flash-staging.txt
for kept in "${KEPT_FILES[@]}"; do
  if [ -f "$P/$kept" ]; then put "$P/$kept" "::/fedal.new/$kept"; fi
done
if has fedal.old; then remove_staged fedal.old firstboot.sh; fi
# while no whole fedal/ is on the card, its boot hook (flash.sh's firstrun.sh, which starts
# fedal/stage.sh) is off the kernel command line: a card booted then starts as the image would;
# the hook is written again at the end
unhook() {
  local now bare
  mcopy -n -i "$FAT" ::/cmdline.txt "$TMP/cmdline.now" || die "cannot read cmdline.txt"
  now="$(head -n 1 "$TMP/cmdline.now" | tr -d '\r')"
  bare="$(printf '%s\n' "$now" | sed -e 's/ systemd\.run[^ ]*//g' -e 's/ systemd\.unit=kernel-command-line\.target//g')"
  if [ "$bare" != "$now" ]; then
    printf '%s\n' "$bare" >"$TMP/cmdline.bare"
    put "$TMP/cmdline.bare" ::/cmdline.txt
  fi
}

if [ "$OLD_FIRST" -eq 1 ] && fat_has fedal; then
  say "note: the new payload fits the boot partition only without the old one, which goes first: should this flash.sh be interrupted, run it again"
  unhook
  mmove -i "$FAT" ::/fedal ::/fedal.old || die "cannot move the old fedal/ aside on the boot partition"
  remove_staged fedal.old firstboot.sh
fi
mcopy -s -o -i "$FAT" "$P"/* ::/fedal.new/ || die "writing fedal/ to the boot partition failed (is it full?)"
if [ "$WH_WHERE" = boot ]; then
  mmd -i "$FAT" ::/fedal.new/wheelhouse || die "cannot create fedal/wheelhouse on the boot partition"
  for name in "$WH_MANIFEST" "${WH_FILES[@]}"; do
    put "$WHEELHOUSE/$name" "::/fedal.new/wheelhouse/$name"
  done
fi
# the swap: the old payload aside, the new one in its place, the old one gone, the marker last
if fat_has fedal; then
  unhook
  mmove -i "$FAT" ::/fedal ::/fedal.old || die "cannot move the old fedal/ aside on the boot partition"
fi
mmove -i "$FAT" ::/fedal.new ::/fedal || die "cannot rename fedal.new/ to fedal/ on the boot partition"
if fat_has fedal.old; then remove_staged fedal.old firstboot.sh; fi
mdel -i "$FAT" ::/fedal/flash-staging.txt || die "cannot remove fedal/flash-staging.txt from the boot partition"
if [ "$WH_WHERE" = boot ]; then
  if [ -z "$ROOT_FS" ]; then ROOT_FS="$(root_fs)"; fi
  if [ -n "$ROOT_FS" ] && command -v debugfs >/dev/null 2>&1 && grep -q '^Block size:' <<<"$(dbg -R stats "$ROOT_FS")"; then
    root_wh_remove  # one from an earlier flash would never be used
  fi
elif [ "$WH_WHERE" = root ]; then
  root_wh_remove
  {
    root_has /opt || echo "mkdir /opt"
    echo "mkdir $WH_ROOT_DIR"
    echo "sif $WH_ROOT_DIR mode 040755"
    echo "sif $WH_ROOT_DIR uid 0"
    echo "sif $WH_ROOT_DIR gid 0"
    for name in "$WH_MANIFEST" "${WH_FILES[@]}"; do
      printf 'write "%s" "%s/%s"\n' "$WHEELHOUSE/$name" "$WH_ROOT_DIR" "$name"
      printf 'sif "%s/%s" mode 0100644\nsif "%s/%s" uid 0\nsif "%s/%s" gid 0\n' \
        "$WH_ROOT_DIR" "$name" "$WH_ROOT_DIR" "$name" "$WH_ROOT_DIR" "$name"
    done
  } >"$TMP/debugfs-write"
  dbg -w -f "$TMP/debugfs-write" "$ROOT_FS" >"$TMP/debugfs-write.log"
  # debugfs exits 0 whatever its commands did: read the sizes back
  wh_listing="$(dbg -R "ls -p $WH_ROOT_DIR" "$ROOT_FS")"
  for name in "$WH_MANIFEST" "${WH_FILES[@]}"; do
    size="$(printf '%s\n' "$wh_listing" | awk -F/ -v n="$name" '$6 == n { print $7 }')"
    [ "$size" = "$(stat -c %s "$WHEELHOUSE/$name")" ] \
      || die "writing $name to $WH_ROOT_DIR on the root partition failed: $(grep -v '^debugfs' "$TMP/debugfs-write.log" | tail -3)"
  done
fi

# -- the hook: written last, so a failure above leaves the image booting as before ---------------
mcopy -n -i "$FAT" ::/cmdline.txt "$TMP/cmdline.orig" || die "cannot read cmdline.txt"
cmdline="$(head -n 1 "$TMP/cmdline.orig" | tr -d '\r' | sed -e 's/ systemd\.run[^ ]*//g' \
  -e 's/ systemd\.unit=kernel-command-line\.target//g' -e 's/ cfg80211\.ieee80211_regdom=[^ ]*//g' -e 's/ *$//')"
if [ -n "$COUNTRY" ]; then cmdline="$cmdline cfg80211.ieee80211_regdom=$COUNTRY"; fi

if [ "$MODE" = firstrun ]; then
  if has firstrun.sh; then
    mcopy -n -i "$FAT" ::/firstrun.sh "$TMP/firstrun.prev" || die "cannot read firstrun.sh from the boot partition"
    if ! grep -q "flash.sh" "$TMP/firstrun.prev"; then
      put "$TMP/firstrun.prev" ::/fedal/firstrun-previous.sh
      say "kept the card's previous firstrun.sh: it runs first (fedal/firstrun-previous.sh)"
    fi
  fi
  put "$SCRIPT_DIR/boot/firstrun.sh" ::/firstrun.sh
  cmdline="$cmdline systemd.run=$BOOT_MOUNT/firstrun.sh systemd.run_success_action=reboot systemd.unit=kernel-command-line.target"
else
  # the value on standard input, not in argv (a process's arguments are readable by every user)
  json() { printf '%s' "$1" | "$PY" -c 'import json, sys; print(json.dumps(sys.stdin.read()))'; }
  if has user-data; then
    mcopy -n -i "$FAT" ::/user-data "$TMP/user-data.orig" || die "cannot read user-data from the boot partition"
    if ! grep -q "flash.sh" "$TMP/user-data.orig"; then put "$TMP/user-data.orig" ::/fedal/user-data.orig; fi
  fi
  {
    echo "#cloud-config"
    echo "# Written by FedAL Edge firmware_scripts/flash.sh: installs the agent on first boot."
    echo "# The image's previous user-data is kept in fedal/user-data.orig."
    if [ -n "$HOST" ]; then printf 'hostname: %s\nmanage_etc_hosts: true\n' "$(json "$HOST")"; fi
    if [ -n "$SSH_KEY" ]; then
      echo "enable_ssh: true"
      echo "ssh_pwauth: false"
      echo "users:"
      printf -- '- name: %s\n' "$(json "$LOGIN")"
      echo "  groups: users,adm,dialout,audio,netdev,video,plugdev,cdrom,games,input,gpio,spi,i2c,render,sudo"
      echo "  shell: /bin/bash"
      echo "  lock_passwd: true"
      echo "  sudo: ALL=(ALL) NOPASSWD:ALL"
      echo "  ssh_authorized_keys:"
      grep -E '^(ssh-|ecdsa-|sk-)' "$SSH_KEY" | while IFS= read -r key; do printf '    - %s\n' "$(json "$key")"; done
    fi
    echo "runcmd:"
    printf -- '- [bash, %s, --start]\n' "$(json "$BOOT_MOUNT/fedal/stage.sh")"
  } >"$TMP/user-data"
  put "$TMP/user-data" ::/user-data
  # a new instance-id at every flash: cloud-init runs runcmd once per instance, so a card booted
  # before (flashed again for a new config, or an image's card used before this first flash) would
  # never stage its payload. The image's own meta-data is kept in fedal/meta-data.orig, its other
  # keys carried over where its shape allows (firmware_scripts/cloud-init-meta.py).
  iid="fedal-$CLIENT-$(date +%s%N)"
  if has meta-data; then
    mcopy -n -i "$FAT" ::/meta-data "$TMP/meta-data.orig" || die "cannot read meta-data from the boot partition"
    if ! grep -Eq '^[[:space:]]*"?instance-id"?[[:space:]]*:[[:space:]]*"?fedal-' "$TMP/meta-data.orig"; then
      put "$TMP/meta-data.orig" ::/fedal/meta-data.orig
    fi
    why="$("$PY" "$SCRIPT_DIR/cloud-init-meta.py" "$TMP/meta-data.orig" "$iid" "$TMP/meta-data")" \
      || die "cannot write the card's meta-data (firmware_scripts/cloud-init-meta.py failed)"
    if [ -n "$why" ]; then say "$why"; fi
  else
    printf 'instance-id: %s\n' "$iid" >"$TMP/meta-data"
  fi
  put "$TMP/meta-data" ::/meta-data
  if [ -n "$SSID" ]; then
    if has network-config; then  # the image's own network settings are kept, as its user-data is
      mcopy -n -i "$FAT" ::/network-config "$TMP/network-config.orig" || die "cannot read network-config from the boot partition"
      if ! grep -q "flash.sh" "$TMP/network-config.orig"; then put "$TMP/network-config.orig" ::/fedal/network-config.orig; fi
    fi
    {
      echo "# Written by FedAL Edge firmware_scripts/flash.sh (the image's previous one: fedal/network-config.orig)."
      echo "network:"
      echo "  version: 2"
      echo "  ethernets:"
      echo "    eth0:"
      echo "      dhcp4: true"
      echo "      optional: true"
      echo "  wifis:"
      echo "    wlan0:"
      echo "      dhcp4: true"
      echo "      optional: true"
      printf '      regulatory-domain: %s\n' "$(json "$COUNTRY")"
      echo "      access-points:"
      printf '        %s:\n' "$(json "$SSID")"
      if [ -n "$PSK" ]; then printf '          password: %s\n' "$(json "$PSK")"; fi
    } >"$TMP/network-config"
    put "$TMP/network-config" ::/network-config
  fi
fi
printf '%s\n' "$cmdline" >"$TMP/cmdline.txt"
put "$TMP/cmdline.txt" ::/cmdline.txt
sync

say "prepared $IMAGE for device $CLIENT ($MODE; boot partition at byte $OFFSET)"
say "  agent config, $([ -n "$CA" ] && echo 'CA, ')$(basename "$WHEEL")$([ "${#DATA[@]}" -gt 0 ] && echo ", ${#DATA[@]} data file(s)") in fedal/"
case "$WH_WHERE" in
  boot) say "  wheelhouse ($WH_ARCH, ${#WH_FILES[@]} wheels, $((WH_BYTES / 1048576)) MiB) in fedal/wheelhouse on the boot partition: the install needs no package index" ;;
  root) say "  wheelhouse ($WH_ARCH, ${#WH_FILES[@]} wheels, $((WH_BYTES / 1048576)) MiB) in $WH_ROOT_DIR on the root partition (too big for the boot partition): the install needs no package index" ;;
esac
if [ -n "$HOST" ]; then say "  hostname $HOST"; fi
if [ -n "$SSID" ]; then say "  wi-fi $SSID ($COUNTRY)"; fi
if [ -n "$SSH_KEY" ]; then say "  ssh: key login for $LOGIN"; fi
say "on first boot the device installs the agent ($BOOT_MOUNT/fedal is wiped afterwards); see docs/deploy-raspberry-pi.md"
