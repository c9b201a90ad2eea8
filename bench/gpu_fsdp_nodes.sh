#!/usr/bin/env bash
# FSDP2 across declared nodes on the one GPU (issue 5 + the drop-in): NCCL >= 2.30 from /tmp/nccl
# (parts carried one per call, bench/NOTES.md).  The GPU test of the drop-in across 2x2, then
# bench/fsdp_step.py at W=4: stock FSDP2 on NCCL (flat) vs tide_triton with its groups declared
# 2 nodes x 2 (put/signal rails) and + Slot-Reuse.  ~6 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONFAULTHANDLER=1 NCCL_MULTI_RANK_GPU_ENABLE=1
lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
[ -f /tmp/nccl/libnccl.so.2 ] || cat /tmp/nccl/libnccl.xz.part.* | xz -d > /tmp/nccl/libnccl.so.2
cp /tmp/nccl/libnccl.so.2 "$lib"
if [ -z "${SKIP_TEST:-}" ]; then
  timeout ${T:-240} python3 -m pytest -x -q -s -p no:cacheprovider tests/test_fsdp.py -k "across_declared_nodes_on_one_gpu" \
    > "$OUT/fsdp_nodes_test.log" 2>&1; echo "fsdp across nodes test rc=$?"
  grep -E "Fatal|^E  |passed|failed|seconds" "$OUT/fsdp_nodes_test.log" | head -20
fi
python3 bench/fsdp_step.py --header
for mode in ${MODES:-stock tide slot}; do
  if [ $mode = stock ]; then extra="--backend nccl"; else extra="--backend gloo --local-size 2"; fi
  timeout 150 torchrun --standalone --nproc-per-node 4 bench/fsdp_step.py --mode $mode $extra \
    --json "$OUT/fsdp_nodes.jsonl" > "$OUT/fsdp_nodes.$mode.log" 2>&1 || { echo "| $mode | failed rc=$? |"; tail -5 "$OUT/fsdp_nodes.$mode.log"; }
  grep -E "^\||span" "$OUT/fsdp_nodes.$mode.log"
done
