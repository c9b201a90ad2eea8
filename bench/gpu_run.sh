#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks, PTX check. Usage on the GPU machine:
#   TIDE_GIT_SHA=<sha> bash bench/gpu_run.sh   (results and logs land in $OUT)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_validation.py ${PYTEST_EXTRA:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
fi
timeout 400 python3 -m tide_triton.bench --json "$OUT/kernels.jsonl" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
# Vector width of the compiled kernels' global loads and stores (16 B = .v4 of b32).
ptx=$(find ~/.triton/cache -name 'segmented_reduce_kernel*.ptx' 2>/dev/null | head -20)
for f in $ptx; do
  echo "$(basename $(dirname $f)): ld.v4=$(grep -c 'ld.global.*v4' $f) ld.v2=$(grep -c 'ld.global.*v2' $f) ld=$(grep -c 'ld.global' $f) st.v4=$(grep -c 'st.global.*v4' $f) st=$(grep -c 'st.global' $f) fma=$(grep -c 'fma.rn.f32' $f)"
done | tee "$OUT/ptx.txt"
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 300 python3 bench/sweep_launch.py 2>&1 | tee "$OUT/sweep.log"
fi
if [ "${PYBENCH:-0}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider bench/test_bench_kernels.py --benchmark-only \
    --benchmark-json="$OUT/pytest_benchmark.json" --benchmark-columns=median,iqr,rounds 2>&1 | tail -40 | tee "$OUT/pytest_benchmark.log"
fi
