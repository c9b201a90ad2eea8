"""FSDP2 step time on the CPU: stock against ``tide_triton.fsdp.enable`` in one job.

    torchrun --nproc-per-node 2 bench/cpu_fsdp_step.py --dim 64 --layers 2
    torchrun --nproc-per-node 2 bench/cpu_fsdp_step.py --dim 256 --layers 6 --rounds 4

examples/train_llama.py's Llama (bf16 params, fp32 reduce, AdamW) on gloo.  The same model
trains in rounds: ``--steps`` stock steps, then ``--steps`` with ``enable()``, then ``disable()``
again, so both sides share the machine's load of the moment (a shared CPU drifts by 2x within
minutes).  The first round of each side is warm-up.  Rank 0 prints each side's median step
time and the ratio; both sides' losses come from the same training run, so they are not
compared here (tests/test_fsdp.py compares them with stock bit for bit).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="steps per side per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of (stock, tide_triton); the first is warm-up")
    args = ap.parse_args()
    if args.rounds < 2 or args.steps < 1:
        ap.error("--rounds must be >= 2 (the first is warm-up) and --steps >= 1")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from train_llama import Llama, LlamaConfig, batch, loss_fn, shard

    import tide_triton

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, hidden=(8 * args.dim) // 3 + 1)
    torch.manual_seed(0)
    model = Llama(cfg)
    shard(model, init_device_mesh("cpu", (world,)),
          MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times: dict[str, list[float]] = {"stock": [], "tide_triton": []}
    step = 0
    for rnd in range(args.rounds):
        for side in ("stock", "tide_triton"):
            if side == "tide_triton":
                report = tide_triton.fsdp.enable(model)
                assert all(v is None for v in report.values()), report
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                loss_fn(model, batch(cfg, step, rank, args.batch, args.seq, torch.device("cpu"))).backward()
                opt.step()
                opt.zero_grad()
                dt = time.perf_counter() - t0
                step += 1
                if rnd > 0:
                    times[side].append(dt)
            if side == "tide_triton":
                tide_triton.fsdp.disable(model)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        n = len(times["stock"])
        print(f"W={world} dim {args.dim} layers {args.layers} {args.batch}x{args.seq} tokens/rank, torch "
              f"{torch.__version__}, {n} steps per side after warm-up: stock {med['stock']:.1f} ms, "
              f"tide_triton {med['tide_triton']:.1f} ms (median), ratio {med['tide_triton'] / med['stock']:.2f}",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
