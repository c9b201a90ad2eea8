"""Accumulation: ``out = [out +] scale * sum_k src_k`` into a whole group's shards at once.

Replaces FSDP2's ``chunk_cat`` into an fp32 buffer plus the reduction of the
reduce-scatter: K contributions (bf16, fp16 or fp32) of rank ``rank``'s segment of every
parameter are read where they lie -- in flat receive slots (padded shards back to back) or
straight from per-parameter gradients -- summed in fp32 in the fixed order k = 0..K-1
(bit-reproducible), scaled (AVG, pre-multiplied sums), optionally added to the old value,
and stored once.  One launch for the group; ``max_ctas`` bounds the grid so the kernel can
stay small next to a GEMM.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from ..runtime.checks import (
    FLOAT_DTYPES,
    check_entries_uniform,
    check_shapes,
    check_sources,
    check_tensor_list,
    check_uniform,
)
from ..plan.layout import ShardLayout
from .placement import Sources, check_layout, check_max_ctas
from .segments import Binding, SegmentProgram, Span, check_device

@lru_cache(maxsize=64)
def _program(layout: ShardLayout, rank: int, flat_src: bool) -> SegmentProgram:
    S = layout.padded_shard_numels
    numels = layout.shard_numels(rank)
    if flat_src:
        runs = [Span(p, 0, 0, layout.flat_offsets[p], numels[p]) for p in range(len(layout))]
    else:
        runs = [Span(p, 0, p, rank * S[p], numels[p]) for p in range(len(layout))]
    return SegmentProgram(
        tuple(runs), n_dst=len(layout), n_src=1 if flat_src else len(layout)
    )


def _check_scale(scale: object) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def bind_accumulate_shards(
    srcs: Sources,
    shards: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    *,
    max_ctas: int | None = None,
) -> Binding:
    """Check the arguments of :func:`accumulate_shards` once; the result's
    ``launch(scale=..., accumulate=...)`` costs one kernel launch."""
    check_layout(layout)
    rank = layout._check_rank(rank)
    max_ctas = check_max_ctas(max_ctas)
    P = len(layout)
    shards_l = check_tensor_list("shards", shards, P)
    entries, flat = check_sources(
        "srcs", srcs, count_name="contribution", count=None,
        flat_numel=layout.flat_shard_numel, n_params=P,
    )
    check_shapes("shards", shards_l, layout.shard_shapes(rank), layout.shard_shapes(rank, padded=True),
                 why=lambda i: layout.shard_rule(i, rank))
    if not flat:
        for j, e in enumerate(entries):
            check_shapes(f"srcs[{j}]", e, layout.shapes, layout.padded_shapes)
    if P == 0:
        return Binding(_program(layout, rank, flat), (), (), len(entries), max_ctas)
    _, device = check_uniform("shards", shards_l, dtypes=FLOAT_DTYPES)
    check_device("shards", device)
    check_entries_uniform("srcs", entries, flat, dtypes=FLOAT_DTYPES, device=device)
    program = _program(layout, rank, flat)
    src_tensors = tuple(t for e in entries for t in e)
    return Binding(program, tuple(shards_l), src_tensors, len(entries), max_ctas)


def accumulate_shards(
    srcs: Sources,
    shards: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    *,
    scale: float | None = None,
    accumulate: bool = False,
    max_ctas: int | None = None,
) -> None:
    """Reduce K contributions of rank ``rank``'s segments into ``shards``.

    ``srcs[k]`` is contribution ``k``: a flat 1-D buffer with rank ``rank``'s padded
    segments back to back (what :func:`pack_shards` writes), or the list of full
    per-parameter gradients (``layout.shapes`` or padded), read at ``rank * S_p``.
    ``shards[p]`` (padded or unpadded shard shape; fp32, bf16 or fp16) gets
    ``[shards[p] +] scale * sum_k srcs[k]`` on its real rows; padding rows are not written.
    One launch on the current stream of the shards' device.
    """
    scale = _check_scale(scale)
    binding = bind_accumulate_shards(srcs, shards, layout, rank, max_ctas=max_ctas)
    binding.launch(scale=scale, accumulate=bool(accumulate), check_addresses=False)


def accumulate_shards_ref(
    srcs: Sources,
    shards: Sequence[torch.Tensor],
    layout: ShardLayout,
    rank: int,
    *,
    scale: float | None = None,
    accumulate: bool = False,
) -> None:
    """Plain-torch reference of :func:`accumulate_shards` (same order, fp32)."""
    S = layout.padded_shard_numels
    numels = layout.shard_numels(rank)
    for p, out in enumerate(shards):
        n = numels[p]
        if n == 0:
            continue
        acc = None
        for src in srcs:
            if isinstance(src, torch.Tensor):
                piece = src[layout.flat_offsets[p]:layout.flat_offsets[p] + n]
            else:
                piece = src[p].reshape(-1)[rank * S[p]:rank * S[p] + n]
            acc = piece.float().clone() if acc is None else acc + piece.float()
        if scale is not None:
            acc *= scale
        dst = out.view(-1)[:n]
        if accumulate:
            acc += dst.float()
        dst.copy_(acc)
