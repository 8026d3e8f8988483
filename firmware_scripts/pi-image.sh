#!/usr/bin/env bash
# A small bootable arm64 Debian bookworm disk image with Raspberry Pi OS's layout, for booting a
# "Pi" under qemu-system-aarch64 -M virt (firmware_scripts/boot-test.sh): a DOS partition table,
# a FAT32 boot partition labelled bootfs (cmdline.txt, config.txt, the kernel and initramfs) that
# the system mounts at /boot/firmware, and an ext4 root labelled rootfs, found through
# root=PARTUUID=<disk id>-02 as on Raspberry Pi OS. The userland (debootstrap, under qemu-user) is
# built once and cached; the image is assembled from it without loop mounts (mkfs.ext4 -d,
# mkfs.vfat and mtools). The kernel and initramfs are also written next to the image (IMG.vmlinuz,
# IMG.initrd): qemu boots them directly with cmdline.txt's text, as a Pi's firmware would.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: pi-image.sh --out IMG [options]

  --out IMG            the disk image to write (refused if it exists and this script did not make it)
  --cache DIR          the arm64 userland (default ${XDG_CACHE_HOME:-~/.cache}/fedal/pi-bookworm, or
                       FEDAL_PI_ROOTFS); built on first use, reused afterwards
  --mirror URL         Debian mirror for debootstrap (default http://deb.debian.org/debian)
  --boot-mb N          size of the FAT boot partition (default 256)
  --root-mb N          size of the ext4 root partition (default 3072)
  --rebuild            delete the cached userland and build it again
  -h, --help           this text
EOF
}

die() { echo "pi-image: error: $*" >&2; exit 2; }
say() { echo "pi-image: $*" >&2; }

ROOTFS="${FEDAL_PI_ROOTFS:-${XDG_CACHE_HOME:-$HOME/.cache}/fedal/pi-bookworm}"
MIRROR="${FEDAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
OUT="" BOOT_MB=256 ROOT_MB=3072 REBUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="${2:?--out needs a path}"; shift 2 ;;
    --cache) ROOTFS="${2:?--cache needs a directory}"; shift 2 ;;
    --mirror) MIRROR="${2:?--mirror needs a URL}"; shift 2 ;;
    --boot-mb) BOOT_MB="${2:?--boot-mb needs a number}"; shift 2 ;;
    --root-mb) ROOT_MB="${2:?--root-mb needs a number}"; shift 2 ;;
    --rebuild) REBUILD=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done
[ -n "$OUT" ] || { usage >&2; die "--out is required"; }
case "$BOOT_MB" in ''|*[!0-9]*) die "--boot-mb must be a number of MiB (got $BOOT_MB)" ;; esac
case "$ROOT_MB" in ''|*[!0-9]*) die "--root-mb must be a number of MiB (got $ROOT_MB)" ;; esac
[ "$BOOT_MB" -ge 64 ] || die "--boot-mb must be at least 64 (FAT32 and the kernel)"
[ "$ROOT_MB" -ge 1024 ] || die "--root-mb must be at least 1024"
PATH="$PATH:/usr/sbin:/sbin"
[ "$(id -u)" -eq 0 ] || die "run as root: debootstrap, chroot and the root file system's owners need it"

IMG_STAMP="pi-image.sh"  # in the image's config.txt: an image this script made may be replaced
if [ -e "$OUT" ]; then
  MTOOLS_SKIP_CHECK=1 MTOOLSRC=/dev/null mtype -i "$OUT@@$((8192 * 512))" ::/config.txt 2>/dev/null | grep -q "$IMG_STAMP" \
    || die "$OUT exists and is not an image pi-image.sh made: refusing to overwrite it"
else  # the kernel and initramfs go beside the image: without it, files of those names are someone else's
  for f in "$OUT.vmlinuz" "$OUT.initrd"; do
    if [ -e "$f" ] || [ -L "$f" ]; then die "$f exists and $OUT does not: it is no file pi-image.sh made; refusing to overwrite it"; fi
  done
fi

for tool in debootstrap sfdisk mkfs.vfat mke2fs mcopy mtype chroot; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool not found (Debian: apt-get install debootstrap fdisk dosfstools e2fsprogs mtools)"
done

STAMP=.fedal-pi-rootfs PARTIAL_STAMP=.fedal-pi-partial
SUITE=bookworm
# What Raspberry Pi OS Lite has that the agent's install and service use (python3, python3-venv,
# systemd, udev, dbus), a kernel with its initramfs, DHCP through systemd-networkd.
PACKAGES=systemd,systemd-sysv,udev,dbus,kmod,iproute2,procps,python3,python3-venv,dosfstools,e2fsprogs,linux-image-arm64,initramfs-tools

if [ "$REBUILD" -eq 1 ] && [ -e "$ROOTFS" ]; then
  [ -f "$ROOTFS/$STAMP" ] || die "--rebuild: $ROOTFS is not a userland this script built (no $STAMP in it): refusing to delete it"
  say "--rebuild: removing $ROOTFS"
  rm -rf --one-file-system "$ROOTFS"
fi

enable_binfmt() {
  local entry=/proc/sys/fs/binfmt_misc/qemu-aarch64
  [ "$(uname -m)" != aarch64 ] || return 0
  if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
    mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || die "binfmt_misc is not available here"
  fi
  if [ ! -e "$entry" ]; then
    command -v update-binfmts >/dev/null 2>&1 || die "update-binfmts not found: apt-get install binfmt-support qemu-user-static"
    update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || die "update-binfmts --enable qemu-aarch64 failed"
  fi
  grep -qx enabled "$entry" || die "the qemu-aarch64 binfmt handler is not enabled"
}

build_rootfs() {
  if [ -f "$ROOTFS/$STAMP" ]; then
    say "userland: $ROOTFS (cached; $(cat "$ROOTFS/$STAMP"))"
    return 0
  fi
  [ ! -e "$ROOTFS" ] || die "$ROOTFS exists but is not a finished userland: remove it or pass --rebuild"
  local partial="$ROOTFS.partial"
  if [ -e "$partial" ]; then
    [ -f "$partial/$PARTIAL_STAMP" ] || die "$partial exists and is not an unfinished userland of this script: remove it"
    rm -rf --one-file-system "$partial"
  fi
  mkdir -p "$partial"
  echo "unfinished arm64 userland of pi-image.sh" >"$partial/$PARTIAL_STAMP"
  say "building the arm64 $SUITE userland in $ROOTFS (debootstrap under emulation: ~20-40 min, once)"
  nice -n 15 debootstrap --arch=arm64 --variant=minbase --include="$PACKAGES" "$SUITE" "$partial" "$MIRROR" \
    >"$ROOTFS.debootstrap.log" 2>&1 || die "debootstrap failed; see $ROOTFS.debootstrap.log"
  configure_rootfs "$partial"
  rm -f "$partial/$PARTIAL_STAMP"
  echo "debian $SUITE arm64, built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $MIRROR" >"$partial/$STAMP"
  mv "$partial" "$ROOTFS"
}

# Raspberry Pi OS's system settings that matter here; the rest stays Debian's.
configure_rootfs() {
  local r="$1"
  echo raspberrypi >"$r/etc/hostname"
  printf '127.0.0.1\tlocalhost\n127.0.1.1\traspberrypi\n' >"$r/etc/hosts"
  install -d "$r/boot/firmware"
  # wired DHCP (Pi OS uses NetworkManager; the agent does not care which)
  install -d "$r/etc/systemd/network"
  printf '[Match]\nName=en* eth*\n\n[Network]\nDHCP=ipv4\n' >"$r/etc/systemd/network/20-wired.network"
  chroot "$r" systemctl enable systemd-networkd.service systemd-networkd-wait-online.service >/dev/null 2>&1 \
    || die "cannot enable systemd-networkd in the userland"
  chroot "$r" systemctl mask apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer >/dev/null 2>&1 || true
  # the root account stays locked: nothing logs in; the serial console shows the boot
  rm -f "$r/etc/resolv.conf"
  : >"$r/etc/resolv.conf"
  # what debootstrap leaves that a booted system must not inherit
  rm -rf "$r/var/cache/apt/archives/"*.deb "$r/var/lib/apt/lists/"*_Packages 2>/dev/null || true
  : >"$r/etc/machine-id"
}

enable_binfmt
build_rootfs

disk_id=5f7e0b1a
vmlinuz="$(find "$ROOTFS/boot" -maxdepth 1 -name 'vmlinuz-*' | sort | tail -n 1)"
initrd="$(find "$ROOTFS/boot" -maxdepth 1 -name 'initrd.img-*' | sort | tail -n 1)"
if [ -z "$vmlinuz" ] || [ -z "$initrd" ]; then die "no kernel or initramfs in $ROOTFS/boot"; fi
fstab="PARTUUID=$disk_id-01  /boot/firmware  vfat  defaults  0  2
PARTUUID=$disk_id-02  /  ext4  defaults,noatime  0  1"
printf '%s\n' "$fstab" >"$ROOTFS/etc/fstab"

BOOT_START=8192
BOOT_SECTORS=$((BOOT_MB * 2048))
ROOT_START=$((BOOT_START + BOOT_SECTORS))
ROOT_SECTORS=$((ROOT_MB * 2048))
TOTAL=$(((ROOT_START + ROOT_SECTORS) * 512))
work="$(mktemp -d)"
tmp_img="$(mktemp "$OUT.partial.XXXXXX")"  # its own: no file of that name beside --out is replaced
trap 'rm -rf "$work"; rm -f "$tmp_img"' EXIT
truncate -s "$TOTAL" "$tmp_img"
printf 'label: dos\nlabel-id: 0x%s\nstart=%s, size=%s, type=c\nstart=%s, size=%s, type=83\n' \
  "$disk_id" "$BOOT_START" "$BOOT_SECTORS" "$ROOT_START" "$ROOT_SECTORS" | sfdisk -q "$tmp_img"
# FAT32 needs at least 65525 clusters: 2 KiB ones from 256 MiB up, 512-byte ones below
mkfs.vfat -F 32 -s "$(( BOOT_MB >= 256 ? 4 : 1 ))" -n bootfs --offset "$BOOT_START" "$tmp_img" $((BOOT_SECTORS / 2)) >/dev/null 2>&1 \
  || die "mkfs.vfat failed"
export MTOOLS_SKIP_CHECK=1 MTOOLSRC=/dev/null
FAT="$tmp_img@@$((BOOT_START * 512))"
# Raspberry Pi OS's cmdline.txt, with the serial console of qemu's virt machine
echo "console=ttyAMA0,115200 root=PARTUUID=$disk_id-02 rootfstype=ext4 fsck.repair=yes rootwait" >"$work/cmdline.txt"
printf '# Written by FedAL Edge firmware_scripts/%s (a Raspberry Pi OS layout for qemu)\narm_64bit=1\nkernel=kernel8.img\ninitramfs initramfs8 followkernel\n' \
  "$IMG_STAMP" >"$work/config.txt"
cp "$vmlinuz" "$work/kernel8.img"
cp "$initrd" "$work/initramfs8"
for f in cmdline.txt config.txt kernel8.img initramfs8; do mcopy -i "$FAT" "$work/$f" "::/$f"; done
say "writing the root file system ($(du -sm "$ROOTFS" | cut -f1) MiB of files) into a $ROOT_MB MiB ext4 partition"
nice -n 15 mke2fs -q -t ext4 -L rootfs -d "$ROOTFS" -E "offset=$((ROOT_START * 512))" "$tmp_img" "${ROOT_MB}M" \
  || die "mke2fs -d failed"
mv "$tmp_img" "$OUT"
cp "$vmlinuz" "$OUT.vmlinuz"
cp "$initrd" "$OUT.initrd"
say "image: $OUT ($((TOTAL / 1048576)) MiB, boot $BOOT_MB MiB FAT32 + root $ROOT_MB MiB ext4); kernel $OUT.vmlinuz, initramfs $OUT.initrd"
