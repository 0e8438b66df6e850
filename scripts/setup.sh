#!/usr/bin/env bash
# Set up gpuforge in ./.venv (idempotent): torch first, so that the range in pyproject.toml is already
# satisfied and pip does not pull a multi-GB CUDA build on a CPU machine; then gpuforge and its tools.
set -euo pipefail  # pipefail: a failing pip fails the set-up, even through the filter below
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${GPUFORGE_TORCH:-torch==2.13.0}   # the CPU build on this machine's disk; set to taste elsewhere

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | sed '/^WARNING: Location/d'
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "$TORCH_SPEC" 2>&1 | sed '/^WARNING: Location/d'
fi
python -m pip install -q -e ".[dev]" 2>&1 | sed '/^WARNING: Location/d'
python -c "import torch, gpuforge; print(f'gpuforge {gpuforge.__version__} with torch {torch.__version__}')"
