#!/usr/bin/env bash
# The whole test suite, after installing what it needs (pip packages and Debian's mosquitto).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-mosquitto.sh
bash scripts/install.sh dev
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pytest -q "$@"
