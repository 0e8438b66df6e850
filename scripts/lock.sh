#!/usr/bin/env bash
# Refresh the lock (locks/<python>-<platform>.txt) that scripts/setup.sh, and so CI, installs from:
#   bash scripts/lock.sh             the newest versions pyproject.toml admits, in a fresh .venv-latest, the
#                                    whole CI suite run on them (.ci/run --latest), then the lock written
#                                    from that venv; a red suite writes nothing
#   bash scripts/lock.sh --no-test   the same without the suite (a lock nobody tested: say so in the commit)
# Commit the new lock with whatever the new versions needed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--no-test" ]; then
  rm -rf .venv-latest
  GPUFORGE_UNLOCKED=1 GPUFORGE_VENV=.venv-latest bash scripts/setup.sh
else
  bash .ci/run --latest
fi
.venv-latest/bin/python scripts/lock.py diff .venv-latest
.venv-latest/bin/python scripts/lock.py write .venv-latest
