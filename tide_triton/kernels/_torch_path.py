"""The CPU path of the segmented kernel: a launch on CPU tensors as plain torch ops on views
of the bound addresses (``TIDE_TRITON_CPU_KERNELS=torch``, the default), one op per run, in
the kernel's arithmetic and order, so that its results equal the kernel's bit for bit."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

from ..runtime import envs

def cpu_runs_torch(device: torch.device) -> bool:
    """Whether a launch on ``device`` runs as plain torch: CPU tensors under
    ``TIDE_TRITON_CPU_KERNELS=torch`` (the default)."""
    return device.type == "cpu" and envs.cpu_kernels() == "torch"


def _host_view(addr: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor over ``numel`` elements of host memory at ``addr`` (not owned: the
    binding's tensors, or the transport's memory the caller bound, keep it alive)."""
    if numel <= 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * (numel * dtype.itemsize)).from_address(addr), dtype=dtype)


@dataclass(frozen=True)
class TorchPlan:
    """A program's runs for the plain-torch path: consecutive runs that continue each other
    in the same destination and source merged (one op each), and how far each destination
    and source slot is reached (the views' lengths)."""

    runs: tuple[tuple[int, int, int, int, int], ...]
    """(dst_idx, dst_off, src_idx, src_off, numel), numel > 0."""
    dst_extent: tuple[int, ...]
    src_extent: tuple[int, ...]


def torch_plan(runs: Sequence, n_dst: int, n_src: int) -> TorchPlan:
    """The runs (:class:`~tide_triton.kernels.segments.Span`) as the plain-torch path executes them."""
    merged: list[list[int]] = []
    dst_ext, src_ext = [0] * n_dst, [0] * n_src
    for r in runs:
        if r.numel <= 0:
            continue
        dst_ext[r.dst_idx] = max(dst_ext[r.dst_idx], r.dst_off + r.numel)
        src_ext[r.src_idx] = max(src_ext[r.src_idx], r.src_off + r.numel)
        if merged:
            d, do, si, so, n = merged[-1]
            if d == r.dst_idx and si == r.src_idx and do + n == r.dst_off and so + n == r.src_off:
                merged[-1][4] = n + r.numel
                continue
        merged.append([r.dst_idx, r.dst_off, r.src_idx, r.src_off, r.numel])
    return TorchPlan(tuple(map(tuple, merged)), tuple(dst_ext), tuple(src_ext))  # type: ignore[arg-type]


def torch_views(plan: TorchPlan, n_src: int, k: int, dst_ptrs: Sequence[int], src_ptrs: Sequence[int],
                ddt: torch.dtype, sdt: torch.dtype) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[int]]:
    """Per run of ``plan``: its destination, its piece of each of the K sources (as lists for
    the ``_foreach`` ops), and its length."""
    dviews = [_host_view(a, n, ddt) for a, n in zip(dst_ptrs, plan.dst_extent)]
    sviews = [_host_view(a, plan.src_extent[i % n_src], sdt) for i, a in enumerate(src_ptrs)]
    dsts = [dviews[di][do:do + n] for di, do, _, _, n in plan.runs]
    srcs = [[sviews[j * n_src + si][so:so + n] for _, _, si, so, n in plan.runs] for j in range(k)]
    return dsts, srcs, [r[4] for r in plan.runs]


def run_torch(views: tuple, k: int, scale: float | None, accumulate: bool, raw: bool) -> None:
    """One launch as plain torch over every run at once (torch's ``_foreach`` ops: one call per
    step, each run's own ``add_`` / ``copy_`` inside): the kernel's ``_block`` -- fp32 sum of
    the K sources in order from source 0, times ``scale``, plus the old value, one cast at the
    store (torch's ``copy_`` rounds to nearest even, as the kernel's store does) -- or a plain
    copy where the kernel moves the bits untouched (``RAW``) or only converts them."""
    dsts, srcs, sizes = views
    # One source and no arithmetic: copy_ is the kernel's widening (exact) then its one
    # rounding to nearest even -- torch converts fp16 -> bf16 through fp32 too.
    if raw or (k == 1 and scale is None and not accumulate):
        torch._foreach_copy_(dsts, srcs[0])
        return
    accs = list(torch.empty(sum(sizes), dtype=torch.float32).split(sizes))
    torch._foreach_copy_(accs, srcs[0])  # from source 0, not from 0.0: -0.0 stays -0.0
    for j in range(1, k):
        torch._foreach_add_(accs, srcs[j])
    if scale is not None:
        torch._foreach_mul_(accs, scale)
    if accumulate:
        torch._foreach_add_(accs, dsts)
    torch._foreach_copy_(dsts, accs)
