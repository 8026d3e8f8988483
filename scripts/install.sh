#!/usr/bin/env bash
# Installs the toolkit and what it needs into the current Python environment.
# Usage: scripts/install.sh [EXTRAS]   (default extras: all; the test command uses dev)
# torch is pinned here: an unpinned torch may pull a multi-GB CUDA build on x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-all}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[${extras}]"
