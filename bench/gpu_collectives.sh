#!/usr/bin/env bash
# Collectives vs NCCL on FSDP2's path (one GPU, W ranks sharing it): tide_triton's
# reduce_scatter / all_gather in the single-process mode (bench/collectives_gpu.py, with the
# device-copy ceiling of the same run), then NCCL doing what FSDP2 does, W processes on the
# GPU (bench/nccl_baseline.py: chunk_cat + fp32 RS, RS alone, copy-in + AG + copy-out), then
# the memory around one reduce-scatter (bench/memory.py).  NCCL >= 2.30 is needed for several
# ranks on one GPU: give it as NCCL_LIBRARY (see bench/gpu_env.sh).
#   bash bench/gpu_collectives.sh      (time limits 200 + 300 + 100 s); WORLD_SIZES="2 4 8", MODELS=..., RING=bytes,
#   RING_SWEEP="67108864 268435456" adds the ring-size rows, SKIP_NCCL=1, SKIP_MEMORY=1.
# Tables: docs/benchmarks.md "Reduce-scatter and all-gather against NCCL on FSDP2's path", "Ring
# size", "Memory around one reduce-scatter".
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log_env
WS=${WORLD_SIZES:-2 4 8}
MODELS=${MODELS:-llama-3.1-70b qwen3-30b-a3b}
RING=${RING:-268435456}
run collectives 200 python3 bench/collectives_gpu.py --world-sizes $WS --models $MODELS \
  --ring-bytes ${RING_SWEEP:-$RING} --iters 5 --json "$OUT/collectives.jsonl"
if [ "${SKIP_NCCL:-0}" != 1 ]; then
  run nccl 300 with_nccl python3 bench/nccl_baseline.py --world-sizes $WS --models $MODELS --iters 5 \
    --json "$OUT/nccl.jsonl"
fi
if [ "${SKIP_MEMORY:-0}" != 1 ]; then
  run memory 100 python3 bench/memory.py --models $MODELS --world-sizes $WS --ring-bytes $RING \
    --json "$OUT/memory.jsonl"
fi
