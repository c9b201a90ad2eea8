"""The eager node-local executor: a ``reduce_scatter`` or ``all_gather`` of one node, checked
and agreed by :mod:`tide_triton.collectives`, run over the group's transport -- on the
multicast path where it is on (docs/multicast.md), else on the ring (:mod:`tide_triton.executors.ring`,
:class:`~tide_triton.executors.ring.Counters` flags) with bindings prepared once per set of addresses
(:mod:`tide_triton.executors.prepare`, the group's cache).
"""
from __future__ import annotations

from typing import Any

import torch

from . import state
from . import multicast
from . import prepare
from . import ring
from ..runtime.checks import RS_APART, check_bound, spans_at
from .ag_block import restore_block
from ..group.core import Group
from ..plan.heap import ag_block_end, staging_ring
from ..plan.layout import ShardLayout
from ..plan.schedule import ring_plan
from .work import Streams, Work

_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel


def _multicast(g: Group, t: Any, device: torch.device, stream: object, async_op: bool, run: Any) -> Work:
    """``run()`` -- a collective on the multicast path -- once the call's identity is agreed."""
    g.check_in_exchange()  # the call's identity, agreed before the barriers pair anything
    st = Streams(g, t, device, stream, async_op)
    with st.kernels():
        run()
    return st.finish()


def reduce_scatter(g: Group, grads_l: list[torch.Tensor], shards_l: list[torch.Tensor], layout: ShardLayout,
                   gdt: torch.dtype, sdt: torch.dtype, device: torch.device, scale: float | None, acc: bool,
                   stream: object, async_op: bool, staging: Any) -> Work:
    """The node-local reduce-scatter of checked, agreed arguments (``staging``: a Slot-Reuse
    region that is the ring, or None)."""
    W, me = g.world_size, g.rank
    t = g.transport(device)
    if g.options.multicast != "off" and multicast.eligible_rs(gdt, sdt, staging):  # docs/multicast.md
        if (mc := multicast.path(g, device, t)) is not None:
            # the checks of the copy-engine path, every call (this path caches nothing by address)
            check_bound("grads", grads_l, "shards", shards_l, apart=RS_APART)
            return _multicast(g, t, device, stream, async_op, lambda: multicast.reduce_scatter_node(
                mc, grads_l, shards_l, layout, me, scale=scale, accumulate=acc))
    es = gdt.itemsize
    S, ring_bytes = g.options.stages, g.options.ring_bytes
    reg = g.ring_layout()
    if staging is not None:  # Slot-Reuse: the caller's region is the ring
        ring_bytes = staging.nbytes
        reg = staging_ring(staging.offset, staging.nbytes, W, S, reg.ag_off)
    plan = ring_plan(layout, ring_bytes, es, S)
    if plan.chunk_elems * es > reg.slot_bytes:
        raise RuntimeError("internal error: ring plan and heap regions disagree")
    t.ensure_heap(reg.ag_off)
    st = Streams(g, t, device, stream, async_op)
    gptrs = tuple(map(_PTR, grads_l))
    shard_ptrs, snumels = tuple(map(_PTR, shards_l)), tuple(map(_NUMEL, shards_l))
    # Prepare (tables, kernels, copy lists) before any flag wait is enqueued (see
    # Binding.prepare); cached by address, so a call on the same tensors prepares nothing.
    key = ("rs", layout, gdt, sdt, device, gptrs, shard_ptrs, snumels, S, ring_bytes, reg.ring_off, scale, acc)
    prep = g.cached(key)
    if prep is None:
        # the shards recur beside new gradients (FSDP2 on MoE layers): their own checks are remembered
        state.of(g).checked_shards.check_bound(
            "grads", grads_l, "shards", shards_l, (sdt, shard_ptrs, snumels), (gdt.itemsize, sdt.itemsize),
            apart=RS_APART, in_spans=spans_at(gptrs, layout, gdt.itemsize))
        with st.kernels():
            prep = g.cache(key, prepare.prepare_reduce_scatter(g, t, reg, plan, layout, gptrs, shard_ptrs,
                                                                    snumels, gdt, sdt, device, scale, acc,
                                                                    ring_bytes))
    reducers, pushes, padding = prep
    t.warm_replays(prepare.copy_lists([p for p, _n in pushes]) + [padding[0] if padding else None])
    g.heap_barrier()
    ops = max((n for _, n in pushes), default=0) + 4 * W
    peers = [c for c in range(W) if c != me]
    dests = [[d for d in peers if j < len(plan.chunks[d])] for j in range(plan.rounds)]
    return ring.reduce_scatter(g, t, st, device, plan, dests, reducers, [p for p, _n in pushes], padding,
                               ring.Counters(g, staging=staging), scale=scale, accumulate=acc, ops=ops)


def all_gather(g: Group, shards_l: list[torch.Tensor], params_l: list[torch.Tensor], layout: ShardLayout,
               pdt: torch.dtype, sdt: torch.dtype, device: torch.device, stream: object, async_op: bool,
               region: Any, source: tuple[int, tuple[int, ...]] | None) -> Work:
    """The node-local all-gather of checked, agreed arguments (``region``, ``source``: the
    params region and ``(its offset, each parameter's byte offset in it)``, or None)."""
    me = g.rank
    # Ranks may pass full or padded params: the flat block (padded shards) is the same.
    # The block holds the parameters' dtype: a cast (fp32 shards -> bf16 parameters) happens
    # once, at the sender, on its own shard (1/W of the layer, on SMs), and every rank then
    # pulls the cast bytes on copy engines -- half the bytes of pulling fp32, no SMs at the
    # receivers.  With a params region there is no block: the cast (or copy) writes my rows
    # in place and the peers pull them from there.
    t = g.transport(device)
    if source is None and g.options.multicast != "off" and multicast.eligible_ag(pdt):  # docs/multicast.md
        if (mc := multicast.path(g, device, t)) is not None:
            check_bound("shards", shards_l, "params", params_l, apart=multicast.AG_APART)
            return _multicast(g, t, device, stream, async_op,
                              lambda: multicast.all_gather_node(mc, shards_l, params_l, layout, me))
    es = pdt.itemsize
    reg = g.ring_layout()
    if source is None:
        restore_block(g, t, device)
        t.ensure_heap(ag_block_end(reg.ag_off, layout.flat_shard_numel * es))
    st = Streams(g, t, device, stream, async_op)
    pulls, stage = _ag_bindings(g, t, st, shards_l, params_l, layout, pdt, sdt, device, source, reg.ag_off)
    _caster, stage_copies, pad_copies, _zeros = stage
    t.warm_replays([*pulls, stage_copies, pad_copies])  # before any flag wait
    g.heap_barrier()
    return ring.all_gather(g, t, st, device, pulls, stage, ring.Counters(g, region=region))


def _ag_bindings(g: Group, t: Any, st: Streams, shards_l: list[torch.Tensor], params_l: list[torch.Tensor],
                 layout: ShardLayout, pdt: torch.dtype, sdt: torch.dtype, device: torch.device,
                 source: tuple[int, tuple[int, ...]] | None, ag_off: int) -> tuple[list, tuple]:
    """The all-gather's pulls and the staging of my shards, from the group's cache by addresses
    (prepared before any flag wait is enqueued, see Binding.prepare: repeats on the same
    storage prepare nothing)."""
    me, es = g.rank, pdt.itemsize
    pptrs, sptrs, snumels = tuple(map(_PTR, params_l)), tuple(map(_PTR, shards_l)), tuple(map(_NUMEL, shards_l))
    where = ag_off if source is None else ("region", source[0])  # the block moves when regions are added
    key = ("ag", layout, pdt, device, pptrs, where)
    pulls = g.cached(key)
    skey = ("ag-stage", layout, sdt, pdt, device, sptrs, snumels, where, pptrs if source is not None else None)
    stage = g.cached(skey)
    if pulls is None or stage is None:
        check_bound("shards", shards_l, "params", params_l)
    if pulls is None:
        pulls = g.cache(key, prepare.prepare_all_gather(g, t, layout, pptrs, es, source, ag_off))
    if stage is None:
        if source is None:  # my place in my block
            block = t.address(me, ag_off)
            dsts = tuple(block + o * es for o in layout.flat_offsets)
        else:  # my rows of each parameter
            dsts = tuple(pptrs[p] + me * n * es for p, n in enumerate(layout.padded_shard_numels))
        with st.kernels():
            stage = g.cache(skey, prepare.prepare_stage(g, t, layout, shards_l, sptrs, dsts, sdt, pdt,
                                                             device, into_block=source is None))
    return pulls, stage
