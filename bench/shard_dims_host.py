"""Host time per reduce-scatter call of ``Shard(dim > 0)`` parameters before anything moves: the
split into :class:`~tide_triton.plan.layout.DimShards` parts (a view per part, of the gradients and
of the shards) and the call's argument checks on the parts; the layout itself (made once and
cached by the FSDP2 drop-in) beside them.  Meta tensors: no memory, no kernels.  Shapes: the
Qwen3-30B-A3B expert layer (``/work/shared/workloads/models.json``), its experts grouped
``[E, H, D]`` (torchtitan) or as 2-D matrices, on Shard(1) and, for comparison, Shard(0).

    python bench/shard_dims_host.py [--worlds 2 4 8]
"""
from __future__ import annotations

import argparse
import time
import types

import torch

from tide_triton.collectives import _rs_arguments, split_parts
from tide_triton.plan.layout import DimShards

E, H, D = 128, 768, 2048
CASES = {
    "grouped [E,H,D] x3 Shard(1)": ([(E, H, D), (E, H, D), (E, D, H)], 1),
    "grouped [E,H,D] x3 Shard(0)": ([(E, H, D), (E, H, D), (E, D, H)], 0),
    "2-D experts x384 Shard(1)": ([(H, D), (H, D), (D, H)] * E, 1),
    "2-D experts x384 Shard(0)": ([(H, D), (H, D), (D, H)] * E, 0),
}


def best(fn, n: int = 3) -> float:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    for W in args.worlds:
        for name, (shapes, k) in CASES.items():
            dims = [k] * len(shapes)
            ds = DimShards(shapes, dims, W)
            full = [torch.empty(s, device="meta") for s in shapes]
            shards = [torch.empty(s, device="meta") for s in ds.shard_shapes(0, padded=True)]
            g = types.SimpleNamespace(world_size=W, rank=0, call_label="layer")
            t_layout = best(lambda: DimShards(shapes, dims, W).layout)  # noqa: B023
            t_split = best(lambda: (split_parts(full, ds), split_parts(shards, ds)))  # noqa: B023
            pf, ps = split_parts(full, ds), split_parts(shards, ds)
            t_args = best(lambda: _rs_arguments(g, "reduce_scatter", pf, ps, "avg", False))  # noqa: B023
            print(f"W={W} {name:28s} parts={len(pf):7d}  layout (once) {t_layout * 1e3:9.2f} ms  "
                  f"split {t_split * 1e3:9.2f} ms  checks on parts {t_args * 1e3:9.2f} ms", flush=True)


if __name__ == "__main__":
    main()
