"""How fast one GPU moves a strided run of rows (equal rows at constant pitches: the expert
matrices of a MoE layer, each rank's rows of them) in the ways the driver offers, against a
contiguous copy of the same bytes in the same run.  Found behind issue 15's floor gap: the
Qwen3 layer's all-gather rows went through ``cuMemcpy2DAsync`` at ~850 GB/s (the driver's
``memcpyDtoD2D_aligned_smalldiffpitch`` kernel), where its contiguous copies ran at ~2100 GB/s.

    python bench/strided_copy.py [--iters 20]

Per geometry (name, rows, row bytes, destination / source pitch): contiguous (one
``cuMemcpyAsync`` of all the bytes), ``2d`` (one ``cuMemcpy2DAsync``), ``3d/<sub>`` (one
``cuMemcpy3DAsync``, each row cut into sub-rows of ``sub`` bytes, as the CUDA transport builds
it: ``tide_triton.transport.copies.memcpy3d_struct``), ``rows`` (a ``cuMemcpyAsync`` per
row), ``torch`` (``Tensor.copy_`` of the strided view), ``triton/<tile>`` (one launch of a
Triton kernel, a CTA per ``tile`` bytes of a row: what a same-GPU copy on SMs could do).  Times are CUDA-event means and
medians of ``iters`` copies, GB/s counts bytes read + written.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

from tide_triton.bench.measure import env_info  # noqa: E402
from tide_triton.transport.driver import check  # noqa: E402
from tide_triton.transport.copies import memcpy2d_struct, memcpy3d_struct  # noqa: E402

# (name, rows, row bytes, dst pitch, src pitch): all-gather rows of one rank at W ranks
GEOMETRIES = [
    ("qwen3 W=2 (128 experts x 3 of [768, 2048] bf16)", 384, 384 * 2048 * 2, 768 * 2048 * 2, 384 * 2048 * 2),
    ("qwen3 W=8", 384, 96 * 2048 * 2, 768 * 2048 * 2, 96 * 2048 * 2),
    ("256 experts W=2 (256 x 3 of [512, 1024] bf16)", 768, 256 * 1024 * 2, 512 * 1024 * 2, 256 * 1024 * 2),
    ("256 experts W=8", 768, 64 * 1024 * 2, 512 * 1024 * 2, 64 * 1024 * 2),
]


def timed(fn, iters: int, back_to_back: int = 1) -> list[float]:
    """Event times of ``fn``; with ``back_to_back`` > 1 each sample is the mean of that many calls
    queued between two events, so a launch's host time hides behind the previous copy."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(back_to_back):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / back_to_back)
    return out


@triton.jit
def _rows_copy_loop(dst, src, width, dpitch, spitch, tiles_per_row, n_tiles, BLOCK: tl.constexpr,
                    CACHE: tl.constexpr):
    """A fixed grid; program ``p`` copies tiles ``p, p + grid, ...`` (row-major over rows x tiles)."""
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        row = (t // tiles_per_row).to(tl.int64)
        col = (t % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
        m = col < width
        if CACHE:
            v = tl.load(src + row * spitch + col, mask=m, cache_modifier=".cg")
            tl.store(dst + row * dpitch + col, v, mask=m, cache_modifier=".cs")
        else:
            tl.store(dst + row * dpitch + col, tl.load(src + row * spitch + col, mask=m), mask=m)


@triton.jit
def _rows_copy(dst, src, width, dpitch, spitch, BLOCK: tl.constexpr):
    """Row ``program_id(0)``, elements ``[program_id(1) * BLOCK, +BLOCK)`` of it (int64 words)."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = col < width
    tl.store(dst + row * dpitch + col, tl.load(src + row * spitch + col, mask=m), mask=m)


def ways_of(rows: int, width: int, dpitch: int, spitch: int, dst: torch.Tensor, src: torch.Tensor, s: int,
            tune: bool = False) -> dict:
    """The ways to make ``dst``'s rows ``src``'s (see the module notes), as callables."""
    d, x = dst.data_ptr(), src.data_ptr()
    ways = {"contiguous": lambda: check(cu.cuMemcpyAsync(d, x, rows * width, s), "1d")}
    m2 = memcpy2d_struct(cu, d, x, width, rows, dpitch, spitch)
    ways["2d"] = lambda: check(cu.cuMemcpy2DAsync(m2, s), "2d")
    for sub in (4096, 65536, 131072, 262144, 524288):
        if width % sub == 0 and dpitch % sub == 0 and spitch % sub == 0:
            m3 = memcpy3d_struct(cu, d, x, width, rows, dpitch, spitch, sub)
            ways[f"3d/{sub >> 10}K"] = (lambda m: lambda: check(cu.cuMemcpy3DAsync(m, s), "3d"))(m3)

    def per_row():
        for i in range(rows):
            check(cu.cuMemcpyAsync(d + i * dpitch, x + i * spitch, width, s), "row")

    ways["rows"] = per_row
    dview, sview = dst.view(rows, dpitch)[:, :width], src.view(rows, spitch)[:, :width]
    ways["torch"] = lambda: dview.copy_(sview)
    if width % 8 == 0 and dpitch % 8 == 0 and spitch % 8 == 0:
        d8, x8 = dst.view(torch.int64), src.view(torch.int64)
        for block, warps in ((1024, 4), (4096, 8), (8192, 8)):
            grid = (rows, triton.cdiv(width // 8, block))
            ways[f"triton/{block * 8 >> 10}K"] = (lambda g, b, nw: lambda: _rows_copy[g](
                d8, x8, width // 8, dpitch // 8, spitch // 8, BLOCK=b, num_warps=nw))(grid, block, warps)
        if tune:
            sms = torch.cuda.get_device_properties(dst.device).multi_processor_count
            for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
                per_row = triton.cdiv(width // 8, block)
                for ctas_per_sm in (1, 2, 4, 8):
                    for cache in (0, 1):
                        grid = (min(rows * per_row, sms * ctas_per_sm),)
                        ways[f"loop/{block * 8 >> 10}K/w{warps}/x{ctas_per_sm}/c{cache}"] = (
                            lambda g, b, nw, pr, c: lambda: _rows_copy_loop[g](
                                d8, x8, width // 8, dpitch // 8, spitch // 8, pr, rows * pr,
                                BLOCK=b, CACHE=c, num_warps=nw))(grid, block, warps, per_row, cache)
            for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)):
                grid = (rows, triton.cdiv(width // 8, block))
                ways[f"triton/{block * 8 >> 10}K/w{warps}"] = (lambda g, b, nw: lambda: _rows_copy[g](
                    d8, x8, width // 8, dpitch // 8, spitch // 8, BLOCK=b, num_warps=nw))(grid, block, warps)
    return ways


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--back-to-back", type=int, default=1,
                    help="copies queued between the two events of a sample (hides launch host time)")
    ap.add_argument("--tune", action="store_true",
                    help="also a grid-stride Triton copy over tile sizes, warps, CTAs per SM, cache hints")
    ap.add_argument("--only", default="", help="substring of the geometries to run")
    args = ap.parse_args()
    torch.cuda.init()
    s = torch.cuda.current_stream().cuda_stream
    version = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    info = env_info(torch.device("cuda", torch.cuda.current_device()))
    print(f"{info['gpu']} | torch {info['torch']} | CUDA {info['cuda']}, driver API {version} | "
          f"git {info['git_sha']} | {info['date']} | each geometry's contiguous row: this run's ceiling for it")
    print("| geometry | way | mean ms | median ms | GB/s (read + write) | of contiguous |")
    print("|---|---|---|---|---|---|")
    for name, rows, width, dpitch, spitch in GEOMETRIES:
        if args.only not in name:
            continue
        src = torch.randint(0, 100, (rows * spitch,), dtype=torch.uint8, device="cuda")
        dst = torch.zeros(rows * dpitch, dtype=torch.uint8, device="cuda")
        want = src.view(rows, spitch)[:, :width]
        base = None
        for way, fn in ways_of(rows, width, dpitch, spitch, dst, src, s, args.tune).items():
            if args.tune and way in ("rows", "2d"):
                continue
            dst.zero_()
            t = timed(fn, args.iters, args.back_to_back)
            if way != "contiguous":
                assert torch.equal(dst.view(rows, dpitch)[:, :width], want), (name, way)
            gbps = 2 * rows * width / (statistics.mean(t) * 1e-3) / 1e9
            base = base or gbps
            print(f"| {name} | {way} | {statistics.mean(t):.3f} | {statistics.median(t):.3f} | {gbps:.0f} | "
                  f"{gbps / base:.0%} |", flush=True)
        del src, dst


if __name__ == "__main__":
    main()
