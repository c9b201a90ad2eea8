"""A tide_triton group: bootstrap over a torch.distributed process group, agreement on
arguments and errors, and the transports it owns.

Every collective starts with :meth:`Group.agree`: each rank checks its own arguments, then
all ranks exchange (signature, error) over the group's gloo bootstrap; if any rank failed,
every rank raises (the failing rank its own error, the others an error naming it), and if
the signatures differ every rank raises naming the ranks that disagree -- nobody is left
waiting on a peer that will never come.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from .errors import ArgumentMismatchError, PeerArgumentError
from .schedule import FlagMap
from .topology import Topology

__all__ = ["GroupOptions", "Group", "init", "local_groups", "ArgumentMismatchError", "PeerArgumentError"]

log = logging.getLogger("tide_triton")

_QUEUED_OPS = 512
"""Operations a rank may have queued ahead of the GPU in one collective (see _Pacer): a
driver whose queue for a stream is full blocks the enqueuing thread, and a thread blocked
while its stream waits on a peer is a deadlock waiting to happen."""

_AGREED_KEEP = 4096
"""Signatures remembered with ``agree="first"`` (a model's parameter groups x ops)."""

_PREPARED_KEEP = 8
"""Prepared collectives kept per group: a training step's few (tensors, op) combinations."""


@dataclass(frozen=True)
class GroupOptions:
    """Options of :func:`init` (keyword-only)."""

    timeout_s: float = 300.0
    """Longest wait on any peer before raising an error that names it."""
    ring_bytes: int = 256 << 20
    """Reduce-scatter receive staging per rank, whatever the world size or the layout.
    Measured on the H200 (Llama-3.1-70B layer, 2 ranks): 256 MiB takes 7 chunks and
    3.0 ms; 64 MiB takes 26 chunks and 9.9 ms, bound by the host's per-chunk enqueue work."""
    stages: int = 2
    """Stages of the receive ring: chunk j+1's copies overlap chunk j's accumulation."""
    max_ctas: int | None = None
    """CTA budget of the collectives' kernels (None: as many as the work has tiles)."""
    agree: str = "always"
    """``"always"``: every collective exchanges its signature and errors over the bootstrap
    group first, so bad arguments on one rank raise on every rank at once.  ``"first"``: only
    the first call with a given signature does; later ones start at once (training loops,
    where the same collectives repeat every step).  A rank whose arguments are bad then raises
    alone, at once; its peers raise ``PeerTimeoutError`` naming it after ``timeout_s`` (or, in
    a call whose signature is new to them, wait in the bootstrap exchange until the process
    group's own timeout)."""
    max_inflight_chunks: int = 8
    """How many reduce-scatter chunks the host may enqueue ahead of the GPU."""
    chunk_bytes: int = 4 << 20
    """Across nodes: largest chunk on the inter-node wire (one send, gated on its signal)."""
    inflight_chunks: int = 2
    """Across nodes: chunks a rank may have on the inter-node wire at once; the wire's
    buffers are ``inflight_chunks * chunk_bytes`` per rank, whatever the number of nodes."""
    inter_node: str = "auto"
    """Across nodes on CUDA, how bytes cross: ``"put_signal"`` -- NCCL's one-sided
    ``ncclPutSignal`` into each rail peer's landing ring (a registered window of
    ``inflight_chunks * chunk_bytes``), ``ncclWaitSignal`` to pace it; copy engines on NVLink,
    NCCL's proxy on a network, no SMs.  ``"send_recv"`` -- grouped ``ncclSend`` / ``ncclRecv``
    (NCCL's kernels: uses SMs).  ``"auto"``: put/signal where the NCCL library and every
    rail support it, else send/recv (logged once).  ``"put_signal"`` where it is not
    supported raises, naming the rank and why."""
    nccl_library: str | None = None
    """Across nodes on CUDA: the libnccl to load (else ``$TIDE_TRITON_NCCL_LIBRARY``, the
    nvidia-nccl wheel, the system's; see :mod:`tide_triton.transport.nccl`)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if isinstance(self.ring_bytes, bool) or not isinstance(self.ring_bytes, int) or self.ring_bytes < 256:
            raise ValueError(f"ring_bytes must be an int >= 256, got {self.ring_bytes!r}")
        if isinstance(self.stages, bool) or not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {self.stages!r}")
        if self.agree not in ("always", "first"):
            raise ValueError(f'agree must be "always" or "first", got {self.agree!r}')
        if isinstance(self.max_inflight_chunks, bool) or not isinstance(self.max_inflight_chunks, int) \
                or self.max_inflight_chunks < 1:
            raise ValueError(f"max_inflight_chunks must be an int >= 1, got {self.max_inflight_chunks!r}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 16:
            raise ValueError(f"chunk_bytes must be an int >= 16, got {self.chunk_bytes!r}")
        if isinstance(self.inflight_chunks, bool) or not isinstance(self.inflight_chunks, int) \
                or self.inflight_chunks < 1:
            raise ValueError(f"inflight_chunks must be an int >= 1, got {self.inflight_chunks!r}")
        if self.inter_node not in ("auto", "put_signal", "send_recv"):
            raise ValueError(f'inter_node must be "auto", "put_signal" or "send_recv", got {self.inter_node!r}')
        if self.nccl_library is not None and not isinstance(self.nccl_library, str):
            raise TypeError(f"nccl_library must be None or a path (str), got {type(self.nccl_library).__name__}")
        if self.max_ctas is not None and (isinstance(self.max_ctas, bool) or not isinstance(self.max_ctas, int)
                                          or self.max_ctas < 1):
            raise ValueError(f"max_ctas must be None or an int >= 1, got {self.max_ctas!r}")


class Group:
    """Collective state over one torch.distributed process group.

    ``topology``: the group's ranks in nodes of ``local_size`` consecutive ranks (see
    :func:`init`).  With one node the collectives run node-locally
    (:mod:`tide_triton.collectives`); with several, across nodes
    (:mod:`tide_triton.hier_collectives`)."""

    def __init__(self, pg: dist.ProcessGroup | None = None, options: GroupOptions | None = None, *,
                 local_size: int | None = None,
                 _local: "_LocalExchange | None" = None, _rank: int = 0) -> None:
        self.options = options or GroupOptions()
        if _local is not None:  # single-process multi-rank mode (see local_groups)
            self.pg = None
            self.rank, self.world_size = _rank, _local.world_size
            self._local = _local
            self._bootstrap = None
        else:
            if not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
            self.pg = pg if pg is not None else dist.group.WORLD
            self._local = None
            self.rank = dist.get_rank(self.pg)
            self.world_size = dist.get_world_size(self.pg)
            if dist.get_backend(self.pg) == "gloo":
                self._bootstrap = self.pg
            else:  # object exchange needs a CPU-capable group
                self._bootstrap = dist.new_group(dist.get_process_group_ranks(self.pg), backend="gloo")
        self.topology = self._agree_topology(local_size)
        self.local_size = self.topology.local_size
        self.nodes = self.topology.nodes
        # Flags are indexed by group rank: the host transport maps every rank's heap (one
        # host), and the cross-node executor keeps its own flags after these.
        self.flags = FlagMap(self.world_size, self.options.stages)
        self.n_flags = self.flags.n_flags
        if self.nodes > 1:
            from .hier_collectives import extra_flags

            self.n_flags += extra_flags(self)
        self._transports: dict[str, Any] = {}
        self._extras: dict[tuple, Any] = {}
        self._prepared: OrderedDict[tuple, Any] = OrderedDict()
        self._agreed: set = set()
        self._lock = threading.Lock()
        self.ag_epoch = 0
        self.rs_last: dict[tuple[int, int], int] = {}
        self.rs_count = 0
        self._heap_regions: dict[tuple[str, str], Any] = {}
        self.heap_regions_end = 0
        """Heap bytes below which named regions lie (0: none); the all-gather block starts past it."""
        self._closed = False

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
        """Every rank's topology, agreed: an error on any rank raises on every rank."""
        err: BaseException | None = None
        topo: Topology | None = None
        try:
            topo = self._topology_here(local_size)
        except (TypeError, ValueError) as e:
            err = e
        got = self.exchange((None if topo is None else (topo.world_size, topo.local_size),
                             None if err is None else f"{type(err).__name__}: {err}"))
        if err is not None:
            raise err
        for r, (_, m) in enumerate(got):
            if m is not None:
                raise ValueError(f"rank {r} rejected the topology: {m}")
        bad = [r for r, (t, _) in enumerate(got) if t != got[0][0]]
        if bad:
            raise ValueError(f"ranks disagree on the topology (world_size, local_size): rank 0 has "
                             f"{got[0][0]}, rank {bad[0]} has {got[bad[0]][0]}; pass the same local_size "
                             f"(or LOCAL_WORLD_SIZE) on every rank")
        return cast(Topology, topo)  # set: this rank raised above otherwise

    # ---- bootstrap ----------------------------------------------------------------------
    def exchange(self, obj: object) -> list:
        """All-gather one small picklable object per rank (rank order)."""
        if self._local is not None:
            return self._local.exchange(self.rank, obj, self.options.timeout_s)
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self._bootstrap)
        return out

    def agree(self, signature: object, error: BaseException | None) -> None:
        """Share this rank's (signature, error); raise on every rank if any rank failed or
        the signatures differ."""
        if self.options.agree == "first":
            # Signatures agreed before are trusted: no exchange (a host round trip over the
            # bootstrap group per collective, which stalls a training loop's run-ahead).  A
            # rank that fails raises alone; its peers then time out naming it.
            if error is not None:
                raise error
            if signature in self._agreed:
                return
        msg = None if error is None else f"{type(error).__name__}: {error}"
        got = self.exchange((signature, msg))
        if error is not None:
            raise error
        for r, (_, m) in enumerate(got):
            if m is not None:
                raise PeerArgumentError(r, m)
        first = got[0][0]
        bad = [r for r, (s, _) in enumerate(got) if s != first]
        if bad:
            raise ArgumentMismatchError(
                f"ranks disagree on the collective's arguments: rank 0 has {first!r}, "
                f"rank {bad[0]} has {got[bad[0]][0]!r}"
            )
        if self.options.agree == "first" and len(self._agreed) < _AGREED_KEEP:
            self._agreed.add(signature)

    # ---- transports ---------------------------------------------------------------------
    def transport(self, device: torch.device):
        self._check_open()
        key = device.type
        with self._lock:
            t = self._transports.get(key)
            if t is None:
                if key == "cpu":
                    from .transport.host import HostTransport

                    t = HostTransport(self.rank, self.world_size, self.exchange, n_flags=self.n_flags)
                elif key == "cuda":
                    from .transport.cuda import CudaTransport

                    if self.nodes > 1:
                        t = self._node_transport(device)
                    elif self._local is not None:  # one process: the ranks' transports are made together
                        t = self._local.shared(("cuda", device.index), lambda: CudaTransport.create_local_group(
                            self.world_size, device=device, n_flags=self.n_flags))[self.rank]
                    else:
                        t = CudaTransport(self.rank, self.world_size, self.exchange, device=device,
                                          n_flags=self.n_flags, timeout_s=self.options.timeout_s)
                else:
                    raise ValueError(f"tensors must be on the CPU or a CUDA device, got {device}")
                self._transports[key] = t
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
        from .regions import heap_region

        self._check_open()
        return heap_region(self, key, nbytes, device)

    def heap_barrier(self) -> None:
        """After ``ensure_heap``: in the single-process mode each rank grows its own heap,
        so nobody may address a peer's new range before the peer has mapped it."""
        if self._local is not None:
            self.exchange(None)

    def side_stream(self, device: torch.device):
        """The group's stream for ``async_op=True`` collectives on ``device``."""
        key = ("stream", device.type, device.index)
        with self._lock:
            s = self._extras.get(key)
            if s is None:
                s = self._extras[key] = torch.cuda.Stream(device)
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
        """A zero-filled buffer of at least ``nbytes`` on ``device`` (grown, never shrunk)."""
        key = ("zeros", device.type, device.index)
        with self._lock:
            z = self._extras.get(key)
            if z is None or z.numel() < nbytes:
                z = self._extras[key] = torch.zeros(max(nbytes, 4096), dtype=torch.uint8, device=device)
                if device.type == "cuda":  # rare (growth only): other streams read it next
                    torch.cuda.current_stream(device).synchronize()
        return z

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
        """Idempotent: closes every transport (unmaps heaps, closes handles)."""
        if self._closed:
            return
        self._closed = True
        for x in list(self._extras.values()):  # e.g. the cross-node path's NCCL communicator
            close = getattr(x, "close_extra", None)
            if close is not None:
                close()
        for t in self._transports.values():
            t.close()
        self._transports.clear()
        if self.pg is not None and _GROUPS.get(id(self.pg)) is self:
            _GROUPS.pop(id(self.pg), None)

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
    """In-process all-gather for ranks driven by threads of one process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list = [None] * world_size
        self._lock = threading.Lock()
        self._shared: dict = {}

    def shared(self, key: object, make: Any) -> Any:
        """One object per key for all local ranks, made by the first rank that asks."""
        with self._lock:
            if key not in self._shared:
                self._shared[key] = make()
            return self._shared[key]

    def exchange(self, rank: int, obj: object, timeout_s: float) -> list:
        self._slots[rank] = obj
        try:
            self._barrier.wait(timeout_s)      # everyone has written
            out = list(self._slots)
            self._barrier.wait(timeout_s)      # everyone has read: slots may be reused
        except threading.BrokenBarrierError:
            raise TimeoutError(
                f"rank {rank}: a local peer did not reach the exchange within {timeout_s} s"
            ) from None
        return out


_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def _enough_hardware_queues(streams: int) -> None:
    """One process driving W ranks has ~2W busy streams (copies, reductions).  The driver
    multiplexes streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (default 8);
    two streams on one queue run in order, so a flag wait on one blocks the other -- and
    when the other is the peer that would release it, the ranks deadlock.  Raise the
    limit (read when the CUDA context is created) to its maximum, 32, if still possible."""
    have = os.environ.get(_MAX_CONNECTIONS)
    if have is not None and have.isdigit() and int(have) >= min(streams, 32):
        return
    if not torch.cuda.is_available():
        return
    if not torch.cuda.is_initialized() and have is None:
        os.environ[_MAX_CONNECTIONS] = "32"
        log.info("single-process mode: %s=32 (streams of different ranks must not share "
                 "hardware queues)", _MAX_CONNECTIONS)
        return
    log.warning("single-process mode with %d streams but %s=%s (default 8): streams sharing a "
                "hardware queue can deadlock on each other's flag waits; set %s=32 before CUDA "
                "is initialised", streams, _MAX_CONNECTIONS, have or "unset", _MAX_CONNECTIONS)


def local_groups(world_size: int, *, local_size: int | None = None, **options: Any) -> list[Group]:
    """Single-process multi-rank mode: ``world_size`` groups whose ranks are driven by
    threads of this process (one thread per rank calls the collectives with its group).
    Each rank has its own heap and streams, so on one GPU their work overlaps the way it
    does on a real node (processes sharing a GPU time-slice instead).  ``local_size``
    declares nodes (default: one node; ``LOCAL_WORLD_SIZE`` is not read here)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    opts = GroupOptions(**options)
    Topology(world_size, world_size if local_size is None else local_size)  # errors before threads
    _enough_hardware_queues(2 * world_size + 2)
    ex = _LocalExchange(world_size)
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
