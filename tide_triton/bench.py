"""Kernel benchmarks: ``python -m tide_triton.bench`` (or ``tide-triton-bench``).

On a GPU: real layer shapes (Llama-3.1-70B, Qwen3-30B-A3B, Wan2.2-14B) at W = 8 and 64,
each kernel side by side with what FSDP2 runs for the same step, bandwidth reported as a
fraction of the device-copy ceiling measured in the same run.  Without a GPU: the same
code through the Triton interpreter at scaled-down sizes (a smoke run: its times say
nothing about GPUs).

What is compared (bytes counted are the fewest each operation must move):

* placement -- FSDP2's copy-out ``torch.split_with_sizes_copy`` of the bf16 all-gather
  buffer ``[W, F]`` into padded per-parameter storages, vs :func:`place_shards` from the
  same ``W`` rank blocks (bytes: read + write of every real element);
* accumulation -- K bf16 contributions of one rank's shards reduced into fp32 shards.
  FSDP2: ``torch._chunk_cat`` of per-parameter bf16 tensors into an fp32 ``[K, F]`` buffer
  then ``torch.sum`` over K; tide: :func:`accumulate_shards` from K flat bf16 receive slots
  in one pass (bytes: ``(2K + 4)`` per fp32 output element);
* host overhead -- CPU time per call for the Qwen3 layer (393 parameters), and the number
  of kernel launches per call.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch

__all__ = ["BenchRow", "env_info", "copy_ceiling", "bench_placement", "bench_accumulation",
           "bench_host_overhead", "main"]


# --------------------------------------------------------------------------- environment
def _git_sha() -> str:
    sha = os.environ.get("TIDE_GIT_SHA")
    if sha:
        return sha
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def script_main(main, header: str, argv: list[str] | None = None) -> int:
    """A benchmark script's entry point: ``--header`` prints its table header (for the
    device scripts, before their rows), anything else runs ``main``."""
    if "--header" in (sys.argv[1:] if argv is None else argv):
        print(header)
        return 0
    return main()


def env_info(device: torch.device) -> dict:
    """GPU, versions, git SHA and date: carried by every result row."""
    import triton

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_sha": _git_sha(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            info["nccl"] = "n/a"
    else:
        info["gpu"] = f"none (CPU: {platform.processor() or platform.machine()}, Triton interpreter)"
        info["cuda"] = "n/a"
    return info


# --------------------------------------------------------------------------- timing
def _time_ms(fn: Callable[[], None], device: torch.device) -> float:
    """Median milliseconds per call (device events on GPU, a host clock on CPU)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()  # warm-up (the interpreter is slow: one timed run)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@dataclass
class BenchRow:
    model: str
    world_size: int
    op: str
    impl: str
    time_ms: float
    bytes: int
    extra: dict = field(default_factory=dict)

    def gbps(self) -> float:
        return self.bytes / (self.time_ms * 1e-3) / 1e9 if self.time_ms > 0 else float("nan")


def copy_ceiling(device: torch.device, nbytes: int) -> BenchRow:
    """Device-copy ceiling: one large contiguous copy, bytes read + written."""
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a)
    t = _time_ms(lambda: b.copy_(a), device)
    return BenchRow("-", 0, "copy ceiling", "torch copy_", t, 2 * n * 4)


# --------------------------------------------------------------------------- benchmarks
def bench_placement(model: str, shapes: Sequence[tuple[int, ...]], world_size: int,
                    device: torch.device, *, src_dtype: torch.dtype = torch.bfloat16) -> list[BenchRow]:
    """split_with_sizes_copy (FSDP2 copy-out) vs place_shards, same rank blocks."""
    from . import ShardLayout, bind_place_shards

    layout = ShardLayout(shapes, world_size)
    W, F = world_size, layout.flat_shard_numel
    ag_out = torch.randn(W * F, device=device).to(src_dtype)
    blocks = list(ag_out.view(W, F).unbind(0))
    params = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in layout.padded_shapes]
    real = sum(layout.numels)
    rows = []
    if src_dtype == torch.bfloat16:
        outs = [p.view(W, -1) for p in params]
        split = list(layout.padded_shard_numels)
        t = _time_ms(lambda: torch.split_with_sizes_copy(ag_out.view(W, F), split, dim=1, out=outs), device)
        rows.append(BenchRow(model, W, "placement bf16", "FSDP2 split_with_sizes_copy", t, 2 * W * F * 2))
    binding = bind_place_shards(blocks, params, layout)
    t = _time_ms(binding.launch, device)
    op = "placement bf16" if src_dtype == torch.bfloat16 else "placement fp32->bf16"
    nbytes = real * (src_dtype.itemsize + 2)
    rows.append(BenchRow(model, W, op, "tide place_shards", t, nbytes))
    del ag_out, blocks, params, binding
    return rows


def bench_accumulation(model: str, shapes: Sequence[tuple[int, ...]], world_size: int,
                       device: torch.device, *, k: int = 8) -> list[BenchRow]:
    """chunk_cat into fp32 + sum (FSDP2's reduce-scatter input + the reduction) vs
    accumulate_shards from K bf16 receive slots into fp32 shards."""
    from . import ShardLayout, bind_accumulate_shards

    layout = ShardLayout(shapes, world_size)
    F = layout.flat_shard_numel
    n = sum(layout.shard_numels(0))
    rows = []
    # FSDP2: per-parameter bf16 tensors holding K segments each -> fp32 [K, F] -> sum.
    grads = [torch.randn((k * c, *s[1:]), device=device).to(torch.bfloat16)
             for c, s in zip(layout.rows_per_rank, shapes)]
    cat = torch.empty(k, F, dtype=torch.float32, device=device)
    red = torch.empty(F, dtype=torch.float32, device=device)

    def fsdp() -> None:
        torch._chunk_cat(grads, dim=0, num_chunks=k, out=cat)
        torch.sum(cat, dim=0, out=red)

    t = _time_ms(fsdp, device)
    rows.append(BenchRow(model, world_size, f"accumulate K={k} bf16->fp32", "FSDP2 chunk_cat fp32 + sum",
                         t, (2 + 4) * k * F + (4 * k + 4) * F))
    del grads, cat, red
    slots = [torch.randn(F, device=device).to(torch.bfloat16) for _ in range(k)]
    shards = [torch.empty(s, dtype=torch.float32, device=device) for s in layout.shard_shapes(0)]
    binding = bind_accumulate_shards(slots, shards, layout, 0)
    t = _time_ms(lambda: binding.launch(scale=1.0 / k), device)
    rows.append(BenchRow(model, world_size, f"accumulate K={k} bf16->fp32", "tide accumulate_shards",
                         t, (2 * k + 4) * n))
    return rows


def _count_launches(fn: Callable[[], None]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def bench_host_overhead(model: str, shapes: Sequence[tuple[int, ...]], world_size: int,
                        device: torch.device, *, calls: int = 200) -> list[BenchRow]:
    """Host microseconds per call after the first (tables cached), and launches per call."""
    from . import ShardLayout, accumulate_shards, bind_accumulate_shards, bind_place_shards, place_shards

    layout = ShardLayout(shapes, world_size)
    W, F = world_size, layout.flat_shard_numel
    blocks = list(torch.randn(W * F, device=device).to(torch.bfloat16).view(W, F).unbind(0))
    params = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in layout.padded_shapes]
    slots = blocks[:8] if W >= 8 else blocks
    shards = [torch.empty(s, dtype=torch.float32, device=device) for s in layout.shard_shapes(0)]
    pb = bind_place_shards(blocks, params, layout)
    ab = bind_accumulate_shards(slots, shards, layout, 0)
    ag_flat = torch.cat(blocks)
    outs = [p.view(W, -1) for p in params]
    split = list(layout.padded_shard_numels)
    cases = {
        "place_shards() (checks every call)": lambda: place_shards(blocks, params, layout),
        "bound place .launch()": pb.launch,
        "bound place .launch(check_addresses=False)": lambda: pb.launch(check_addresses=False),
        "accumulate_shards() (checks every call)": lambda: accumulate_shards(slots, shards, layout, 0, scale=0.125),
        "bound accumulate .launch()": lambda: ab.launch(scale=0.125),
        "FSDP2 split_with_sizes_copy": lambda: torch.split_with_sizes_copy(ag_flat.view(W, F), split, dim=1, out=outs),
    }
    rows = []
    for name, fn in cases.items():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = math.inf
        for _ in range(3 if device.type == "cuda" else 1):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
            if device.type == "cuda":
                torch.cuda.synchronize()
        launches = _count_launches(fn) if device.type == "cuda" else -1
        rows.append(BenchRow(model, W, "host overhead / call", name, best / 1e3, 0,
                             {"host_us": round(best, 1), "launches": launches, "params": len(layout)}))
    return rows


def staging_table(models: Sequence[str], world_sizes: Sequence[int], ring_bytes: int = 256 << 20) -> str:
    """Reduce-scatter buffer bytes per rank, from the layout: FSDP2's fp32 input (the whole
    layer, W padded shards) vs tide_triton's receive ring (fixed) -- no GPU needed."""
    from . import ShardLayout
    from .schedule import ring_plan
    from .workloads import layer_shapes

    lines = ["| model | W | FSDP2 fp32 RS input / rank | tide RS staging / rank | chunks per RS |",
             "|---|---|---|---|---|"]
    for model in models:
        for W in world_sizes:
            layout = ShardLayout(layer_shapes(model), W)
            plan = ring_plan(layout, ring_bytes, 2)
            lines.append(f"| {model} | {W} | {4 * sum(layout.padded_numels) / 2**20:.0f} MiB | "
                         f"{plan.staging_elems() * 2 / 2**20:.1f} MiB | {plan.rounds} |")
    return "\n".join(lines)


def slot_reuse_table(models: Sequence[str], world_sizes: Sequence[int], ring_bytes: int = 256 << 20,
                     pool: int = 2) -> str:
    """Per rank, backward of a stack of identical layers (bf16 params, fp32 reduce, one
    layer prefetched): the unsharded-parameter and reduce-scatter staging bytes, from the
    layout -- stock FSDP2 (2 unsharded layers + the fp32 RS input), tide_triton with its ring,
    tide_triton with Slot-Reuse (``pool`` heap slots of one unsharded layer, no staging of its
    own; the 4 MiB fallback ring counted).  No GPU needed."""
    from . import ShardLayout
    from .schedule import ring_plan
    from .workloads import layer_shapes

    mib = 2 ** 20
    lines = ["| model | W | unsharded layer (bf16) | stock FSDP2: 2 layers + fp32 RS input | "
             "tide ring: 2 layers + ring | tide Slot-Reuse: slots + 4 MiB ring | chunks per staged RS |",
             "|---|---|---|---|---|---|---|"]
    for model in models:
        for W in world_sizes:
            layout = ShardLayout(layer_shapes(model), W)
            layer = 2 * sum(layout.padded_numels)
            stock = 2 * layer + 2 * layer
            ring = 2 * layer + ring_bytes
            slot = pool * layer + (4 << 20)
            plan = ring_plan(layout, layer, 2, 2)
            lines.append(f"| {model} | {W} | {layer / mib:.0f} MiB | {stock / mib:.0f} MiB | {ring / mib:.0f} MiB | "
                         f"{slot / mib:.0f} MiB | {plan.rounds} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def _table(rows: list[BenchRow], ceiling: BenchRow) -> str:
    cgbps = ceiling.gbps()
    lines = ["| model | W | op | implementation | time (ms) | GB/s | % of copy ceiling | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    base: dict[tuple, float] = {}
    for r in rows:
        key = (r.model, r.world_size, r.op)
        if r.impl.startswith("FSDP2"):
            base[key] = r.time_ms
        if r.op.startswith("host"):
            lines.append(f"| {r.model} | {r.world_size} | {r.op} | {r.impl} | "
                         f"{r.extra['host_us']:.1f} µs host | | | launches: {r.extra['launches']} |")
            continue
        su = f"{base[key] / r.time_ms:.2f}x" if key in base and not r.impl.startswith("FSDP2") else ""
        lines.append(f"| {r.model} | {r.world_size} | {r.op} | {r.impl} | {r.time_ms:.3f} | "
                     f"{r.gbps():.0f} | {100 * r.gbps() / cgbps:.1f}% | {su} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from .kernels._segments import interpreting
    from .workloads import MODELS, layer_shapes, scaled_shapes

    ap = argparse.ArgumentParser(prog="python -m tide_triton.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--world-sizes", nargs="+", type=int, default=None,
                    help="default: 8 64 on a GPU, 8 on CPU")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--json", default=None, help="append result rows (with env info) to this JSON-lines file")
    ap.add_argument("--skip", nargs="*", default=[], choices=["placement", "cast", "accumulate", "host"])
    args = ap.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and not interpreting():
        ap.error("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before starting")
    gpu = device.type == "cuda"
    world_sizes = args.world_sizes or ([8, 64] if gpu else [8])
    factor = 1 if gpu else 256
    max_params = None if gpu else 48
    info = env_info(device)
    print(f"tide_triton kernel benchmarks on {info['gpu']} | torch {info['torch']} | triton "
          f"{info['triton']} | CUDA {info['cuda']} | git {info['git_sha']} | {info['date']}")
    print("sizes: real layer shapes" if gpu else
          f"sizes: layer shapes with every dim divided by {factor} (CPU, Triton interpreter: "
          "a smoke run, times say nothing about GPUs)")
    ceiling = copy_ceiling(device, (2 << 30) if gpu else (16 << 20))
    print(f"device-copy ceiling: {ceiling.gbps():.0f} GB/s (read + write, {ceiling.bytes >> 20} MiB moved)")
    rows: list[BenchRow] = []
    def shapes_of(model: str) -> tuple[str, tuple]:
        shapes = layer_shapes(model) if factor == 1 else scaled_shapes(model, factor)
        if max_params is not None and len(shapes) > max_params:
            return f"{model} (first {max_params} of {len(shapes)} params)", shapes[:max_params]
        return model, shapes

    for model_name in args.models:
        model, shapes = shapes_of(model_name)
        for W in world_sizes:
            if "placement" not in args.skip:
                rows += bench_placement(model, shapes, W, device)
            if "cast" not in args.skip:
                rows += bench_placement(model, shapes, W, device, src_dtype=torch.float32)
            if "accumulate" not in args.skip:
                rows += bench_accumulation(model, shapes, W, device)
            if gpu:
                torch.cuda.empty_cache()
    if "host" not in args.skip and "qwen3-30b-a3b" in args.models:
        model, shapes = shapes_of("qwen3-30b-a3b")
        rows += bench_host_overhead(model, shapes, 8, device, calls=200 if gpu else 2)
    print(_table(rows, ceiling))
    print("\nreduce-scatter buffers per rank (from the layout, bf16 gradients, 64 MiB ring):")
    print(staging_table(args.models, [2, 4, 8, 16, 64]))
    if not gpu:
        print("(CPU: every kernel runs in Triton's Python interpreter, so kernel times and 'host "
              "overhead' measure the interpreter, not tide_triton)")
    if args.json:
        with open(args.json, "a") as f:
            for r in [ceiling] + rows:
                d = asdict(r)
                d.update(gbps=r.gbps(), pct_ceiling=100 * r.gbps() / ceiling.gbps(), device=str(device), **info)
                f.write(json.dumps(d) + "\n")
        print(f"rows appended to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
