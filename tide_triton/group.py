"""A tide_triton group: bootstrap over a torch.distributed process group, agreement on
arguments and errors, and the transports it owns.

Every collective starts with :meth:`Group.agree`: each rank checks its own arguments, then
all ranks exchange (call number, signature, error) through the bootstrap store with the
group's deadline (:mod:`tide_triton.bootstrap`); if any rank failed, every rank raises (the
failing rank its own error, the others an error naming it), and if the signatures differ
every rank raises naming the argument and the ranks that disagree -- nobody is left waiting
on a peer that will never come.  Call identity on the data path, aborts and the broken state:
:mod:`tide_triton.calls`; options: :mod:`tide_triton.options`.

Why ~740 lines: the :class:`Group` is the state every layer above shares (bootstrap,
agreement, transports per device, the heap's regions and layout, caches of prepared calls,
side streams, the pacer) and the ``init`` / ``local_groups`` / close-at-exit entry points,
with the single-process mode's placement and its CUDA preconditions (hardware queues, eager
module loading); the pieces that stand alone already live in ``calls``, ``options``, ``heap``
and ``regions``.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from . import device_wide, heap
from ._checks import is_int
from .bootstrap import Exchange, LocalKeyValue, StoreKeyValue
from .calls import Call, CallIdentity, check_same, describe, fingerprint, sig32_of
from .errors import ArgumentMismatchError, PeerArgumentError
from .options import GroupOptions
from .regions import heap_region
from .transport import own_streams
from .envs import cuda_module_loading
from .transport.driver import wait_with_deadline
from .schedule import FlagMap
from .topology import Topology

__all__ = ["GroupOptions", "Group", "init", "local_groups", "existing", "ArgumentMismatchError", "PeerArgumentError"]

log = logging.getLogger("tide_triton")

_QUEUED_OPS = 512
"""Operations a rank may have queued ahead of the GPU in one collective (see _Pacer): a
driver whose queue for a stream is full blocks the enqueuing thread, and a thread blocked
while its stream waits on a peer is a deadlock waiting to happen."""

_AGREED_KEEP = 4096
"""Signatures remembered with ``agree="first"`` (a model's parameter groups x ops)."""

_BROKEN_DRAIN_S = 3.0
"""How long closing a broken group waits for its GPU work (which may never finish)."""

_PREPARED_KEEP = 512
"""Prepared collectives kept per group (least recently used first out).  A training step
uses every one of its combinations once -- the FSDP2 drop-in's one group serves every
module, about three entries per module and step (all-gather pulls, its staging, the
reduce-scatter) -- so the cache must hold a whole step (512: ~170 modules) or each entry is
evicted before its next use and every call prepares again (as with 8 entries).
An entry is copy plans on the host and kernel bindings whose pointer tables are device memory:
~50 KiB for a Qwen3-30B-A3B layer's reduce-scatter at W=8 (8 chunks x (393 + 8 x ~50)
addresses), so at most ~25 MiB if every entry were one of those."""


class Group(CallIdentity):
    """Collective state over one torch.distributed process group.

    ``topology``: the group's ranks in nodes of ``local_size`` consecutive ranks (see
    :func:`init`).  With one node the collectives run node-locally
    (:mod:`tide_triton.collectives`); with several, across nodes
    (:mod:`tide_triton.hier_collectives`)."""

    def __init__(self, pg: dist.ProcessGroup | None = None, options: GroupOptions | None = None, *,
                 local_size: int | None = None,
                 _local: "_LocalExchange | None" = None, _rank: int = 0) -> None:
        self.options = options or GroupOptions()
        self._seq = 0
        """Collective calls started on this group (every rank counts the same calls)."""
        self._synced = 0  # calls whose GPU work synchronize() has seen finish
        self._failed_calls: tuple[int, ...] = ()  # calls that failed on this rank (CallIdentity._note_failed)
        self._keys: dict[int, tuple[int, object]] = {}  # recent calls: identity word, signature
        self._posted_pending: tuple[int, int, tuple[int, ...]] | None = None  # CallIdentity.check_in_posted
        self._call: Call | None = None
        self._broken: str | None = None
        self._call_lock = threading.Lock()
        self._setup_index = 0  # exchanges outside any call (creation): call number 0
        self._sig_names: dict[int, str] = {}
        self.call_label: str | None = None
        """Joins the signature of the calls made inside :meth:`labelled`."""
        if _local is not None:  # single-process multi-rank mode (see local_groups)
            self.pg = None
            self.rank, self.world_size = _rank, _local.world_size
            self._local = _local
            self._exchange = Exchange(_local.kv, "", self.rank, self.world_size)
        else:
            if not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
            self.pg = pg if pg is not None else dist.group.WORLD
            self._local = None
            self.rank = dist.get_rank(self.pg)
            self.world_size = dist.get_world_size(self.pg)
            self._exchange = _store_exchange(self.pg, _store_prefix(self.pg))
        self.topology = self._agree_topology(local_size)
        self.local_size = self.topology.local_size
        self.nodes = self.topology.nodes
        # Flags are indexed by group rank: the host transport maps every rank's heap (one
        # host), and the cross-node executor keeps its own flags after these.
        self.flags = FlagMap(self.world_size, self.options.stages)
        self.n_flags = self.flags.n_flags
        if self.nodes > 1:
            self.n_flags += heap.extra_flags(self.world_size, self.options.inflight_chunks)
        self._transports: dict[str, Any] = {}
        self._extras: dict[tuple, Any] = {}
        self._until_idle: list[Any] = []  # see keep_until_idle
        self._prepared: OrderedDict[tuple, Any] = OrderedDict()
        self.preparations = 0
        """Collectives prepared so far (cache fills): flat in a training loop's steady state."""
        self._agreed: set = set()
        self._lock = threading.Lock()
        self.ag_epoch = 0
        self.rs_last: dict[tuple[int, int], int] = {}
        self.rs_count = 0
        self._heap_regions: dict[tuple[str, str], Any] = {}
        self.heap_regions_end = 0
        """Heap bytes below which named regions lie (0: none); the all-gather block starts past it."""
        self._closed = False
        self._opened = next(_OPENED)
        _ALL.add(self)

    # ---- topology -----------------------------------------------------------------------
    def _topology_here(self, local_size: int | None) -> Topology:
        """This rank's reading of the topology (may raise ValueError / TypeError)."""
        if local_size is not None:
            return Topology(self.world_size, local_size)
        if self._local is not None:  # one process: one node unless declared
            return Topology(self.world_size, self.world_size)
        if self.world_size == dist.get_world_size():
            return Topology.from_env(self.world_size)
        # A sub-group: nodes from LOCAL_WORLD_SIZE and global ranks (torchrun numbers ranks
        # node by node); _agree_topology checks the group holds whole blocks of one size.
        lws = Topology.from_env(dist.get_world_size()).local_size
        node = dist.get_rank() // lws
        mine = sum(1 for r in dist.get_process_group_ranks(self.pg) if r // lws == node)
        return Topology(self.world_size, mine)

    def _agree_topology(self, local_size: int | None) -> Topology:
        """Every rank's topology and the options every rank must share, agreed: an error on
        any rank, or a difference, raises on every rank."""
        err: BaseException | None = None
        topo: Topology | None = None
        try:
            topo = self._topology_here(local_size)
        except (TypeError, ValueError) as e:
            err = e
        shared = tuple(getattr(self.options, f) for f in _SHARED_OPTIONS)
        got = self.exchange((None if topo is None else (topo.world_size, topo.local_size),
                             None if err is None else f"{type(err).__name__}: {err}", shared))
        if err is not None:
            raise err
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
        return cast(Topology, topo)  # set: this rank raised above otherwise

    # ---- bootstrap ----------------------------------------------------------------------
    def exchange(self, obj: object) -> list:
        """All-gather one small picklable object per rank (rank order), with the group's
        deadline: ``PeerTimeoutError`` names the ranks that did not arrive; a peer that
        abandons the current call raises its error here at once."""
        c = self._call
        if c is None:
            self._setup_index += 1
            call, index, what = 0, self._setup_index, "group set-up"
        else:
            c.index += 1
            call, index, what = c.seq, c.index, f"call #{c.seq} ({c.name})"
        return self._exchange.exchange(obj, call=call, index=index, timeout_s=self.options.timeout_s,
                                       what=what, check=self._check_aborts if c is not None else None)

    def agree(self, signature: object, error: BaseException | None) -> None:
        """Share this rank's (call number, signature, error); raise on every rank if any rank
        failed or the signatures or call numbers differ.  With ``agree="first"`` a signature
        agreed before is trusted without an exchange (the call's identity still reaches the
        peers before any data moves: :meth:`check_in`)."""
        c = self._call
        if c is not None and signature is not None and c.signature is None:
            # the call's own arguments: an agreement nested in it (a heap region the call
            # makes) keeps the call's identity, which check_in compares
            c.set_signature(signature)
        if self.options.agree == "first":
            # Signatures agreed before are trusted: no exchange (a host round trip per
            # collective, which stalls a training loop's run-ahead).  A rank that fails
            # raises alone; the call's abort reaches its peers (see _Call).
            if error is not None:
                raise error
            if signature in self._agreed:
                return
        msg = None if error is None else f"{type(error).__name__}: {error}"
        seq = c.seq if c is not None else 0
        # The signature's fingerprint travels, not the signature: a few bytes per call
        # whatever the parameter count (a signature holds every parameter's shape, and
        # pickling W of them, unpickling and comparing them cost ~1 ms per call for 771
        # parameters, and left W x 771 tuples for the garbage collector).
        fp = None if signature is None else fingerprint(signature)
        got = self.exchange((seq, fp, msg))
        if error is not None:
            raise error
        for r, (_, _, m) in enumerate(got):
            if m is not None:
                raise PeerArgumentError(r, m)
        seqs = [q for q, _, _ in got]
        if any(q != seq for q in seqs):
            raise ArgumentMismatchError(f"ranks are at different calls of this group: rank {self.rank} at call "
                                        f"#{seq}, " + ", ".join(f"rank {r} at #{q}" for r, q in enumerate(seqs)
                                                                 if q != seq)
                                        + "; every rank must make the same collective calls in the same order")
        if any(f != fp for _, f, _ in got):
            # Every rank saw the same fingerprints, so every rank takes this second exchange:
            # the signatures themselves, for an error naming the field, the ranks and values.
            sigs = self.exchange(signature)
            check_same([(q, sg, None) for q, sg in zip(seqs, sigs)], self.rank)
            raise ArgumentMismatchError(f"ranks' call signatures differ by fingerprint, yet compare equal: "
                                        f"{describe(signature)} on rank {self.rank}")
        if fp is not None and (k := sig32_of(fp)) not in self._sig_names:
            self._sig_names[k] = describe(signature)
        if self.options.agree == "first" and len(self._agreed) < _AGREED_KEEP:
            self._agreed.add(signature)

    # ---- call identity, aborts, broken state ------------------------------------------
    def call(self, name: str) -> "Call":
        """``with g.call("reduce_scatter") as c:`` around one collective: numbers it, refuses
        concurrent use and calls on a broken group, and on an error publishes the abort to
        the peers (and marks the group broken when data may have moved)."""
        self._check_open()
        return Call(self, name)

    @property
    def broken(self) -> str | None:
        """Why the group is broken (see :class:`~tide_triton.errors.GroupBrokenError`), or None."""
        return self._broken

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
        self._check_open()
        key = device.type
        with self._lock:
            t = self._transports.get(key)
            if t is None:
                if key == "cuda" and self._local is not None:
                    from .transport.driver import module_loading_is_lazy

                    why = _lazy_loading_problem(self.world_size, module_loading_is_lazy())
                    if why:
                        raise RuntimeError(why)
                if key == "cpu":
                    from .transport.host import HostTransport

                    t = HostTransport(self.rank, self.world_size, self.exchange, n_flags=self.n_flags)
                elif key == "cuda":
                    from .transport.cuda import CudaTransport

                    if self.nodes > 1:
                        t = self._node_transport(device)
                    elif self._local is not None:  # one process: the ranks' transports are made together
                        devices = self._local.devices()
                        want = devices[self.rank]
                        if device.index is not None and device != want:
                            raise ValueError(
                                f"single-process mode: rank {self.rank}'s tensors must be on {want} "
                                f"({self._local.placement()}), got {device}; pass local_groups(..., "
                                f"devices=[...]) to place the ranks otherwise")
                        t = self._local.shared("cuda", lambda: CudaTransport.create_local_group(
                            self.world_size, devices=devices, n_flags=self.n_flags))[self.rank]
                    else:
                        t = CudaTransport(self.rank, self.world_size, self.exchange, device=device,
                                          n_flags=self.n_flags, timeout_s=self.options.timeout_s)
                else:
                    raise ValueError(f"tensors must be on the CPU or a CUDA device, got {device}")
                self._transports[key] = t
        if key == "cuda" and device.index is not None:
            have = self.cuda_device()
            if have is not None and have != device:  # its heap, streams and context are that GPU's
                raise ValueError(
                    f"tensors on {device}, but rank {self.rank} of this group drives {have} (where its first "
                    f"CUDA collective ran): a group moves one GPU's tensors per rank -- put them on {have}, or "
                    f"make another group for {device}")
        return t

    def _node_transport(self, device: torch.device):
        """Several nodes on CUDA: a transport over this node's ranks only (VMM handles do not
        cross nodes), addressed with global rank numbers (:class:`GlobalRanks`)."""
        from .transport.cuda import CudaTransport
        from .transport.node_view import GlobalRanks

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

    def heap_region(self, key: str, nbytes: int, device: object):
        """Collective: a persistent region of ``nbytes`` bytes named ``key`` at the same
        offset of every rank's heap on ``device`` -- memory peers can write into, e.g. the
        staging of ``reduce_scatter(..., staging=region)`` (Slot-Reuse).  Calling it again
        with the same key returns the same region.  See :mod:`tide_triton.regions`."""

        self._check_open()
        return heap_region(self, key, nbytes, device)

    def ring_layout(self) -> heap.Ring:
        """The node-local heap layout now: ring after the flags, all-gather block past the
        named regions (:func:`tide_triton.heap.ring`)."""
        o = self.options
        return heap.ring(self.flags.n_flags, self.world_size, o.ring_bytes, o.stages, self.heap_regions_end)

    def cross_node_layout(self) -> heap.CrossNode:
        """The cross-node heap layout now (:func:`tide_triton.heap.cross_node`)."""
        o = self.options
        return heap.cross_node(self.n_flags, o.ring_bytes, o.chunk_bytes, o.inflight_chunks, self.heap_regions_end)

    def existing_transport(self, device_type: str) -> Any:
        """The transport of ``device_type`` (``"cpu"`` / ``"cuda"``) if a collective made it, else None."""
        with self._lock:
            return self._transports.get(device_type)

    def keep_until_idle(self, obj: Any) -> None:
        """Keep ``obj`` (device memory that queued work may still read: a failed run's kernel
        pushes' tables) as long as this group's streams may run: until :meth:`close`, and past
        it -- for the rest of the process -- where close leaked a heap because its streams did not
        drain (freed then, the memory could be reused under a launch that runs late)."""
        with self._lock:
            self._until_idle.append(obj)

    @property
    def kept_until_idle(self) -> tuple:
        """What :meth:`keep_until_idle` holds."""
        with self._lock:
            return tuple(self._until_idle)

    def state(self, key: tuple, make: Any = None) -> Any:
        """Per-group state an executor keeps under ``key`` (made by ``make()`` if missing and
        ``make`` is given; else None).  A value with a ``close_extra()`` method is closed by
        :meth:`close`."""
        with self._lock:
            v = self._extras.get(key)
        if v is None and make is not None:
            v = make()
            with self._lock:
                v = self._extras.setdefault(key, v)
        return v

    @property
    def ranks_in_process(self) -> int:
        """How many of the group's ranks this process drives: all of them in the
        single-process mode (:func:`local_groups`), else one."""
        return self.world_size if self._local is not None else 1

    def heap_barrier(self) -> None:
        """After ``ensure_heap``: in the single-process mode each rank grows its own heap,
        so nobody may address a peer's new range before the peer has mapped it."""
        if self._local is not None:
            self.exchange(None)

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
        if self._local is None or self.world_size == 1 or device.type != "cuda" or self._call is None:
            return
        s = stream if stream is not None else torch.cuda.current_stream(device)
        owner = self._local.claim_stream(self.rank, self._call.seq, s.device.index, s.cuda_stream)
        if owner != self.rank:
            what = "the default stream" if s.cuda_stream == 0 else f"stream {hex(s.cuda_stream)}"
            raise ValueError(
                f"stream: rank {self.rank} enqueues on {what} of {s.device}, which rank {owner} of this "
                "single-process group uses too; ranks that share a stream wait on each other forever -- give "
                "each rank's thread its own (`with torch.cuda.stream(torch.cuda.Stream(device)):`) or pass "
                "stream=")

    def side_stream(self, device: torch.device):
        """The group's stream for ``async_op=True`` collectives on ``device``."""
        key = ("stream", device.type, device.index)
        with self._lock:
            s = self._extras.get(key)
            if s is None:
                # the lowest priority CUDA offers (priority_range()[0], 0 today: the default's),
                # named so that it stays below a caller's higher-priority compute streams; the
                # driver's, not torch's pool, which hands the same streams to callers
                s = self._extras[key] = own_streams.take(device, torch.cuda.Stream.priority_range()[0])
        return s

    def cached(self, key: tuple) -> Any:
        """A prepared collective (bindings, copy lists) for ``key``, or None."""
        with self._lock:
            hit = self._prepared.get(key)
            if hit is not None:
                self._prepared.move_to_end(key)
            return hit

    def cache(self, key: tuple, value: Any) -> Any:
        """Keep ``value`` for ``key`` (the few most recent keys are kept); returns it."""
        with self._lock:
            self.preparations += 1
            self._prepared[key] = value
            while len(self._prepared) > _PREPARED_KEEP:
                self._prepared.popitem(last=False)
        return value

    def pacer(self, device: torch.device) -> "_Pacer":
        """The group's pacer for long collectives on ``device`` (see :class:`_Pacer`)."""
        key = ("pacer", device.type, device.index)
        with self._lock:
            p = self._extras.get(key)
            if p is None:
                p = self._extras[key] = _Pacer(device.type == "cuda", self.options.max_inflight_chunks)
        return p

    def zeros(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """A zero-filled buffer of at least ``nbytes`` on ``device`` (grown, never shrunk).
        A grown-out buffer is kept until the group closes (:meth:`keep_until_idle`; past it
        where close leaked a heap, like the buffer in use): prepared copy lists (cached by
        address) may still read it from the copy queue, where torch's allocator would not
        see the use and could hand its memory out again."""
        key = ("zeros", device.type, device.index)
        with self._lock:
            z = self._extras.get(key)
            if z is not None and z.numel() < nbytes:
                self._until_idle.append(z)
            if z is None or z.numel() < nbytes:
                if z is None and device.type == "cuda":  # the fill kernel's first launch may load it
                    device_wide.before("the zero buffer's first fill (torch may load its kernel)",
                                       device.index if device.index is not None else torch.cuda.current_device())
                z = self._extras[key] = torch.zeros(max(nbytes, 4096), dtype=torch.uint8, device=device)
                if device.type == "cuda":  # rare (growth only): other streams read it next
                    # with a deadline: the stream may hold waits on a peer that died
                    wait_with_deadline(torch.cuda.current_stream(device).synchronize, self.options.timeout_s,
                                       lambda: self._busy_error(device, "growing the zero buffer"))
        return z

    def _busy_error(self, device: torch.device, what: str) -> BaseException:
        """The error for a wait on ``device`` past the group's deadline: the transport's (which
        names a peer its pending stream waits wait for), else a ``TimeoutError``."""
        t = self._transports.get(device.type)
        inner = getattr(t, "inner", t)  # a node's view wraps its transport
        if hasattr(inner, "busy_error"):
            return inner.busy_error(what)
        return TimeoutError(f"rank {self.rank}: {what}: {device} still busy after {self.options.timeout_s:.1f} s")

    def heap_nbytes(self, device: torch.device | str) -> int:
        """Bytes of this rank's heap for ``device``'s kind (cpu / cuda) -- flags, receive ring,
        regions -- mapped outside torch's allocator; 0 when no collective has made it yet.  Not
        collective."""
        kind = torch.device(device).type
        with self._lock:
            t = self._transports.get(kind)
        return 0 if t is None else t.heap_nbytes()

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
        leaked = False
        for x in list(self._extras.values()):  # e.g. the cross-node path's NCCL communicator
            close = getattr(x, "close_extra", None)
            if close is not None:
                try:
                    # a broken group's NCCL hop may wait forever on peers: the short drain
                    broken = self._broken is not None and getattr(x, "close_broken", False)
                    close(drain_timeout_s=_BROKEN_DRAIN_S) if broken else close()
                except Exception as e:  # noqa: BLE001 -- the heaps below are unmapped all the same
                    log.error("rank %d: closing %s failed: %s", self.rank, type(x).__name__, e)
                    failed = failed or e
        for t in self._transports.values():
            inner = getattr(t, "inner", t)  # a node's view (GlobalRanks) closes its transport
            if self._broken is not None and hasattr(inner, "synchronize"):
                # A broken group's GPU work may wait forever on peers: do not hold the
                # process 30 s at close for it, and release its own stuck flag waits so its
                # streams end -- if every peer they wait for abandoned its call (published an
                # abort), so nobody consumes what the released work sends; else the heap is
                # leaked, never unmapped under running work.
                inner.close(drain_timeout_s=_BROKEN_DRAIN_S, may_release=self._all_aborted)
            else:
                t.close()
            leaked = leaked or getattr(inner, "leaked", False)
        self._transports.clear()
        with self._lock:
            if leaked:  # its streams may still run: what they read stays, the zero buffer too
                _KEPT_PAST_LEAKED_HEAPS.extend(self._until_idle)
                _KEPT_PAST_LEAKED_HEAPS.extend(x for k, x in self._extras.items()
                                               if isinstance(k, tuple) and k[:1] == ("zeros",))
            self._until_idle.clear()
        for key, x in list(self._extras.items()):  # the side streams: idle ones serve later groups
            if isinstance(key, tuple) and key[:1] == ("stream",) and key[1] == "cuda":
                del self._extras[key]
                if not own_streams.give_back(x):
                    log.warning("rank %d: its side stream on cuda:%s is still busy at close; not reused",
                                self.rank, key[2])
        if self.pg is not None and _GROUPS.get(id(self.pg)) is self:
            _GROUPS.pop(id(self.pg), None)
        _ALL.discard(self)
        if failed is not None:
            raise failed

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Pacer:
    """Keeps the host at most ``depth`` chunks ahead of the GPU in a long collective.

    Every chunk enqueues flag waits on peers; a host that runs far ahead fills the driver's
    queues with work that cannot start, and where streams share hardware queues (the
    single-process mode: all ranks in one context) a full queue can stall a peer that would
    release it.  After chunk ``j`` an event is recorded; before chunk ``j`` the host waits
    (with the group's timeout, naming a short peer) for chunk ``j - depth``'s event."""

    def __init__(self, cuda: bool, depth: int) -> None:
        self.cuda = cuda
        self.max_depth = depth
        self.depth = depth
        self._events = [torch.cuda.Event() for _ in range(depth)] if cuda else []

    def start(self, ops_per_chunk: int) -> None:
        """Begin a collective whose chunks enqueue up to ``ops_per_chunk`` operations each
        (copy descriptors and flag operations): the depth shrinks so that at most about
        :data:`_QUEUED_OPS` operations wait in the driver's queues at a time."""
        self.depth = max(1, min(self.max_depth, _QUEUED_OPS // max(1, ops_per_chunk)))

    def before(self, j: int, transport: Any, timeout_s: float) -> None:
        if self.cuda and j >= self.depth:
            transport.host_wait_event(self._events[j % self.depth], timeout_s=timeout_s)

    def after(self, j: int, stream: Any) -> None:
        if self.cuda and stream is not None:
            self._events[j % self.depth].record(stream)


class _LocalExchange:
    """What the ranks of one process share: the key-value store of their exchanges and
    objects made once for all of them (e.g. the CUDA transports)."""

    def __init__(self, world_size: int, devices: Sequence[Any] | None = None) -> None:
        self.world_size = world_size
        self.kv = LocalKeyValue()
        self._lock = threading.Lock()
        self._shared: dict = {}
        self._streams: dict[tuple[int, int, int], int] = {}
        self._devices = None if devices is None else _local_rank_devices(world_size, devices)

    def devices(self) -> list[torch.device]:
        """Rank r's CUDA device: as given to :func:`local_groups`, else ``cuda:(r % n)`` over
        the ``n`` visible GPUs (the torchrun convention)."""
        if self._devices is not None:
            return self._devices
        from .transport.cuda import local_devices

        return local_devices(self.world_size)

    def placement(self) -> str:
        if self._devices is not None:
            return "the devices given to local_groups"
        return f"rank r on cuda:(r % {torch.cuda.device_count()}) over the visible GPUs"

    def claim_stream(self, rank: int, seq: int, device_index: int, handle: int) -> int:
        """The rank that first enqueued call ``seq`` on CUDA stream ``handle`` of device
        ``device_index`` (``rank`` if none did).  The last 4096 claims are kept (a rank
        would have to run that many calls ahead of a peer for one to be missed)."""
        with self._lock:
            owner = self._streams.setdefault((seq, device_index, handle), rank)
            while len(self._streams) > 4096:
                del self._streams[next(iter(self._streams))]
            return owner

    def shared(self, key: object, make: Any) -> Any:
        """One object per key for all local ranks, made by the first rank that asks."""
        with self._lock:
            if key not in self._shared:
                self._shared[key] = make()
            return self._shared[key]


def _local_rank_devices(world_size: int, devices: Sequence[Any]) -> list[torch.device]:
    """``local_groups``' ``devices`` checked: one CUDA device with an index per rank."""
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise ValueError(f"devices must be a sequence of {world_size} CUDA devices (rank r's device at "
                         f"index r), got {devices!r}")
    if len(devices) != world_size:
        raise ValueError(f"devices must name one CUDA device per rank: {world_size} entries, "
                         f"got {len(devices)}")
    out = []
    for r, d in enumerate(devices):
        try:
            dev = torch.device(d)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"devices[{r}] must be a CUDA device such as 'cuda:0', got {d!r} ({e})") from None
        if dev.type != "cuda":
            raise ValueError(f"devices[{r}] must be a CUDA device such as 'cuda:0', got {dev} "
                             "(the CPU ranks of local_groups need no device list)")
        if dev.index is None:  # "cuda": the current device, as torch reads it
            dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        out.append(dev)
    return out


_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
_MOST_CONNECTIONS = 32
"""The most hardware queues ``CUDA_DEVICE_MAX_CONNECTIONS`` can give a context."""


def _enough_hardware_queues(streams: int) -> None:
    """One process driving W ranks has ~2W busy streams (copies, reductions).  The driver
    multiplexes streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (default 8);
    two streams on one queue run in order, so a flag wait on one blocks the other -- and
    when the other is the peer that would release it, the ranks deadlock.  Raise the
    limit (read when the CUDA context is created) to what the ranks need (at most 32), if
    still possible -- not beyond: queues cost the GPU's capacity for contexts of all
    processes (H200: 62 contexts at 8 queues each, 9 at 32;
    docs/constraints.md#contexts-per-gpu-and-hardware-queues)."""
    if not torch.cuda.is_available():
        return
    want = min(max(streams, 8), _MOST_CONNECTIONS)
    if streams > _MOST_CONNECTIONS:
        log.warning("single-process mode: its ranks use ~%d streams, more than the %d hardware queues CUDA "
                    "offers: streams of different ranks will share queues, and a flag wait can then hold up the "
                    "peer that would release it (on the H200 at W=4 with 8 queues every rank stalled until its "
                    "deadline); beyond %d ranks run one process per rank", streams, _MOST_CONNECTIONS,
                    (_MOST_CONNECTIONS - 2) // 2)
    have = os.environ.get(_MAX_CONNECTIONS)
    if have is not None and have.isdigit() and int(have) >= want:
        return
    if not torch.cuda.is_initialized() and have is None:
        os.environ[_MAX_CONNECTIONS] = str(want)
        log.info("single-process mode: %s=%d (streams of different ranks must not share "
                 "hardware queues)", _MAX_CONNECTIONS, want)
        return
    log.warning("single-process mode with %d streams but %s=%s (default 8): streams sharing a "
                "hardware queue can deadlock on each other's flag waits; set %s=%d before CUDA "
                "is initialised", streams, _MAX_CONNECTIONS, have or "unset", _MAX_CONNECTIONS, want)


_MODULE_LOADING = "CUDA_MODULE_LOADING"


def _lazy_loading_problem(world_size: int, lazy: bool) -> str | None:
    """The error of a CUDA transport for ``world_size`` ranks of one process whose driver
    loads kernels lazily, or None (one rank, or eager loading).

    Lazy module loading (torch's default) loads a kernel at its first launch, and that load
    can synchronize the whole CUDA context.  One process driving several ranks then
    deadlocks when one rank's thread launches a kernel for the first time (``Tensor.to``,
    ``torch.full`` ...) while another rank's stream waits for a flag that rank will only set
    later: seen on an H200, 3 of 3 runs of the planned-collectives test under load with
    ``LAZY`` (both ranks' threads stopped in ``Tensor.to``), 3 of 3 passed with ``EAGER``
    (docs/constraints.md#lazy-module-loading).  The driver reads ``CUDA_MODULE_LOADING`` once, at ``cuInit`` -- which
    ``torch.cuda.is_available()`` already calls (checked on the H200: set after it, the
    driver still loads lazily) -- so the library cannot switch it; the process must."""
    if world_size < 2 or not lazy:
        return None
    return (f"single-process mode (local_groups) with {world_size} ranks needs eager CUDA module "
            f"loading, but this process loads kernels lazily ({_MODULE_LOADING}="
            f"{cuda_module_loading() or 'unset: LAZY, torch default'}): a kernel's first launch "
            f"synchronizes the CUDA context, and while one rank's stream waits for a peer's flag "
            f"that synchronization can deadlock the ranks. Set {_MODULE_LOADING}=EAGER in the "
            f"environment before the process's first CUDA call (the driver reads it once, at "
            f"cuInit: torch.cuda.is_available() is already too late), or run one process per "
            f"rank (torchrun)")


_SHARED_OPTIONS = ("ring_bytes", "stages", "agree", "chunk_bytes", "inflight_chunks", "inter_node", "multicast")
"""The options every rank of a group must share (agreed at creation): they lay out the heap,
the ring and the flag map, choose the protocol of the calls or the hop across nodes.  The
others (``timeout_s``, ``max_ctas``, ``rs_push``, ``max_inflight_chunks``, ``nccl_library``) are this
rank's own affair."""


def local_groups(world_size: int, *, local_size: int | None = None,
                 devices: Sequence[Any] | None = None, **options: Any) -> list[Group]:
    """Single-process multi-rank mode: ``world_size`` groups whose ranks are driven by
    threads of this process (one thread per rank calls the collectives with its group).
    Each rank has its own heap and streams, so on one GPU their work overlaps the way it
    does on a real node (processes sharing a GPU time-slice instead).  ``local_size``
    declares nodes (default: one node; ``LOCAL_WORLD_SIZE`` is not read here).
    ``devices``: rank r's CUDA device (``world_size`` entries; e.g. ``["cuda:0"] * W`` to
    share one GPU); default ``cuda:(r % n)`` over the ``n`` visible GPUs."""
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    opts = GroupOptions(**options)
    Topology(world_size, world_size if local_size is None else local_size)  # errors before threads
    ex = _LocalExchange(world_size, devices)
    _enough_hardware_queues(2 * world_size + 2)
    groups: list[Group | None] = [None] * world_size

    def make(r: int) -> None:  # Group() agrees on the topology: every rank at once
        groups[r] = Group(None, opts, local_size=local_size, _local=ex, _rank=r)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(g is None for g in groups):
        raise RuntimeError("local_groups: a rank failed to create its group")
    return groups  # type: ignore[return-value]


_GROUPS: dict[int, Group] = {}
_KEPT_PAST_LEAKED_HEAPS: list[Any] = []
"""What closed groups kept for their streams (:meth:`Group.keep_until_idle`) where close leaked
a heap: never freed."""
_ALL: "weakref.WeakSet[Group]" = weakref.WeakSet()
"""Every open group of this process: closed at interpreter exit and when their process
group is destroyed (a group left open there aborted the process in 3 of 27 exits)."""
_OPENED = itertools.count()
"""Creation order of this process's groups (``Group._opened``)."""
_INSTANCES: dict[str, int] = {}


def _default_store() -> Any:
    """The default process group's store (every process group's ranks reach it)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return c10d._get_default_store()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"tide_triton needs torch.distributed's default store for its bootstrap "
                           f"exchanges, and none is reachable ({e}); call init_process_group first") from e


def exchange_once(pg: Any, obj: object, *, what: str, timeout_s: float) -> list:
    """One all-gather of a small picklable object over ``pg``'s ranks (in their order there),
    through the bootstrap store like a group's exchanges -- with a deadline naming the ranks
    that did not arrive, and no collective of ``pg`` itself (no NCCL communicator made)."""
    ex = _store_exchange(pg, _store_prefix(pg) + "once/")
    return ex.exchange(obj, call=0, index=1, timeout_s=timeout_s, what=what)


def _store_exchange(pg: Any, prefix: str) -> Exchange:
    """An exchange of ``pg``'s ranks through the default store, whose failure names its host:
    global rank 0 (``init_method="tcp://..."`` / ``"env://"`` serve the store there)."""
    ex = Exchange(StoreKeyValue(_default_store()), prefix, dist.get_rank(pg), dist.get_world_size(pg))
    ranks = dist.get_process_group_ranks(pg)
    ex.store_host = ranks.index(0) if 0 in ranks else None
    return ex


def _store_prefix(pg: Any) -> str:
    """Keys of one group instance: the process group's name and how many groups this process
    made for it before (every rank makes them in the same order: creation is collective)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        name = c10d._get_process_group_name(pg)
    except Exception:  # noqa: BLE001
        name = "ranks-" + "-".join(map(str, dist.get_process_group_ranks(pg)))
    n = _INSTANCES[name] = _INSTANCES.get(name, 0) + 1
    return f"tide_triton/{name}/{n}/"


def _open_groups_newest_first() -> "list[Group]":
    """The open groups in the reverse of their creation order.  Closing destroys NCCL
    communicators, which their other members must destroy in the same order (a window
    deregistration and the destroy wait for them): ``_ALL`` iterates by address, which
    differs between processes -- two ranks closing two communicators in opposite orders
    hung in ``ncclCommDestroy`` (docs/constraints.md#communicators-close-in-one-order).  Groups
    are created collectively, so the
    creation order is the same on every member."""
    return sorted(_ALL, key=lambda g: g._opened, reverse=True)


def _close_all() -> None:
    for g in _open_groups_newest_first():
        try:
            g.close()
        except Exception as e:  # noqa: BLE001 -- at exit: log, never raise
            log.warning("closing a tide_triton group at exit failed: %s", e)


atexit.register(_close_all)

_destroy_wrapped = False


def _close_with_process_groups() -> None:
    """Close groups when their process group is destroyed: ``dist.destroy_process_group``
    is wrapped (once) to close the groups over that process group (all, for the world)
    before torch tears it down."""
    global _destroy_wrapped
    if _destroy_wrapped:
        return
    from torch.distributed import distributed_c10d as c10d

    orig = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> Any:
        for g in _open_groups_newest_first():
            if g.pg is not None and (group is None or g.pg is group or group is dist.group.WORLD):
                try:
                    g.close()
                except Exception as e:  # noqa: BLE001
                    log.warning("closing a tide_triton group before destroy_process_group failed: %s", e)
        return orig(group)

    destroy_process_group.__wrapped__ = orig  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = orig.__doc__
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    _destroy_wrapped = True


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
    _close_with_process_groups()
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
