#!/usr/bin/env bash
# Installs the toolkit and what it needs into the project's virtualenv (.venv, created once), or
# into the virtualenv that is active, never into a system Python (see scripts/python-env.sh).
# Usage: scripts/install.sh [EXTRAS]   (default extras: all; the test command uses dev;
#        "none" installs the core only)
# torch is pinned here, and taken CPU-only: PyPI's torch depends on the CUDA 13 toolkit from 2.11
# on (several GB). On 64-bit ARM (a Raspberry Pi, an arm64 server) it always comes from PyTorch's
# CPU wheel index; on x86-64 from there too when the configured sources would bring the CUDA
# packages with it (pip's dry run says; a local CPU wheel or one already installed is kept).
# FEDAL_TORCH_INDEX names another index.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-all}"
# shellcheck source=scripts/python-env.sh
source scripts/python-env.sh
target="."
[ "$extras" = "none" ] || target=".[${extras}]"
torch_pin="torch==2.13.0"
cpu_index="${FEDAL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
case "$(uname -m)" in
  aarch64|arm64) from_cpu_index=1 ;;
  *)
    from_cpu_index=0
    # the report is read whole first: `pip ... | grep -q` under pipefail fails when grep stops
    # reading at its match while pip still writes (SIGPIPE), which would hide exactly that match
    report="$("$PYTHON" -m pip install --quiet --disable-pip-version-check --dry-run --report - "$torch_pin" \
      2>/dev/null || true)"
    if [ -n "${FEDAL_TORCH_INDEX:-}" ] || grep -q '"name": "nvidia-' <<<"$report"; then
      from_cpu_index=1
    fi ;;
esac
if [ "$from_cpu_index" -eq 1 ]; then
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --index-url "$cpu_index" "$torch_pin"
fi
# The editable build needs setuptools; where the virtualenv already has one new enough to build it
# without the `wheel` package (installed here the first time), it is used instead of a fresh
# build environment, which pip fills from the package index: a machine with everything installed
# reinstalls offline (scripts/demo.sh runs this each time).
build_isolation=()
if "$PYTHON" -c 'import sys, setuptools; v = tuple(int(p) for p in setuptools.__version__.split(".")[:2]); sys.exit(v < (70, 1))' \
    2>/dev/null; then
  build_isolation=(--no-build-isolation)
fi
"$PYTHON" -m pip install --quiet --disable-pip-version-check ${build_isolation[@]+"${build_isolation[@]}"} "$torch_pin" \
  "setuptools>=70.1" \
  -e "$target"
venv_dir=$("$PYTHON" -c 'import sys; print(sys.prefix if sys.prefix != sys.base_prefix else "")')
if [ -n "$venv_dir" ] && [ "${VIRTUAL_ENV:-}" != "$venv_dir" ]; then
  echo "installed into $venv_dir; to use the fedal command: source $venv_dir/bin/activate" >&2
fi
