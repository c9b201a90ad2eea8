"""Prepared collectives: a node-local reduce-scatter or all-gather checked, agreed and
prepared once for fixed tensors (:func:`tide_triton.prepare_reduce_scatter`,
:func:`tide_triton.prepare_all_gather`), then run any number of times.  A run does no argument
checks, no agreement with the peers and no cache lookups: its host work does not grow with the
parameter count, only with the rounds of the ring (one ``copy_prepared`` per round, replayed as
a CUDA graph from the second run, and a few flag operations).

Flags: tokens, not counters (docs/design.md, "CUDA graph capture").  Each prepared collective
has a token ``T`` (the call number of the call that prepared it: the same on every rank,
distinct per prepared collective).  Each token word has one writer and one reader: the writer
stores ``T``, the reader waits for exactly ``T`` and sets its own word back to 0 before it tells
the writer (through the writer's own word) that the slot may be written again.  A run therefore
leaves every word 0, and the next run -- of this collective or of another prepared one --
starts from free slots without knowing what ran before.  For that, a run ends *quiescent*: a
reduce-scatter's copy queue waits until every slot it wrote was reduced by its reader, an
all-gather's until every reader has read its block (the caller's stream does not wait for
that: it only orders this rank's next write into the same memory).  Prepared collectives have
their own flags, ring and block (named heap regions), so they never share a slot or a word
with the eager calls.  Two ranks running different prepared collectives wait for tokens that
never come: a :class:`~tide_triton.errors.PeerTimeoutError` (host waits; on CUDA at
:func:`tide_triton.synchronize`) naming the peer, never a pairing of two calls.

The tensors are kept alive by the prepared collective, and a run checks that their storage has
not moved (``check_addresses=False`` skips that, for hot loops that know).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from . import node_prepare
from .executor import Streams, Work, copy_batches_paced
from .group import Group
from .heap import Ring, staging_ring
from .layout import ShardLayout
from .regions import HeapRegion
from .schedule import ring_plan

__all__ = ["PreparedReduceScatter", "PreparedAllGather", "prepared_reduce_scatter", "prepared_all_gather",
           "RING_KEY", "block_key"]

_PTR = torch.Tensor.data_ptr

RING_KEY = "tide_triton/prepared-rs-ring"
"""The heap region every prepared reduce-scatter of a group stages in (``ring_bytes``)."""


def block_key(nbytes: int) -> str:
    """The heap region the prepared all-gathers of ``nbytes``-byte blocks share."""
    return f"tide_triton/prepared-ag-block/{nbytes}"


class _Prepared:
    """What both prepared collectives share: the group, the device, the token, the tensors
    (kept alive; their addresses as prepared) and the heap region they own."""

    name = "prepared collective"

    def __init__(self, g: Group, device: torch.device, token: int, tensors: Sequence[Sequence[torch.Tensor]],
                 region: HeapRegion) -> None:
        self.g = g
        self.device = device
        self.token = token
        self._tensors = tuple(tuple(ts) for ts in tensors)
        self._ptrs = tuple(tuple(map(_PTR, ts)) for ts in self._tensors)
        self._region = region

    def _begin(self, check_addresses: bool, stream: object) -> None:
        """The run's preconditions, on this rank (before anything moves)."""
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be None or a torch.cuda.Stream, got {type(stream).__name__}")
        if self.device.type == "cuda" and _capturing(self.device, stream):
            raise RuntimeError(
                f"{self.name}: a run cannot be captured into a CUDA graph yet -- the token protocol that "
                "makes it capturable is built and tested on the CPU transport, but not yet on a GPU under "
                "capture; run it outside the captured region")
        if self._region.released:
            raise RuntimeError(f"{self.name}: its heap region {self._region.key!r} is released; restore() it "
                               "on every rank before running")
        if check_addresses:
            for ts, ptrs, what in zip(self._tensors, self._ptrs, self._names):
                now = tuple(map(_PTR, ts))
                if now != ptrs:
                    i = next(i for i, (a, b) in enumerate(zip(now, ptrs)) if a != b)
                    raise ValueError(
                        f"{self.name}: {what}[{i}] moved (data_ptr {hex(ptrs[i])} when prepared, {hex(now[i])} "
                        f"now; e.g. its storage was resized or swapped): prepare the collective again for the "
                        f"new storage")

    _names: tuple[str, ...] = ()

    def run(self, *, stream: object = None, async_op: bool = False, check_addresses: bool = True) -> Work:
        """The collective, as prepared, on the tensors' current values.  ``stream`` /
        ``async_op`` as for the eager call; ``check_addresses=False`` skips the check that no
        tensor's storage moved since it was prepared."""
        g = self.g
        with g.call(self.name) as c:
            self._begin(check_addresses, stream)
            c.moving = True
            return self._run(g, stream, async_op)

    def _run(self, g: Group, stream: object, async_op: bool) -> Work:
        raise NotImplementedError


def _capturing(device: torch.device, stream: object) -> bool:
    s = stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream(device)
    with torch.cuda.stream(s):
        return torch.cuda.is_current_stream_capturing()


class PreparedReduceScatter(_Prepared):
    """A node-local reduce-scatter prepared for fixed ``grads`` and ``shards``
    (:func:`tide_triton.prepare_reduce_scatter`); :meth:`run` performs it: the shards receive
    the sums of the grads' current values (same op, same accumulate as prepared)."""

    name = "reduce_scatter (prepared)"
    _names = ("grads", "shards")

    def __init__(self, g: Group, device: torch.device, token: int, grads: Sequence[torch.Tensor],
                 shards: Sequence[torch.Tensor], region: HeapRegion, plan: Any, prepared: tuple,
                 scale: float | None, accumulate: bool) -> None:
        super().__init__(g, device, token, (grads, shards), region)
        self.plan = plan
        self.reducers, pushes, self.padding = prepared
        self.pushes = [p for p, _n in pushes]
        self._ops = max((n for _, n in pushes), default=0) + 4 * g.world_size
        self.scale = scale
        self.accumulate = accumulate
        me, W = g.rank, g.world_size
        self.peers = [c for c in range(W) if c != me]
        self.dests = [[d for d in self.peers if j < len(plan.chunks[d])] for j in range(plan.rounds)]

    def _run(self, g: Group, stream: object, async_op: bool) -> Work:
        t = g.transport(self.device)
        st = Streams(g, t, self.device, stream, async_op)
        cs = st.compute
        fm, T, timeout = g.flags, self.token, g.options.timeout_s
        me, S, plan, peers = g.rank, self.plan.stages, self.plan, self.peers
        pace = g.pacer(self.device)
        pace.start(self._ops)
        pending: set[tuple[int, int]] = set()  # (dest, stage): written, its free token not seen yet
        with t.session(), st.kernels():
            t.fence_from(cs)  # grads are complete before the copy queue reads them
            for j in range(plan.rounds):
                s = j % S
                pace.before(j, t, timeout)
                dests = self.dests[j]
                frees = [d for d in dests if (d, s) in pending]
                if frees:  # the slot's previous contents were reduced by its reader
                    slots = [fm.program_rs_free(s, d) for d in frees]
                    t.wait_all_equal(slots, [T] * len(frees), peers=frees, timeout_s=timeout,
                                     what=f"rank {{peer}} to free prepared reduce-scatter slot (stage {s})")
                    t.signal_all([me] * len(frees), slots, [0] * len(frees))
                    pending.difference_update((d, s) for d in frees)
                t.copy_prepared(self.pushes[j])
                t.signal_all(dests, [fm.program_rs_ready(s, me)] * len(dests), [T] * len(dests))
                pending.update((d, s) for d in dests)
                if j < len(self.reducers):  # my chunk j, from my grads and the peers' slots, in rank order
                    slots = [fm.program_rs_ready(s, p) for p in peers]
                    t.wait_all_equal(slots, [T] * len(peers), peers=peers, timeout_s=timeout, stream=cs,
                                     what=f"rank {{peer}}'s prepared reduce-scatter contribution (chunk {j})")
                    t.signal_all([me] * len(peers), slots, [0] * len(peers), stream=cs)
                    self.reducers[j].launch(scale=self.scale, accumulate=self.accumulate, check_addresses=False)
                    t.signal_all(peers, [fm.program_rs_free(s, me)] * len(peers), [T] * len(peers), stream=cs)
                if st.cuda:
                    pace.after(j, cs if j < len(self.reducers) else t.copy_stream)
            if self.padding is not None:  # padding rows become zero (disjoint from the sums' rows)
                t.copy_prepared(self.padding[0])
            t.fence_to(cs)  # the grads may be reused once the copy queue has read them
            if pending:  # quiescent end: every slot this run wrote has been reduced
                ds = sorted(pending)
                slots = [fm.program_rs_free(s, d) for d, s in ds]
                t.wait_all_equal(slots, [T] * len(ds), peers=[d for d, _ in ds], timeout_s=timeout,
                                 what="rank {peer} to free prepared reduce-scatter slots (end of run)")
                t.signal_all([me] * len(ds), slots, [0] * len(ds))
        return st.finish()


class PreparedAllGather(_Prepared):
    """A node-local all-gather prepared for fixed ``shards`` and ``params``
    (:func:`tide_triton.prepare_all_gather`); :meth:`run` performs it: every rank's shards'
    current values into the params."""

    name = "all_gather (prepared)"
    _names = ("shards", "params")

    def __init__(self, g: Group, device: torch.device, token: int, shards: Sequence[torch.Tensor],
                 params: Sequence[torch.Tensor], region: HeapRegion, pulls: list, stage: tuple) -> None:
        super().__init__(g, device, token, (shards, params), region)
        self.pulls = pulls
        self.caster, self.stage_copies, self.pad_copies, self._zeros = stage

    def _run(self, g: Group, stream: object, async_op: bool) -> Work:
        t = g.transport(self.device)
        st = Streams(g, t, self.device, stream, async_op)
        cs = st.compute
        fm, T, timeout = g.flags, self.token, g.options.timeout_s
        me, W = g.rank, g.world_size
        ranks = list(range(W))
        with t.session(), st.kernels():
            t.fence_from(cs)  # shards are complete before the copy queue reads them
            # My block is free: the previous run (of any prepared all-gather) ended only after
            # every reader had read it.
            if self.caster is not None:  # cast on SMs, then the copy queue goes on from there
                self.caster.launch(check_addresses=False)
                t.fence_from(cs)
            else:
                t.copy_prepared(self.stage_copies)
            t.copy_prepared(self.pad_copies)
            t.signal_all(ranks, [fm.program_ag_ready(me)] * W, [T] * W)
            slots = [fm.program_ag_ready(r) for r in ranks]
            t.wait_all_equal(slots, [T] * W, peers=ranks, timeout_s=timeout,
                             what="rank {peer}'s prepared all-gather block")
            t.signal_all([me] * W, slots, [0] * W)
            copy_batches_paced(g, t, self.device, self.pulls, node_prepare.AG_BATCH, timeout)
            t.signal_all(ranks, [fm.program_ag_done(me)] * W, [T] * W)
            t.fence_to(cs)  # the params are complete for later work on the stream
            slots = [fm.program_ag_done(r) for r in ranks]  # quiescent end: every reader is done
            t.wait_all_equal(slots, [T] * W, peers=ranks, timeout_s=timeout,
                             what="rank {peer} to finish reading my prepared all-gather block")
            t.signal_all([me] * W, slots, [0] * W)
        return st.finish()


def prepared_reduce_scatter(g: Group, token: int, grads: list[torch.Tensor], shards: list[torch.Tensor],
                            layout: ShardLayout, gdt: torch.dtype, sdt: torch.dtype, device: torch.device,
                            scale: float | None, accumulate: bool) -> PreparedReduceScatter:
    """Make the prepared reduce-scatter of checked, agreed arguments (collective: the ring's
    heap region).  ``token``: the preparing call's number."""
    ring_bytes = g.options.ring_bytes
    region = g.heap_region(RING_KEY, ring_bytes, device)
    W, S, es = g.world_size, g.options.stages, gdt.itemsize
    reg: Ring = staging_ring(region.offset, region.nbytes, W, S, g.ring_layout().ag_off)
    plan = ring_plan(layout, ring_bytes, es, S)
    if plan.chunk_elems * es > reg.slot_bytes:
        raise RuntimeError("internal error: prepared ring plan and heap region disagree")
    t = g.transport(device)
    st = Streams(g, t, device, None, False)
    with st.kernels():
        prepared = node_prepare.prepare_reduce_scatter(
            g, t, reg, plan, layout, tuple(map(_PTR, grads)), tuple(map(_PTR, shards)),
            tuple(x.numel() for x in shards), gdt, sdt, device, scale, accumulate, ring_bytes)
    g.heap_barrier()
    return PreparedReduceScatter(g, device, token, grads, shards, region, plan, prepared, scale, accumulate)


def prepared_all_gather(g: Group, token: int, shards: list[torch.Tensor], params: list[torch.Tensor],
                        layout: ShardLayout, sdt: torch.dtype, pdt: torch.dtype,
                        device: torch.device) -> PreparedAllGather:
    """Make the prepared all-gather of checked, agreed arguments (collective: the block's
    heap region, shared by the group's prepared all-gathers of the same block size)."""
    es = pdt.itemsize
    nbytes = max(layout.flat_shard_numel * es, 1)
    region = g.heap_region(block_key(nbytes), nbytes, device)
    t = g.transport(device)
    pptrs, sptrs = tuple(map(_PTR, params)), tuple(map(_PTR, shards))
    block = t.address(g.rank, region.offset)
    dsts = tuple(block + o * es for o in layout.flat_offsets)
    st = Streams(g, t, device, None, False)
    pulls = node_prepare.prepare_all_gather(g, t, layout, pptrs, es, None, region.offset)
    with st.kernels():
        stage = node_prepare.prepare_stage(g, t, layout, shards, sptrs, dsts, sdt, pdt, device, into_block=True)
    g.heap_barrier()
    return PreparedAllGather(g, device, token, shards, params, region, pulls, stage)
