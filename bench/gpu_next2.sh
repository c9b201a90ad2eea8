#!/usr/bin/env bash
# Second device call of a session: the collectives table at the library's 256 MiB ring, GEMM
# interference (warm, ungated cuBLAS first), the FSDP2 GPU test with its error text, and
# >= 100 create/run/close cycles (fds, mappings, device memory).  ~6 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 bench/collectives_gpu.py --world-sizes 2 4 8 --models llama-3.1-70b qwen3-30b-a3b --iters 5 \
  --json "$OUT/collectives.jsonl" > "$OUT/collectives.log" 2>&1; grep "^|" "$OUT/collectives.log"
timeout 150 python3 -X faulthandler bench/interference.py --gemm-iters 100 --json "$OUT/interference.jsonl" \
  > "$OUT/interference.log" 2>&1; echo "interference rc=$?"; grep "^|\|SM time\|ERROR\|WARN" "$OUT/interference.log"
timeout 60 python3 -X faulthandler bench/diag_teardown.py --cycles 100 --no-saveall --world-size 2 --ops both \
  > "$OUT/cycles.log" 2>&1; echo "cycles rc=$?"; tail -3 "$OUT/cycles.log"
timeout 120 python3 -m pytest -x -q -p no:cacheprovider tests/test_fsdp.py -k "gpu and 2" > "$OUT/fsdp.log" 2>&1
echo "fsdp rc=$?"; grep -E "Error|error|passed|failed|Fatal|Segmentation" "$OUT/fsdp.log" | head -30
