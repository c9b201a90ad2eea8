#!/usr/bin/env bash
# FSDP2 step time and peak memory (one GPU, W processes sharing it): bench/fsdp_step.py, 4
# Llama-3.1-70B decoder layers, stock FSDP2 vs tide_triton vs tide_triton + Slot-Reuse, W = 2, 4;
# then the drop-in's GPU test.  Stock runs on torch's NCCL backend when a newer NCCL is given
# (NCCL_LIBRARY, see bench/gpu_env.sh: several ranks on one GPU need >= 2.30), else on gloo;
# tide_triton runs on a gloo process group (its data path does not use it).
#   bash bench/gpu_fsdp.sh             (time limits 6 x 150 + 200 s); WORLD_SIZES="2 4",
#   MODES="stock tide slot", MODELS="llama-3.1-70b qwen3-30b-a3b" (default: the Llama layers only;
#   qwen3-30b-a3b: Qwen3-style MoE blocks, 397 parameters each), SKIP_TEST=1 skips the test.
# Table: docs/benchmarks.md "FSDP2 step time and peak memory".  Rows: $OUT/fsdp_step.jsonl.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log_env
stock_backend=gloo; [ -n "$NCCL_LIB" ] && stock_backend=nccl
python3 bench/fsdp_step.py --header
for model in ${MODELS:-llama-3.1-70b}; do
  echo "model: $model"
  for W in ${WORLD_SIZES:-2 4}; do
    for mode in ${MODES:-stock tide slot}; do
      b=gloo; [ "$mode" = stock ] && b=$stock_backend
      log="$OUT/fsdp_step.$model.$mode.$W.log"
      with_nccl timeout -k 15 150 torchrun --standalone --nproc-per-node "$W" bench/fsdp_step.py --mode "$mode" \
        --model "$model" --backend "$b" --json "$OUT/fsdp_step.jsonl" > "$log" 2>&1 \
        || { echo "| $mode | $b | $W | failed rc=$? |"; tail -5 "$log"; }
      grep "^|" "$log"
    done
  done
done
if [ -z "${SKIP_TEST:-}" ]; then
  run fsdp_test 200 python3 -m pytest -x -q -p no:cacheprovider tests/test_fsdp.py -k gpu
fi
