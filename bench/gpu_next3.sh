#!/usr/bin/env bash
# Interference vs the accumulation grid bound; where the FSDP2 GPU test and stock FSDP2 on
# gloo + CUDA crash (faulthandler on in every child).  ~6 minutes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONFAULTHANDLER=1
timeout 240 python3 bench/interference.py --gemm-iters 100 --tide-max-ctas 0 264 132 66 33 --json "$OUT/interference.jsonl" \
  > "$OUT/interference.log" 2>&1; echo "interference rc=$?"; grep "^|\|SM time\|ERROR\|WARN" "$OUT/interference.log"
cat > /tmp/gloo_probe.py <<'PY'
import os, sys, torch, torch.distributed as dist
def main(rank, W):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=W)
    torch.cuda.set_device(0)
    x = torch.full((W * 4,), float(rank + 1), device="cuda")
    for name, fn in [("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(torch.empty(W * 16, device="cuda"), x)),
                     ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(torch.empty(4, device="cuda"), x)),
                     ("all_reduce", lambda: dist.all_reduce(x))]:
        try:
            fn(); torch.cuda.synchronize(); print(f"rank {rank} gloo+cuda {name}: ok", flush=True)
        except Exception as e:
            print(f"rank {rank} gloo+cuda {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(main, args=(2,), nprocs=2)
PY
timeout 60 python3 /tmp/gloo_probe.py > "$OUT/gloo_probe.log" 2>&1; echo "gloo probe rc=$?"; grep -v "^\s*$" "$OUT/gloo_probe.log" | tail -12
for mode in "" "--no-tide"; do
  timeout 90 torchrun --standalone --nproc-per-node 2 examples/train_llama.py --device cuda --steps 3 $mode \
    > "$OUT/example$mode.log" 2>&1; echo "example $mode rc=$?"; grep -E "loss|step|Fatal|File|Error" "$OUT/example$mode.log" | head -25
done
timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/test_fsdp.py -k "gpu and 2" > "$OUT/fsdp.log" 2>&1
echo "fsdp rc=$?"; grep -E "Fatal|File \"|Error|passed|failed" "$OUT/fsdp.log" | grep -v "^\s*raise\|^\s*#" | head -40
