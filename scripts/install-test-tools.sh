#!/usr/bin/env bash
# Debian packages the test suite drives for real: Mosquitto (integration tests), Chromium and
# chromium-driver (the dashboard's browser test), fdisk/dosfstools/mtools (synthetic Raspberry
# Pi OS images for firmware_scripts/flash.sh), shellcheck (the shell scripts), postgresql (the
# run store's PostgreSQL test). Installs only what is missing.
set -euo pipefail
bash "$(dirname "$0")/install-mosquitto.sh"
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v sfdisk >/dev/null 2>&1 || [ -x /usr/sbin/sfdisk ] || [ -x /sbin/sfdisk ] || need+=(fdisk)
command -v mkfs.vfat >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.vfat ] || [ -x /sbin/mkfs.vfat ] || need+=(dosfstools)
command -v mcopy >/dev/null 2>&1 || need+=(mtools)
command -v shellcheck >/dev/null 2>&1 || need+=(shellcheck)
command -v mkfs.ext4 >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.ext4 ] || [ -x /sbin/mkfs.ext4 ] || need+=(e2fsprogs)
# PostgreSQL server binaries, for the run store's PostgreSQL test (the tests start their own server)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
