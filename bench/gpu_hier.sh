#!/usr/bin/env bash
# Declared nodes on the one GPU (issue 5): NCCL >= 2.30 from /tmp/nccl (parts carried one per
# call, see bench/NOTES.md), then the cross-node contract tests, the emulated 2x2 / 4x2 layer
# benchmark, and the FSDP2 GPU test (incl. Slot-Reuse).  ~8 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONFAULTHANDLER=1
lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
if ls /tmp/nccl/libnccl.xz.part.* >/dev/null 2>&1; then
  [ -f /tmp/nccl/libnccl.so.2 ] || cat /tmp/nccl/libnccl.xz.part.* | xz -d > /tmp/nccl/libnccl.so.2
  cp /tmp/nccl/libnccl.so.2 "$lib"
fi
export NCCL_MULTI_RANK_GPU_ENABLE=1
python3 -c "from tide_triton.transport import nccl; print(nccl.load())"
timeout 240 python3 -m pytest -x -q -p no:cacheprovider tests/test_hier_cuda.py > "$OUT/hier_test.log" 2>&1
echo "hier test rc=$?"; grep -E "Fatal|^E  |passed|failed|skipped|Error" "$OUT/hier_test.log" | head -30
python3 bench/hier_gpu.py --header
timeout 90 torchrun --standalone --nproc-per-node 4 bench/hier_gpu.py --local-size 2 --json "$OUT/hier_gpu.jsonl" \
  > "$OUT/hier_gpu.2x2.log" 2>&1; echo "bench 2x2 rc=$?"; grep -E "^\||Error|error" "$OUT/hier_gpu.2x2.log" | head -12
timeout 120 python3 -m pytest -x -q -p no:cacheprovider tests/test_fsdp.py -k "gpu and 2" > "$OUT/fsdp_test.log" 2>&1
echo "fsdp test rc=$?"; grep -E "Fatal|^E  |passed|failed" "$OUT/fsdp_test.log" | head -20
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 80 torchrun --standalone --nproc-per-node 4 bench/hier_gpu.py \
  --local-size 2 --json "$OUT/hier_gpu.jsonl" > "$OUT/hier_gpu.2x2-socket.log" 2>&1
echo "bench 2x2 socket rc=$?"; grep -E "^\||Error|error" "$OUT/hier_gpu.2x2-socket.log" | head -12
