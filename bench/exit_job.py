"""One small FSDP2 job that ends as a user's does: a step on tide_triton's collectives
(``tide_triton.fsdp.enable``), ``dist.destroy_process_group()``, then a normal interpreter
exit -- the model, its FSDP2 state and tide_triton's group still alive until then.  Run by
``bench/exit_loop.sh`` under torchrun, many times, to count exits that are not clean.

    torchrun --standalone --nproc-per-node 2 bench/exit_job.py [--no-tide] [--steps 1]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-tide", action="store_true", help="stock FSDP2 collectives only")
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tide_triton.fsdp

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not args.no_tide:
        tide_triton.fsdp.enable(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 100 + dist.get_rank()))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if not args.no_tide:
        tide_triton.synchronize()
    if dist.get_rank() == 0:
        print(f"exit_job: {args.steps} step(s) done, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
