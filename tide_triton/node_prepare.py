"""What a node-local collective enqueues that depends only on its addresses, prepared once
and cached by them: the reduce-scatter's bound reductions and per-round push copies, the
all-gather's pull copies and the staging of this rank's shards.  Shared by the eager
executor (:mod:`tide_triton.collectives`) and the prepared collectives
(:mod:`tide_triton.programs`), which differ only in how their flags say "ready" and "free"."""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch

from .executor import Strided, plan_copies, prepare_padding_zeros, prepare_planned
from .group import Group
from .heap import Ring
from .kernels import Binding, SegmentProgram, Span
from .layout import ShardLayout
from .ranges import in_host_range
from .schedule import ring_plan

__all__ = ["AG_BATCH", "chunk_program", "prepare_reduce_scatter", "push_plans", "prepare_all_gather",
           "prepare_stage", "cast_program"]

AG_BATCH = 256
"""Copy descriptors per batch of an all-gather's pulls."""


@lru_cache(maxsize=256)
def chunk_program(layout: ShardLayout, ring_bytes: int, elem_bytes: int, stages: int, dest: int,
                   j: int) -> SegmentProgram:
    """Destination ``dest``'s reduction of its chunk ``j``: run ``i`` (one piece) reads
    source entry ``i`` of every contributor -- a slot address for a peer, a gradient
    address for ``dest`` itself -- so the pointer tables carry the offsets."""
    plan = ring_plan(layout, ring_bytes, elem_bytes, stages)
    pieces = plan.chunks[dest][j]
    runs = tuple(Span(pc.param, pc.start, i, 0, pc.numel) for i, pc in enumerate(pieces))
    return SegmentProgram(runs, n_dst=len(layout), n_src=len(pieces))


@in_host_range("tide_triton::prepare_reduce_scatter")
def prepare_reduce_scatter(g: Group, t, reg: Ring, plan, layout: ShardLayout, gptrs: tuple[int, ...],
                            shard_ptrs: tuple[int, ...], snumels: tuple[int, ...], gdt: torch.dtype,
                            sdt: torch.dtype, device: torch.device, scale: float | None, acc: bool,
                            ring_bytes: int | None = None):
    """Everything a reduce-scatter enqueues that depends only on its addresses: one bound
    reduction per chunk of this rank (sources in rank order: the peers' slots, and this
    rank's own gradients read in place), per round the copies that push this rank's slices
    to its peers' slots, and (without ``acc``) the zero-fill of padded shards' padding.  The
    bindings hold stand-in tensors, not the caller's: a cached entry keeps no gradient alive."""
    W, me, S = g.world_size, g.rank, plan.stages
    es = gdt.itemsize
    Sp = layout.padded_shard_numels
    src_stub = torch.empty(0, dtype=gdt, device=device)
    dst_stub = (torch.empty(0, dtype=sdt, device=device),) * len(layout)
    reducers = []
    for j, pieces in enumerate(plan.chunks[me]):
        s = j % S
        ptrs: list[int] = []
        for c in range(W):  # contributors in rank order: the sum's fixed order
            if c == me:
                ptrs += [gptrs[pc.param] + (me * Sp[pc.param] + pc.start) * es for pc in pieces]
            else:
                slot = t.address(me, reg.slot(s, c, me))
                ptrs += [slot + pc.slot_off * es for pc in pieces]
        b = Binding(chunk_program(layout, ring_bytes or g.options.ring_bytes, es, S, me, j), dst_stub,
                    (src_stub,) * len(ptrs), W, g.options.max_ctas, known_ptrs=(shard_ptrs, tuple(ptrs)))
        b.prepare(scale=scale, accumulate=acc)
        reducers.append(b)
    pushes = [(prepare_planned(t, p), len(p)) for p in push_plans(W, me, plan, t.address, reg, gptrs, Sp, es)]
    padding = None if acc else prepare_padding_zeros(g, t, shard_ptrs, snumels, layout.shard_numels(me),
                                                     sdt.itemsize, device)
    return reducers, pushes, padding


def push_plans(W: int, me: int, plan, address, reg: Ring, gptrs: Sequence[int], Sp: Sequence[int],
                es: int) -> list[list[Strided]]:
    """Per round, the copies pushing rank ``me``'s slices of its gradients (at ``gptrs``)
    into its peers' slots, planned: equal-shaped gradients allocated back to back (experts)
    are one strided copy per peer and round."""
    out = []
    for j in range(plan.rounds):
        s = j % plan.stages
        dsts, srcs, sizes = [], [], []
        for d in range(W):
            if d == me or j >= len(plan.chunks[d]):
                continue
            dst0 = address(d, reg.slot(s, me, d))
            for pc in plan.chunks[d][j]:
                dsts.append(dst0 + pc.slot_off * es)
                srcs.append(gptrs[pc.param] + (d * Sp[pc.param] + pc.start) * es)
                sizes.append(pc.numel * es)
        out.append(plan_copies(dsts, srcs, sizes))
    return out


@in_host_range("tide_triton::prepare_all_gather")
def prepare_all_gather(g: Group, t, layout: ShardLayout, pptrs: tuple[int, ...], es: int,
                        source: tuple[int, tuple[int, ...]] | None, block_off: int) -> list:
    """The copy-engine descriptors of an all-gather into parameters at ``pptrs``: every
    rank's real rows of every parameter (``es``-byte elements) -- from that rank's heap
    block at ``block_off``, or (``source = (region offset, byte offset of each parameter in
    it)``, :func:`all_gather`'s ``params_region``) from the peers' copies of the region,
    where each rank wrote its own rows in place -- planned
    (:func:`~tide_triton.executor.plan_copies`: a run of equal-shaped parameters allocated
    back to back is one strided copy per rank) and prepared for the transport in batches of
    :data:`AG_BATCH` descriptors."""
    offs, S = layout.flat_offsets, layout.padded_shard_numels
    dsts, srcs, sizes = [], [], []
    for r in range(g.world_size):
        if source is not None and r == g.rank:
            continue  # my rows are in place
        base = t.address(r, block_off if source is None else source[0])
        for p, n in enumerate(layout.shard_numels(r)):
            if n:
                dsts.append(pptrs[p] + r * S[p] * es)
                srcs.append(base + (offs[p] * es if source is None else source[1][p] + r * S[p] * es))
                sizes.append(n * es)
    plan = plan_copies(dsts, srcs, sizes)
    return [prepare_planned(t, plan[i:i + AG_BATCH]) for i in range(0, len(plan), AG_BATCH)]


@in_host_range("tide_triton::prepare_stage")
def prepare_stage(g: Group, t, layout: ShardLayout, shards: list[torch.Tensor], sptrs: tuple[int, ...],
                   dsts: tuple[int, ...], sdt: torch.dtype, pdt: torch.dtype, device: torch.device,
                   into_block: bool):
    """How this rank's shards (as they are: padded or not) reach ``dsts`` (one address per
    parameter: its place in this rank's heap block, or -- ``into_block`` False, ``params_region`` --
    its own rows in the parameter) in the parameters' dtype: ``(caster, copies, pad_copies,
    zeros)`` -- a bound cast kernel when the dtypes differ (stand-in tensors, addresses known),
    else prepared copies; then the zero-fill, from ``zeros`` (kept alive here), of what a
    shard lacks of this rank's part: its block slot (padded), or its rows of the parameter as
    the layout knows them (a padded parameter: the padded rows; the zeros the block path
    delivers too).  Into the block a padded shard goes whole; into the parameter only up to
    those rows: the last ranks' padding rows lie past the end of a parameter passed unpadded,
    where other data may live."""
    es = pdt.itemsize
    # how far this rank's part reaches: its block slot, or its rows of the parameter
    part = layout.padded_shard_numels if into_block else layout.shard_numels(g.rank)
    numels = [min(x.numel(), n) for x, n in zip(shards, part)]
    caster = copies = None
    if pdt != sdt:
        runs = tuple(Span(p, 0, p, 0, n) for p, n in enumerate(numels))
        caster = Binding(cast_program(runs, len(layout)),
                         (torch.empty(0, dtype=pdt, device=device),) * len(layout),
                         (torch.empty(0, dtype=sdt, device=device),) * len(layout), 1, g.options.max_ctas,
                         known_ptrs=(dsts, sptrs))
        caster.prepare()
    else:
        copies = prepare_planned(t, plan_copies(list(dsts), list(sptrs), [n * es for n in numels]))
    pads = [(p, n) for p, n in enumerate(numels) if n < part[p]]
    zeros = g.zeros(device, max(part[p] - n for p, n in pads) * es) if pads else None
    pad_copies = prepare_planned(t, plan_copies([dsts[p] + n * es for p, n in pads],
                                                [zeros.data_ptr()] * len(pads) if pads else [],
                                                [(part[p] - n) * es for p, n in pads]))
    return caster, copies, pad_copies, zeros


@lru_cache(maxsize=64)
def cast_program(runs: tuple[Span, ...], n: int) -> SegmentProgram:
    return SegmentProgram(runs, n_dst=n, n_src=n)
