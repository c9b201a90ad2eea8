"""Statement by statement: the host time of a collective's argument checks for one layer.

A profile of the 256-expert all-gather (one process per rank on the H200) once put ~14 ms per
call inside ``collectives._full_and_shards`` -- 0.24 ms on the CPU for the same 771 tensors:
a shape object per parameter held at once started garbage-collector passes
(docs/constraints.md#garbage-collector-passes).  This times each step of that function on the
device's own tensors, with the collector on and off, so a step that costs shows by name:
    python bench/host_checks.py [--device cuda] [--model synthetic-moe-256e] [--world-size 2]
Prints a table of medians and means (microseconds per call) over ``--calls`` calls.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from itertools import chain, repeat
from typing import Callable

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from tide_triton import collectives as coll  # noqa: E402
from tide_triton.runtime.checks import FLOAT_DTYPES, check_tensor_list, check_uniform  # noqa: E402
from tide_triton.plan.layout import ShardLayout  # noqa: E402
from tide_triton.plan.workloads import layer_shapes  # noqa: E402


def back_to_back(shapes, dtype, device) -> list[torch.Tensor]:
    """Views of one buffer, as FSDP2 and bench/collectives_gpu.py allocate them."""
    numels = [torch.Size(s).numel() for s in shapes]
    flat = torch.zeros(sum(numels), dtype=dtype, device=device)
    out, o = [], 0
    for s, n in zip(shapes, numels):
        out.append(flat[o:o + n].view(s))
        o += n
    return out


def steps(full: list[torch.Tensor], shards: list[torch.Tensor], world: int) -> dict[str, Callable[[], object]]:
    flat = tuple(chain.from_iterable(map(torch.Tensor.size, full)))
    return {
        "check_tensor_list(full)": lambda: check_tensor_list("params", full),
        "check_tensor_list(shards)": lambda: check_tensor_list("shards", shards, len(full)),
        "check_uniform(full)": lambda: check_uniform("params", full, dtypes=FLOAT_DTYPES),
        "tuple(map(Tensor.size)) (a shape object each)": lambda: tuple(map(torch.Tensor.size, full)),
        "sizes flattened (the layout key)": lambda: tuple(chain.from_iterable(map(torch.Tensor.size, full))),
        "hash(sizes flattened)": lambda: hash(flat),
        "_layout_of (cached)": lambda: coll._layout_of(full, world),
        "all(isinstance)": lambda: all(map(isinstance, full, repeat(torch.Tensor))),
        "_full_and_shards (whole)": lambda: coll._full_and_shards("params", full, shards, world),
    }


def time_us(fn: Callable[[], object], calls: int) -> list[float]:
    fn()  # first call: caches fill
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="synthetic-moe-256e")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device(args.device)
    layout = ShardLayout(layer_shapes(args.model), args.world_size)
    params = back_to_back(layout.padded_shapes, torch.bfloat16, dev)       # the all-gather's
    grads = back_to_back(layout.shapes, torch.bfloat16, dev)               # the reduce-scatter's
    shards = back_to_back(layout.shard_shapes(0, padded=True), torch.bfloat16, dev)
    print(f"{args.model} ({len(layout)} params), W={args.world_size}, {dev}, torch {torch.__version__}, "
          f"{len(gc.get_objects())} objects tracked by the garbage collector")
    print("| step | all-gather args: median / mean (us) | gc off | reduce-scatter args: median / mean | gc off |")
    print("|---|---|---|---|---|")
    ag, rs = steps(params, shards, args.world_size), steps(grads, shards, args.world_size)
    for name in ag:
        cells = []
        for fn in (ag[name], rs[name]):
            for gc_on in (True, False):
                (gc.enable if gc_on else gc.disable)()
                t = time_us(fn, args.calls)
                cells.append(f"{statistics.median(t):.1f} / {statistics.mean(t):.1f}")
            gc.enable()
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
