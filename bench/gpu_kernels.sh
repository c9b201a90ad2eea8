#!/usr/bin/env bash
# Kernels (one GPU): the kernel tests compiled on CUDA, then `python -m tide_triton.bench`
# (placement / accumulation / host-overhead tables against FSDP2's copies, with the device-copy
# ceiling of the same run), then the vector width of the compiled loads and stores.
#   bash bench/gpu_kernels.sh          (time limits 300 + 400 s); SKIP_TESTS=1 skips the tests,
#   SWEEP=1 adds bench/sweep_launch.py (launch configs), STRIDED=1 bench/strided_copy.py (a MoE
#   layer's expert rows copied each way, against a contiguous copy; STRIDED_ARGS=... adds
#   --tune / --only), PYBENCH=1 the pytest-benchmark run.
# Tables: docs/benchmarks.md "Kernels against the copy ceiling", "Strided expert rows".
# Rows: $OUT/kernels.jsonl.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log_env
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  run kernel_tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_validation.py
fi
timeout 400 python3 -m tide_triton.bench --json "$OUT/kernels.jsonl" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
# Vector width of the compiled kernels' global loads and stores (16 B = .v4 of b32).
for f in $(find ~/.triton/cache -name 'segmented_reduce_kernel*.ptx' 2>/dev/null | head -20); do
  echo "$(basename "$(dirname "$f")"): ld.v4=$(grep -c 'ld.global.*v4' "$f") ld.v2=$(grep -c 'ld.global.*v2' "$f")" \
       "ld=$(grep -c 'ld.global' "$f") st.v4=$(grep -c 'st.global.*v4' "$f") st=$(grep -c 'st.global' "$f") fma=$(grep -c 'fma.rn.f32' "$f")"
done | tee "$OUT/ptx.txt"
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 300 python3 bench/sweep_launch.py 2>&1 | tee "$OUT/sweep.log"
fi
if [ "${STRIDED:-0}" = 1 ]; then
  timeout 400 python3 bench/strided_copy.py --iters 10 --back-to-back 4 ${STRIDED_ARGS:-} 2>&1 | tee "$OUT/strided_copy.log"
fi
if [ "${PYBENCH:-0}" = 1 ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider bench/test_bench_kernels.py --benchmark-only \
    --benchmark-json="$OUT/pytest_benchmark.json" --benchmark-columns=median,iqr,rounds 2>&1 | tail -40 | tee "$OUT/pytest_benchmark.log"
fi
