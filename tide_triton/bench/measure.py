"""Kernel measurements behind ``python -m tide_triton.bench`` (the command line is its
``__main__``; tables and plots in :mod:`tide_triton.bench.report`).  Nothing here prints.

What is compared (bytes counted are the fewest each operation must move):

* placement -- FSDP2's copy-out ``torch.split_with_sizes_copy`` of the bf16 all-gather
  buffer ``[W, F]`` into padded per-parameter storages, vs :func:`place_shards` from the
  same ``W`` rank blocks (bytes: read + write of every real element);
* accumulation -- K bf16 contributions of one rank's shards reduced into fp32 shards.
  FSDP2: ``torch._chunk_cat`` of per-parameter bf16 tensors into an fp32 ``[K, F]`` buffer
  then ``torch.sum`` over K; tide: :func:`accumulate_shards` from K flat bf16 receive slots
  in one pass (bytes: ``(2K + 4)`` per fp32 output element);
* host overhead -- CPU time per call for the Qwen3 layer (393 parameters), and, on a GPU,
  the number of kernel launches per call.
"""
from __future__ import annotations

import datetime as _dt
import gc
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from ..kernels import accumulate_shards, bind_accumulate_shards, bind_place_shards, place_shards
from ..kernels.segments import cpu_runs_torch
from ..plan.layout import ShardLayout

# --------------------------------------------------------------------------- garbage collector
class GcPasses:
    """The garbage collector's passes while counting (process-wide: every thread's), the full
    (generation 2) ones among them, and their time.  ~700 container objects alive at once
    start a pass; a call holding one per parameter (a shape, a tuple) starts passes in
    proportion to the parameter count, and now and then a full pass over every object of
    the process -- tens of milliseconds with torch and Triton loaded -- lands in one call.
    A context manager, or :meth:`start` / :meth:`stop`."""

    def __init__(self) -> None:
        self.count = self.full = 0
        self.seconds = self._t0 = 0.0
        self._on = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.full += info.get("generation") == 2
            self.seconds += time.perf_counter() - self._t0

    def start(self) -> "GcPasses":
        if not self._on:
            gc.callbacks.append(self._callback)
            self._on = True
        return self

    def stop(self) -> None:
        if self._on:
            gc.callbacks.remove(self._callback)
            self._on = False

    def __enter__(self) -> "GcPasses":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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


def env_info(device: torch.device) -> dict:
    """GPU, versions, git SHA and date: carried by every result row."""
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
        info["gpu"] = f"none (CPU: {platform.processor() or platform.machine()}, {cpu_kernels_label(device)})"
        info["cuda"] = "n/a"
    return info


def device_label(device: torch.device) -> str:
    """What ``device`` is, in words, for headers: ``"NVIDIA H200 (cuda:0)"`` or
    ``"CPU (x86_64, 2 cores), kernels as plain torch"``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"{torch.cuda.get_device_name(index)} (cuda:{index})"
    cpu = platform.processor() or platform.machine() or "unknown"
    return f"CPU ({cpu}, {os.cpu_count()} cores), kernels {cpu_kernels_label(device)}"


def cpu_kernels_label(device: torch.device) -> str:
    """How the kernels run on ``device``'s CPU tensors, in words (``TIDE_TRITON_CPU_KERNELS``)."""
    return "as plain torch" if cpu_runs_torch(device) else "through the Triton interpreter"


# --------------------------------------------------------------------------- timing
def _time_ms(fn: Callable[[], None], device: torch.device) -> float:
    """Median milliseconds per call (device events on GPU, a host clock on CPU)."""
    if device.type == "cuda":
        import triton.testing  # GPU only: the CPU path times with a host clock

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
    return rows


def _time_fsdp_accumulate(layout, k: int, device: torch.device) -> float:
    """FSDP2: per-parameter bf16 tensors holding K segments each -> fp32 [K, F] -> sum."""
    grads = [torch.randn((k * c, *s[1:]), device=device).to(torch.bfloat16)
             for c, s in zip(layout.rows_per_rank, layout.shapes)]
    cat = torch.empty(k, layout.flat_shard_numel, dtype=torch.float32, device=device)
    red = torch.empty(layout.flat_shard_numel, dtype=torch.float32, device=device)

    def fsdp() -> None:
        torch._chunk_cat(grads, dim=0, num_chunks=k, out=cat)
        torch.sum(cat, dim=0, out=red)

    return _time_ms(fsdp, device)


def bench_accumulation(model: str, shapes: Sequence[tuple[int, ...]], world_size: int,
                       device: torch.device, *, k: int = 8) -> list[BenchRow]:
    """chunk_cat into fp32 + sum (FSDP2's reduce-scatter input + the reduction) vs
    accumulate_shards from K bf16 receive slots into fp32 shards."""
    layout = ShardLayout(shapes, world_size)
    F = layout.flat_shard_numel
    n = sum(layout.shard_numels(0))
    rows = []
    t = _time_fsdp_accumulate(layout, k, device)  # its buffers are freed before tide's are made
    rows.append(BenchRow(model, world_size, f"accumulate K={k} bf16->fp32", "FSDP2 chunk_cat fp32 + sum",
                         t, (2 + 4) * k * F + (4 * k + 4) * F))
    slots = [torch.randn(F, device=device).to(torch.bfloat16) for _ in range(k)]
    shards = [torch.empty(s, dtype=torch.float32, device=device) for s in layout.shard_shapes(0)]
    binding = bind_accumulate_shards(slots, shards, layout, 0)
    t = _time_ms(lambda: binding.launch(scale=1.0 / k), device)
    rows.append(BenchRow(model, world_size, f"accumulate K={k} bf16->fp32", "tide accumulate_shards",
                         t, (2 * k + 4) * n))
    return rows


def _count_launches(fn: Callable[[], None]) -> int:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def bench_host_overhead(model: str, shapes: Sequence[tuple[int, ...]], world_size: int,
                        device: torch.device, *, calls: int = 200) -> list[BenchRow]:
    """Host microseconds per call after the first (tables cached), and launches per call."""
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
        extra = {"host_us": round(best, 1), "params": len(layout)}
        if device.type == "cuda":  # launches are counted by the CUDA profiler: GPU only
            extra["launches"] = _count_launches(fn)
        rows.append(BenchRow(model, W, "host overhead / call", name, best / 1e3, 0, extra))
    return rows
