#!/usr/bin/env bash
# Declared nodes on the one GPU, both inter-node hops (issue 5): NCCL >= 2.30 from /tmp/nccl
# (parts carried one per call, see bench/NOTES.md); tests/test_hier_cuda.py (put/signal 2x2,
# 3x2, 4x2; send/recv 2x2, 4x2, 2x2 over sockets; "auto" over sockets), then hier_gpu.py
# rows for each hop and NCCL's flat FSDP2 path over the same emulation.  ~8 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONFAULTHANDLER=1 NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
if ls /tmp/nccl/libnccl.xz.part.* >/dev/null 2>&1; then
  [ -f /tmp/nccl/libnccl.so.2 ] || cat /tmp/nccl/libnccl.xz.part.* | xz -d > /tmp/nccl/libnccl.so.2
  cp /tmp/nccl/libnccl.so.2 "$lib"
fi
python3 -c "from tide_triton.transport import nccl; print(nccl.load())"
if [ -z "${SKIP_TEST:-}" ]; then
  timeout ${T1:-120} python3 -m pytest -x -q -s -p no:cacheprovider tests/test_hier_cuda.py -k "2x2-default-put_signal" \
    > "$OUT/rma_first.log" 2>&1; echo "first put_signal test rc=$?"
  grep -E "took|Fatal|^E  |passed|failed|Error|error" "$OUT/rma_first.log" | head -20
  timeout ${T2:-300} python3 -m pytest -q -s -p no:cacheprovider tests/test_hier_cuda.py -k "not 2x2-default-put_signal" \
    > "$OUT/rma_tests.log" 2>&1; echo "other hier tests rc=$?"
  grep -E "took|Fatal|^E  |passed|failed|FAILED" "$OUT/rma_tests.log" | head -20
fi
python3 bench/hier_gpu.py --header
for hop in ${HOPS:-put_signal send_recv}; do
  timeout 100 torchrun --standalone --nproc-per-node 4 bench/hier_gpu.py --local-size 2 --inter-node $hop \
    ${CHUNK:+--chunk-bytes $CHUNK} --json "$OUT/hier_gpu.jsonl" > "$OUT/hier_$hop.log" 2>&1
  echo "bench 2x2 $hop rc=$?"; grep -E "^\||Error|error" "$OUT/hier_$hop.log" | head -6
done
if [ -n "${BASELINE:-1}" ]; then
  timeout 150 python3 bench/nccl_baseline.py --world-sizes 4 --models llama-3.1-70b --iters 5 --no-profile \
    --json "$OUT/nccl_w4.jsonl" > "$OUT/nccl_w4.log" 2>&1; echo "nccl W=4 rc=$?"; grep -E "^\|" "$OUT/nccl_w4.log" | head -12
fi
