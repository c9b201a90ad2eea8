"""Packing: one destination rank's slices of many per-parameter gradients into one
contiguous buffer (the payload of a network chunk, or a receive slot's layout).

Block ``j`` of ``out`` (``layout.flat_shard_numel`` elements) receives rank ``ranks[j]``'s
real rows of every gradient at ``layout.flat_offsets`` -- the same flat layout that
:func:`~tide_triton.kernels.accumulate_shards` and :func:`~tide_triton.kernels.place_shards`
read.  Padding positions are not written.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from ..runtime.checks import FLOAT_DTYPES, check_flat, check_shapes, check_tensor_list, check_uniform
from ..plan.layout import ShardLayout
from .placement import check_layout, check_max_ctas, check_ranks
from .segments import Binding, SegmentProgram, Span, check_device

@lru_cache(maxsize=64)
def _program(layout: ShardLayout, ranks: tuple[int, ...]) -> SegmentProgram:
    S, F = layout.padded_shard_numels, layout.flat_shard_numel
    runs = [
        Span(0, j * F + layout.flat_offsets[p], p, r * S[p], layout.shard_numels(r)[p])
        for j, r in enumerate(ranks)
        for p in range(len(layout))
    ]
    return SegmentProgram(tuple(runs), n_dst=1, n_src=len(layout))


def bind_pack_shards(
    grads: Sequence[torch.Tensor],
    out: torch.Tensor,
    layout: ShardLayout,
    ranks: int | Sequence[int],
    *,
    max_ctas: int | None = None,
) -> Binding:
    """Check the arguments of :func:`pack_shards` once; ``launch()`` the result."""
    check_layout(layout)
    rank_list = check_ranks(layout, ranks)
    max_ctas = check_max_ctas(max_ctas)
    P = len(layout)
    grads_l = check_tensor_list("grads", grads, P)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    check_shapes("grads", grads_l, layout.shapes, layout.padded_shapes)
    if out.dim() != 1:
        raise ValueError(f"out must be a 1-D buffer, got shape {tuple(out.shape)}")
    check_flat("out", out, len(rank_list) * layout.flat_shard_numel)
    if out.dtype not in FLOAT_DTYPES:
        raise TypeError(f"out must be bfloat16, float16 or float32, got {str(out.dtype).replace('torch.', '')}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {tuple(out.stride())}")
    check_device("out", out.device)
    if P:
        check_uniform("grads", grads_l, dtypes=FLOAT_DTYPES, device=out.device)
    program = _program(layout, rank_list)
    return Binding(program, (out,), tuple(grads_l), 1, max_ctas)


def pack_shards(
    grads: Sequence[torch.Tensor],
    out: torch.Tensor,
    layout: ShardLayout,
    ranks: int | Sequence[int],
    *,
    max_ctas: int | None = None,
) -> None:
    """Gather rank ``ranks``' (one rank or several, blocks back to back) real rows of every
    gradient into the flat buffer ``out``; dtypes may differ (cast fused).  ``grads[p]`` has
    ``layout.shapes[p]`` or the padded shape.  One launch on the current stream."""
    bind_pack_shards(grads, out, layout, ranks, max_ctas=max_ctas).launch(check_addresses=False)


def pack_shards_ref(
    grads: Sequence[torch.Tensor],
    out: torch.Tensor,
    layout: ShardLayout,
    ranks: int | Sequence[int],
) -> None:
    """Plain-torch reference of :func:`pack_shards`."""
    S, F = layout.padded_shard_numels, layout.flat_shard_numel
    for j, r in enumerate(check_ranks(layout, ranks)):
        for p, g in enumerate(grads):
            n = layout.shard_numels(r)[p]
            o = j * F + layout.flat_offsets[p]
            out[o:o + n].copy_(g.reshape(-1)[r * S[p]:r * S[p] + n])
