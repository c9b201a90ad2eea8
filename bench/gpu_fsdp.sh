#!/usr/bin/env bash
# FSDP2 step time / peak memory, stock (NCCL >= 2.30, several ranks on the one GPU) vs tide vs
# tide + Slot-Reuse, and the FSDP2 GPU test.  Expects NCCL's library parts in /tmp/nccl (see
# bench/NOTES.md); without them stock runs on gloo.  MODES="tide slot" picks modes, SKIP_TEST=1
# skips the test.  ~6 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONFAULTHANDLER=1
backend=gloo
if ls /tmp/nccl/libnccl.xz.part.* >/dev/null 2>&1; then
  lib=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
  cat /tmp/nccl/libnccl.xz.part.* | xz -d > /tmp/nccl/libnccl.so.2 && cp /tmp/nccl/libnccl.so.2 "$lib" && backend=nccl
  export NCCL_MULTI_RANK_GPU_ENABLE=1
  NCCL_DEBUG=VERSION python3 -c "import torch,torch.distributed as d,os;os.environ.update(MASTER_ADDR='127.0.0.1',MASTER_PORT='29555');d.init_process_group('nccl',rank=0,world_size=1);torch.cuda.set_device(0);x=torch.ones(4,device='cuda');d.all_reduce(x);print('nccl ok',x.sum().item())" 2>&1 | grep -i "version\|ok" | head -3
fi
python3 bench/fsdp_step.py --header
for W in 2 4; do
  for mode in ${MODES:-stock tide slot}; do
    b=$backend; [ $mode != stock ] && b=gloo
    timeout 150 torchrun --standalone --nproc-per-node $W bench/fsdp_step.py --mode $mode --backend $b \
      --json "$OUT/fsdp_step.jsonl" > "$OUT/fsdp_step.$mode.$W.log" 2>&1 || { echo "| $mode | $b | $W | failed rc=$? |"; tail -5 "$OUT/fsdp_step.$mode.$W.log"; }
    grep "^|" "$OUT/fsdp_step.$mode.$W.log"
  done
done
[ -n "${SKIP_TEST:-}" ] || timeout 200 python3 -m pytest -x -q -p no:cacheprovider tests/test_fsdp.py -k gpu > "$OUT/fsdp_test.log" 2>&1
echo "fsdp test rc=$?"; grep -E "Fatal|^E  |passed|failed|seconds" "$OUT/fsdp_test.log" | head -30
