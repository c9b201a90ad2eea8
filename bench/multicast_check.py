"""First check of NVSwitch multicast on a system that has it: creates ONE multicast object,
runs both collectives on it and on the copy-engine path, reports exactness and timings.

    torchrun --nproc-per-node 8 bench/multicast_check.py --i-have-nvswitch-multicast

Refuses to run unless ``--i-have-nvswitch-multicast`` is passed AND the guard passes on
every rank (every device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED; no
TIDE_TRITON_MULTICAST=0, NCCL_NVLS_ENABLE=0 or TORCH_SYMM_MEM_DISABLE_MULTICAST=1).  Never
run it on a shared host without the operators' consent: creating a multicast object where
the fabric is unhealthy can take GPUs out of service.  See docs/multicast.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch
import torch.distributed as dist

FLAG = "--i-have-nvswitch-multicast"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(FLAG, dest="confirmed", action="store_true",
                    help="confirm this is an NVSwitch system whose multicast may be used")
    ap.add_argument("--numel", type=int, default=1 << 24, help="elements per parameter (two parameters)")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    if not a.confirmed:
        print(f"refusing: pass {FLAG} to create a multicast object (docs/multicast.md)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("refusing: no CUDA device", file=sys.stderr)
        return 2
    import tide_triton as tt
    from tide_triton.transport import driver
    from tide_triton.transport.multicast import device_supports_multicast, resolve_multicast

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    cu = driver.init()

    def exchange(obj):
        out = [None] * world
        dist.all_gather_object(out, obj)
        return out

    # The guard alone, before any group exists: "on" raises on every rank, saying why.
    d = resolve_multicast("on", rank=rank, exchange=exchange,
                          query=lambda: device_supports_multicast(cu, driver.check(cu.cuDeviceGet(dev.index), "")))
    if rank == 0:
        print(f"guard: {d.reason}")
    shapes = [(a.numel // 4096, 4096), (a.numel // 1024, 1024)]
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randint(-4, 5, s, generator=gen).to(torch.bfloat16).to(dev) for s in shapes]
    results = {}
    layout = tt.ShardLayout(shapes, world)
    for mode in ("off", "on"):  # the copy-engine path first, then the multicast path
        g = tt.init(multicast=mode)
        shards = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
        params = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes]
        times = []
        for it in range(a.iters + 1):  # iteration 0 warms up (and creates the object)
            torch.cuda.synchronize(dev)
            dist.barrier()
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record()
            tt.reduce_scatter(grads, shards, group=g, op="sum")
            tt.all_gather(shards, params, group=g)
            t1.record()
            torch.cuda.synchronize(dev)
            if it:
                times.append(t0.elapsed_time(t1))
        results[mode] = ([x.clone() for x in shards], [p.clone() for p in params], sorted(times)[len(times) // 2])
        g.close()
    exact_rs = all(torch.equal(x, y) for x, y in zip(results["off"][0], results["on"][0]))
    exact_ag = all(torch.equal(x, y) for x, y in zip(results["off"][1], results["on"][1]))
    flags = exchange((exact_rs, exact_ag, results["off"][2], results["on"][2]))
    if rank == 0:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        now = datetime.datetime.now(datetime.timezone.utc).isoformat()
        print(f"# {now} git {sha} {torch.cuda.get_device_name(dev)} "
              f"torch {torch.__version__} cuda {torch.version.cuda} W={world} numel={a.numel} iters={a.iters}")
        for r, (ers, eag, t_ce, t_mc) in enumerate(flags):
            print(f"rank {r}: reduce-scatter exact={ers} all-gather exact={eag} "
                  f"copy-engine {t_ce:.3f} ms, multicast {t_mc:.3f} ms (median, RS + AG)")
    dist.destroy_process_group()
    return 0 if all(f[0] and f[1] for f in flags) else 1


if __name__ == "__main__":
    sys.exit(main())
