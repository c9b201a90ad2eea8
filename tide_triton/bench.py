"""Kernel benchmarks: ``python -m tide_triton.bench`` (or ``tide-triton-bench``).

On a GPU: real layer shapes (Llama-3.1-70B, Qwen3-30B-A3B, Wan2.2-14B) at W = 8 and 64,
each kernel side by side with what FSDP2 runs for the same step, bandwidth reported as a
fraction of the device-copy ceiling measured in the same run.  Without a GPU: the same
code on CPU tensors (the kernels as plain torch, or through the Triton interpreter under
``TIDE_TRITON_CPU_KERNELS=interpret``) at scaled-down sizes (a smoke run: its times say
nothing about GPUs).

    python -m tide_triton.bench [--json ROWS.jsonl] [--plot FILE.png]
    python -m tide_triton.bench --plot FILE.png --from ROWS.jsonl     # plot a recorded run

This module is the command line; the measurements live in :mod:`tide_triton.measure`, the
tables and plots in :mod:`tide_triton.report` (their names are re-exported here).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .measure import (
    BenchRow,
    bench_accumulation,
    bench_host_overhead,
    bench_placement,
    copy_ceiling,
    device_label,
    env_info,
)
from .report import kernel_json_rows, kernel_table, slot_reuse_table, staging_table

__all__ = ["BenchRow", "env_info", "copy_ceiling", "bench_placement", "bench_accumulation",
           "bench_host_overhead", "staging_table", "slot_reuse_table", "script_main", "main"]

_RING_BYTES = 256 << 20  # tide_triton's default reduce-scatter ring (GroupOptions.ring_bytes)


def script_main(main, header: str, argv: list[str] | None = None) -> int:
    """A benchmark script's entry point: ``--header`` prints its table header (for the
    device scripts, before their rows), anything else runs ``main``."""
    if "--header" in (sys.argv[1:] if argv is None else argv):
        print(header)
        return 0
    return main()


def _plot(ap: argparse.ArgumentParser, path: str, rows: list[dict]) -> None:
    from .report import plot_kernel_rows

    try:
        plot_kernel_rows(rows, path)
    except (RuntimeError, ValueError) as e:
        ap.exit(2, f"{ap.prog}: error: --plot {path}: {e}\n")
    print(f"plot written to {path}")


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from ._cli import Progress, recorded_rows, require_device
    from .kernels.segments import cpu_runs_torch
    from .measure import cpu_kernels_label
    from .workloads import MODELS, layer_shapes, scaled_shapes

    ap = argparse.ArgumentParser(prog="python -m tide_triton.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--world-sizes", nargs="+", type=int, default=None,
                    help="default: 8 64 on a GPU, 8 on CPU")
    ap.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    ap.add_argument("--json", default=None, help="append result rows (with env info) to this JSON-lines file")
    ap.add_argument("--skip", nargs="*", default=[], choices=["placement", "cast", "accumulate", "host"])
    ap.add_argument("--plot", default=None, metavar="FILE",
                    help="draw time and bandwidth against world size (with the copy ceiling) into FILE "
                         "(.png, .svg, .pdf; needs matplotlib: pip install 'tide_triton[bench]')")
    ap.add_argument("--from", dest="from_rows", nargs="+", default=None, metavar="ROWS.jsonl",
                    help="with --plot: plot these recorded JSON rows instead of running the benchmarks")
    args = ap.parse_args(argv)

    if args.from_rows:
        _plot(ap, args.plot, recorded_rows(ap, args.from_rows, args.plot))
        return 0
    if any(w < 1 for w in args.world_sizes or []):
        ap.error(f"--world-sizes must be >= 1, got {args.world_sizes}")
    device = require_device(ap, "--device", args.device)
    if device.type == "cpu" and not cpu_runs_torch(device) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        ap.error("--device cpu with TIDE_TRITON_CPU_KERNELS=interpret: the kernels need the Triton interpreter; set "
                 "TRITON_INTERPRET=1 before starting (or unset TIDE_TRITON_CPU_KERNELS for plain torch)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gpu = device.type == "cuda"
    world_sizes = args.world_sizes or ([8, 64] if gpu else [8])
    factor = 1 if gpu else 256
    max_params = None if gpu else 48
    info = env_info(device)
    print(f"tide_triton kernel benchmarks on {device_label(device)} | torch {info['torch']} | triton "
          f"{info['triton']} | CUDA {info['cuda']} | git {info['git_sha']} | {info['date']}")
    print("sizes: real layer shapes" if gpu else
          f"sizes: layer shapes with every dim divided by {factor}, at most the first {max_params} parameters "
          f"(CPU, kernels {cpu_kernels_label(device)}: a smoke run, times say nothing about GPUs)", flush=True)

    def shapes_of(model: str) -> tuple[str, tuple]:
        shapes = layer_shapes(model) if factor == 1 else scaled_shapes(model, factor)
        if max_params is not None and len(shapes) > max_params:
            return f"{model} (first {max_params} of {len(shapes)} params)", shapes[:max_params]
        return model, shapes

    kinds = [k for k in ("placement", "cast", "accumulate") if k not in args.skip]
    host = "host" not in args.skip and "qwen3-30b-a3b" in args.models
    total = 1 + len(args.models) * len(world_sizes) * len(kinds) + host
    rows: list[BenchRow] = []
    with Progress(total, "bench") as progress:
        ceiling_bytes = (2 << 30) if gpu else (16 << 20)
        progress.step(f"device-copy ceiling (one {ceiling_bytes >> 20} MiB copy)")
        ceiling = copy_ceiling(device, ceiling_bytes)
        for model_name in args.models:
            model, shapes = shapes_of(model_name)
            for W in world_sizes:
                for kind in kinds:
                    progress.step(f"{model_name} W={W} {kind}")
                    if kind == "placement":
                        rows += bench_placement(model, shapes, W, device)
                    elif kind == "cast":
                        rows += bench_placement(model, shapes, W, device, src_dtype=torch.float32)
                    else:
                        rows += bench_accumulation(model, shapes, W, device)
                if gpu:
                    torch.cuda.empty_cache()
        if host:
            progress.step("qwen3-30b-a3b W=8 host overhead")
            model, shapes = shapes_of("qwen3-30b-a3b")
            rows += bench_host_overhead(model, shapes, 8, device, calls=200 if gpu else 2)
    print(f"device-copy ceiling: {ceiling.gbps():.0f} GB/s (read + write, {ceiling.bytes >> 20} MiB moved)")
    print(kernel_table(rows, ceiling, speedups=gpu))
    print(f"\nreduce-scatter buffers per rank (from the layout, bf16 gradients, {_RING_BYTES >> 20} MiB ring):")
    print(staging_table(args.models, [2, 4, 8, 16, 64], _RING_BYTES))
    if not gpu:
        print(f"(CPU: every kernel runs {cpu_kernels_label(device)}, so kernel times and host overhead say "
              "nothing about GPUs; no speed-ups or launch counts are shown)")
    json_rows = kernel_json_rows(rows, ceiling, str(device), info)
    if args.json:
        with open(args.json, "a") as f:
            for d in json_rows:
                f.write(json.dumps(d) + "\n")
        print(f"rows appended to {args.json}")
    if args.plot:
        _plot(ap, args.plot, json_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
