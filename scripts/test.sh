#!/usr/bin/env bash
# The whole test suite, after installing what it needs (pip packages into the project's
# virtualenv .venv; Debian packages: mosquitto, chromium + chromium-driver, fdisk, dosfstools,
# mtools, shellcheck, postgresql -- see install-test-tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-tools.sh
bash scripts/install.sh dev
# shellcheck source=scripts/python-env.sh
source scripts/python-env.sh
# the venv's console scripts (fedal, ...) for tests that start them by name
PATH="$(dirname "$PYTHON"):$PATH"
export PATH
# the layering (import-linter), style (ruff) and types of the core (mypy), as pyproject.toml configures them
lint-imports --no-cache
"$PYTHON" -m ruff check --quiet .
"$PYTHON" -m mypy
# three workers (pytest-xdist) on CI's two cores: many tests wait on brokers, processes and
# links for part of their time, and a third worker fills the cores meanwhile (13:05 against 14:50
# with two, measured one after the other on two cores); a test file's tests stay on one worker,
# the files taken in the order tests/conftest.py gives them (the longest first: the workers
# finish together)
exec "$PYTHON" -m pytest -q -n "${FEDAL_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@"
