#!/usr/bin/env bash
# Installs the toolkit and what it needs into the project's virtualenv (.venv, created once), or
# into the virtualenv that is active, never into a system Python (see scripts/python-env.sh).
# Usage: scripts/install.sh [EXTRAS]   (default extras: all; the test command uses dev;
#        "none" installs the core only)
# torch is pinned here: an unpinned torch may pull a multi-GB CUDA build on x86-64. On 64-bit ARM
# (a Raspberry Pi, an arm64 server) PyPI's torch depends on the CUDA 13 toolkit from 2.11 on (a
# 4.7 GB virtualenv): there torch comes from PyTorch's CPU wheel index (FEDAL_TORCH_INDEX).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-all}"
# shellcheck source=scripts/python-env.sh
source scripts/python-env.sh
target="."
[ "$extras" = "none" ] || target=".[${extras}]"
torch_pin="torch==2.13.0"
case "$(uname -m)" in
  aarch64|arm64)
    "$PYTHON" -m pip install --quiet --disable-pip-version-check \
      --index-url "${FEDAL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "$torch_pin" ;;
esac
"$PYTHON" -m pip install --quiet --disable-pip-version-check "$torch_pin" -e "$target"
venv_dir=$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')
if [ -n "$venv_dir" ] && [ "${VIRTUAL_ENV:-}" != "$venv_dir" ]; then
  echo "installed into $venv_dir; to use the fedal command: source $venv_dir/bin/activate" >&2
fi
