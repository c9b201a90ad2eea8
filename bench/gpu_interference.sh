#!/usr/bin/env bash
# GEMM interference (one GPU): a 1024x16896x8192 bf16 torch.mm, 100 back-to-back behind a stream
# gate, alone and while W=2 local ranks loop the Llama-3.1-70B reduce-scatter (tide_triton at
# each accumulation grid bound, and an SM reduction as FSDP2 does it); plus the SM time of one
# tide_triton reduce-scatter (bench/interference.py).
#   bash bench/gpu_interference.sh     (time limit 300 s);
#   MAX_CTAS="0 264 132 66 33" picks the grid bounds (0: one CTA per tile), GEMM_ITERS=100.
# Then one process per rank (torchrun, RANKS=2 of them, sharing GPU 0 unless SHARE_GPU=0):
# tide_triton's reduce-scatter and NCCL's on FSDP2's path side by side (NCCL_LIBRARY, see
# gpu_env.sh: several ranks on one GPU need NCCL >= 2.30).  RANKS=0 skips it.
# Table: docs/benchmarks.md "Interference with a GEMM".  Rows: $OUT/interference.jsonl.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log_env
run interference 300 python3 bench/interference.py --gemm-iters ${GEMM_ITERS:-100} \
  --tide-max-ctas ${MAX_CTAS:-0 264 132 66 33} --json "$OUT/interference.jsonl"
grep "SM time" "$OUT/interference.log"
if [ "${RANKS:-2}" != 0 ]; then
  share=--share-gpu; [ "${SHARE_GPU:-1}" = 0 ] && share=
  echo "=== interference_ranks"
  with_nccl timeout -k 15 300 torchrun --standalone --nproc-per-node "${RANKS:-2}" bench/interference.py \
    $share --gemm-iters ${GEMM_ITERS:-100} --backgrounds tide nccl --json "$OUT/interference.jsonl" \
    > "$OUT/interference_ranks.log" 2>&1
  echo "=== interference_ranks rc=$?"
  grep -E "^\||Error" "$OUT/interference_ranks.log" | head -40
fi
