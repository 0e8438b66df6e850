#!/usr/bin/env bash
# Set up (scripts/setup.sh, and Chromium for the browser tests: scripts/browser.sh), lint, then run the test
# suite. Extra arguments go to pytest.
#   bash scripts/test.sh           every test (what CI runs)
#   bash scripts/test.sh --fast    the fast tier alone: the tests not marked slow (docs/testing.md), minutes
# The store's tests run on SQLite and on the PostgreSQL server GPUFORGE_TEST_POSTGRES_URL names. When it is
# unset and PostgreSQL's server binaries are installed, a throwaway server is started (scripts/postgres.sh;
# it installs nothing from here); without one those cases are skipped. GPUFORGE_TEST_POSTGRES_URL= (set,
# empty) skips them on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--fast" ]; then
  shift
  tier=(-m "not slow")
fi
bash scripts/setup.sh
. "${GPUFORGE_VENV:-.venv}/bin/activate"
if ! bash scripts/browser.sh; then  # Chromium for tests/dashboard/ (as root, with apt-get)
  echo "test.sh: no Chromium; the dashboard's browser tests will be skipped" >&2
fi
if [ -z "${GPUFORGE_TEST_POSTGRES_URL+set}" ] \
  && { compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || [ -n "${PG_BIN:-}" ] || command -v initdb >/dev/null; }; then
  if url=$(bash scripts/postgres.sh); then
    export GPUFORGE_TEST_POSTGRES_URL=$url
  else
    echo "test.sh: PostgreSQL did not start; its test cases will be skipped" >&2
  fi
fi
ruff check src tests benchmarks scripts
lint-imports  # the layer contracts in pyproject.toml
# two workers: most tests wait on subprocesses, servers and sleeps rather than on the CPU (24 min in one,
# 16 in two, on this 2-core machine). --dist worksteal: each worker takes one half of the run in order (a
# module's tests together, so the server or trained run they share is made once; tests/conftest.py puts the
# heaviest modules first) and takes from the other's end when it runs out. Not loadscope: it hands out work
# by node id, and schemathesis gives all 47 cases of tests/server/test_fuzz.py one id (it ran one).
# The slowest 20 printed, and every test's time kept in test-durations.xml (JUnit XML: `python
# scripts/durations.py` sums it per file), to make the run cheaper
python -m pytest -n 2 --dist worksteal --durations=20 --junitxml=test-durations.xml "${tier[@]}" "$@"
