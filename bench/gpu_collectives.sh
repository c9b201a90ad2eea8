#!/usr/bin/env bash
# One device call for the collectives: GPU transport tests, collective tests, timings.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout -s INT -k 15 240 python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout=120 \
  tests/test_transport_cuda.py tests/test_collectives_cuda.py 2>&1 | tee "$OUT/pytest_collectives_gpu.log" | tail -25
timeout 200 python3 bench/collectives_gpu.py --json "$OUT/collectives.jsonl" 2>&1 | tee "$OUT/collectives.log"
