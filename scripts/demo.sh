#!/usr/bin/env bash
# The main job: a federated FedAL run on the embedded MNIST-1D default (10 clients with
# heterogeneous private models), results in runs/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh all
PYTHON="${PYTHON:-python3}"
mkdir -p runs/demo
"$PYTHON" -m fedal.cli.main simulate --config examples/demo.toml \
  --out runs/demo/results.json --plot runs/demo/accuracy.png "$@"
