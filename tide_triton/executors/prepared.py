"""Prepared collectives: a node-local reduce-scatter or all-gather checked, agreed and
prepared once for fixed tensors (:func:`tide_triton.prepare_reduce_scatter`,
:func:`tide_triton.prepare_all_gather`), then run any number of times.  A run does no argument
checks, no agreement with the peers and no cache lookups: its host work does not grow with the
parameter count, only with the rounds of the ring (one ``copy_prepared`` per round and a few flag
operations) -- and from the second run on a set of addresses the whole run is recorded once and
replayed by one graph launch (:mod:`tide_triton.executors.recorded`, ``$TIDE_TRITON_RUN_GRAPHS``).

Flags: tokens, not counters (docs/design.md, "CUDA graph capture"; the ring of
:mod:`.ring` with its :class:`~.ring.Tokens` discipline).  Each prepared collective
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

The tensors are kept alive by the prepared collective, and a run checks that each is still the
tensor it was prepared for -- the same address (its storage and storage offset), shape,
contiguity and dtype: an in-place ``t_()``, ``resize_()`` or ``set_()`` keeps the address and
would have the run read and write the prepared layout (``check_addresses=False`` skips the
check, for hot loops that know).  What depends on the
tensors' addresses is this rank's alone (its copy lists and reduction tables: the peers' side is
the heap), so a trusted caller -- the FSDP2 drop-in, whose parameter groups keep their shapes --
prepares without holding tensors (``hold=False``) and runs on the tensors of the moment
(:meth:`_Prepared._run_on`): a new set of addresses is bound locally, checked once, and cached.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch

from ..runtime import envs
from . import state
from ..runtime import host_capture
from . import prepare
from . import ring
from . import recorded
from ..runtime.checks import (RS_APART, CheckedLists, check_gather_shards, check_shapes, check_uniform, same_shapes,
                      spans_at)
from ..group.core import Group
from ..plan.heap import Ring, staging_ring
from ..plan.layout import ShardLayout
from ..group.regions import HeapRegion
from ..plan.schedule import ring_plan
from .held import HeldList
from .work import Streams, Work, capturing

_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel

RING_KEY = "tide_triton/prepared-rs-ring"
"""The heap region every prepared reduce-scatter of a group stages in (``ring_bytes``)."""

_BINDINGS_KEPT = 32
"""Sets of addresses a prepared collective keeps bound (:meth:`_Prepared._run_on`).  FSDP2's
caching allocator hands a parameter group's all-gather outputs more recurring addresses than
one might think (forward and backward, and they drift over the first steps): with 8 the
Llama-3.1-70B layers on the H200 bound ~5 new sets per step in the steady state (every one
new against the last two kept), where the eager path's cache (512 entries per group) hit
every call."""


_LISTS_KEPT = 8
"""Second lists (a reduce-scatter's shards) whose checks :meth:`_Prepared._check` remembers."""


_UNRECORDED = object()
"""``_Prepared._graphs``' answer for a binding not recorded yet (None: recording refused)."""


def block_key(nbytes: int) -> str:
    """The heap region the prepared all-gathers of ``nbytes``-byte blocks share."""
    return f"tide_triton/prepared-ag-block/{nbytes}"


class _Prepared:
    """What both prepared collectives share: the group, the device, the token, the layout,
    the heap region they own, the tensors they were prepared for (kept alive, unless
    ``hold`` is False) and this rank's bindings (address-dependent preparation) by address."""

    name = "prepared collective"
    _names: tuple[str, str] = ("", "")
    _full_first = True
    """Whether the first tensor list is the full one (grads) or the shards (all-gather)."""
    _recorded_in = ("auto", "all")
    """The ``$TIDE_TRITON_RUN_GRAPHS`` values under which this collective's runs are recorded
    (see envs)."""
    _dtypes: tuple[torch.dtype, torch.dtype]
    """The prepared dtypes of the full tensors and of the shards."""

    def __init__(self, g: Group, device: torch.device, token: int, layout: ShardLayout, region: HeapRegion,
                 first: Sequence[torch.Tensor], second: Sequence[torch.Tensor], hold: bool,
                 checked: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None) -> None:
        self.g = g
        self.device = device
        self.token = token
        self.layout = layout
        self._region = region
        self._bindings: OrderedDict[tuple, Any] = OrderedDict()
        self._checked_second = CheckedLists(_LISTS_KEPT)
        """Second lists that passed their own checks in :meth:`_check`, by addresses and sizes."""
        self.binds = 1
        """Sets of addresses bound so far (the first at preparation): a steady state adds none."""
        key = self._key(first, second)
        self._bindings[key] = self._bind(first, second, key)
        if checked is None:
            held = (HeldList(first, key[0]), HeldList(second, key[1]))
        else:  # the caller's tensors, which ``first`` and ``second`` are parts of (``shard_dims``)
            held = (HeldList(checked[0], tuple(map(_PTR, checked[0]))),
                    HeldList(checked[1], tuple(map(_PTR, checked[1]))))
        self._held = (*held, key) if hold else None
        """The tensors held (``hold``): each list as the caller passed it, as prepared (what a run
        checks), and the key of the binding of ``first`` and ``second``."""
        self._captured: dict[tuple, Any] = {}
        """Bindings a CUDA graph has recorded: kept (never evicted) as long as the group."""
        # host graphs (CPU) are safe in any mode; CUDA graphs of several ranks in one process not
        mode = envs.run_graphs(ranks_in_process=g.ranks_in_process if device.type == "cuda" else 1)
        self._graphs_on = mode in self._recorded_in
        self._graphs: dict[tuple, recorded.RunGraph | None] = {}
        """Eager runs recorded once per binding (:mod:`tide_triton.executors.recorded`); None: refused."""
        self._uses: dict[tuple, int] = {}
        """Eager runs made per binding not recorded yet."""
        self._last_compute: Any = None
        """The stream the last run's waits and sums went on (CUDA; see :meth:`_follow`)."""

    @staticmethod
    def _key(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> tuple:
        return tuple(map(_PTR, first)), tuple(map(_PTR, second)), tuple(map(_NUMEL, second))

    def _bind(self, first: Sequence[torch.Tensor], second: Sequence[torch.Tensor], key: tuple) -> Any:
        """This rank's copy lists and tables for these tensors (``key``: their :meth:`_key`)."""
        raise NotImplementedError

    def _check(self, first: list[torch.Tensor], second: list[torch.Tensor], key: tuple) -> None:
        """New tensors against what was prepared (the eager call's own rules): the full
        tensors (grads / params) with the layout's shapes, the shards by the collective's
        shard rule, each list of the prepared dtype on this device, their storages allocated,
        the outputs disjoint (and a reduce-scatter's shards apart from its grads).

        Every list's shapes, dtype, device and contiguity are checked every time.  The
        second list's storage and disjointness are not read again where it passed them at
        these very addresses and sizes (``key[1:]``, its dtype checked now): the drop-in's
        reduce-scatter shards recur every step beside autograd's new gradients; its pairing
        with the new list is still checked.  (A storage freed and allocated again smaller at
        the same address passes, as it does on the known-addresses path.)"""
        full, shards = (first, second) if self._full_first else (second, first)
        full_dtype, shard_dtype = self._dtypes
        layout, me = self.layout, self.g.rank
        name = self._names[0 if self._full_first else 1]
        if len(full) != len(layout) or not same_shapes(full, layout.shapes):
            raise ValueError(f"{self.name}: {name} must have the prepared shapes ({len(layout)} tensors)")
        check_uniform(name, full, dtypes=(full_dtype,), device=self.device)
        if self._full_first:
            check_shapes("shards", shards, layout.shard_shapes(me), layout.shard_shapes(me, padded=True),
                         why=lambda i: layout.shard_rule(i, me))
        else:
            check_gather_shards(shards, layout, me)
        check_uniform("shards", shards, dtypes=(shard_dtype,), device=self.device)
        esizes = tuple(d.itemsize for d in (self._dtypes if self._full_first else self._dtypes[::-1]))
        if self._full_first:  # the gradients' addresses are key[0], their sizes the layout's (shapes checked)
            self._checked_second.check_bound(name, full, "shards", shards, key[1:], esizes, apart=RS_APART,
                                             in_spans=spans_at(key[0], layout, esizes[0]))
        else:
            self._checked_second.check_bound("shards", shards, name, full, key[1:], esizes)

    def _run(self, g: Group, binding: Any, stream: object, async_op: bool, captured: bool) -> Work:
        raise NotImplementedError

    def _is_captured(self, stream: object) -> bool:
        """Whether this run is being recorded into a graph: a CUDA graph (the caller's stream is
        capturing), or on the host a :class:`~tide_triton.runtime.host_capture.HostGraph` (tests)."""
        if self.device.type == "cuda":
            t = self.g.transport(self.device)
            if hasattr(t, "stream_capturing"):
                return t.stream_capturing(stream)
            return capturing(stream, self.device)
        return host_capture.recording() is not None

    def _begin(self, stream: object, async_op: bool) -> bool:
        """The run's preconditions, on this rank (before anything moves); returns whether the
        run is being captured into a CUDA graph.

        A run is not agreed with the peers (that is what makes it cheap), so they do not learn
        of an error here before they move: their run goes on and waits for this rank's tokens,
        and this rank's *next* run would satisfy them -- every run after it paired with the
        peer's previous one, wrong sums and no error.  So every error of a run, its own
        arguments' included, counts as a failure once the call has begun (``Call.moving`` set
        first): the abort is published, the group breaks, the peers' waits end in an error
        naming this rank and its next run raises ``GroupBrokenError``.  Those waits watch the
        peers' published aborts (:meth:`~tide_triton.group.calls.Call.watch`, as an eager call's check-in
        does): a peer's failed run ends them at once, not at the deadline, naming the peer and its
        error -- also for a peer arriving after this rank gave up."""
        if stream is not None and not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be None or a torch.cuda.Stream, got {type(stream).__name__}")
        self.g.check_own_stream(stream, self.device)
        captured = self._is_captured(stream)
        if captured and async_op:
            raise ValueError(f"async_op: {self.name} under CUDA graph capture must run with async_op=False "
                             "(its Work would wait on an event recorded inside the graph)")
        if self._region.released:
            raise RuntimeError(f"{self.name}: its heap region {self._region.key!r} is released; restore() it "
                               "on every rank before running")
        return captured

    def _keep_for_graph(self, key: tuple, binding: Any) -> None:
        """A graph now replays ``binding`` (its tables, copy addresses, heap and flag words)
        whenever the user launches it: keep the binding past eviction and this prepared
        collective alive until the group closes; from now on every prepared run of the group
        ends joined (see :meth:`_joined`)."""
        self._captured[key] = binding
        kept = state.of(self.g).captured
        if not any(p is self for p in kept):
            kept.append(self)

    def _joined(self, captured: bool) -> bool:
        """Whether this run's end makes the caller's stream wait for the copy queue's
        quiescent end.  Eager runs leave that wait on the copy queue (the caller's stream runs
        on while peers finish reading), and the next eager run's copy queue work comes after
        it in order.  A graph's copy queue is its own branch, forked from the caller's stream
        at each replay: it must be joined at the graph's end (a capture requires it), and once
        a group has captured runs its eager runs join too -- so that a replay, ordered after
        them on the caller's stream, never overwrites a ring slot or a block a peer still reads."""
        return captured or bool(state.of(self.g).captured)

    def run(self, *, stream: object = None, async_op: bool = False, check_addresses: bool = True) -> Work:
        """The collective, as prepared, on the tensors' current values.  ``stream`` /
        ``async_op`` as for the eager call; ``check_addresses=False`` skips the check that every
        tensor is still as prepared (its address, shape, contiguity and dtype).  A tensor
        changed raises ``ValueError`` naming it and what changed; the peers' runs end at once
        in ``PeerAbortedError`` naming this rank (see :meth:`_begin`)."""
        if self._held is None:
            raise RuntimeError(f"{self.name} was prepared with hold=False (it keeps no tensors): its caller "
                               "runs it on the tensors of the moment")
        first, second, key = self._held
        g = self.g
        with g.call(self.name) as c:
            c.moving = True  # no agreement: see _begin
            c.watch(g.transport(self.device))  # a peer's abort ends this run's waits at once (see _begin)
            captured = self._begin(stream, async_op)
            if check_addresses:
                for held, what in zip((first, second), self._names):
                    if not held.unchanged():
                        raise ValueError(
                            f"{self.name} on rank {g.rank}: {held.first_change(what)}; a run reads and writes "
                            f"the layout it was prepared for and is not agreed with the peers, so this breaks "
                            f"the group: make a new group and prepare the collective for the tensors as they "
                            f"are now")
            binding = self._bindings[key]
            if captured:
                self._keep_for_graph(key, binding)
            return self._launch(key, binding, stream, async_op, captured)

    def _run_on(self, first: Sequence[torch.Tensor], second: Sequence[torch.Tensor], *, stream: object = None,
                async_op: bool = False) -> Work:
        """A run on these tensors, for a trusted caller (the FSDP2 drop-in) whose tensors have
        the prepared shapes, dtypes and device whenever they sit at addresses seen before:
        a new set of addresses is checked in full and bound (this rank's copy lists and
        tables; nothing of the peers'), a known one is run as bound."""
        g = self.g
        with g.call(self.name) as c:
            c.moving = True  # no agreement: see _begin
            c.watch(g.transport(self.device))  # a peer's abort ends this run's waits at once (see _begin)
            captured = self._begin(stream, async_op)
            key = self._key(first, second)
            binding = self._bindings.get(key) or self._captured.get(key)
            if binding is None:
                if captured:  # binding allocates and uploads tables: nothing a capture may record
                    raise ValueError(f"{self.name}: captured into a CUDA graph on tensors it has not run on yet; "
                                     "run it once on these tensors outside the capture first")
                first_l, second_l = list(first), list(second)
                self._check(first_l, second_l, key)
                t = g.transport(self.device)
                with Streams(g, t, self.device, stream, False).kernels():
                    binding = self._bindings[key] = self._bind(first_l, second_l, key)
                self.binds += 1
                held = self._held[2] if self._held is not None else None
                while len(self._bindings) > _BINDINGS_KEPT:
                    old = next(k for k in self._bindings if k != held)
                    del self._bindings[old]
                    self._graphs.pop(old, None)  # an in-flight replay ends first (the driver frees it then)
                    self._uses.pop(old, None)
            elif key in self._bindings:
                self._bindings.move_to_end(key)
            if captured:
                self._keep_for_graph(key, binding)
            return self._launch(key, binding, stream, async_op, captured)

    def _launch(self, key: tuple, binding: Any, stream: object, async_op: bool, captured: bool) -> Work:
        """The run of ``binding``: recorded into the caller's capture, or -- eager-launched --
        enqueued op by op the first time, recorded at the second and replayed from then on
        (:mod:`tide_triton.executors.recorded`, ``$TIDE_TRITON_RUN_GRAPHS``)."""
        g = self.g
        if captured:
            try:
                return self._run(g, binding, stream, async_op, captured)
            finally:  # the thread's later waits are outside this capture (see _is_captured)
                if self.device.type == "cuda":
                    ended = getattr(g.transport(self.device), "user_capture_ended", None)
                    if ended is not None:
                        ended()
        if not self._graphs_on:
            return self._run(g, binding, stream, async_op, captured)
        rg = self._graphs.get(key, _UNRECORDED)  # one lookup: the key hashes O(parameters) ints
        if rg is _UNRECORDED:
            uses = self._uses[key] = self._uses.get(key, 0) + 1
            if uses < 2:
                return self._run(g, binding, stream, async_op, captured)
            t = g.transport(self.device)
            rg = self._graphs[key] = recorded.record(t, self.device, lambda s: self._run(g, binding, s, False, True))
            del self._uses[key]
            # The recorded kernels do not wait for their tables' uploads (a graph cannot wait on
            # an event recorded outside it) and a replay may go on another stream than the
            # uploads': the host waits for them once, with the group's deadline.
            if rg is not None:
                for kernel in self._kernels(binding):
                    for ev in kernel.upload_events:
                        t.host_wait_event(ev, timeout_s=g.options.timeout_s)
        if rg is None:  # the driver refused to record it (logged): eager
            return self._run(g, binding, stream, async_op, captured)
        return self._replay(rg, binding, stream, async_op)

    def _replay(self, rg: recorded.RunGraph, binding: Any, stream: object, async_op: bool) -> Work:
        """Launch a recorded run on the caller's stream.  It starts after this rank's earlier
        runs' quiescent ends (an eager run leaves that on the copy queue: the caller's stream
        waits for it first) and, being recorded joined, ends with its own; the copy queue's
        later work -- and so every later run, on any stream -- comes after it."""
        g = self.g
        t = g.transport(self.device)
        st = Streams(g, t, self.device, stream, async_op)
        cs = st.compute
        self._follow(cs, False)
        for kernel in self._kernels(binding):  # its tables outlive an eviction until cs is past them
            kernel.keep_tables_for(cs)
        t.fence_to(cs)
        self._before_replay(t, cs)
        rg.replay(t, cs)
        # The copy queue goes on after the replay's quiescent end: a later run on another
        # stream starts behind the copy queue (fence_to), so it cannot push into a slot this
        # replay's reads or a peer's still need (a recorded run forks its copies from ``cs``,
        # not from the copy queue).
        t.fence_from(cs)
        self._after_replay(t, cs)
        return st.finish()

    def _kernels(self, binding: Any) -> list:
        """The kernel bindings (``tide_triton.kernels.Binding``) of ``binding``."""
        raise NotImplementedError

    def _follow(self, cs: Any, captured: bool) -> None:
        """Order this run's stream-side waits and sums (on ``cs``) after the previous run's
        when that one went on another stream.  Every run of a prepared collective uses the
        same token (a recording cannot vary it), and a rank's readers take their peers'
        "ready" tokens on the compute stream: a run with ``async_op=True`` (its waits on the
        group's side stream) followed by a run on the caller's stream had the second run's
        waits take the tokens the peers pushed for the first -- sums of the wrong run, or a
        wait that never ends (seen on the H200).  The copy queue's side was
        ordered already (:meth:`_replay`, the eager run's fences).  A capture is ordered by
        its replay's stream, not here."""
        if captured or self.device.type != "cuda":
            return
        last = self._last_compute
        if last is not None and last != cs:
            cs.wait_stream(last)
        self._last_compute = cs

    def _before_replay(self, t: Any, cs: object) -> None:
        """What a recorded run cannot hold and a replay needs first (the all-gather's block)."""

    def _after_replay(self, t: Any, cs: object) -> None:
        """What a replay leaves for later runs, the copy queue already behind it (the
        all-gather's block-free point)."""


class PreparedReduceScatter(_Prepared):
    """A node-local reduce-scatter prepared for fixed ``grads`` and ``shards``
    (:func:`tide_triton.prepare_reduce_scatter`); :meth:`run` performs it: the shards receive
    the sums of the grads' current values (same op, same accumulate as prepared)."""

    name = "reduce_scatter (prepared)"
    _names = ("grads", "shards")
    _full_first = True

    def __init__(self, g: Group, device: torch.device, token: int, layout: ShardLayout, region: HeapRegion,
                 reg: Ring, plan: Any, gdt: torch.dtype, sdt: torch.dtype, scale: float | None, accumulate: bool,
                 grads: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], hold: bool,
                 checked: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None) -> None:
        self.reg, self.plan = reg, plan
        self._dtypes = (gdt, sdt)
        self.scale, self.accumulate = scale, accumulate
        me, W = g.rank, g.world_size
        self.peers = [c for c in range(W) if c != me]
        self.dests = [[d for d in self.peers if j < len(plan.chunks[d])] for j in range(plan.rounds)]
        super().__init__(g, device, token, layout, region, grads, shards, hold, checked)

    def _bind(self, grads: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], key: tuple) -> tuple:
        g = self.g
        t = g.transport(self.device)
        gptrs, sptrs, snumels = key
        reducers, pushes, padding = prepare.prepare_reduce_scatter(
            g, t, self.reg, self.plan, self.layout, gptrs, sptrs, snumels, *self._dtypes, self.device, self.scale,
            self.accumulate, g.options.ring_bytes)
        ops = max((n for _, n in pushes), default=0) + 4 * g.world_size
        return reducers, [p for p, _n in pushes], padding, ops

    def _kernels(self, binding: Any) -> list:
        return list(binding[0]) + [p.binding for p in binding[1] if isinstance(p, prepare.KernelPush)]

    def _run(self, g: Group, binding: Any, stream: object, async_op: bool, captured: bool) -> Work:
        reducers, pushes, padding, ops = binding
        t = g.transport(self.device)
        if not captured:  # a capture records loop copies instead (docs/design.md)
            t.warm_replays([*prepare.copy_lists(pushes), padding[0] if padding else None])  # before any wait
        st = Streams(g, t, self.device, stream, async_op)
        self._follow(st.compute, captured)
        flags = ring.Tokens(g, self.token, captured, lambda: self._joined(captured))
        return ring.reduce_scatter(g, t, st, self.device, self.plan, self.dests, reducers, pushes, padding, flags,
                                   scale=self.scale, accumulate=self.accumulate, ops=ops)


class PreparedAllGather(_Prepared):
    """A node-local all-gather prepared for fixed ``shards`` and ``params``
    (:func:`tide_triton.prepare_all_gather`); :meth:`run` performs it: every rank's shards'
    current values into the params."""

    name = "all_gather (prepared)"
    _names = ("shards", "params")
    _full_first = False
    _recorded_in = ("auto", "all", "all-gathers")

    def __init__(self, g: Group, device: torch.device, token: int, layout: ShardLayout, region: HeapRegion,
                 sdt: torch.dtype, pdt: torch.dtype, shards: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 hold: bool, checked: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None) -> None:
        self._dtypes = (pdt, sdt)
        super().__init__(g, device, token, layout, region, shards, params, hold, checked)

    def _bind(self, shards: Sequence[torch.Tensor], params: Sequence[torch.Tensor], key: tuple) -> tuple:
        g, layout = self.g, self.layout
        pdt, sdt = self._dtypes
        es = pdt.itemsize
        t = g.transport(self.device)
        sptrs, pptrs, _pnumels = key
        block = t.address(g.rank, self._region.offset)
        dsts = tuple(block + o * es for o in layout.flat_offsets)
        pulls = prepare.prepare_all_gather(g, t, layout, pptrs, es, None, self._region.offset)
        stage = prepare.prepare_stage(g, t, layout, list(shards), sptrs, dsts, sdt, pdt, self.device,
                                           into_block=True)
        return pulls, stage

    def _kernels(self, binding: Any) -> list:
        caster = binding[1][0]
        return [] if caster is None else [caster]

    def _run(self, g: Group, binding: Any, stream: object, async_op: bool, captured: bool) -> Work:
        pulls, stage = binding
        _caster, stage_copies, pad_copies, _zeros = stage
        t = g.transport(self.device)
        if not captured:  # a capture records loop copies instead (docs/design.md)
            t.warm_replays([*pulls, stage_copies, pad_copies])  # before any flag wait
        st = Streams(g, t, self.device, stream, async_op)
        self._follow(st.compute, captured)
        flags = ring.Tokens(g, self.token, captured, lambda: self._joined(captured), self._block_free())
        return ring.all_gather(g, t, st, self.device, pulls, stage, flags)

    def _before_replay(self, t: Any, cs: object) -> None:
        t.wait_mark(self._block_free()[0], cs)  # another all-gather of this block may end elsewhere

    def _after_replay(self, t: Any, cs: object) -> None:
        self._block_free()[0] = t.mark()  # the replay ended quiescent: the block is free again there

    def _block_free(self) -> list:
        """The event after the last run's quiescent end on this rank's block (shared by the
        group's prepared all-gathers of the block's size), in a one-element list; ``[None]``
        before the first run."""
        return state.of(self.g).block_free.setdefault(
            (self.device.type, self.device.index, self._region.key), [None])


def prepared_reduce_scatter(g: Group, token: int, grads: list[torch.Tensor], shards: list[torch.Tensor],
                            layout: ShardLayout, gdt: torch.dtype, sdt: torch.dtype, device: torch.device,
                            scale: float | None, accumulate: bool, hold: bool = True,
                            checked: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                            ) -> PreparedReduceScatter:
    """Make the prepared reduce-scatter of checked, agreed arguments (collective: the ring's
    heap region).  ``token``: the preparing call's number.  ``checked``: the caller's (grads,
    shards) where ``grads`` and ``shards`` are parts of them (``shard_dims``): what runs check."""
    ring_bytes = g.options.ring_bytes
    region = g.heap_region(RING_KEY, ring_bytes, device)
    W, S, es = g.world_size, g.options.stages, gdt.itemsize
    reg: Ring = staging_ring(region.offset, region.nbytes, W, S, g.ring_layout().ag_off)
    plan = ring_plan(layout, ring_bytes, es, S)
    if plan.chunk_elems * es > reg.slot_bytes:
        raise RuntimeError("internal error: prepared ring plan and heap region disagree")
    t = g.transport(device)
    with Streams(g, t, device, None, False).kernels():
        out = PreparedReduceScatter(g, device, token, layout, region, reg, plan, gdt, sdt, scale, accumulate,
                                    grads, shards, hold, checked)
    g.heap_barrier()
    return out


def prepared_all_gather(g: Group, token: int, shards: list[torch.Tensor], params: list[torch.Tensor],
                        layout: ShardLayout, sdt: torch.dtype, pdt: torch.dtype, device: torch.device,
                        hold: bool = True, checked: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                        ) -> PreparedAllGather:
    """Make the prepared all-gather of checked, agreed arguments (collective: the block's
    heap region, shared by the group's prepared all-gathers of the same block size)."""
    nbytes = max(layout.flat_shard_numel * pdt.itemsize, 1)
    region = g.heap_region(block_key(nbytes), nbytes, device)
    t = g.transport(device)
    with Streams(g, t, device, None, False).kernels():
        out = PreparedAllGather(g, device, token, layout, region, sdt, pdt, shards, params, hold, checked)
    g.heap_barrier()
    return out
