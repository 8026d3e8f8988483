#!/usr/bin/env bash
# Mosquitto from Debian, for the integration tests and the benchmarks (each starts its own
# instance on a free loopback port; the package's system service is not used).
set -euo pipefail
if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mosquitto >/dev/null
