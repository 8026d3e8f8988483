#!/usr/bin/env bash
# The main job: a federated FedAL run across processes on this machine -- an embedded MQTT
# broker, the coordinator (REST API) and 10 edge agents with heterogeneous private models on
# the embedded MNIST-1D default. Results in runs/demo/. Installs into the project's virtualenv
# .venv (created once) or the active one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh all
# shellcheck source=scripts/python-env.sh
source scripts/python-env.sh
# exec: a signal to this script (its PID) reaches the demo, which stops its coordinator and agents
# (the demo's defaults: --workdir runs/demo, results.json and accuracy.png in the workdir)
exec "$PYTHON" -m fedal_cli.main demo --config examples/demo.toml "$@"
