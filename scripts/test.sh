#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check src tests benchmarks scripts
python -m pytest "$@"
