"""tide_triton's collectives on their own: reduce_scatter (bf16 gradients -> fp32 shards) and
all_gather (bf16 shards -> bf16 parameters), checked against plain torch.

    python examples/collectives.py                              # 2 ranks as threads of one process
    python examples/collectives.py --world-size 3
    torchrun --nproc-per-node 2 examples/collectives.py         # one process per rank (gloo bootstrap)
    torchrun --nproc-per-node 2 examples/collectives.py --device cuda   # rank r on cuda:LOCAL_RANK

Without a GPU everything runs on the CPU: the data moves through shared memory and the
kernels run as plain torch, equal to the Triton kernels bit for bit (``--device cpu`` does the
same on a GPU machine; ``TIDE_TRITON_CPU_KERNELS=interpret`` runs them through Triton's
interpreter).
With ``--device cuda`` under torchrun, rank r uses ``cuda:LOCAL_RANK`` (``--share-gpu``: every
rank on cuda:0); run as threads, all ranks share cuda:0.  Each rank prints its shard shapes;
rank 0 prints ``OK`` when every rank's results equal plain torch's (the all-gather bit for
bit, the average to the last bit of fp32).  Takes a few seconds on CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import threading

if "RANK" not in os.environ:  # one process, one thread per rank: no lazy kernel load may
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # sync the context (tide_triton.local_groups)

import torch  # noqa: E402

# Awkward on purpose: dim 0 not divisible by W (padding), a 1-D bias, a 3-D parameter whose
# dim 0 is smaller than some world sizes (the last ranks hold no rows of it).
SHAPES = [(10, 6), (7,), (2, 3, 4)]


def gradients(rank: int, device: torch.device) -> list[torch.Tensor]:
    """Rank ``rank``'s full gradients: small integers in bf16, so that sums are exact in fp32
    and the check below can use ``torch.equal``."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(-8, 9, s, generator=g).to(torch.bfloat16).to(device) for s in SHAPES]


def parameters(device: torch.device) -> list[torch.Tensor]:
    """The full bf16 parameters every rank should end up with after the all-gather."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g).to(torch.bfloat16).to(device) for s in SHAPES]


def run_rank(group, rank: int, world: int, device: torch.device) -> list[str]:
    """One rank's part; returns what went wrong (empty: all equal to plain torch)."""
    import tide_triton as tt

    layout = tt.ShardLayout(SHAPES, world)
    # FSDP2's dim-0 sharding: rank r holds rows [r*c, r*c + rows_r) of every parameter,
    # c = ceil(d0 / W).  shard_shapes(r) are the unpadded shapes; padded=True gives (c, ...).
    shard_shapes = layout.shard_shapes(rank)
    print(f"rank {rank}: shard shapes {shard_shapes} (padded: {layout.shard_shapes(rank, padded=True)})",
          flush=True)
    problems = []

    # reduce_scatter: bf16 full gradients in, fp32 shards of the average out.
    grads = gradients(rank, device)
    shards = [torch.empty(s, dtype=torch.float32, device=device) for s in shard_shapes]
    tt.reduce_scatter(grads, shards, group=group, op="avg")
    tt.synchronize(group, device=device)
    every = [gradients(r, device) for r in range(world)]  # plain torch: sum every rank's, slice ours
    for i, (c, shard) in enumerate(zip(layout.rows_per_rank, shards)):
        want = (sum(g[i].float() for g in every) / world)[rank * c: rank * c + shard.shape[0]]
        # The fp32 sum of small integers is exact; "avg" then scales it by 1/W, which may
        # round differently from torch's division by W in the last bit (W not a power of 2).
        if not torch.allclose(shard, want, rtol=2**-22, atol=0):
            problems.append(f"rank {rank}: reduce_scatter of parameter {i} differs from torch")

    # all_gather: bf16 shards in, full bf16 parameters out on every rank.
    full = parameters(device)
    mine = [p[rank * c: rank * c + s[0]].clone() for p, c, s in zip(full, layout.rows_per_rank, shard_shapes)]
    params = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in SHAPES]
    tt.all_gather(mine, params, group=group)
    tt.synchronize(group, device=device)
    for i, (got, want) in enumerate(zip(params, full)):
        if not torch.equal(got, want):
            problems.append(f"rank {rank}: all_gather of parameter {i} differs from torch")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=2, help="ranks, when run without torchrun (threads)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present, else cpu")
    ap.add_argument("--share-gpu", action="store_true", help="under torchrun: every rank on cuda:0")
    args = ap.parse_args()
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch; leave --device out to run on the CPU")
    import tide_triton as tt

    if "RANK" in os.environ:  # under torchrun: one process per rank
        import torch.distributed as dist

        dist.init_process_group("gloo")  # tide_triton only bootstraps over it; data moves on its own
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = torch.device("cpu") if kind == "cpu" else torch.device(
            "cuda", 0 if args.share_gpu else local % torch.cuda.device_count())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = tt.init()
        problems = run_rank(group, rank, world, device)
        all_problems: list = [None] * world
        dist.all_gather_object(all_problems, problems)
        group.close()
        dist.destroy_process_group()
        problems = [p for ps in all_problems for p in ps]
        if rank != 0:
            return 1 if problems else 0
    else:  # one process, one thread per rank
        world = args.world_size
        if world < 1:
            ap.error(f"--world-size must be >= 1, got {world}")
        if kind == "cpu":
            devices = [torch.device("cpu")] * world
        else:  # rank r on cuda:(r % n), or all on cuda:0 with --share-gpu
            n = 1 if args.share_gpu else torch.cuda.device_count()
            devices = [torch.device("cuda", r % n) for r in range(world)]
        groups = tt.local_groups(world, devices=devices if kind == "cuda" else None)
        results: list[list[str]] = [[f"rank {r}: did not finish"] for r in range(world)]

        def thread(r: int) -> None:
            try:
                own_stream = contextlib.nullcontext()
                if devices[r].type == "cuda":  # ranks sharing a GPU need a stream each
                    torch.cuda.set_device(devices[r])
                    own_stream = torch.cuda.stream(torch.cuda.Stream(devices[r]))
                with own_stream:
                    results[r] = run_rank(groups[r], r, world, devices[r])
            except Exception as e:  # noqa: BLE001 - reported below with the rank
                results[r] = [f"rank {r}: {type(e).__name__}: {e}"]

        threads = [threading.Thread(target=thread, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for g in groups:
            g.close()
        problems = [p for ps in results for p in ps]
    for p in problems:
        print(p)
    print("OK: reduce_scatter and all_gather equal plain torch on every rank" if not problems else "FAILED")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
