"""What a node-local collective enqueues that depends only on its addresses, prepared once
and cached by them: the reduce-scatter's bound reductions and per-round push copies, the
all-gather's pull copies and the staging of this rank's shards -- what the ring
(:mod:`tide_triton.executors.ring`) runs, eagerly (:mod:`tide_triton.executors.node_local`) or prepared
(:mod:`tide_triton.executors.prepared`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import chain
from typing import Any, Sequence

import numpy as np
import torch

from .copy_plan import ARRAY_PLAN_MIN, Strided, plan_copies, prepare_planned
from .work import prepare_padding_zeros
from ..group.core import Group
from ..plan.heap import Ring
from ..kernels.segments import Binding, SegmentProgram, Span, upload_table_pairs
from ..plan.layout import ShardLayout
from ..runtime.profiling import host_range, in_host_range
from ..plan.schedule import ring_plan

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


KERNEL_PUSH_MIN_PIECES = 64
"""Under ``GroupOptions.rs_push="auto"``, a reduce-scatter round whose pushes hold more pieces
than this (a piece: one gradient's rows for one peer) moves them with one kernel launch
instead of a copy descriptor each.  On new, scattered gradient addresses (FSDP2's MoE
layers every step) each descriptor costs the host ~5 us in ``cuMemcpyBatchAsync`` on the
H200, and more than ~1,000 queued behind a flag wait block the enqueuing thread, so the
pacer let the host only one or two rounds ahead (docs/constraints.md#queued-work-per-stream);
the Llama layers' 9 parameters stay on the copy engines."""


@lru_cache(maxsize=256)
def push_program(layout: ShardLayout, ring_bytes: int, elem_bytes: int, stages: int, me: int,
                 j: int) -> SegmentProgram:
    """Rank ``me``'s pushes of round ``j`` as one segment program: run ``i`` copies one piece --
    the rows of destination ``d`` of a gradient (source entry = the parameter, read where the
    gradient lies) into ``d``'s slot for ``me`` (destination entry = ``d``'s index among the
    round's destinations, in rank order)."""
    plan = ring_plan(layout, ring_bytes, elem_bytes, stages)
    Sp = layout.padded_shard_numels
    dests = _round_dests(plan, me, j)
    runs = tuple(Span(k, pc.slot_off, pc.param, d * Sp[pc.param] + pc.start, pc.numel)
                 for k, d in enumerate(dests) for pc in plan.chunks[d][j])
    return SegmentProgram(runs, n_dst=len(dests), n_src=len(layout))


def _round_dests(plan, me: int, j: int) -> list[int]:
    """The peers rank ``me`` pushes to in round ``j`` (rank order)."""
    return [d for d in range(plan.layout.world_size) if d != me and j < len(plan.chunks[d])]


def kernel_push_rounds(plan, me: int, how: str) -> frozenset[int]:
    """The rounds whose pushes go as one kernel launch (:class:`KernelPush`) under
    ``GroupOptions.rs_push`` = ``how``: none (``"copy_engine"``), every round with pieces
    (``"kernel"``), or those with more than :data:`KERNEL_PUSH_MIN_PIECES` (``"auto"``).  Made
    from the layout alone (kept by it): the same for every set of addresses."""
    if how == "copy_engine":
        return frozenset()
    least = 1 if how == "kernel" else KERNEL_PUSH_MIN_PIECES + 1
    return plan.layout.derived(
        ("node_prepare.kernel-push-rounds", plan.chunk_elems, plan.stages, me, least),
        lambda: frozenset(j for j in range(plan.rounds)
                          if sum(len(plan.chunks[d][j]) for d in _round_dests(plan, me, j)) >= least))


@dataclass(frozen=True, eq=False)
class KernelPush:
    """One round's pushes as one launch of the segment kernel (rows copied as they are:
    ``K=1``, no scale) in the copy queue's order; its tables hold the gradients' addresses,
    uploaded with the round's reductions'.  SM work, capped by ``GroupOptions.max_ctas``.
    The run's copy queue starts fenced from its compute stream ``cs``: where the tables went up
    on ``cs`` that orders the launch after them; where they went up elsewhere (a collective
    prepared on one stream and run on another) the copy queue waits for their upload events
    first.  ``cs`` waits for the copy queue at the run's end, so the tables are kept for ``cs``
    (a binding cached from a run on another stream: freed there, its memory could be reused
    before this launch ran), never recorded on the copy queue's own stream (the transport's,
    destroyed at close).  In a profiler's trace the launch lies in a ``tide_triton::kernel_push``
    range: the kernel's name is the reductions' (``segmented_reduce_kernel``), the range tells
    the SM time spent on transport from the sums'."""

    binding: Binding

    def enqueue(self, t: Any, cs: Any, captured: bool = False) -> None:
        b = self.binding
        ordered = captured or cs is None or b.uploaded_on(cs)
        if not captured and cs is not None:
            b.keep_tables_for(cs)
        with host_range("tide_triton::kernel_push"):
            t.on_copy_queue(lambda s: b.launch(check_addresses=False, capturing=captured, ordered=ordered,
                                               stream=s, record=False))


def keep_after_failure(g: Group, pushes: Sequence[Any]) -> None:
    """A run failed after enqueueing kernel pushes (a peer's timeout, a bad argument): the copy
    queue may still hold them, waiting on a flag its run's end would have joined -- keep their
    tables while the group's streams may run (:meth:`Group.keep_until_idle`: past its close where
    that leaked the heap), so that memory is never reused under a late launch."""
    kept = [p for p in pushes if isinstance(p, KernelPush)]
    if kept:
        g.keep_until_idle(kept)


def enqueue_push(t: Any, push: Any, cs: Any, captured: bool = False) -> None:
    """A round's pushes on the copy queue of a run on compute stream ``cs``: a
    :class:`KernelPush`, or prepared copies."""
    if isinstance(push, KernelPush):
        push.enqueue(t, cs, captured)
    else:
        t.copy_prepared(push, capturable=captured)


def copy_lists(pushes: Sequence[Any]) -> list[Any]:
    """The prepared copy lists among a reduce-scatter's pushes (what ``warm_replays`` takes)."""
    return [p for p in pushes if not isinstance(p, KernelPush)]


@in_host_range("tide_triton::prepare_reduce_scatter")
def prepare_reduce_scatter(g: Group, t, reg: Ring, plan, layout: ShardLayout, gptrs: tuple[int, ...],
                            shard_ptrs: tuple[int, ...], snumels: tuple[int, ...], gdt: torch.dtype,
                            sdt: torch.dtype, device: torch.device, scale: float | None, acc: bool,
                            ring_bytes: int | None = None):
    """Everything a reduce-scatter enqueues that depends only on its addresses: one bound
    reduction per chunk of this rank (sources in rank order: the peers' slots, and this
    rank's own gradients read in place), per round the pushes of this rank's slices into its
    peers' slots with the operations each queues -- ``(prepared copies, descriptors)``, or
    ``(KernelPush, 1)`` in the rounds :func:`kernel_push_rounds` picks -- and (without ``acc``)
    the zero-fill of padded shards' padding.  Every table (the reductions' and the kernel
    pushes') goes up in one upload.  The bindings hold stand-in tensors, not the caller's: a
    cached entry keeps no gradient alive."""
    W, me, S = g.world_size, g.rank, plan.stages
    es = gdt.itemsize
    ring = ring_bytes or g.options.ring_bytes
    src_stub = torch.empty(0, dtype=gdt, device=device)
    dst_stub = (torch.empty(0, dtype=sdt, device=device),) * len(layout)
    gp = _Addresses(gptrs)
    sources = []  # per chunk: contributors in rank order (the sum's fixed order): a peer's slot, or my gradients
    for j, (param, own_off, slot_off) in enumerate(_reduce_template(plan, me, es)):
        own = gp.plus(param, own_off)
        sources.append(_joined([own if c == me else _shifted(slot_off, t.address(me, reg.slot(j % S, c, me)))
                                for c in range(W)]))
    by_kernel = sorted(kernel_push_rounds(plan, me, g.options.rs_push))
    slot_tables = [tuple(t.address(d, reg.slot(j % S, me, d)) for d in _round_dests(plan, me, j)) for j in by_kernel]
    tables = upload_table_pairs(device, [(shard_ptrs, p) for p in sources] + [(d, gptrs) for d in slot_tables])
    mx = g.options.max_ctas
    made = layout.derived(("node_prepare.bindings", device.type, device.index), dict)
    reducers = []
    for j, (ptrs, shared) in enumerate(zip(sources, tables)):
        b = _bound(made, ("reduce", ring, es, S, me, j, gdt, sdt, W, mx),
                   partial(chunk_program, layout, ring, es, S, me, j),
                   dst_stub, (src_stub,) * len(ptrs), W, mx, (shard_ptrs, ptrs), shared)
        b.prepare(scale=scale, accumulate=acc)
        reducers.append(b)
    kernels = {}
    for j, dsts, shared in zip(by_kernel, slot_tables, tables[len(sources):]):
        b = _bound(made, ("push", ring, es, S, me, j, gdt, mx), partial(push_program, layout, ring, es, S, me, j),
                   (src_stub,) * len(dsts), (src_stub,) * len(gptrs), 1, mx, (dsts, gptrs), shared)
        b.prepare()
        kernels[j] = (KernelPush(b), 1)
    plans = push_plans(me, plan, t.address, reg, gptrs, es, skip=kernels)
    pushes = [kernels[j] if j in kernels else (prepare_planned(t, p), len(p)) for j, p in enumerate(plans)]
    padding = None if acc else prepare_padding_zeros(g, t, shard_ptrs, snumels, layout.shard_numels(me),
                                                     sdt.itemsize, device)
    return reducers, pushes, padding


def _bound(made: dict, key: tuple, program: Any, dsts: tuple, srcs: tuple, k: int, max_ctas: int | None,
           known_ptrs: tuple, shared: Any) -> Binding:
    """The binding of ``key`` (its ``program()``, stand-in tensors, ``k``, ``max_ctas``) on
    ``known_ptrs`` with tables ``shared``: the first one made, kept in ``made`` (the layout's,
    per device), :meth:`~tide_triton.kernels.Binding.rebound` to them -- its tile table, launch
    settings and compiled kernels shared where they agree."""
    first = made.get(key)
    if first is None:
        made[key] = b = Binding(program(), dsts, srcs, k, max_ctas, known_ptrs=known_ptrs, shared=shared)
        return b
    return first.rebound(known_ptrs, shared)


def _reduce_template(plan, me: int, es: int) -> list[tuple]:
    """Per chunk of rank ``me`` in ``plan``: its pieces' parameters, their byte offsets in
    the gradients (my rows of each) and in a slot -- what a chunk's source addresses are made
    of besides the addresses themselves; made once per plan, kept by its layout."""
    Sp = plan.layout.padded_shard_numels

    def make() -> list[tuple]:
        return [_columns([pc.param for pc in pieces], [(me * Sp[pc.param] + pc.start) * es for pc in pieces],
                         [pc.slot_off * es for pc in pieces]) for pieces in plan.chunks[me]]

    return plan.layout.derived(("node_prepare.reduce", plan.chunk_elems, plan.stages, me, es), make)


def _columns(*cols: list[int]) -> tuple:
    """A template's columns: int64 arrays where there are more than ``ARRAY_PLAN_MIN`` pieces
    (the per-call arithmetic then runs on arrays), else the lists (arrays cost more there)."""
    if cols and len(cols[0]) > ARRAY_PLAN_MIN:
        return tuple(np.asarray(c, dtype=np.int64) for c in cols)
    return cols


def push_plans(me: int, plan, address, reg: Ring, gptrs: Sequence[int], es: int,
               skip: Any = ()) -> list[list[Strided]]:
    """Per round, the copies pushing rank ``me``'s slices of its gradients (at ``gptrs``)
    into its peers' slots, planned: equal-shaped gradients allocated back to back (experts)
    are one strided copy per peer and round.  The pieces' parameters and offsets come from
    a template made once per plan (:func:`_push_template`); per call only the addresses are
    added (on arrays for long rounds).  Rounds in ``skip`` (pushed by a kernel) get ``[]``."""
    gp = _Addresses(gptrs)
    out = []
    for j, (dests, (dest_of, param, slot_off, const, size)) in enumerate(_push_template(plan, me, es)):
        if not dests or j in skip:
            out.append([])
            continue
        s = j % plan.stages
        bases = _Addresses([address(d, reg.slot(s, me, d)) for d in dests])
        out.append(plan_copies(bases.plus(dest_of, slot_off), gp.plus(param, const), size))  # arrays or lists
    return out


class _Addresses:
    """Addresses by index, as the tuple given and (made once, when first needed) an array."""

    __slots__ = ("values", "_array")

    def __init__(self, values: Sequence[int]) -> None:
        self.values, self._array = values, None

    def plus(self, index, offset):
        """``values[index[i]] + offset[i]`` for every ``i``: an array for array columns
        (:func:`_columns`), a list for list ones."""
        if isinstance(index, np.ndarray):
            if self._array is None:
                self._array = np.asarray(self.values, dtype=np.int64)
            return self._array[index] + offset
        v = self.values
        return [v[i] + o for i, o in zip(index, offset)]


def _shifted(offsets, base: int):
    return offsets + base if isinstance(offsets, np.ndarray) else [base + o for o in offsets]


def _joined(parts: list) -> tuple[int, ...]:
    if isinstance(parts[0], np.ndarray):
        return tuple(np.concatenate(parts).tolist())
    return tuple(chain.from_iterable(parts))


def _push_template(plan, me: int, es: int) -> list[tuple]:
    """Per round of ``plan``: the peers rank ``me`` pushes to, and per piece (in push order)
    the peer's index among them, the gradient's parameter, the byte offset in the peer's
    slot, the byte offset in the gradient, and the size -- everything but the addresses;
    made once per plan, kept by its layout."""
    layout = plan.layout
    Sp = layout.padded_shard_numels

    def make() -> list[tuple]:
        rounds = []
        for j in range(plan.rounds):
            dests = _round_dests(plan, me, j)
            cols: list[list[int]] = [[], [], [], [], []]
            for k, d in enumerate(dests):
                for pc in plan.chunks[d][j]:
                    cols[0].append(k)
                    cols[1].append(pc.param)
                    cols[2].append(pc.slot_off * es)
                    cols[3].append((d * Sp[pc.param] + pc.start) * es)
                    cols[4].append(pc.numel * es)
            rounds.append((dests, _columns(*cols)))
        return rounds

    return layout.derived(("node_prepare.push", plan.chunk_elems, plan.stages, me, es), make)


@in_host_range("tide_triton::prepare_all_gather")
def prepare_all_gather(g: Group, t, layout: ShardLayout, pptrs: tuple[int, ...], es: int,
                        source: tuple[int, tuple[int, ...]] | None, block_off: int) -> list:
    """The copy-engine descriptors of an all-gather into parameters at ``pptrs``: every
    rank's real rows of every parameter (``es``-byte elements) -- from that rank's heap
    block at ``block_off``, or (``source = (region offset, byte offset of each parameter in
    it)``, :func:`all_gather`'s ``params_region``) from the peers' copies of the region,
    where each rank wrote its own rows in place -- planned
    (:func:`~tide_triton.executors.copy_plan.plan_copies`: a run of equal-shaped parameters allocated
    back to back is one strided copy per rank) and prepared for the transport in batches of
    :data:`AG_BATCH` descriptors."""
    ranks, (rank_of, param, dst_off, src_off, size) = _gather_template(  # from blocks: every rank's is the same
        layout, None if source is None else g.rank, es, None if source is None else source[1])
    bases = _Addresses([t.address(r, block_off if source is None else source[0]) for r in ranks])
    plan = plan_copies(_Addresses(pptrs).plus(param, dst_off), bases.plus(rank_of, src_off), size)
    return [prepare_planned(t, plan[i:i + AG_BATCH]) for i in range(0, len(plan), AG_BATCH)]


def _gather_template(layout: ShardLayout, me: int | None, es: int, region_offs: tuple[int, ...] | None) -> tuple:
    """The ranks an all-gather reads from and, per copy (rank by rank, parameter by
    parameter): the rank's index among them, the parameter, the byte offset in the
    parameter, in the source (the rank's block, or its copy of the parameters' region at
    ``region_offs``) and the size -- everything but the addresses; kept by the layout."""
    offs, S = layout.flat_offsets, layout.padded_shard_numels

    def make() -> tuple:
        ranks = [r for r in range(layout.world_size) if region_offs is None or r != me]  # a region: mine in place
        cols: list[list[int]] = [[], [], [], [], []]
        for k, r in enumerate(ranks):
            for p, n in enumerate(layout.shard_numels(r)):
                if n:
                    cols[0].append(k)
                    cols[1].append(p)
                    cols[2].append(r * S[p] * es)
                    cols[3].append(offs[p] * es if region_offs is None else region_offs[p] + r * S[p] * es)
                    cols[4].append(n * es)
        return ranks, _columns(*cols)

    return layout.derived(("node_prepare.gather", me, es, region_offs), make)


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
