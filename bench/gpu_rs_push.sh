#!/usr/bin/env bash
# Kernel pushes against copy descriptors for the reduce-scatter of MoE layers (GroupOptions.rs_push),
# one GPU, three views of the same question in one device call:
#   1. the collective: W=2 processes sharing the GPU, prepared runs on new gradient addresses kept
#      apart (FSDP2's steady state on MoE layers), synthetic-moe-256e and qwen3-30b-a3b;
#   2. the GEMM beside it (bench/interference.py, one process): the kernel pushes spend SMs, the
#      copy descriptors do not; swept over the grid bound MAX_CTAS (0: uncapped);
#   3. the user's number: bench/fsdp_step.py, Qwen3-style MoE blocks, stock FSDP2 (torch's NCCL
#      backend when a newer NCCL is given, see gpu_env.sh) and the prepared drop-in with
#      rs_push copy_engine / auto.
# On two GPUs or more each rank takes its own (SHARE_GPU=1: all on GPU 0), and the GEMM part
# runs one process per rank with NCCL's reduce-scatter on FSDP2's path beside.
#   bash bench/gpu_rs_push.sh        (~500 s); PARTS="collective interference fsdp", ITERS=10,
#   MAX_CTAS="0 32", STEPS=12, PAIRS=3 (alternating copy_engine / auto runs of the step;
#   FSDP_AB=stock: alternating stock FSDP2 / the drop-in with auto instead; FSDP_MODEL=wan2.2-14b
#   or llama-3.1-70b: another model's blocks, default qwen3-30b-a3b).
#   Rows: $OUT/rs_push.jsonl, $OUT/interference.jsonl, $OUT/fsdp_step.jsonl.
# Tables: docs/benchmarks.md "Gradients at new addresses every step (MoE)", "Interference with a
# GEMM" (kernel pushes), "Qwen3-style MoE blocks", "Wan2.2-14B DiT blocks".
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log_env
parts=${PARTS:-collective interference fsdp}
# Two GPUs or more (issue 13's case): one GPU per rank -- pushes cross NVLink, copy descriptors
# on the copy engines against the kernel's stores from SMs -- unless SHARE_GPU=1.
share=--share-gpu
[ "${SHARE_GPU:-auto}" = auto ] && [ "${NGPU:-0}" -ge 2 ] && share=
if [ -n "$share" ]; then echo "GPUs: $NGPU; every rank on GPU 0"; else echo "GPUs: $NGPU; one GPU per rank"; fi
if [[ " $parts " == *" collective "* ]]; then
  for push in copy_engine kernel; do
    echo "=== collective rs_push=$push"
    with_nccl timeout -k 15 150 torchrun --standalone --nproc-per-node 2 bench/collectives_gpu.py $share \
      --models synthetic-moe-256e qwen3-30b-a3b --world-sizes 2 --iters "${ITERS:-10}" --prepared --new-grads \
      --apart --rs-push "$push" --json "$OUT/rs_push.jsonl" > "$OUT/collective.$push.log" 2>&1
    echo "rc=$?"; grep -E "^\||Error" "$OUT/collective.$push.log" | head -20
  done
fi
if [[ " $parts " == *" interference "* ]]; then
  if [ -n "$share" ]; then  # one process, W=2 rank threads on this GPU
    run interference 200 python3 bench/interference.py --model synthetic-moe-256e --backgrounds tide \
      --tide-rs-push copy_engine kernel --tide-max-ctas ${MAX_CTAS:-0 32} --gemm-priority default \
      --gemm-iters ${GEMM_ITERS:-100} --json "$OUT/interference.jsonl"
    grep "SM time" "$OUT/interference.log"
  else  # one process per GPU, NCCL on FSDP2's path beside (bench/interference_ranks.py)
    echo "=== interference_ranks"
    with_nccl timeout -k 15 300 torchrun --standalone --nproc-per-node 2 bench/interference.py \
      --model synthetic-moe-256e --backgrounds tide nccl --tide-rs-push copy_engine kernel \
      --gemm-priority default --gemm-iters ${GEMM_ITERS:-100} --json "$OUT/interference.jsonl" \
      > "$OUT/interference_ranks.log" 2>&1
    echo "rc=$?"; grep -E "^\||Error" "$OUT/interference_ranks.log" | head -20
  fi
fi
if [[ " $parts " == *" fsdp "* ]]; then
  # Stock FSDP2 once, then PAIRS alternating pairs of the prepared drop-in (copy_engine, auto):
  # the step spreads by ~60 ms on two processes time-slicing one GPU, so one run each decides
  # nothing; the summary pools every step of each setting (mean, median, standard deviation).
  stock_backend=gloo; [ -n "$NCCL_LIB" ] && stock_backend=nccl
  python3 bench/fsdp_step.py --header
  if [ "${FSDP_AB:-rs_push}" = stock ]; then  # the user's question: stock FSDP2 or the drop-in
    specs=()
    for i in $(seq "${PAIRS:-3}"); do specs+=("stock auto $stock_backend" "prepared auto gloo"); done
  else
    specs=("stock auto $stock_backend")
    for i in $(seq "${PAIRS:-3}"); do specs+=("prepared copy_engine gloo" "prepared auto gloo"); done
  fi
  n=0
  for spec in "${specs[@]}"; do
    set -- $spec
    n=$((n + 1)); log="$OUT/fsdp_step.$n.$1.$2.log"
    (cd bench && with_nccl timeout -k 15 150 torchrun --standalone --nproc-per-node 2 fsdp_step.py --mode "$1" \
      --rs-push "$2" --backend "$3" --model "${FSDP_MODEL:-qwen3-30b-a3b}" --layers 2 --seq 1024 $share \
      --steps "${STEPS:-12}" --json "$OUT/fsdp_step.jsonl") > "$log" 2>&1 \
      || { echo "| $1 | $2 | failed rc=$? |"; tail -5 "$log"; }
    grep "^|" "$log" | tail -1 | sed "s/^| $1 /| $1 (rs_push $2) /"
  done
  python3 - "$OUT/fsdp_step.jsonl" <<'PY'
import json, statistics as st, sys
steps = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    per_rank = [x["step_ms_all"] for x in r["ranks"]]
    steps.setdefault((r["mode"], r["rs_push"]), []).extend(map(max, zip(*per_rank)))  # the slower rank
print("| mode | rs_push | steps | mean (ms) | median (ms) | standard deviation (ms) |")
print("|---|---|---|---|---|---|")
for (mode, push), xs in steps.items():
    sd = st.stdev(xs) if len(xs) > 1 else float("nan")
    print(f"| {mode} | {push} | {len(xs)} | {st.mean(xs):.1f} | {st.median(xs):.1f} | {sd:.1f} |")
PY
fi
exit 0
