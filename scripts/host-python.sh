#!/usr/bin/env bash
# Sourced by firmware_scripts/arm64-smoke.sh and boot-test.sh: the host Python that runs their
# drivers (bench/arm64_smoke.py, bench/boot_test.py), which import the toolkit and torch. Order:
# $FEDAL_PYTHON; the active virtualenv; this checkout's .venv; python3. An inherited $PYTHON is
# not taken (other toolchains set it), and under sudo, which drops VIRTUAL_ENV, the checkout's
# .venv is still found. Checked before any long work: the drivers run after the image build.

fedal_host_python() {
  # $1: the checkout. Prints the interpreter, or says what to do and returns 1.
  local repo="$1" candidate=""
  if [ -n "${FEDAL_PYTHON:-}" ]; then
    candidate="$FEDAL_PYTHON"
  elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    candidate="$VIRTUAL_ENV/bin/python"
  elif [ -x "$repo/.venv/bin/python" ]; then
    candidate="$repo/.venv/bin/python"
  else
    candidate=python3
  fi
  if ! PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$candidate" -c 'import torch, tomli_w, fedal, edge_agent' >/dev/null 2>&1; then
    echo "the host side runs with $candidate, which cannot import the toolkit (torch, tomli_w, fedal, edge_agent):" \
      "run 'bash scripts/install.sh dev' in $repo, or set FEDAL_PYTHON to a Python that has it" >&2
    return 1
  fi
  echo "$candidate"
}
