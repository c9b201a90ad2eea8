"""A tide_triton group: the state of one rank over a torch.distributed process group (or
one of :func:`~tide_triton.group.single_process.local_groups`' ranks) and the parts it owns.

Every collective starts with :meth:`Group.agree`: each rank checks its own arguments, then
all ranks exchange (call number, signature, error) through the bootstrap store with the
group's deadline; if any rank failed, every rank raises, naming the rank and argument --
nobody is left waiting on a peer that will never come.  The parts: call identity,
agreement, aborts and the broken state (:class:`~tide_triton.group.calls.CallIdentity`), the
transports per device, the named heap regions (:mod:`tide_triton.group.regions`), the prepare
cache, pacers, side streams and zero buffers (:mod:`tide_triton.group.parts`).  Entry points:
:func:`init`, :func:`existing`, :func:`resolve`; the store and closing at exit:
:mod:`tide_triton.group.process_groups`.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from ..plan import heap
from . import process_groups
from .bootstrap import Exchange
from .calls import Call, CallIdentity
from .options import GroupOptions
from .parts import KeptUntilIdle, Pacer, PreparedCache, ZeroBuffers
from .regions import RegionTable, heap_region
from ..transport import own_streams
from ..transport.host import HostTransport
from ..transport.node_view import GlobalRanks
from ..plan.schedule import FlagMap
from ..plan.topology import Topology

log = logging.getLogger("tide_triton")

_BROKEN_DRAIN_S = 3.0
"""How long closing a broken group waits for its GPU work (which may never finish)."""

_DeviceKey = tuple[str, "int | None"]


class Group:
    """Collective state over one torch.distributed process group.

    ``topology``: the group's ranks in nodes of ``local_size`` consecutive ranks (see
    :func:`init`).  With one node the collectives run node-locally
    (:mod:`tide_triton.collectives`); with several, across nodes
    (:mod:`tide_triton.executors.across_nodes`)."""

    def __init__(self, pg: dist.ProcessGroup | None = None, options: GroupOptions | None = None, *,
                 local_size: int | None = None, _local: Any = None, _rank: int = 0) -> None:
        self.options = options or GroupOptions()
        self._local = _local
        """The single-process mode's shared part (:class:`~tide_triton.group.single_process.LocalRanks`), or None."""
        if _local is not None:
            self.pg = None
            self.rank, self.world_size = _rank, _local.world_size
            exchange = Exchange(_local.kv, "", self.rank, self.world_size)
        else:
            if not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
            self.pg = pg if pg is not None else dist.group.WORLD
            self.rank = dist.get_rank(self.pg)
            self.world_size = dist.get_world_size(self.pg)
            exchange = process_groups.store_exchange(self.pg)
        # Flags are indexed by group rank: the host transport maps every rank's heap (one
        # host), and the cross-node executor keeps its own flags after these.
        self.flags = FlagMap(self.world_size, self.options.stages)
        self._transports: dict[str, Any] = {}
        self.calls = CallIdentity(self.rank, self.world_size, exchange, flags=self.flags,
                                  timeout_s=self.options.timeout_s, agree=self.options.agree,
                                  transports=self._transports.values)
        """Call numbers, agreement, call identity, aborts and the broken state."""
        self._synced = 0  # calls whose GPU work synchronize() has seen finish
        self.call_label: str | None = None
        """Joins the signature of the calls made inside :meth:`labelled`."""
        self.topology = _agree_topology(self.exchange, self.options, lambda: _topology_here(
            self.pg, self.world_size, _local is not None, local_size))
        self.local_size = self.topology.local_size
        self.nodes = self.topology.nodes
        self.n_flags = self.flags.n_flags
        if self.nodes > 1:
            self.n_flags += heap.extra_flags(self.world_size, self.options.inflight_chunks)
        self._extras: dict[tuple, Any] = {}
        self.prepared = PreparedCache()
        """Prepared collectives (:meth:`cached` / :meth:`cache`)."""
        self.kept = KeptUntilIdle()
        """What queued work may still read (:meth:`keep_until_idle`)."""
        self._zeros = ZeroBuffers(self.kept, self.rank, self.options.timeout_s, self._transports.get)
        self._pacers: dict[_DeviceKey, Pacer] = {}
        self._side_streams: dict[_DeviceKey, Any] = {}
        self.regions = RegionTable(self.flags.regions)
        """The named heap regions (:meth:`heap_region`)."""
        self._lock = threading.Lock()
        self.executor_state: Any = None
        """The executor layer's typed state of this group (made there: ``exec_state.of``); closed by close()."""
        self._closed = False
        self._opened = process_groups.opened(self)

    # ---- agreement and calls (see CallIdentity) -----------------------------------------
    def exchange(self, obj: object) -> list:
        """All-gather one small picklable object per rank (:meth:`CallIdentity.exchange`)."""
        return self.calls.exchange(obj)

    def agree(self, signature: object, error: BaseException | None) -> None:
        """Agree on this call's signature and errors (:meth:`CallIdentity.agree`)."""
        self.calls.agree(signature, error)

    def call(self, name: str) -> Call:
        """``with g.call("reduce_scatter") as c:`` around one collective: numbers it, refuses
        concurrent use and calls on a broken group, and on an error publishes the abort to
        the peers (and marks the group broken when data may have moved)."""
        self._check_open()
        return Call(self.calls, name)

    def check_in(self, t: Any, peers: Sequence[int]) -> None:
        """:meth:`CallIdentity.check_in`: the call's identity, exchanged with ``peers`` before data moves."""
        self.calls.check_in(t, peers)

    def check_in_exchange(self) -> None:
        """:meth:`CallIdentity.check_in_exchange`."""
        self.calls.check_in_exchange()

    def check_in_posted(self, peers: Sequence[int]) -> None:
        """:meth:`CallIdentity.check_in_posted`."""
        self.calls.check_in_posted(peers)

    def check_posted(self, timeout_s: float | None = None) -> None:
        """:meth:`CallIdentity.check_posted`."""
        self.calls.check_posted(timeout_s)

    def explain_timeout(self, e: BaseException, since: int) -> Exception | None:
        """:meth:`CallIdentity.explain_timeout`."""
        return self.calls.explain_timeout(e, since)

    def raise_if_abandoned(self, since: int) -> None:
        """:meth:`CallIdentity.raise_if_abandoned`."""
        self.calls.raise_if_abandoned(since)

    @property
    def _seq(self) -> int:
        """Collective calls started on this group (:attr:`CallIdentity.seq`)."""
        return self.calls.seq

    def _break(self, why: str) -> None:
        self.calls.mark_broken(why)

    @property
    def broken(self) -> str | None:
        """Why the group is broken (see :class:`~tide_triton.errors.GroupBrokenError`), or None."""
        return self.calls.broken

    @contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """The calls made inside carry ``label`` in their signature (agreed, and in every
        call's identity): the FSDP2 drop-in labels each parameter group's collectives with
        its module's name, so ranks running other same-shaped modules at the same position
        (conditional blocks, experts) raise ``ArgumentMismatchError`` naming both instead of
        pairing their data."""
        before, self.call_label = self.call_label, label
        try:
            yield
        finally:
            self.call_label = before

    # ---- transports ---------------------------------------------------------------------
    def cuda_device(self) -> torch.device | None:
        """The GPU this rank's CUDA transport drives (its first CUDA call's), or None."""
        t = self._transports.get("cuda")
        return None if t is None else getattr(getattr(t, "inner", t), "device", None)

    def transport(self, device: torch.device):
        """This rank's transport for ``device``'s kind, made by the first call that needs it
        (collective: every rank makes it in the same call)."""
        self._check_open()
        key = device.type
        with self._lock:
            t = self._transports.get(key)
            if t is None:
                t = self._transports[key] = self._make_transport(device)
        if key == "cuda" and device.index is not None:
            have = self.cuda_device()
            if have is not None and have != device:  # its heap, streams and context are that GPU's
                raise ValueError(
                    f"tensors on {device}, but rank {self.rank} of this group drives {have} (where its first "
                    f"CUDA collective ran): a group moves one GPU's tensors per rank -- put them on {have}, or "
                    f"make another group for {device}")
        return t

    def _make_transport(self, device: torch.device):
        if device.type == "cpu":
            return HostTransport(self.rank, self.world_size, self.exchange, n_flags=self.n_flags)
        if device.type != "cuda":
            raise ValueError(f"tensors must be on the CPU or a CUDA device, got {device}")
        if self._local is not None:
            self._local.check_module_loading()
        if self.nodes > 1:
            return self._node_transport(device)
        if self._local is not None:  # one process: the ranks' transports are made together
            return self._local.cuda_transport(self.rank, device, self.n_flags)
        from ..transport.cuda import CudaTransport  # loads at the first CUDA collective: CPU runs never need it

        return CudaTransport(self.rank, self.world_size, self.exchange, device=device,
                             n_flags=self.n_flags, timeout_s=self.options.timeout_s)

    def _node_transport(self, device: torch.device):
        """Several nodes on CUDA: a transport over this node's ranks only (VMM handles do not
        cross nodes), addressed with global rank numbers (:class:`GlobalRanks`)."""
        from ..transport.cuda import CudaTransport  # loads at the first CUDA collective: CPU runs never need it

        if self._local is not None:
            raise NotImplementedError(
                f"a {self.topology} topology on CUDA in the single-process mode: the inter-node hop "
                "runs on NCCL, and one process cannot drive several NCCL ranks here; use one process "
                "per rank (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 for several ranks per GPU)")
        L = self.local_size
        first = self.rank - self.rank % L

        def node_exchange(obj: object) -> list:  # collective over the whole group
            return self.exchange(obj)[first:first + L]

        inner = CudaTransport(self.rank % L, L, node_exchange, device=device, n_flags=self.n_flags,
                              timeout_s=self.options.timeout_s)
        return GlobalRanks(inner, first)

    def existing_transport(self, device_type: str) -> Any:
        """The transport of ``device_type`` (``"cpu"`` / ``"cuda"``) if a collective made it, else None."""
        with self._lock:
            return self._transports.get(device_type)

    def heap_nbytes(self, device: torch.device | str) -> int:
        """Bytes of this rank's heap for ``device``'s kind (cpu / cuda) -- flags, receive ring,
        regions -- mapped outside torch's allocator; 0 when no collective has made it yet.  Not
        collective."""
        t = self.existing_transport(torch.device(device).type)
        return 0 if t is None else t.heap_nbytes()

    # ---- the heap -----------------------------------------------------------------------
    def heap_region(self, key: str, nbytes: int, device: object):
        """Collective: a persistent region of ``nbytes`` bytes named ``key`` at the same
        offset of every rank's heap on ``device`` -- memory peers can write into, e.g. the
        staging of ``reduce_scatter(..., staging=region)`` (Slot-Reuse).  Calling it again
        with the same key returns the same region.  See :mod:`tide_triton.group.regions`."""
        self._check_open()
        return heap_region(self, key, nbytes, device)

    @property
    def heap_regions_end(self) -> int:
        """Heap bytes below which named regions lie (0: none); the all-gather block starts past it."""
        return self.regions.end

    def ring_layout(self) -> heap.Ring:
        """The node-local heap layout now: ring after the flags, all-gather block past the
        named regions (:func:`tide_triton.plan.heap.ring`)."""
        o = self.options
        return heap.ring(self.flags.n_flags, self.world_size, o.ring_bytes, o.stages, self.regions.end)

    def cross_node_layout(self) -> heap.CrossNode:
        """The cross-node heap layout now (:func:`tide_triton.plan.heap.cross_node`)."""
        o = self.options
        return heap.cross_node(self.n_flags, o.ring_bytes, o.chunk_bytes, o.inflight_chunks, self.regions.end)

    def heap_barrier(self) -> None:
        """After ``ensure_heap``: in the single-process mode each rank grows its own heap,
        so nobody may address a peer's new range before the peer has mapped it."""
        if self._local is not None:
            self.exchange(None)

    # ---- what the executors keep here ---------------------------------------------------
    def cached(self, key: tuple) -> Any:
        """A prepared collective (bindings, copy lists) for ``key``, or None."""
        return self.prepared.get(key)

    def cache(self, key: tuple, value: Any) -> Any:
        """Keep ``value`` for ``key`` (the most recent keys are kept); returns it."""
        return self.prepared.put(key, value)

    @property
    def preparations(self) -> int:
        """Collectives prepared so far (cache fills): flat in a training loop's steady state."""
        return self.prepared.fills

    def keep_until_idle(self, obj: Any) -> None:
        """Keep ``obj`` (device memory that queued work may still read: a failed run's kernel
        pushes' tables) as long as this group's streams may run (:class:`~tide_triton.group.parts.KeptUntilIdle`)."""
        self.kept.add(obj)

    @property
    def kept_until_idle(self) -> tuple:
        """What :meth:`keep_until_idle` holds."""
        return self.kept.items()

    def zeros(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A zero-filled buffer of at least ``nbytes`` on ``device`` (:class:`~tide_triton.group.parts.ZeroBuffers`)."""
        return self._zeros.get(device, nbytes)

    def pacer(self, device: torch.device) -> Pacer:
        """The group's pacer for long collectives on ``device`` (see :class:`~tide_triton.group.parts.Pacer`)."""
        with self._lock:
            p = self._pacers.get((device.type, device.index))
            if p is None:
                p = self._pacers[(device.type, device.index)] = Pacer(device.type == "cuda",
                                                                      self.options.host_ahead_chunks)
        return p

    def side_stream(self, device: torch.device):
        """The group's stream for ``async_op=True`` collectives on ``device``."""
        with self._lock:
            s = self._side_streams.get((device.type, device.index))
            if s is None:
                # the lowest priority CUDA offers (priority_range()[0], 0 today: the default's),
                # named so that it stays below a caller's higher-priority compute streams; the
                # driver's, not torch's pool, which hands the same streams to callers
                s = own_streams.take(device, torch.cuda.Stream.priority_range()[0])
                self._side_streams[(device.type, device.index)] = s
        return s

    # ---- the single-process mode --------------------------------------------------------
    @property
    def ranks_in_process(self) -> int:
        """How many of the group's ranks this process drives: all of them in the
        single-process mode (:func:`~tide_triton.group.single_process.local_groups`), else one."""
        return self.world_size if self._local is not None else 1

    def check_own_stream(self, stream: Any, device: torch.device) -> None:
        """Single-process mode, CUDA: the stream this rank's call enqueues on (``stream``, else
        the current stream of ``device``) is no other rank's.  Ranks that share a stream
        deadlock -- a wait for a peer's flag sits in front of the peer's own write -- so the
        second rank to use one in the same call gets a ValueError (agreed with the call: every
        rank raises).  Per call, not for ever: torch hands out pooled streams round-robin, so
        threads that make a stream per step may in time get one another rank had.  Any mode:
        ``stream`` is on ``device`` (the transport's fences record and wait on it in
        ``device``'s context -- another device's stream would fail mid-call)."""
        if stream is not None and device.type == "cuda" and stream.device != device:
            raise ValueError(f"stream: a stream of {stream.device}, but the tensors are on {device}; pass a stream "
                             f"of {device}, or None for its current stream")
        c = self.calls.current
        if self._local is None or self.world_size == 1 or device.type != "cuda" or c is None:
            return
        self._local.check_stream(self.rank, c.seq, stream, device)

    # ---- lifetime -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this tide_triton group is closed")

    def close(self) -> None:
        """Idempotent: closes every transport (unmaps heaps, closes handles), then raises the
        first error of a part that failed to close (the others are closed all the same).  A
        group with communicators across nodes waits there for their other members: close
        groups in the same order on every rank -- newest first, as exit and
        ``destroy_process_group`` do."""
        if self._closed:
            return
        self._closed = True
        failed: BaseException | None = None
        for x in (self.executor_state, *self._extras.values()):  # e.g. the cross-node path's NCCL communicator
            close = getattr(x, "close_extra", None)
            if close is not None:
                try:
                    # a broken group's NCCL hop may wait forever on peers: the short drain
                    broken = self.broken is not None and getattr(x, "close_broken", False)
                    close(drain_timeout_s=_BROKEN_DRAIN_S) if broken else close()
                except Exception as e:  # noqa: BLE001 -- the heaps below are unmapped all the same
                    log.error("rank %d: closing %s failed: %s", self.rank, type(x).__name__, e)
                    failed = failed or e
        leaked = self._close_transports()
        # its streams may still run where a heap leaked: what they read stays, the zero buffers too
        self.kept.release(leaked, also=self._zeros.buffers())
        self._give_back_side_streams()
        if self.pg is not None and _GROUPS.get(id(self.pg)) is self:
            _GROUPS.pop(id(self.pg), None)
        process_groups.forget(self)
        if failed is not None:
            raise failed

    def _close_transports(self) -> bool:
        """Close every transport; whether one leaked its heap (its streams did not drain)."""
        leaked = False
        for t in self._transports.values():
            inner = getattr(t, "inner", t)  # a node's view (GlobalRanks) closes its transport
            if self.broken is not None and hasattr(inner, "synchronize"):
                # A broken group's GPU work may wait forever on peers: do not hold the
                # process 30 s at close for it, and release its own stuck flag waits so its
                # streams end -- if every peer they wait for abandoned its call (published an
                # abort), so nobody consumes what the released work sends; else the heap is
                # leaked, never unmapped under running work.
                inner.close(drain_timeout_s=_BROKEN_DRAIN_S, may_release=self.calls.all_aborted)
            else:
                t.close()
            leaked = leaked or getattr(inner, "leaked", False)
        self._transports.clear()
        return leaked

    def _give_back_side_streams(self) -> None:
        """The side streams: idle ones serve later groups."""
        for (kind, index), s in list(self._side_streams.items()):
            if kind != "cuda":
                continue
            del self._side_streams[(kind, index)]
            if not own_streams.give_back(s):
                log.warning("rank %d: its side stream on cuda:%s is still busy at close; not reused",
                            self.rank, index)

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED_OPTIONS = ("ring_bytes", "stages", "agree", "chunk_bytes", "inflight_chunks", "inter_node", "multicast")
"""The options every rank of a group must share (agreed at creation): they lay out the heap,
the ring and the flag map, choose the protocol of the calls or the hop across nodes.  The
others (``timeout_s``, ``max_ctas``, ``rs_push``, ``host_ahead_chunks``, ``nccl_library``) are this
rank's own affair."""


def _topology_here(pg: Any, world_size: int, single_process: bool, local_size: int | None) -> Topology:
    """This rank's reading of the topology (may raise ValueError / TypeError)."""
    if local_size is not None:
        return Topology(world_size, local_size)
    if single_process:  # one process: one node unless declared
        return Topology(world_size, world_size)
    if world_size == dist.get_world_size():
        return Topology.from_env(world_size)
    # A sub-group: nodes from LOCAL_WORLD_SIZE and global ranks (torchrun numbers ranks
    # node by node); _check_same_topology checks the group holds whole blocks of one size.
    lws = Topology.from_env(dist.get_world_size()).local_size
    node = dist.get_rank() // lws
    mine = sum(1 for r in dist.get_process_group_ranks(pg) if r // lws == node)
    return Topology(world_size, mine)


def _agree_topology(exchange: Callable[[object], list], options: GroupOptions,
                    here: Callable[[], Topology]) -> Topology:
    """Every rank's topology (``here()``, this rank's) and the options every rank must
    share, agreed: an error on any rank, or a difference, raises on every rank."""
    err: BaseException | None = None
    topo: Topology | None = None
    try:
        topo = here()
    except (TypeError, ValueError) as e:
        err = e
    shared = tuple(getattr(options, f) for f in _SHARED_OPTIONS)
    got = exchange((None if topo is None else (topo.world_size, topo.local_size),
                    None if err is None else f"{type(err).__name__}: {err}", shared))
    if err is not None:
        raise err
    _check_same_topology(got)
    return cast(Topology, topo)  # set: this rank raised above otherwise


def _check_same_topology(got: list) -> None:
    """Raise on every rank where a rank rejected the topology, or ranks differ in it or in an
    option of :data:`_SHARED_OPTIONS` (``got``: every rank's (topology, error, options))."""
    for r, (_, m, _o) in enumerate(got):
        if m is not None:
            raise ValueError(f"rank {r} rejected the topology: {m}")
    for i, name in enumerate(_SHARED_OPTIONS):
        values = [o[i] for _t, _m, o in got]
        if any(v != values[0] for v in values):
            by = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(
                f"ranks disagree on the group option {name} ({by}): it lays out the heap, the ring or "
                f"the flags every rank reads of the others -- pass the same {name} on every rank")
    bad = [r for r, (t, _, _o) in enumerate(got) if t != got[0][0]]
    if bad:
        raise ValueError(f"ranks disagree on the topology (world_size, local_size): rank 0 has "
                         f"{got[0][0]}, rank {bad[0]} has {got[bad[0]][0]}; pass the same local_size "
                         f"(or LOCAL_WORLD_SIZE) on every rank")


_GROUPS: dict[int, Group] = {}
"""The groups :func:`init` made, by their process group's id."""


def existing(pg: dist.ProcessGroup | None = None) -> Group | None:
    """The open tide_triton group of ``pg`` (default: the world group) made by :func:`init`,
    or None.  Not collective."""
    key_pg = pg if pg is not None else dist.group.WORLD
    g = _GROUPS.get(id(key_pg))
    return g if g is not None and not g.closed else None


def init(pg: dist.ProcessGroup | None = None, *, local_size: int | None = None, **options: Any) -> Group:
    """The tide_triton group for ``pg`` (default: the world group), created on first use
    (collective: every rank of ``pg`` calls it) and cached.

    ``local_size``: ranks per node -- ``local_size`` consecutive ranks of ``pg`` form a node
    (rails: ranks with the same local index).  Default: ``LOCAL_WORLD_SIZE`` as torchrun
    sets it (for a sub-group: its ranks' nodes under it), else every rank on one node.  The
    group size must be a multiple of it; a bad value raises ValueError on every rank."""
    key_pg = pg if pg is not None else dist.group.WORLD
    g = _GROUPS.get(id(key_pg))
    if g is not None and not g._closed:
        if options and GroupOptions(**options) != g.options:
            raise ValueError(f"init: a group for this process group exists with options {g.options}")
        if local_size is not None and local_size != g.local_size:
            raise ValueError(f"init: a group for this process group exists with local_size={g.local_size}, "
                             f"got local_size={local_size!r}")
        return g
    process_groups.close_with_process_groups()
    g = Group(pg, GroupOptions(**options), local_size=local_size)
    _GROUPS[id(key_pg)] = g
    return g


def resolve(group: object) -> Group:
    """A tide_triton group from a Group, a ProcessGroup or None (the default group)."""
    if isinstance(group, Group):
        group._check_open()
        return group
    if group is None or isinstance(group, dist.ProcessGroup):
        return init(group)
    raise TypeError(f"group must be a tide_triton Group, a ProcessGroup or None, got {type(group).__name__}")
