#!/usr/bin/env bash
# Set up (scripts/setup.sh), then train every shipped example on this machine's best device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${GPUFORGE_VENV:-.venv}/bin/activate"
gpuforge hw
gpuforge demo "$@"
