#!/usr/bin/env bash
# Sourced by the set-up scripts: chooses the Python the toolkit is installed into and run with,
# and exports it as PYTHON. Order: $FEDAL_PYTHON if the caller set it; the virtualenv that is
# active ($VIRTUAL_ENV); else the project's own virtualenv .venv (or $FEDAL_VENV), created once.
# An inherited $PYTHON is not taken: other toolchains set it (to a system Python, say).
# A system Python is never installed into: on Debian 12, Ubuntu 23.04+ and Raspberry Pi OS it
# is externally managed (PEP 668) and pip refuses it.

fedal_base_python() {
  # The interpreter a new virtualenv is made from: the first python3.11+ on PATH.
  local candidate
  for candidate in "${FEDAL_BASE_PYTHON:-}" python3 python3.13 python3.12 python3.11; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  echo "error: FedAL Edge needs Python 3.11 or newer; none found on PATH" >&2
  return 1
}

fedal_make_venv() {
  # Creates the project virtualenv with the given base Python. Debian-family systems ship venv's
  # pip bootstrap (ensurepip) as a separate package: installed with apt-get when it is missing.
  local base="$1" dir="$2"
  if ! "$base" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
      local version sudo=""
      version=$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
      [ "$(id -u)" -eq 0 ] || sudo="sudo"
      echo "installing python${version}-venv (the system Python has no venv/ensurepip)" >&2
      $sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "python${version}-venv" >/dev/null
    else
      echo "error: $base cannot create a virtualenv (no ensurepip); install your system's python3-venv package" >&2
      return 1
    fi
  fi
  echo "creating the project virtualenv $dir (from $base)" >&2
  "$base" -m venv "$dir"
}

PYTHON="${FEDAL_PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "${VIRTUAL_ENV}/bin/python" ]; then
    PYTHON="${VIRTUAL_ENV}/bin/python"
  else
    FEDAL_VENV="${FEDAL_VENV:-$(pwd)/.venv}"
    if [ ! -x "${FEDAL_VENV}/bin/python" ]; then
      # two steps: a failure inside "$(...)" would not stop the line that uses it
      fedal_base="$(fedal_base_python)" || exit 1
      fedal_make_venv "$fedal_base" "$FEDAL_VENV" || exit 1
    fi
    PYTHON="${FEDAL_VENV}/bin/python"
  fi
fi
export PYTHON
