"""Kernel benchmarks: ``python -m tide_triton.bench`` (or ``tide-triton-bench``).

On a GPU: real layer shapes (Llama-3.1-70B, Qwen3-30B-A3B, Wan2.2-14B) at W = 8 and 64,
each kernel side by side with what FSDP2 runs for the same step, bandwidth reported as a
fraction of the device-copy ceiling measured in the same run.  Without a GPU: the same
code on CPU tensors (the kernels as plain torch, or through the Triton interpreter under
``TIDE_TRITON_CPU_KERNELS=interpret``) at scaled-down sizes (a smoke run: its times say
nothing about GPUs).

    python -m tide_triton.bench [--json ROWS.jsonl] [--plot FILE.png]
    python -m tide_triton.bench --plot FILE.png --from ROWS.jsonl     # plot a recorded run

This module is the command line; the measurements live in :mod:`tide_triton.bench.measure`,
the tables and plots in :mod:`tide_triton.bench.report`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from ..kernels.segments import cpu_runs_torch
from ..plan.workloads import MODELS, layer_shapes, scaled_shapes
from .cli import Progress, plot_or_exit, recorded_rows, require_device
from .measure import (
    BenchRow,
    bench_accumulation,
    bench_host_overhead,
    bench_placement,
    copy_ceiling,
    cpu_kernels_label,
    device_label,
    env_info,
)
from .report import kernel_json_rows, kernel_table, plot_kernel_rows, staging_table

_RING_BYTES = 256 << 20  # tide_triton's default reduce-scatter ring (GroupOptions.ring_bytes)


def _parser() -> argparse.ArgumentParser:
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
    return ap


def _device(ap: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The device of ``--device``, with the interpreter it needs on the CPU checked."""
    device = require_device(ap, "--device", args.device)
    if device.type == "cpu" and not cpu_runs_torch(device) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        ap.error("--device cpu with TIDE_TRITON_CPU_KERNELS=interpret: the kernels need the Triton interpreter; set "
                 "TRITON_INTERPRET=1 before starting (or unset TIDE_TRITON_CPU_KERNELS for plain torch)")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _run(args: argparse.Namespace, device: torch.device, world_sizes: list[int]) -> tuple[BenchRow, list[BenchRow]]:
    """The device-copy ceiling, then every (model, W, kernel) asked for: real layer shapes on a
    GPU; on the CPU every dim divided by 256 and at most 48 parameters a layer."""
    gpu = device.type == "cuda"
    factor, max_params = (1, None) if gpu else (256, 48)

    def shapes_of(model: str) -> tuple[str, tuple]:
        shapes = layer_shapes(model) if factor == 1 else scaled_shapes(model, factor)
        if max_params is not None and len(shapes) > max_params:
            return f"{model} (first {max_params} of {len(shapes)} params)", shapes[:max_params]
        return model, shapes

    print("sizes: real layer shapes" if gpu else
          f"sizes: layer shapes with every dim divided by {factor}, at most the first {max_params} parameters "
          f"(CPU, kernels {cpu_kernels_label(device)}: a smoke run, times say nothing about GPUs)", flush=True)
    kinds = [k for k in ("placement", "cast", "accumulate") if k not in args.skip]
    host = "host" not in args.skip and "qwen3-30b-a3b" in args.models
    rows: list[BenchRow] = []
    with Progress(1 + len(args.models) * len(world_sizes) * len(kinds) + host, "bench") as progress:
        ceiling_bytes = (2 << 30) if gpu else (16 << 20)
        progress.step(f"device-copy ceiling (one {ceiling_bytes >> 20} MiB copy)")
        ceiling = copy_ceiling(device, ceiling_bytes)
        for model_name in args.models:
            model, shapes = shapes_of(model_name)
            for W in world_sizes:
                for kind in kinds:
                    progress.step(f"{model_name} W={W} {kind}")
                    if kind == "accumulate":
                        rows += bench_accumulation(model, shapes, W, device)
                    else:
                        rows += bench_placement(model, shapes, W, device,
                                                **({"src_dtype": torch.float32} if kind == "cast" else {}))
                if gpu:
                    torch.cuda.empty_cache()
        if host:
            progress.step("qwen3-30b-a3b W=8 host overhead")
            model, shapes = shapes_of("qwen3-30b-a3b")
            rows += bench_host_overhead(model, shapes, 8, device, calls=200 if gpu else 2)
    return ceiling, rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.from_rows:
        plot_or_exit(ap, args.plot, plot_kernel_rows, recorded_rows(ap, args.from_rows, args.plot))
        return 0
    if any(w < 1 for w in args.world_sizes or []):
        ap.error(f"--world-sizes must be >= 1, got {args.world_sizes}")
    device = _device(ap, args)
    gpu = device.type == "cuda"
    info = env_info(device)
    print(f"tide_triton kernel benchmarks on {device_label(device)} | torch {info['torch']} | triton "
          f"{info['triton']} | CUDA {info['cuda']} | git {info['git_sha']} | {info['date']}")
    ceiling, rows = _run(args, device, args.world_sizes or ([8, 64] if gpu else [8]))
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
        plot_or_exit(ap, args.plot, plot_kernel_rows, json_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
