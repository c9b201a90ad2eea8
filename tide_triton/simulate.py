"""Schedule simulator, command line: ``python -m tide_triton.simulate``.

Runs the cross-node all-gather / reduce-scatter schedules of a real layer without data,
checks them element range by element range (:mod:`tide_triton.schedule_check`), and prints
bytes per rank, rounds and staging next to NCCL's ring and FSDP2's buffers (tables from
:mod:`tide_triton.report`).  The checker's names are re-exported here.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .schedule_check import (
    SimReport,
    fixed_shard_shapes,
    nccl_ring_bytes,
    simulate,
    simulate_all_gather,
    simulate_reduce_scatter,
)

__all__ = ["SimReport", "simulate", "simulate_all_gather", "simulate_reduce_scatter",
           "fixed_shard_shapes", "nccl_ring_bytes", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    from ._cli import Progress
    from .report import simulation_rows, simulation_table
    from .workloads import MODELS

    ap = argparse.ArgumentParser(prog="python -m tide_triton.simulate", description=(
        "Simulate and check the cross-node all-gather / reduce-scatter schedules; "
        "print bytes per rank, rounds and staging next to NCCL's ring and FSDP2's buffers."))
    ap.add_argument("--model", default="llama-3.1-70b", choices=list(MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64, 128, 1024])
    ap.add_argument("--local-size", type=int, default=8)
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20, help="all-gather chunk cap")
    ap.add_argument("--ring-bytes", type=int, default=64 << 20, help="reduce-scatter staging per rank")
    ap.add_argument("--elem-bytes", type=int, default=2, help="parameter / gradient element bytes (bf16: 2)")
    ap.add_argument("--fixed-ref", type=int, default=None,
                    help="also a fixed-per-rank-shard variant: each rank's shard is the one it has at this "
                         "world size (default: the smallest of --ranks); 0 to skip")
    ap.add_argument("--check-limit", type=int, default=3_000_000,
                    help="check element by element when the plans have at most this many runs (estimate); "
                         "larger ones are counted from the node-level rounds only")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of tables")
    args = ap.parse_args(argv)
    if args.local_size < 1:
        ap.error(f"--local-size must be >= 1, got {args.local_size}")
    for W in args.ranks:
        if W < 1 or W % args.local_size and W > args.local_size:
            ap.error(f"--ranks: {W} is not a multiple of --local-size {args.local_size}")
    ref = min(args.ranks) if args.fixed_ref is None else (args.fixed_ref or None)
    print(f"{args.model}: ranks {' '.join(map(str, args.ranks))}, {args.local_size} per node, "
          f"all-gather chunks of {args.chunk_bytes / 2**20:g} MiB, reduce-scatter staging "
          f"{args.ring_bytes / 2**20:g} MiB per rank, {args.elem_bytes}-byte elements",
          file=sys.stderr if args.json else sys.stdout, flush=True)
    with Progress(None, "simulate") as progress:
        rows = simulation_rows(args.model, args.ranks, args.local_size, args.chunk_bytes, args.ring_bytes,
                               args.elem_bytes, ref, args.check_limit, on_step=progress.step)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(simulation_table(rows))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
