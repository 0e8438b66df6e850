#!/usr/bin/env bash
# Set up gpuforge in ./.venv (idempotent): torch first, so that the range in pyproject.toml is already
# satisfied and pip does not pull a multi-GB CUDA build on a CPU machine; then gpuforge, its tools and the
# benchmarks' peers, at the versions in the lock for this Python and platform (locks/, written by
# scripts/lock.sh from a venv the whole suite passed in): every fresh install is the combination the tests
# passed with, not whatever was newest that day.
# GPUFORGE_UNLOCKED=1 installs the newest versions the ranges admit instead (scripts/lock.sh, .ci/run
# --latest); GPUFORGE_VENV names another venv folder.
set -euo pipefail  # pipefail: a failing pip fails the set-up, even through the filter below
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${GPUFORGE_TORCH:-torch==2.13.0}   # the CPU build on this machine's disk; set to taste elsewhere
VENV=${GPUFORGE_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
. "$VENV/bin/activate"
lock=locks/$(python scripts/lock.py name)
constraints=()
if [ "${GPUFORGE_UNLOCKED:-}" = 1 ]; then
  echo "setup: GPUFORGE_UNLOCKED=1: the newest versions pyproject.toml admits, not $lock" >&2
elif [ -f "$lock" ]; then
  constraints=(-c "$lock")
else
  echo "setup: no lock for this Python and platform ($lock): the newest versions are installed;" \
    "bash scripts/lock.sh writes one once the suite passes" >&2
fi
quiet() { sed '/^WARNING: Location/d'; }
python -m pip install -q --upgrade pip "${constraints[@]}" 2>&1 | quiet
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "$TORCH_SPEC" 2>&1 | quiet
fi
python -m pip install -q -e ".[dev,bench]" "${constraints[@]}" 2>&1 | quiet
python -c "import torch, gpuforge; print(f'gpuforge {gpuforge.__version__} with torch {torch.__version__}')"
