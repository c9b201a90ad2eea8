#!/usr/bin/env bash
# One device call for the collectives: GPU transport tests, collective tests, timings.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
timeout -s INT -k 15 240 python3 -X faulthandler -m pytest -v -p no:cacheprovider -p no:hypothesispytest -o faulthandler_timeout=120 \
  tests/test_transport_cuda.py tests/test_collectives_cuda.py 2>&1 | tee "$OUT/pytest_collectives_gpu.log" | grep -E "PASS|FAIL|ERROR|passed|failed|Fatal|^  File \"/work" | tail -40
fi
TIDE_HANG_DUMP_S=${HANG_S:-100} timeout 200 python3 bench/collectives_gpu.py ${COLL_ARGS:-} --json "$OUT/collectives.jsonl" 2>&1 | tee "$OUT/collectives.log" | grep -vE "^  File \"/(opt|usr)" | tail -60
