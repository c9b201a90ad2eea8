#!/usr/bin/env bash
# For nvidia-h200-x2 (two GPUs of one host; not run yet): NCCL >= 2.30 from /tmp/nccl (parts
# carried one per call, bench/NOTES.md).  Each GPU a "node": the rails cross GPUs (NVLink
# copy engines for put/signal, NCCL's kernels for send/recv), as between real nodes.  1 x 1
# per GPU (W=2, local 1) and 2 per GPU (W=4, local 2); tide's hops side by side.  ~4 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONFAULTHANDLER=1 NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi topo -m
lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
[ -f /tmp/nccl/libnccl.so.2 ] || cat /tmp/nccl/libnccl.xz.part.* | xz -d > /tmp/nccl/libnccl.so.2
cp /tmp/nccl/libnccl.so.2 "$lib"
python3 bench/hier_gpu.py --header
for cfg in "2 1" "4 2"; do
  set -- $cfg
  for hop in put_signal send_recv; do
    timeout 100 torchrun --standalone --nproc-per-node $1 bench/hier_gpu.py --local-size $2 --gpu-per-node \
      --inter-node $hop --json "$OUT/hier_x2.jsonl" > "$OUT/x2_$1_$hop.log" 2>&1
    echo "W=$1 local=$2 $hop rc=$?"; grep -E "^\||Error" "$OUT/x2_$1_$hop.log" | head -4
  done
done
