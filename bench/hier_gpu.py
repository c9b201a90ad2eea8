"""Declared nodes on the GPU: tide_triton's cross-node reduce_scatter / all_gather of one layer.

    NCCL_MULTI_RANK_GPU_ENABLE=1 torchrun --standalone --nproc-per-node 4 bench/hier_gpu.py --local-size 2
    (add NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 to put the inter-node hop on NCCL's socket transport)

One process per rank, all on GPU 0 (NCCL >= 2.30 for several ranks per GPU).  ``--local-size``
consecutive ranks form a "node": they share a node-local CUDA transport (VMM heaps, copy
engines, stream-memory flags); the rails cross "nodes" through NCCL: ``--inter-node
put_signal`` (one-sided ncclPutSignal into landing rings, copy engines, no SMs), ``send_recv``
(grouped ncclSend / ncclRecv, NCCL's kernels) or ``auto``.  Per collective: median wall time of ``--iters`` calls (each ended by
``tide_triton.synchronize`` and a barrier), bytes this rank sent across nodes per round
(``hier_collectives.stats``, what the plans predict), and from one profiled call the device
time of NCCL's kernels (the inter-node hop's SM time) and of tide_triton's kernels.  On one
GPU every byte the ranks move between them is read and written once in its memory, so the
rows also report those bytes per unit of time as a fraction of the device-copy ceiling rank 0
measures at the start of the same run (not on several GPUs, where links set the ceiling).
Rank 0 prints one row per collective and appends them to ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402


def _kernel_us(prof) -> dict:
    out = {"nccl_us": 0.0, "tide_us": 0.0, "memcpy_us": 0.0}
    for e in prof.events():
        if str(getattr(e, "device_type", "")) != "DeviceType.CUDA":
            continue
        us = e.device_time_total
        if e.name.startswith(("Memcpy", "Memset")):
            out["memcpy_us"] += us
        elif e.name.startswith("nccl"):
            out["nccl_us"] += us
        elif "segmented" in e.name:
            out["tide_us"] += us
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--local-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ring-bytes", type=int, default=256 << 20)
    ap.add_argument("--chunk-bytes", type=int, default=64 << 20)
    ap.add_argument("--inter-node", default="auto", choices=["auto", "put_signal", "send_recv"])
    ap.add_argument("--inflight-chunks", type=int, default=2)
    ap.add_argument("--gpu-per-node", action="store_true",
                    help="node n on GPU n (several GPUs: rails cross GPUs, as between real nodes); "
                         "default: rank r on GPU r % count")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch.distributed as dist

    import tide_triton as tt
    from tide_triton.executors import across_nodes as hc
    from tide_triton.bench.measure import copy_ceiling, env_info
    from tide_triton.plan.workloads import layer_shapes

    dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    n_gpu = torch.cuda.device_count()
    torch.cuda.set_device((rank // args.local_size if args.gpu_per_node else rank) % n_gpu)
    dev = torch.device("cuda", torch.cuda.current_device())
    # The device-copy ceiling of this run, measured by rank 0 alone (the others wait).
    ceiling_gbps = copy_ceiling(dev, 1 << 30).gbps() if rank == 0 else 0.0
    dist.barrier()
    g = tt.init(local_size=args.local_size, ring_bytes=args.ring_bytes, chunk_bytes=args.chunk_bytes,
                inflight_chunks=args.inflight_chunks, inter_node=args.inter_node, agree="first", timeout_s=300)
    shapes = layer_shapes(args.model)
    layout = tt.ShardLayout(shapes, W)
    gen = torch.Generator(device=dev).manual_seed(rank)
    grads = [torch.randn(s, device=dev, generator=gen).to(torch.bfloat16) for s in shapes]
    shards = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
    pshards = [torch.randn(s, device=dev, generator=gen) for s in layout.shard_shapes(rank)]
    params = [torch.empty(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    rows = []
    for name, call in [("reduce_scatter bf16->fp32", lambda: tt.reduce_scatter(grads, shards, group=g)),
                       ("all_gather fp32->bf16", lambda: tt.all_gather(pshards, params, group=g))]:
        call()
        tt.synchronize(g)
        dist.barrier()
        times = []
        for _ in range(args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            tt.synchronize(g)
            times.append(time.perf_counter() - t0)
        st = hc.stats(g, "cuda")
        last = st["last"]
        from torch.profiler import ProfilerActivity, profile

        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            call()
            tt.synchronize(g)
        prof = _kernel_us(p)
        mine = {"ms": 1e3 * statistics.median(times), "last": last, "inter_node": st["inter_node"], **prof}
        got = [None] * W
        dist.all_gather_object(got, mine)
        if rank == 0:
            inter = max(sum(v for k, v in r["last"].items() if "inter" in k) for r in got)
            # every byte the ranks moved between them (across and within nodes) is read and
            # written once on this GPU: the rig's copy rate against its device-copy ceiling
            moved = 2 * sum(sum(r["last"].values()) for r in got)
            frac = moved / (max(r["ms"] for r in got) * 1e6) / ceiling_gbps if n_gpu == 1 else None
            row = {"script": "hier_gpu", "collective": name, "inter_node": got[0]["inter_node"],
                   "chunk_bytes": args.chunk_bytes, "inflight_chunks": args.inflight_chunks, "model": args.model, "world_size": W,
                   "local_size": args.local_size, "nodes": W // args.local_size, "ms": max(r["ms"] for r in got),
                   "inter_node_bytes_per_rank_max": inter, "ranks": got, "moved_bytes_all_ranks": moved,
                   "copy_ceiling_gbps": ceiling_gbps, "fraction_of_ceiling": frac,
                   "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE"), "gpus": n_gpu,
                   "gpu_per_node": args.gpu_per_node, **env_info(dev)}
            rows.append(row)
            nccl_ms = max(r.get("nccl_us", 0.0) for r in got) / 1e3
            tide_ms = max(r.get("tide_us", 0.0) for r in got) / 1e3
            print(f"| {args.model} | {W // args.local_size} x {args.local_size} | {row['inter_node']}"
                  f"{' (socket)' if row['nccl_p2p_disable'] == '1' else ''} | {name} | {row['ms']:.2f} | "
                  f"{inter / 2**20:.1f} | {nccl_ms:.2f} | {tide_ms:.2f} | "
                  f"{'-' if frac is None else f'{100 * frac:.1f}% of {ceiling_gbps:.0f} GB/s'} |", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
    g.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


HEADER = ("| model | nodes x local | inter-node hop | collective | ms (rank max) | sent across nodes / rank (MiB) | "
          "NCCL kernels = hop SM time (ms, one call) | tide kernels (ms, one call) | bytes moved (all ranks, read + "
          "write) per ms, of the copy ceiling (one GPU) |\n|---|---|---|---|---|---|---|---|---|")

if __name__ == "__main__":
    from script_tools import script_main

    sys.exit(script_main(main, HEADER))
