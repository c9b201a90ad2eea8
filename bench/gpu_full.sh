#!/usr/bin/env bash
# One device call for the benchmark tables: NCCL baseline (needs the NCCL >= 2.30 library in
# place, see README), tide_triton collectives, interference, memory.  Logs/rows land in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
RING=${RING:-268435456}
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -E "^\||NCCL|nccl|rror|Timeout|Fatal|slowdown|SM" | head -80; }
run collectives 150 python3 -X faulthandler bench/collectives_gpu.py --world-sizes 2 4 8 --models llama-3.1-70b qwen3-30b-a3b --ring-bytes $RING --iters 5 --json "$OUT/collectives.jsonl"
run nccl 210 python3 bench/nccl_baseline.py --world-sizes 2 4 8 --models llama-3.1-70b qwen3-30b-a3b --iters 5 --json "$OUT/nccl.jsonl"
run interference 90 python3 bench/interference.py --ring-bytes $RING --json "$OUT/interference.jsonl"
run memory 60 python3 bench/memory.py --models llama-3.1-70b qwen3-30b-a3b --world-sizes 2 4 8 --ring-bytes $RING --json "$OUT/memory.jsonl"
