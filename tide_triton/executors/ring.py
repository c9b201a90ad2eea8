"""The node-local ring, written once: the reduce-scatter's rounds (push my slices into the
peers' slots, reduce my chunk from the peers' slots in rank order) and the all-gather's block
exchange (stage my shards, pull every rank's rows), over bindings prepared by
:mod:`tide_triton.executors.prepare`.

Runs differ only in how their flags say "ready" and "free" -- a flag discipline plugged in:

* :class:`Counters` (eager calls, :mod:`tide_triton.executors.node_local`): every round signals a
  new value from the group's counters (:class:`~tide_triton.executors.state.ExecState`); a slot is
  written again once its reader's free flag reached the value last pushed into it.  The call's
  identity is checked in first; Slot-Reuse staging waits for the peers' hand-over.
* :class:`Tokens` (prepared runs, :mod:`tide_triton.executors.prepared`): one token per prepared
  collective; each word has one writer and one reader, which sets it back to 0; runs end
  quiescent.  ``recorded=True``: the same run recorded into a graph (a user's capture or
  :mod:`tide_triton.executors.recorded`): capturable copies, no pacing, no host-side marks.
"""
from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any, Callable, ContextManager, Sequence

from . import state
from . import prepare
from .work import Streams, Work, copy_batches_paced, wait_vacated

class Counters:
    """The eager flag discipline: values counted up per group (``rs_count``, ``rs_last``,
    ``ag_epoch`` of :class:`~tide_triton.executors.state.ExecState`), never cleared.  Also what the
    across-nodes executor's node-local rounds use (:meth:`wait_free`, :meth:`pushed_to`,
    :meth:`rounds_done`, :meth:`next_epoch`)."""

    recorded = False

    def __init__(self, g: Any, *, staging: Any = None, region: Any = None) -> None:
        self.g, self.fm, self.timeout = g, g.flags, g.options.timeout_s
        self.me, self.W = g.rank, g.world_size
        self.state = state.of(g)
        self.base = self.state.rs_count
        self.epoch = 0
        self.staging, self.region = staging, region

    # -- shared with the across-nodes executor
    def value(self, j: int) -> int:
        """The value round (window) ``j`` of this call signals."""
        return self.base + j + 1

    def wait_free(self, t: Any, s: int, dests: Sequence[int], what: str) -> None:
        """Wait until each of ``dests`` has consumed what this rank last pushed into its slot of stage ``s``."""
        last = self.state.rs_last
        frees = [d for d in dests if (d, s) in last]
        t.wait_all([self.fm.rs_free(s, d) for d in frees], [last[(d, s)] for d in frees], peers=frees,
                   timeout_s=self.timeout, what=what)

    def pushed_to(self, d: int, s: int, v: int) -> None:
        """Rank ``d``'s slot of stage ``s`` was signalled ready with ``v``."""
        self.state.rs_last[(d, s)] = v

    def rounds_done(self, rounds: int, stream: Any) -> None:
        """Every round is enqueued: the counters move on, and a staging region learns where its
        contributions were read (``stream``)."""
        self.state.rs_count = self.base + rounds
        if self.staging is not None:
            self.staging._staged(stream)

    def next_epoch(self) -> int:
        self.state.ag_epoch += 1
        self.epoch = self.state.ag_epoch
        return self.epoch

    def begin_staging(self, t: Any, peers: Sequence[int]) -> None:
        """Slot-Reuse: nobody writes into a peer's region before the peer vacated it."""
        if self.staging is not None:
            wait_vacated(t, self.fm, self.staging, peers, self.timeout)

    # -- the ring's reduce-scatter
    def rs_begin(self, t: Any, plan: Any, peers: list[int]) -> None:
        # the peers this rank exchanges data with learn this call's identity (and check it)
        # before any of its data moves
        self.g.check_in(t, [d for d in peers if plan.chunks[d] or plan.chunks[self.me]])
        self.begin_staging(t, [d for d in peers if plan.chunks[d]])

    def rs_wait_free(self, t: Any, j: int, s: int, dests: list[int]) -> None:
        self.wait_free(t, s, dests, f"rank {{peer}} to free reduce-scatter slot (stage {s})")

    def rs_pushed(self, t: Any, j: int, s: int, dests: list[int]) -> None:
        v = self.value(j)
        t.signal_all(dests, [self.fm.rs_ready(s, self.me)] * len(dests), [v] * len(dests))
        for d in dests:
            self.pushed_to(d, s, v)

    def rs_wait_pushed(self, t: Any, j: int, s: int, peers: list[int], cs: Any) -> None:
        v = self.value(j)
        t.wait_all([self.fm.rs_ready(s, c) for c in peers], [v] * len(peers), peers=peers, timeout_s=self.timeout,
                   stream=cs, what=f"rank {{peer}}'s reduce-scatter contribution (chunk {j})")

    def rs_reduced(self, t: Any, j: int, s: int, peers: list[int], cs: Any) -> None:
        t.signal_all(peers, [self.fm.rs_free(s, self.me)] * len(peers), [self.value(j)] * len(peers), stream=cs)

    def rs_end(self, t: Any, cs: Any) -> None:
        """Nothing: the slots' free flags are waited for by the next call that writes them."""

    # -- the ring's all-gather
    def ag_scope(self, t: Any, st: Streams) -> ContextManager[Any]:
        """The eager all-gather runs outside a transport session, its cast alone on the kernels' stream."""
        return nullcontext()

    def ag_begin(self, t: Any, cs: Any, on_sms: bool) -> None:
        ranks = list(range(self.W))
        self.g.check_in(t, [r for r in ranks if r != self.me])  # every peer reads my block, I read theirs
        e = self.next_epoch()
        if e > 1:  # my block (my rows) may be written once every reader has finished the previous epoch
            t.wait_all([self.fm.ag_done(r) for r in ranks], [e - 1] * self.W, peers=ranks, timeout_s=self.timeout,
                       stream=cs if on_sms else None, what="rank {peer} to finish reading my all-gather block")

    def ag_staged(self, t: Any) -> None:
        ranks, e, W = list(range(self.W)), self.epoch, self.W
        t.signal_all(ranks, [self.fm.ag_ready(self.me)] * W, [e] * W)
        t.wait_all([self.fm.ag_ready(r) for r in ranks], [e] * W, peers=ranks, timeout_s=self.timeout,
                   what="rank {peer}'s all-gather block")

    def ag_pulled(self, t: Any) -> None:
        t.signal_all(list(range(self.W)), [self.fm.ag_done(self.me)] * self.W, [self.epoch] * self.W)

    def ag_end(self, t: Any, cs: Any) -> None:
        if self.region is not None:
            self.region._read(self.epoch)  # its vacate() waits for every peer's ag_done of this epoch


class Tokens:
    """The prepared flag discipline: token ``T`` (the preparing call's number) in words with
    one writer and one reader each; the reader waits for exactly ``T`` and sets its word back
    to 0 before it tells the writer the slot is free, so a run leaves every word 0 and ends
    quiescent.  ``recorded``: the run is being recorded into a graph.  ``joined()``: whether
    the run's end makes the caller's stream wait for the copy queue's quiescent end.
    ``block_free``: the all-gather block's one-element list holding the event of the last
    quiescent end on this rank."""

    def __init__(self, g: Any, token: int, recorded: bool, joined: Callable[[], bool],
                 block_free: list | None = None) -> None:
        self.g, self.fm, self.timeout = g, g.flags, g.options.timeout_s
        self.me, self.W = g.rank, g.world_size
        self.T, self.recorded, self.joined, self.block_free = token, recorded, joined, block_free
        self.pending: set[tuple[int, int]] = set()
        """``(dest, stage)``: written, its free token not seen yet."""

    def _take(self, t: Any, slots: list[int], peers: list[int], what: str, stream: Any = None) -> None:
        """Wait for exactly ``T`` in each of my ``slots`` (one per peer), then set them back to 0."""
        n = len(slots)
        if stream is None:
            t.wait_all_equal(slots, [self.T] * n, peers=peers, timeout_s=self.timeout, what=what)
            t.signal_all([self.me] * n, slots, [0] * n)
        else:
            t.wait_all_equal(slots, [self.T] * n, peers=peers, timeout_s=self.timeout, stream=stream, what=what)
            t.signal_all([self.me] * n, slots, [0] * n, stream=stream)

    # -- the ring's reduce-scatter
    def rs_begin(self, t: Any, plan: Any, peers: list[int]) -> None:
        """Nothing: a prepared run is not agreed, and starts from free slots."""

    def rs_wait_free(self, t: Any, j: int, s: int, dests: list[int]) -> None:
        frees = [d for d in dests if (d, s) in self.pending]
        if frees:  # the slot's previous contents were reduced by its reader
            self._take(t, [self.fm.program_rs_free(s, d) for d in frees], frees,
                       f"rank {{peer}} to free prepared reduce-scatter slot (stage {s})")
            self.pending.difference_update((d, s) for d in frees)

    def rs_pushed(self, t: Any, j: int, s: int, dests: list[int]) -> None:
        t.signal_all(dests, [self.fm.program_rs_ready(s, self.me)] * len(dests), [self.T] * len(dests))
        self.pending.update((d, s) for d in dests)

    def rs_wait_pushed(self, t: Any, j: int, s: int, peers: list[int], cs: Any) -> None:
        self._take(t, [self.fm.program_rs_ready(s, p) for p in peers], peers,
                   f"rank {{peer}}'s prepared reduce-scatter contribution (chunk {j})", stream=cs)

    def rs_reduced(self, t: Any, j: int, s: int, peers: list[int], cs: Any) -> None:
        t.signal_all(peers, [self.fm.program_rs_free(s, self.me)] * len(peers), [self.T] * len(peers), stream=cs)

    def rounds_done(self, rounds: int, stream: Any) -> None:
        """Nothing: tokens count no rounds."""

    def rs_end(self, t: Any, cs: Any) -> None:
        if self.pending:  # quiescent end: every slot this run wrote has been reduced
            ds = sorted(self.pending)
            self._take(t, [self.fm.program_rs_free(s, d) for d, s in ds], [d for d, _ in ds],
                       "rank {peer} to free prepared reduce-scatter slots (end of run)")
        if self.joined():
            t.fence_to(cs)

    # -- the ring's all-gather
    def ag_scope(self, t: Any, st: Streams) -> ContextManager[Any]:
        scope = ExitStack()
        scope.enter_context(t.session())
        scope.enter_context(st.kernels())
        return scope

    def ag_begin(self, t: Any, cs: Any, on_sms: bool) -> None:
        # My block is free for the copy queue: the previous run (of any prepared all-gather of
        # this block) ended there only after every reader had read it.  The cast writes it on
        # SMs, from the caller's stream, which never waited for that end: it waits for the
        # event recorded there (without it, a run following a run wrote the block while a
        # slower peer still read the previous one -- seen on the H200).  Under capture there
        # is no such event to wait on (a graph may not wait on one recorded outside it): the
        # capture began with the device idle, and replays follow joined runs on the caller's
        # stream.
        if on_sms and not self.recorded:
            t.wait_mark(self.block_free[0], cs)

    def ag_staged(self, t: Any) -> None:
        ranks, W = list(range(self.W)), self.W
        t.signal_all(ranks, [self.fm.program_ag_ready(self.me)] * W, [self.T] * W)
        self._take(t, [self.fm.program_ag_ready(r) for r in ranks], ranks, "rank {peer}'s prepared all-gather block")

    def ag_pulled(self, t: Any) -> None:
        t.signal_all(list(range(self.W)), [self.fm.program_ag_done(self.me)] * self.W, [self.T] * self.W)

    def ag_end(self, t: Any, cs: Any) -> None:
        ranks = list(range(self.W))  # quiescent end: every reader is done
        self._take(t, [self.fm.program_ag_done(r) for r in ranks], ranks,
                   "rank {peer} to finish reading my prepared all-gather block")
        if not self.recorded:  # where the block is free again (the next run's cast waits for it)
            self.block_free[0] = t.mark()
        if self.joined():
            t.fence_to(cs)


def reduce_scatter(g: Any, t: Any, st: Streams, device: Any, plan: Any, dests: Sequence[list[int]],
                   reducers: Sequence[Any], pushes: Sequence[Any], padding: Any, flags: Any, *,
                   scale: float | None, accumulate: bool, ops: int) -> Work:
    """The ring's reduce-scatter on stream policy ``st``: per round ``j`` (stage ``j % S``) my
    pushes into the slots of ``dests[j]`` once they are free, then my chunk ``j`` reduced from
    my gradients and the peers' slots in rank order; then the zero-fill of padding rows.
    ``reducers``, ``pushes``, ``padding``: :func:`~tide_triton.executors.prepare.prepare_reduce_scatter`'s
    (pushes without their descriptor counts); ``ops``: operations per round, for the pacing."""
    cs, rec, timeout = st.compute, flags.recorded, g.options.timeout_s
    me, S = g.rank, plan.stages
    peers = [c for c in range(g.world_size) if c != me]
    on = cs if st.cuda else None
    pace = None if rec else g.pacer(device)  # a recording neither fills queues nor waits on the host
    if pace is not None:
        pace.start(ops)
    with t.session(), st.kernels():
        t.fence_from(cs)  # grads are complete before the copy queue reads them
        flags.rs_begin(t, plan, peers)
        try:
            for j in range(plan.rounds):
                s = j % S
                if pace is not None:
                    pace.before(j, t, timeout)
                flags.rs_wait_free(t, j, s, dests[j])
                prepare.enqueue_push(t, pushes[j], on, rec)
                flags.rs_pushed(t, j, s, dests[j])
                if j < len(reducers):  # my chunk j, from my gradients and the peers' slots, in rank order
                    flags.rs_wait_pushed(t, j, s, peers, cs)
                    reducers[j].launch(scale=scale, accumulate=accumulate, check_addresses=False, capturing=rec,
                                       stream=on)
                    flags.rs_reduced(t, j, s, peers, cs)
                if st.cuda and pace is not None:  # my reduction's progress, or my copies' without chunk j
                    pace.after(j, cs if j < len(reducers) else t.copy_stream)
            flags.rounds_done(plan.rounds, cs)
            if padding is not None:  # padding rows become zero: after the pushes, on the copy queue
                t.copy_prepared(padding[0], capturable=rec)  # (disjoint from the sums' rows)
            t.fence_to(cs)  # the grads may be reused once the copy queue has read them
            flags.rs_end(t, cs)
        except BaseException:  # queued kernel pushes may still read their tables (to the run's end)
            prepare.keep_after_failure(g, pushes)
            raise
    return st.finish()


def all_gather(g: Any, t: Any, st: Streams, device: Any, pulls: Sequence[Any], stage: tuple, flags: Any) -> Work:
    """The ring's all-gather on stream policy ``st``: my shards staged into my block or my rows
    (cast on SMs where the dtypes differ, padding zero-filled), then every rank's real rows
    pulled into every parameter on the copy queue, in paced batches.  ``pulls``, ``stage``:
    :func:`~tide_triton.executors.prepare.prepare_all_gather`'s and ``prepare_stage``'s."""
    caster, stage_copies, pad_copies, _zeros = stage
    cs, rec = st.compute, flags.recorded
    with flags.ag_scope(t, st):
        t.fence_from(cs)  # shards are complete before the copy queue reads them
        flags.ag_begin(t, cs, caster is not None)
        if caster is not None:  # cast on SMs, then the copy queue goes on from there
            with st.kernels():
                caster.launch(check_addresses=False, capturing=rec)
            t.fence_from(cs)
        else:
            t.copy_prepared(stage_copies, capturable=rec)
        t.copy_prepared(pad_copies, capturable=rec)  # zeros from a buffer, on the copy queue
        flags.ag_staged(t)
        copy_batches_paced(g, t, device, pulls, prepare.AG_BATCH, g.options.timeout_s, capturing=rec)
        flags.ag_pulled(t)
        t.fence_to(cs)  # the params are complete for later work on the stream
        flags.ag_end(t, cs)
    return st.finish()
