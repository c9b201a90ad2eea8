"""Sweep BLOCK x num_warps of the segmented kernel on the Llama-3.1-70B layer (GPU only).

Pins ``launch_config`` the way a test can, so the numbers behind the constant in
``tide_triton/kernels/segments.py`` can be re-measured:  python bench/sweep_launch.py
"""
from __future__ import annotations

import sys

import torch

from tide_triton.bench import measure as bench
from tide_triton.kernels import accumulate, pack, placement, segments
from tide_triton.plan.workloads import layer_shapes


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 0
    dev = torch.device("cuda")
    ceiling = bench.copy_ceiling(dev, 2 << 30).gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    shapes = layer_shapes("llama-3.1-70b")
    original = segments.launch_config
    qwen = layer_shapes("qwen3-30b-a3b")
    print("| BLOCK | warps | place bf16 W=8 | place fp32->bf16 W=8 | acc K=8 W=8 | acc K=8 W=64 | qwen place W=64 | qwen acc W=64 |")
    print("|---|---|---|---|---|---|---|---|")
    for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]:
        segments.launch_config = lambda dst_dtype, k, b=block, w=warps: segments.LaunchConfig(b, w)
        for mod in (placement, accumulate, pack):
            mod._program.cache_clear()
        cells = []
        for fn, args in [(bench.bench_placement, dict(src_dtype=torch.bfloat16)),
                         (bench.bench_placement, dict(src_dtype=torch.float32))]:
            r = [x for x in fn("llama", shapes, 8, dev, **args) if x.impl.startswith("tide")][0]
            cells.append(f"{r.time_ms:.3f} ms {100 * r.gbps() / ceiling:.0f}%")
        for W in (8, 64):
            r = [x for x in bench.bench_accumulation("llama", shapes, W, dev) if x.impl.startswith("tide")][0]
            cells.append(f"{r.time_ms:.3f} ms {100 * r.gbps() / ceiling:.0f}%")
        r = [x for x in bench.bench_placement("qwen", qwen, 64, dev) if x.impl.startswith("tide")][0]
        cells.append(f"{r.time_ms:.3f} ms {100 * r.gbps() / ceiling:.0f}%")
        r = [x for x in bench.bench_accumulation("qwen", qwen, 64, dev) if x.impl.startswith("tide")][0]
        cells.append(f"{r.time_ms:.3f} ms {100 * r.gbps() / ceiling:.0f}%")
        print(f"| {block} | {warps} | " + " | ".join(cells) + " |", flush=True)
        torch.cuda.empty_cache()
    segments.launch_config = original
    return 0


if __name__ == "__main__":
    sys.exit(main())
