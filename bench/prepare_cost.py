"""Host time of preparing a collective for a new set of addresses -- what the FSDP2 drop-in's
reduce-scatter pays every step (autograd's gradients land at new addresses) -- on the CPU,
at full layer sizes, with a stand-in transport (addresses only: no device, no driver calls)
and the real planners and kernel bindings.

    python bench/prepare_cost.py [--models qwen3-30b-a3b synthetic-moe-256e llama-3.1-70b]
                                 [--world-sizes 2 4 8] [--reps 30]

Per (layer, W): medians (and means) over ``reps`` calls on new addresses of
``node_prepare.prepare_reduce_scatter`` (rank 0's bound reductions and push copies, 256 MiB
ring, bf16 -> fp32) and ``node_prepare.prepare_all_gather`` (the pull copies), gradients and
parameters back to back (FSDP2's layout) or ``--apart`` (every tensor at its own address: no
strided runs).  On a GPU the transport's driver objects and the tables' uploads come on top.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tide_triton.executors import prepare as node_prepare  # noqa: E402
from tide_triton.plan.heap import ring as heap_ring  # noqa: E402
from tide_triton.plan.layout import ShardLayout  # noqa: E402
from tide_triton.bench.measure import env_info  # noqa: E402
from tide_triton.group.options import GroupOptions  # noqa: E402
from tide_triton.plan.schedule import ring_plan  # noqa: E402
from tide_triton.plan.workloads import layer_shapes  # noqa: E402


class AddressOnly:
    """The transport as the prepare functions see it: rank ``r``'s heap at a fixed address,
    copies and strided runs kept as given (the CUDA transport makes driver structs of them)."""

    strided_copies = True

    def address(self, rank: int, offset: int) -> int:
        return (1 << 44) + rank * (1 << 36) + offset

    def prepare_copies(self, dsts, srcs, nbytes, *, strided=()):
        return dsts, srcs, nbytes, strided


class EngineStandIn(AddressOnly):
    """``AddressOnly`` whose ``prepare_copies`` is the CUDA transport's own
    (``Copies.prepare_copies``: checks, cuts at allocation ends, driver structs), its
    driver queries answered in Python -- every allocation 1 TiB long, on this rank's GPU --
    so the host cost of preparing copies is measured without a GPU (``--engine``; needs
    cuda-bindings for the structs)."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        from tide_triton.transport.copies import Copies

        class Driver:
            def __getattr__(self, name):
                return getattr(cu, name)

            def cuMemGetAddressRange(self, ptr):
                p = int(ptr)
                return cu.CUresult.CUDA_SUCCESS, p - p % (1 << 40), 1 << 40

            def cuPointerGetAttribute(self, attr, ptr):
                return cu.CUresult.CUDA_SUCCESS, 0

        e = object.__new__(Copies)
        e._cu, e._guard, e.device = Driver(), contextlib.nullcontext(), torch.device("cuda", 0)
        e.rank = 0
        self._engine = e

    def prepare_copies(self, dsts, srcs, nbytes, *, strided=()):
        return self._engine.prepare_copies(dsts, srcs, nbytes, strided=strided)


def addresses(numels, elem_bytes: int, base: int, apart: bool) -> tuple[int, ...]:
    out, at = [], base
    for i, n in enumerate(numels):
        out.append(at)
        at += n * elem_bytes + (4096 * (1 + i % 7) if apart else 0)
    return tuple(out)


def timed(fn, reps: int) -> list[float]:
    fn(0)
    out = []
    for i in range(1, reps + 1):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "synthetic-moe-256e", "llama-3.1-70b"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--apart", action="store_true", help="every tensor at its own address (no strided runs)")
    ap.add_argument("--engine", action="store_true",
                    help="the CUDA transport's prepare_copies (driver structs; queries answered in Python)")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the bindings' CPU tables
    info = env_info(torch.device("cpu"))
    print(f"{info['gpu']}, {os.cpu_count()} cores | torch {info['torch']} | python {info['python']} | "
          f"git {info['git_sha']} | {info['date']} | {'tensors apart' if args.apart else 'back to back'}"
          f"{' | Copies.prepare_copies' if args.engine else ''}")
    print("| layer | W | prepare_reduce_scatter median / mean (ms) | prepare_all_gather median / mean (ms) |")
    print("|---|---|---|---|")
    for model in args.models:
        for W in args.world_sizes:
            rs, ag = row(model, W, args.reps, args.apart, args.engine)
            print(f"| {model} | {W} | {statistics.median(rs):.3f} / {statistics.mean(rs):.3f} | "
                  f"{statistics.median(ag):.3f} / {statistics.mean(ag):.3f} |", flush=True)


def row(model: str, W: int, reps: int, apart: bool, engine: bool = False) -> tuple[list[float], list[float]]:
    """Milliseconds of ``reps`` reduce-scatter and all-gather preparations on new addresses."""
    t = EngineStandIn() if engine else AddressOnly()
    layout = ShardLayout(layer_shapes(model), W)
    es, ring_bytes, stages = 2, 256 << 20, 2
    reg = heap_ring(64, W, ring_bytes, stages, 0)
    plan = ring_plan(layout, ring_bytes, es, stages)
    g = types.SimpleNamespace(world_size=W, rank=0, options=GroupOptions(ring_bytes=ring_bytes))
    Sp = tuple(layout.padded_shard_numels)
    cpu = torch.device("cpu")

    def rs(i: int) -> None:
        base = (1 << 40) + i * (1 << 34)
        node_prepare.prepare_reduce_scatter(
            g, t, reg, plan, layout, addresses(layout.padded_numels, es, base, apart),
            addresses(Sp, 4, base + (1 << 38), apart), Sp, torch.bfloat16, torch.float32, cpu,
            1.0 / W, True, ring_bytes)

    def ag(i: int) -> None:
        base = (1 << 40) + i * (1 << 34)
        node_prepare.prepare_all_gather(g, t, layout, addresses(layout.padded_numels, es, base, apart),
                                        es, None, reg.ag_off)

    return timed(rs, reps), timed(ag, reps)


if __name__ == "__main__":
    main()
