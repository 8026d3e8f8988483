#!/usr/bin/env bash
# The whole test suite, after installing what it needs (pip packages; Debian packages: mosquitto, chromium, fdisk, dosfstools, mtools, shellcheck).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-tools.sh
bash scripts/install.sh dev
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pytest -q "$@"
