#!/usr/bin/env bash
# The whole test suite, after installing what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pytest -q "$@"
