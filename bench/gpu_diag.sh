#!/usr/bin/env bash
# One device call: GPU transport + collective tests, teardown diagnostics, collective timings
# with a profile of one reduce-scatter.  Logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout -s INT -k 15 ${TEST_S:-300} python3 -X faulthandler -m pytest -q -p no:cacheprovider -p no:hypothesispytest \
    -o faulthandler_timeout=150 ${TESTS:-tests/test_transport_cuda.py tests/test_collectives_cuda.py tests/test_kernels.py tests/test_validation.py} \
    2>&1 | tee "$OUT/pytest_gpu.log" | grep -E "FAIL|ERROR|passed|failed|Fatal|^  File \"/work" | tail -30
fi
if [ "${SKIP_DIAG:-0}" != 1 ]; then
  timeout 120 python3 -X faulthandler bench/diag_teardown.py 2>&1 | tee "$OUT/diag_teardown.log" | tail -32
fi
TIDE_HANG_DUMP_S=${HANG_S:-150} timeout 300 python3 bench/collectives_gpu.py ${COLL_ARGS:-} --json "$OUT/collectives.jsonl" \
  2>&1 | tee "$OUT/collectives.log" | grep -vE "^  File \"/(opt|usr)" | tail -60
