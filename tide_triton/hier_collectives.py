"""Across nodes: ``reduce_scatter`` and ``all_gather`` for a group of several nodes.

:mod:`tide_triton.collectives` dispatches here (after every rank has agreed on the
arguments) when the group's topology has more than one node.  The contract is the node-local
one, unchanged; the schedules are :class:`~tide_triton.hier_schedule.AllGatherPlan` and
:class:`~tide_triton.hier_schedule.ReduceScatterPlan` (checked by :mod:`tide_triton.simulate`).

All-gather
    1. this rank's shard into its own parameter storage (a copy; a Triton cast when the
       parameters' dtype differs, so everything after moves in the parameters' dtype);
    2. ``ceil(log2 nodes)`` rounds along the rail (recursive doubling; Bruck for node counts
       that are not powers of two): round ``k`` sends the shards held to the rail peer the
       plan names and receives its shards, straight from and into the per-parameter
       ``params`` storage (one run per parameter and block of nodes), in chunks of at most
       ``chunk_bytes`` with at most ``inflight_chunks`` on the wire;
    3. node-local pickup: each rank publishes its whole rail (a copy into its heap block,
       because ``params`` is private process memory here), node peers copy it into their
       parameter storage.

Reduce-scatter, window by window over the flat shard coordinate (``ReduceScatterPlan``'s
windows, so the staging is at most ``ring_bytes`` per rank whatever the number of nodes):
    1. node-local: every rank pushes its gradient slices for each node peer's rail into that
       peer's slots (copies); each rank sums, with the Triton segmented kernel, the ``L``
       contributions in local-rank order 0..L-1 (its own read in place) into fp32 partial
       sums for the ``nodes`` shards of its rail;
    2. along the rail: recursive halving (Bruck's transpose otherwise) -- each round sends
       fp32 partial sums for half of the destinations still held and adds the partial sums
       received (Triton kernel: ``held + received``, in that order);
    3. the full fp32 sum of this rank's window, scaled (``op``), into its shard (Triton
       kernel, ``accumulate`` adds the old value); the last round's addition (which only
       concerns this rank's own shard) is done in this same kernel: ``(held + received)``.

Summation order (fixed, so repeated runs are bit-identical): within a node, local ranks
0..L-1; across nodes, the order the plan's rounds combine node partial sums (for 2 nodes:
``own node + other node``).  It differs from the node-local path's 0..W-1 order, so sums of
arbitrary floats may differ from it in the last bits; integer-valued inputs sum exactly in
both.  The wire carries fp32 partial sums (no extra rounding; twice bf16's bytes).

The inter-node transport
    :class:`InterNodeTransport` is the interface the cross-node hop needs: grouped,
    two-sided ``sendrecv`` of byte streams between rail peers (as ``ncclGroupStart``;
    ``ncclSend``/``ncclRecv`` per peer; ``ncclGroupEnd``), chunked and paced inside the
    transport.  Receivers name their own destination addresses, so data lands in
    per-parameter storage without a staging copy on the interface.  On CUDA two NCCL
    transports implement it, chosen by ``GroupOptions.inter_node`` (:func:`_nccl_net`):
    :class:`NcclPutSignalInterNode` (one-sided ``ncclPutSignal`` / ``ncclWaitSignal`` /
    ``ncclSignal`` through per-rank windows, copy engines, no SMs) and
    :class:`NcclInterNode` (grouped ``ncclSend`` / ``ncclRecv``, SM kernels).

    :class:`HostInterNode` implements it for CPU tensors over the host transport's
    ``/dev/shm`` heaps, which every rank of the test maps (all "nodes" share one host).
    What it exercises: the cross-node schedules and the executor for real -- every byte
    between nodes goes through ``sendrecv``, only to rail peers on other nodes, in
    ``chunk_bytes`` chunks through a bounded ring of ``inflight_chunks`` slots per sender,
    each chunk gated on a flag signal and freed by the receiver's signal; progress of sends
    and receives interleaves, so symmetric exchanges cannot deadlock; timeouts name the
    peer.  What it does not exercise: a network (latency, bandwidth, loss), NCCL itself and
    its feature detection, GPU memory registration, copy engines or RDMA, overlap of the
    wire with compute (everything here is synchronous on the host), and the bounce copy
    into the sender's slot is an emulation cost a real network transport does not have.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from .collectives import Work, _round_up
from .group import Group
from .hier_schedule import AllGatherPlan, ReduceScatterPlan, _RailRuns
from .kernels._segments import Binding, Run, SegmentProgram
from .layout import ShardLayout
from .schedule import peer_slot
from .transport.base import PeerTimeoutError

log = logging.getLogger("tide_triton")

__all__ = ["InterNodeTransport", "HostInterNode", "NcclInterNode", "NcclPutSignalInterNode", "reduce_scatter", "all_gather", "extra_flags",
           "stats"]

Iov = Sequence[tuple[int, int]]
"""A byte stream as ``(address, nbytes)`` pieces, in order."""
Message = tuple[int, Iov]
"""``(peer rank, pieces)``: what one ``sendrecv`` sends to, or receives from, one peer."""

_HEADER = 24  # per slot: (dst << 40 | channel sequence), global sequence, nbytes
_CHAN_BITS = 40


class InterNodeTransport(Protocol):
    """The cross-node hop: two-sided, grouped, chunked and paced inside the transport.

    ``sendrecv(sends, recvs)`` starts every send and receive at once and returns when every
    receive has landed and every send's source may be reused.  Messages between one pair of
    ranks are matched in call order (as NCCL's); a sender's and a receiver's byte counts must
    agree.  Counters: bytes and chunks sent, bytes received (what crossed between nodes)."""

    bytes_sent: int
    bytes_received: int
    chunks_sent: int

    def sendrecv(self, sends: Sequence[Message], recvs: Sequence[Message], *, timeout_s: float,
                 what: str = "") -> None: ...


def extra_flags(g: Group) -> int:
    """Flags the cross-node executor needs after the group's :class:`FlagMap`: one ready
    flag per sending rank and one free flag per slot of this rank's wire ring."""
    return g.world_size + g.options.inflight_chunks


class _Cursor:
    """Position in an iov byte stream."""

    __slots__ = ("iov", "total", "pos", "i", "off")

    def __init__(self, iov: Iov) -> None:
        self.iov = [(a, n) for a, n in iov if n]
        self.total = sum(n for _, n in self.iov)
        self.pos = self.i = self.off = 0

    def move(self, other: int, n: int, *, out: bool) -> None:
        """Copy the next ``n`` bytes of the stream to (``out``) or from ``other``."""
        done = 0
        while done < n:
            a, ln = self.iov[self.i]
            take = min(ln - self.off, n - done)
            if out:
                ctypes.memmove(other + done, a + self.off, take)
            else:
                ctypes.memmove(a + self.off, other + done, take)
            done += take
            self.off += take
            if self.off == ln:
                self.i, self.off = self.i + 1, 0
        self.pos += n


class HostInterNode:
    """:class:`InterNodeTransport` over host shared memory (see the module docstring).

    Each rank owns a wire ring in its heap at ``region_off``: ``n_slots`` headers, then
    ``n_slots`` data slots of ``chunk_bytes``.  A sender packs the next chunk of a message
    into its next slot (global sequence ``g``, slot ``g % n_slots``) once the receiver of
    that slot's previous chunk has freed it, writes the header, and raises the receiver's
    ready flag for this channel to the channel's chunk count.  The receiver finds the chunk
    by its header, copies it to its own destination addresses and writes ``g`` into the
    sender's free flag of that slot."""

    path = "host"

    def __init__(self, t: object, rank: int, world_size: int, local_size: int, flag_base: int,
                 region_off: int, chunk_bytes: int, n_slots: int) -> None:
        self.t, self.rank, self.world_size, self.local_size = t, rank, world_size, local_size
        self.flag_base, self.region_off = flag_base, region_off
        self.chunk_bytes, self.n_slots = chunk_bytes, n_slots
        self._data_off = region_off + _round_up(n_slots * _HEADER, 64)
        self._slot_stride = _round_up(chunk_bytes, 64)
        self._g = 0
        self._sent: dict[int, int] = {}
        self._recvd: dict[int, int] = {}
        self.bytes_sent = self.bytes_received = self.chunks_sent = 0

    @staticmethod
    def region_bytes(chunk_bytes: int, n_slots: int) -> int:
        return _round_up(n_slots * _HEADER, 64) + n_slots * _round_up(chunk_bytes, 64)

    def _ready(self, src: int) -> int:
        return self.flag_base + src

    def _free(self, slot: int) -> int:
        return self.flag_base + self.world_size + slot

    def _header(self, rank: int, slot: int) -> ctypes.Array:
        return (ctypes.c_int64 * 3).from_address(self.t.address(rank, self.region_off + slot * _HEADER))

    def _slot(self, rank: int, slot: int) -> int:
        return self.t.address(rank, self._data_off + slot * self._slot_stride)

    def _check_peers(self, msgs: Sequence[Message], name: str) -> None:
        seen = set()
        for peer, _ in msgs:
            if not 0 <= peer < self.world_size or peer // self.local_size == self.rank // self.local_size:
                raise ValueError(f"{name}: peer {peer} is not a rank on another node than rank {self.rank}")
            if peer in seen:
                raise ValueError(f"{name}: peer {peer} appears twice in one sendrecv")
            seen.add(peer)

    def sendrecv(self, sends: Sequence[Message], recvs: Sequence[Message], *, timeout_s: float,
                 what: str = "") -> None:
        self._check_peers(sends, "sends")
        self._check_peers(recvs, "recvs")
        t, me, C = self.t, self.rank, self.chunk_bytes
        out = [(p, _Cursor(iov)) for p, iov in sends]
        inc = [(p, _Cursor(iov)) for p, iov in recvs]
        deadline = time.monotonic() + timeout_s
        pause = 1e-6
        while True:
            moved = False
            for peer, cur in out:
                while cur.pos < cur.total:
                    g = self._g + 1
                    slot = (g - 1) % self.n_slots
                    if g > self.n_slots and t.read_flag(self._free(slot)) < g - self.n_slots:
                        break  # the slot's previous chunk is still unread
                    n = min(C, cur.total - cur.pos)
                    cur.move(self._slot(me, slot), n, out=True)
                    chan = self._sent.get(peer, 0) + 1
                    h = self._header(me, slot)
                    h[1], h[2] = g, n
                    h[0] = (peer << _CHAN_BITS) | chan  # one aligned 8-byte store, written last
                    t.signal(peer, self._ready(me), chan)
                    self._g, self._sent[peer] = g, chan
                    self.bytes_sent += n
                    self.chunks_sent += 1
                    moved = True
            for peer, cur in inc:
                while cur.pos < cur.total:
                    want = self._recvd.get(peer, 0) + 1
                    if t.read_flag(self._ready(peer)) < want:
                        break
                    key = (me << _CHAN_BITS) | want
                    slot = next((j for j in range(self.n_slots) if self._header(peer, j)[0] == key), None)
                    if slot is None:
                        raise RuntimeError(f"rank {peer} announced chunk {want} for rank {me} but no slot holds it")
                    h = self._header(peer, slot)
                    g, n = h[1], h[2]
                    if n != min(C, cur.total - cur.pos):
                        raise RuntimeError(
                            f"rank {peer} sent a {n}-byte chunk, rank {me} expected "
                            f"{min(C, cur.total - cur.pos)} bytes ({what}): the ranks disagree on the schedule")
                    cur.move(self._slot(peer, slot), n, out=False)
                    t.signal(peer, self._free(slot), g)
                    self._recvd[peer] = want
                    self.bytes_received += n
                    moved = True
            if all(c.pos == c.total for _, c in out) and all(c.pos == c.total for _, c in inc):
                return
            if moved:
                pause = 1e-6
                continue
            if time.monotonic() > deadline:
                late = next((p for p, c in inc if c.pos < c.total), None)
                if late is None:
                    late = next(p for p, c in out if c.pos < c.total)
                raise PeerTimeoutError(late, what or "inter-node sendrecv", timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


# --------------------------------------------------------------------------- per-group state
def _rail(g: Group) -> tuple[int, ...]:
    L = g.local_size
    return tuple(m * L + g.rank % L for m in range(g.nodes))


class NcclInterNode:
    """The cross-node hop over NCCL's grouped ``ncclSend`` / ``ncclRecv`` (``inter_node=
    "send_recv"``, and the fallback of ``"auto"``).  This rank's rail (the ranks with its
    local index, one per node) is one communicator, made from a unique id exchanged through
    the group; ``sendrecv`` enqueues one NCCL group on the group's side stream (where the
    executor runs), after the node-local work before it and before the additions after it
    (stream order, no host wait).  Every piece of a message goes as its own send, split at
    ``chunk_bytes``: the sender's and the receiver's pieces are built from the same plan
    runs, so they pair one to one, in order, as NCCL matches them.  NCCL's send/recv kernels
    use SMs.  NCCL operations have no timeout of their own: a peer that never posts its side
    leaves the stream waiting, and :func:`tide_triton.synchronize` reports it as GPU work
    still busy after the group's timeout."""

    path = "send_recv"

    def __init__(self, g: Group, t: object, comm: object) -> None:
        self.rank = g.rank
        self.rail = _rail(g)
        self.comm = comm
        self.stream = g.side_stream(t.device)  # the stream _Order runs the collective on
        self.chunk_bytes = g.options.chunk_bytes
        self.bytes_sent = self.bytes_received = self.chunks_sent = 0
        self._watch: list[tuple[object, tuple[int, ...], str]] = []

    # NCCL's stream-side waits have no timeout: after each operation that can wait on a peer an
    # event is recorded, and stuck() names the peers of the oldest one not passed yet (for
    # tide_triton.synchronize's PeerTimeoutError).
    def _watch_after(self, peers: tuple[int, ...], what: str) -> None:
        while self._watch and self._watch[0][0].query():
            self._watch.pop(0)
        ev = torch.cuda.Event()
        ev.record(self.stream)
        self._watch.append((ev, peers, what))

    def stuck(self) -> tuple[tuple[int, ...], str] | None:
        """``(global ranks, what)`` of the oldest NCCL operation still waiting, or None."""
        for ev, peers, what in self._watch:
            if not ev.query():
                return peers, what
        self._watch.clear()
        return None

    def _index(self, peer: int, name: str) -> int:
        if peer == self.rank or peer not in self.rail:
            raise ValueError(f"{name}: rank {peer} is not a rail peer of rank {self.rank} (rail {self.rail})")
        return self.rail.index(peer)

    def _ops(self, msgs: Sequence[Message], name: str) -> tuple[list[tuple[int, int, int]], int]:
        ops, total, cb = [], 0, self.chunk_bytes
        for peer, iov in msgs:
            idx = self._index(peer, name)
            for addr, n in iov:
                for o in range(0, n, cb):
                    ops.append((addr + o, min(cb, n - o), idx))
                total += n
        return ops, total

    def sendrecv(self, sends: Sequence[Message], recvs: Sequence[Message], *, timeout_s: float,
                 what: str = "") -> None:
        s_ops, s_bytes = self._ops(sends, "sends")
        r_ops, r_bytes = self._ops(recvs, "recvs")
        if s_ops or r_ops:
            self.comm.send_recv(s_ops, r_ops, int(self.stream.cuda_stream))
            peers = tuple(sorted({p for p, iov in (*sends, *recvs) if any(n for _, n in iov)}))
            self._watch_after(peers, f"ncclSend/ncclRecv of {what or 'the inter-node hop'}")
        self.bytes_sent += s_bytes
        self.bytes_received += r_bytes
        self.chunks_sent += len(s_ops)

    def close(self) -> None:
        self.stream.synchronize()  # nothing of ours is left queued on the communicator
        self.comm.close()


class NcclPutSignalInterNode(NcclInterNode):
    """The cross-node hop over NCCL's one-sided RMA (``inter_node="put_signal"``, and
    ``"auto"`` where supported).  NCCL moves RMA between registered windows only, so every
    rank owns one window (``ncclMemAlloc``: one physical segment) holding a landing ring and
    a send ring of ``inflight_chunks`` slots of ``chunk_bytes`` each, and a message moves chunk
    by chunk under :mod:`~tide_triton.transport.rma_protocol`'s program: a copy-engine copy
    packs the chunk's pieces into a send slot, ``ncclPutSignal`` puts the slot into the
    receiver's landing slot, the receiver's ``ncclWaitSignal`` lets its stream go on, a copy
    moves the chunk into its destinations, and ``ncclSignal`` frees the slot.  All of it is
    enqueued on the side stream; nothing runs on SMs (NCCL moves RMA on copy engines inside
    an NVLink domain and through its proxy on a network).  Staging: the window,
    ``2 * inflight_chunks * chunk_bytes``, whatever the message or the number of nodes.  The
    two local copies per chunk are the price of NCCL's window rule.  As with send/recv,
    waits on peers have no timeout of their own (see the base class)."""

    path = "put_signal"

    def __init__(self, g: Group, t: object, comm: object, window_addr: int, window: object) -> None:
        from .transport.rma_protocol import LandingRing

        super().__init__(g, t, comm)
        self.t = t
        self.ring = LandingRing(g.options.chunk_bytes, g.options.inflight_chunks)
        self.window_addr, self.window = window_addr, window
        self.puts = 0

    def _one(self, msgs: Sequence[Message], name: str) -> tuple[int, Iov] | None:
        live = [(p, iov) for p, iov in msgs if any(n for _, n in iov)]
        for p, _ in msgs:
            self._index(p, name)
        if len(live) > 1:
            raise ValueError(f"{name}: the put/signal hop takes one peer per call, got ranks {[p for p, _ in live]}")
        return (self._index(live[0][0], name), live[0][1]) if live else None

    def sendrecv(self, sends: Sequence[Message], recvs: Sequence[Message], *, timeout_s: float,
                 what: str = "") -> None:
        send, recv = self._one(sends, "sends"), self._one(recvs, "recvs")
        s = int(self.stream.cuda_stream)
        comm, base = self.comm, self.window_addr
        for op in self.ring.program(send, recv):
            kind = op[0]
            if kind == "put":
                _, peer, src_off, dst_off, n = op
                comm.put_signal(base + src_off, n, peer, self.window, dst_off, s)
                self.puts += 1
            elif kind == "wait":
                comm.wait_signals({op[1]: op[2]}, s)
                self._watch_after((self.rail[op[1]],), f"its ncclPutSignal/ncclSignal in {what or 'the inter-node hop'}")
            elif kind == "signal":
                comm.signal(op[1], s)
            elif kind == "pack":  # my pieces into my send ring
                _, srcs, offs, sizes = op
                self.t.copy([base + o for o in offs], srcs, sizes, stream=self.stream)
            else:  # copy: out of my landing ring
                _, dsts, offs, sizes = op
                self.t.copy(dsts, [base + o for o in offs], sizes, stream=self.stream)
        if send:
            k = sum(n for _, n in send[1])
            self.bytes_sent += k
            self.chunks_sent += -(-k // self.chunk_bytes)
        if recv:
            self.bytes_received += sum(n for _, n in recv[1])


_fallback_logged = False
_fallback_lock = threading.Lock()


def _nccl_net(g: Group, t: object) -> NcclInterNode:
    """The rail communicator and the hop over it that ``g.options.inter_node`` asks for.
    Collective over the group, in phases separated by exchanges so that every rank takes the
    same path and none is left inside a collective NCCL call its peers never make: (1) every
    rank's request and local obstacles -- the library's features, allocating its window
    memory; (2) if none: registering the windows (collective per rail) and a first signal to
    each rail peer.  ``"auto"`` falls back to send/recv when any rank has an obstacle
    (logged once, naming it); ``"put_signal"`` raises on every rank, naming it."""
    global _fallback_logged
    from .transport import nccl

    want = g.options.inter_node
    o = g.options
    lib = nccl.load(o.nccl_library)
    comm = nccl.NcclComm(lib, _rail(g), g.rank, g.exchange, device_index=t.device.index)
    v = ".".join(map(str, lib.version))
    nbytes = _round_up(2 * o.chunk_bytes * o.inflight_chunks, 2 << 20)  # landing + send ring, whole granules
    why, addr = None, None
    if want != "send_recv":
        if not lib.features.rma_landing:
            why = (f"NCCL {v} ({lib.path}) lacks one-sided RMA with windows (ncclPutSignal/ncclWaitSignal/"
                   f"ncclSignal, ncclMemAlloc; NCCL >= 2.29.2)")
        else:
            try:
                addr = comm.mem_alloc(nbytes)
            except Exception as e:  # noqa: BLE001 -- reported to every rank below
                why = f"NCCL {v}: {e}"
    asked = g.exchange((want, why))
    odd = next((r for r, (w, _) in enumerate(asked) if w != want), None)
    if odd is not None:
        comm.close()
        raise ValueError(f"GroupOptions.inter_node differs between ranks: rank {g.rank} has {want!r}, "
                         f"rank {odd} has {asked[odd][0]!r}")
    if want == "send_recv":
        return NcclInterNode(g, t, comm)
    whys = [w for _, w in asked]
    window = None
    if not any(whys):
        try:
            window = comm.register_window(addr, nbytes)
            stream = int(g.side_stream(t.device).cuda_stream)
            for i in range(len(comm.members)):
                if i != comm.index:
                    comm.signal(i, stream)  # a first signal: RMA works between us (counted below)
        except Exception as e:  # noqa: BLE001 -- reported to every rank below
            why = f"NCCL {v}: {e}"
        whys = g.exchange(why)
    bad = next((r for r, w in enumerate(whys) if w), None)
    if bad is not None:
        if want == "put_signal":
            comm.close()
            raise RuntimeError(f'inter_node="put_signal" is not available: rank {bad}: {whys[bad]}')
        with _fallback_lock:
            first, _fallback_logged = not _fallback_logged, True
        if first:  # windows and first signals already made stay unused until close()
            log.warning('inter_node="auto" falls back to ncclSend/ncclRecv (their kernels use SMs): rank %d: %s',
                        bad, whys[bad])
        return NcclInterNode(g, t, comm)
    net = NcclPutSignalInterNode(g, t, comm, addr, window)
    for i in range(len(comm.members)):  # the first signals are the peers' first events
        if i != comm.index:
            net.ring.base[i] = 1
    return net


@dataclass
class _State:
    net: "HostInterNode | NcclInterNode"
    calls: dict = field(default_factory=lambda: {"reduce_scatter": 0, "all_gather": 0})
    last: dict = field(default_factory=dict)
    """Bytes this rank moved in its last collective, per round label (see :func:`stats`)."""

    def close_extra(self) -> None:
        """Called by :meth:`Group.close`: destroys the NCCL communicator, if any."""
        close = getattr(self.net, "close", None)
        if close is not None:
            close()


@dataclass(frozen=True)
class _Regions:
    net_off: int
    rs_off: int
    ag_off: int


def _regions(g: Group) -> _Regions:
    """Heap layout of the cross-node path: ``[flags | wire ring (host) | reduce-scatter ring |
    named regions | all-gather block]`` (regions: :meth:`Group.heap_region`, placed past
    :func:`fixed_end`; the all-gather block moves past them)."""
    o = g.options
    net_off = _round_up(g.n_flags * 8, 4096)
    rs_off = net_off + _round_up(HostInterNode.region_bytes(o.chunk_bytes, o.inflight_chunks), 4096)
    return _Regions(net_off, rs_off, max(rs_off + _round_up(o.ring_bytes, 4096), _round_up(g.heap_regions_end, 4096)))


def fixed_end(g: Group) -> int:
    """Where the cross-node path's fixed heap areas (flags, wire ring, reduce-scatter ring) end."""
    o = g.options
    r = _regions(g)
    return r.rs_off + _round_up(o.ring_bytes, 4096)


def _state(g: Group, t: object) -> _State:
    key = ("hier", id(t))
    st = g._extras.get(key)
    if st is None:
        reg = _regions(g)
        if getattr(t, "device", torch.device("cpu")).type == "cuda":
            net = _nccl_net(g, t)
        else:
            net = HostInterNode(t, g.rank, g.world_size, g.local_size, g.flags.n_flags, reg.net_off,
                                g.options.chunk_bytes, g.options.inflight_chunks)
        st = g._extras[key] = _State(net)
    return st


def stats(group: Group, device: object = "cpu") -> dict:
    """This rank's counters of the cross-node path: calls of each collective, and the bytes
    its last collective moved per round label -- ``"ag inter k"`` / ``"rs inter k"``: sent
    to the rail peer in round ``k`` (what :meth:`AllGatherPlan.sent_bytes` and
    :meth:`ReduceScatterPlan.sent_bytes` predict); ``"rs intra"``: gradient bytes pushed to
    node peers; ``"ag intra"``: bytes read from node peers' rails.  ``"inter_node"``: how
    bytes crossed -- ``"put_signal"`` or ``"send_recv"`` (NCCL), ``"host"`` (shared memory)."""
    t = group._transports.get(torch.device(device).type)
    st = group._extras.get(("hier", id(t))) if t is not None else None
    if st is None:
        return {"reduce_scatter": 0, "all_gather": 0, "last": {}}
    return {**st.calls, "last": dict(st.last), "inter_node": st.net.path, "bytes_sent": st.net.bytes_sent,
            "bytes_received": st.net.bytes_received, "chunks_sent": st.net.chunks_sent}


def synchronize_side(g: Group, device: torch.device, timeout_s: float) -> None:
    """Wait for the cross-node executor's side stream (:func:`tide_triton.synchronize`):
    after ``timeout_s`` a ``PeerTimeoutError`` names the peer of a node-local flag wait that
    is still short, else of the oldest NCCL wait that has not passed."""
    t = g._transports.get(device.type)
    st = g._extras.get(("hier", id(t))) if t is not None else None
    if st is None:
        return
    try:
        t.synchronize(timeout_s=timeout_s, stream=g.side_stream(device))
    except PeerTimeoutError:
        raise
    except TimeoutError as e:
        stuck = getattr(st.net, "stuck", None)
        hit = stuck() if stuck is not None else None
        if hit is None:
            raise
        peers, what = hit
        more = "" if len(peers) == 1 else f"; or rank {', '.join(map(str, peers[1:]))}"
        raise PeerTimeoutError(peers[0], what + more, timeout_s) from e


class _OnStream:
    """The transport with every copy, signal and wait on ``stream``."""

    def __init__(self, t: object, stream: object) -> None:
        self.t, self.stream = t, stream

    def __getattr__(self, name: str) -> object:
        return getattr(self.t, name)

    def copy(self, *a: object, **k: object) -> None:
        self.t.copy(*a, stream=self.stream, **k)

    def signal(self, *a: object, **k: object) -> None:
        self.t.signal(*a, stream=self.stream, **k)

    def signal_all(self, *a: object, **k: object) -> None:
        self.t.signal_all(*a, stream=self.stream, **k)

    def wait(self, *a: object, **k: object) -> None:
        self.t.wait(*a, stream=self.stream, **k)

    def wait_all(self, *a: object, **k: object) -> None:
        self.t.wait_all(*a, stream=self.stream, **k)


class _Order:
    """Where the collective's work goes.  Host: everything is synchronous, in program order.
    CUDA: everything -- node-local copies and flags, the Triton sums, the NCCL groups -- goes
    on the group's side stream (a torch stream, :meth:`Group.side_stream`) in program order,
    after the work already on ``stream`` (default: the current stream); then ``stream`` waits
    for it, or, with ``async_op``, the returned :class:`Work` carries an event (the caller
    keeps the tensors alive until ``wait()``).  Not the transport's own copy stream: torch
    work on it (allocations, kernel tables) would be recorded against a stream the transport
    destroys at close, and torch's allocator then fails freeing those blocks (seen on the
    H200 as ``cudaErrorContextIsDestroyed`` after ``Group.close()``)."""

    def __init__(self, g: Group, t: object, device: torch.device, stream: object, async_op: bool) -> None:
        self.cuda = device.type == "cuda"
        self.async_op = async_op
        self.t = t
        if self.cuda:
            self.user = stream if stream is not None else torch.cuda.current_stream(device)
            self.stream = g.side_stream(device)
            self.stream.wait_stream(self.user)
            self.t = _OnStream(t, self.stream)
            self.ctx = torch.cuda.stream(self.stream)
        else:
            self.ctx = contextlib.nullcontext()

    def finish(self) -> Work:
        if not self.cuda:
            return Work()
        if self.async_op:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            return Work(ev)
        self.user.wait_stream(self.stream)
        return Work()


def _binding(dst_dtype: torch.dtype, src_dtype: torch.dtype, dst_ptrs: tuple[int, ...],
             pieces: list[tuple[int, int, tuple[int, ...], int]], k: int, max_ctas: int | None,
             device: torch.device) -> Binding:
    """The segmented kernel over raw addresses: piece ``(dst_idx, dst_off, srcs, numel)``
    writes ``numel`` elements at ``dst_ptrs[dst_idx] + dst_off`` from the ``k`` source
    addresses ``srcs`` (summed in that order, fp32).  Pieces that continue the previous
    one in the destination and in every source merge: fewer tiles."""
    se = src_dtype.itemsize
    merged: list[tuple[int, int, tuple[int, ...], int]] = []
    for d, off, srcs, n in pieces:
        if merged:
            d0, off0, srcs0, n0 = merged[-1]
            if d0 == d and off0 + n0 == off and all(a + n0 * se == b for a, b in zip(srcs0, srcs)):
                merged[-1] = (d0, off0, srcs0, n0 + n)
                continue
        merged.append((d, off, srcs, n))
    pieces = merged
    runs = tuple(Run(d, off, i, 0, n) for i, (d, off, _, n) in enumerate(pieces))
    prog = SegmentProgram(runs, n_dst=len(dst_ptrs), n_src=len(pieces))
    src_ptrs = tuple(pc[2][c] for c in range(k) for pc in pieces)
    dst_stub = (torch.empty(0, dtype=dst_dtype, device=device),) * len(dst_ptrs)
    src_stub = (torch.empty(0, dtype=src_dtype, device=device),) * len(src_ptrs)
    return Binding(prog, dst_stub, src_stub, k, max_ctas, known_ptrs=(dst_ptrs, src_ptrs))


def _pieces(runs) -> list[tuple[int, int, int]]:
    return [pc for r in runs for pc in r.pieces()]


# --------------------------------------------------------------------------- reduce-scatter
def _prepare_rs(g: Group, t: object, reg: _Regions, plan: ReduceScatterPlan, layout: ShardLayout,
                gptrs: tuple[int, ...], shard_ptrs: tuple[int, ...], gdt: torch.dtype, sdt: torch.dtype,
                device: torch.device) -> list:
    """Per window: node-local pushes, the node-local reduction, each round's messages and
    addition, and the final reduction into the shards -- everything that depends only on
    addresses (cached by the caller)."""
    topo = plan.topology
    L, N, me = topo.local_size, topo.nodes, g.rank
    n, l = divmod(me, L)
    gb = gdt.itemsize
    win = plan.window_elems
    S, offs = layout.padded_shard_numels, layout.flat_offsets
    rr = _RailRuns(layout, topo)
    mx = g.options.max_ctas
    slot_b = N * win * gb  # one contributor's slot: the rail's N shards of the window
    p_rel = (L - 1) * slot_b  # partial sums P, fp32, after the grad slots
    r_rel = p_rel + N * win * 4  # receive slot R, fp32
    stage_b = r_rel + plan.max_message_shards * win * 4
    if plan.stages * stage_b > plan.ring_bytes:
        raise RuntimeError("internal error: cross-node staging exceeds ring_bytes")

    def where(e: int, p: int) -> tuple[int, int, int]:
        """Element ``e`` of parameter ``p``'s padded storage: (node, flat position, a)."""
        r, a = divmod(e, S[p])
        return r // L, offs[p] + a, a

    windows = []
    peers = [n * L + c for c in range(L) if c != l]
    for w, (lo, hi) in enumerate(plan.windows):
        sb = reg.rs_off + (w % plan.stages) * stage_b
        # 1. pushes: my gradient slices of node peer d's rail into d's slot for me
        pushes = {}
        for d in peers:
            ld = d % L
            base = t.address(d, sb + peer_slot(l, ld) * slot_b)
            dsts, srcs, sizes = [], [], []
            for p, e, k in _pieces(rr.window_runs(lo, hi, ld, range(N))):
                m, x, _ = where(e, p)
                dsts.append(base + (m * win + x - lo) * gb)
                srcs.append(gptrs[p] + e * gb)
                sizes.append(k * gb)
            pushes[d] = (dsts, srcs, sizes)
        # 1'. node-local sum, contributors in local order 0..L-1 (mine read in place)
        P = t.address(me, sb + p_rel)
        R = t.address(me, sb + r_rel)
        pcs = []
        for p, e, k in _pieces(rr.window_runs(lo, hi, l, range(N))):
            m, x, _ = where(e, p)
            pos = m * win + x - lo
            srcs = tuple(gptrs[p] + e * gb if c == l else
                         t.address(me, sb + peer_slot(c, l) * slot_b) + pos * gb for c in range(L))
            pcs.append((0, pos, srcs, k))
        local = _binding(torch.float32, gdt, (P,), pcs, L, mx, device)
        # 2. rounds along the rail: send partial sums for `dests`, add what arrives
        rounds = []
        fuse: dict = {}  # last round: what arrives is this rank's own window; added in `final`
        for k, rnd in enumerate(plan.node_rounds):
            last_round = k == len(plan.node_rounds) - 1
            sends, recvs, adds = [], [], []
            for sn, dn, dests in rnd:
                if sn == n:
                    iov = []
                    for m in dests:
                        for p, e, k in _pieces(rr.window_runs(lo, hi, l, [m])):
                            _, x, _ = where(e, p)
                            iov.append((P + (m * win + x - lo) * 4, k * 4))
                    sends.append((dn * L + l, iov))
                if dn == n:
                    iov = []
                    for j, m in enumerate(dests):
                        for p, e, k in _pieces(rr.window_runs(lo, hi, l, [m])):
                            _, x, _ = where(e, p)
                            rpos, ppos = j * win + x - lo, m * win + x - lo
                            iov.append((R + rpos * 4, k * 4))
                            if last_round and m == n:
                                fuse[ppos] = R + rpos * 4
                            else:
                                adds.append((0, ppos, (P + ppos * 4, R + rpos * 4), k))
                    recvs.append((sn * L + l, iov))
            rounds.append((sends, recvs, _binding(torch.float32, torch.float32, (P,), adds, 2, mx, device)))
        # 3. my window's full sums into my shards: held + received (the last round), scaled
        fin = []
        for p, e, k in _pieces(rr.window_runs(lo, hi, l, [n])):
            _, x, a = where(e, p)
            ppos = n * win + x - lo
            fin.append((p, a, (P + ppos * 4, fuse[ppos]) if fuse else (P + ppos * 4,), k))
        final = _binding(sdt, torch.float32, shard_ptrs, fin, 2 if fuse else 1, mx, device)
        windows.append((pushes, local, rounds, final))
    return windows


def reduce_scatter(g: Group, grads_l: list[torch.Tensor], shards_l: list[torch.Tensor], layout: ShardLayout,
                   gdt: torch.dtype, sdt: torch.dtype, device: torch.device, scale: float | None,
                   accumulate: bool, stream: object = None, async_op: bool = False, staging=None) -> Work:
    """The cross-node reduce-scatter (arguments already checked and agreed).  ``staging``: a
    heap region (Slot-Reuse) that holds the windows' staging -- the node peers' pushes, the
    partial sums and the receive slot -- instead of the group's ring; before the first push
    into node peer ``d``'s copy this rank waits until ``d`` has vacated it once per use."""
    t = g.transport(device)
    topo = g.topology
    L, me = topo.local_size, g.rank
    n = me // L
    ring_bytes = staging.nbytes if staging is not None else g.options.ring_bytes
    plan = ReduceScatterPlan(layout, topo, ring_bytes=ring_bytes, grad_bytes=gdt.itemsize,
                             wire_bytes=4, stages=g.options.stages)
    reg = _regions(g)
    t.ensure_heap(reg.ag_off)
    if staging is not None:
        reg = _Regions(reg.net_off, staging.offset, reg.ag_off)
    st = _state(g, t)
    gptrs = tuple(x.data_ptr() for x in grads_l)
    shard_ptrs = tuple(x.data_ptr() for x in shards_l)
    key = ("hier rs", layout, gdt, sdt, gptrs, shard_ptrs, reg.rs_off, ring_bytes, g.options.stages)
    prep = g.cached(key)
    if prep is None:
        prep = g.cache(key, _prepare_rs(g, t, reg, plan, layout, gptrs, shard_ptrs, gdt, sdt, device))
    order = _Order(g, t, device, stream, async_op)
    t = order.t
    with order.ctx:
        if not accumulate:  # padding rows of padded shards become zero
            for x, k in zip(shards_l, layout.shard_numels(me)):
                if x.numel() > k:
                    x.view(-1)[k:].zero_()
        fm, timeout, S = g.flags, g.options.timeout_s, plan.stages
        peers = [n * L + c for c in range(L) if c != me % L]
        net = st.net
        last = {"rs intra": 0, **{f"rs inter {k}": 0 for k in range(len(plan.node_rounds))}}
        base = g.rs_count
        if staging is not None:  # nobody writes into a node peer's region before it vacated it
            e = staging._begin_staging()
            t.wait_all([fm.vacated(staging.index, d) for d in peers], [e] * len(peers), peers=peers,
                       timeout_s=timeout, what=f"rank {{peer}} to vacate staging region {staging.key!r} "
                       f"(use {e}: its staging.vacate())")
        for w, (pushes, local, rounds, final) in enumerate(prep):
            s, v = w % S, base + w + 1
            if peers:
                frees = [d for d in peers if (d, s) in g.rs_last]
                t.wait_all([fm.rs_free(s, d) for d in frees], [g.rs_last[(d, s)] for d in frees], peers=frees,
                           timeout_s=timeout, what=f"rank {{peer}} to free cross-node reduce-scatter slot (stage {s})")
                for d in peers:
                    t.copy(*pushes[d])
                    last["rs intra"] += sum(pushes[d][2])
                    t.signal(d, fm.rs_ready(s, me), v)
                    g.rs_last[(d, s)] = v
                t.wait_all([fm.rs_ready(s, c) for c in peers], [v] * len(peers), peers=peers, timeout_s=timeout,
                           what=f"rank {{peer}}'s node-local reduce-scatter contribution (window {w})")
            local.launch(check_addresses=False)
            if peers:
                t.signal_all(peers, [fm.rs_free(s, me)] * len(peers), [v] * len(peers))
            for k, (sends, recvs, add) in enumerate(rounds):
                before = net.bytes_sent
                net.sendrecv(sends, recvs, timeout_s=timeout, what=f"reduce-scatter window {w} round {k}")
                last[f"rs inter {k}"] += net.bytes_sent - before
                add.launch(check_addresses=False)
            final.launch(scale=scale, accumulate=accumulate, check_addresses=False)
        g.rs_count = base + len(prep)
        if staging is not None:
            staging._staged(order.stream if order.cuda else None)
        st.calls["reduce_scatter"] += 1
        st.last = last
    return order.finish()


# --------------------------------------------------------------------------- all-gather
def all_gather(g: Group, shards_l: list[torch.Tensor], params_l: list[torch.Tensor], layout: ShardLayout,
               pdt: torch.dtype, sdt: torch.dtype, device: torch.device, stream: object = None,
               async_op: bool = False) -> Work:
    """The cross-node all-gather (arguments already checked and agreed)."""
    # The rounds forward other ranks' shards through this rank's params, so every rank must
    # hold the same rows: the params' shapes are part of the signature agreed across nodes
    # (collectives.all_gather), so full params on some ranks and padded on others raise there.
    t = g.transport(device)
    topo = g.topology
    L, N, me = topo.local_size, topo.nodes, g.rank
    n, l = divmod(me, L)
    es = pdt.itemsize
    reg = _regions(g)
    flat = layout.flat_shard_numel
    t.ensure_heap(reg.ag_off + _round_up(N * flat * es, 16))
    st = _state(g, t)
    net = st.net
    fm, timeout = g.flags, g.options.timeout_s
    S, offs = layout.padded_shard_numels, layout.flat_offsets
    pptrs = [x.data_ptr() for x in params_l]
    plan = AllGatherPlan(layout, topo, elem_bytes=es, chunk_bytes=g.options.chunk_bytes,
                         max_inflight=g.options.inflight_chunks)
    rr = _RailRuns(layout, topo)
    last = {**{f"ag inter {k}": 0 for k in range(len(plan.node_rounds))}, "ag intra": 0}
    order = _Order(g, t, device, stream, async_op)
    t = order.t
    with order.ctx:
        # 1. my shard into my params (cast on SMs when the dtypes differ); missing rows are zero
        real = layout.shard_numels(me)
        have = [min(x.numel(), k) for x, k in zip(shards_l, real)]
        if pdt == sdt:
            t.copy([pptrs[p] + me * S[p] * es for p in range(len(layout))], [x.data_ptr() for x in shards_l],
                   [k * es for k in have])
        else:
            _binding(pdt, sdt, tuple(pptrs), [(p, me * S[p], (x.data_ptr(),), k)
                                              for p, (x, k) in enumerate(zip(shards_l, have)) if k],
                     1, g.options.max_ctas, device).launch(check_addresses=False)
        pads = [(p, k, r - k) for p, (k, r) in enumerate(zip(have, real)) if r > k]
        if pads:
            z = g.zeros(device, max(m for _, _, m in pads) * es)
            t.copy([pptrs[p] + (me * S[p] + k) * es for p, k, _ in pads], [z.data_ptr()] * len(pads),
                   [m * es for _, _, m in pads])
        # 2. rounds along my rail, params to params
        for k, rnd in enumerate(plan.node_rounds):
            sends, recvs = [], []
            for sn, dn, nodes in rnd:
                if sn == n or dn == n:
                    iov = [(pptrs[p] + e * es, c * es) for p, e, c in _pieces(rr.all_runs(l, nodes))]
                    if sn == n:
                        sends.append((dn * L + l, iov))
                    if dn == n:
                        recvs.append((sn * L + l, iov))
            before = net.bytes_sent
            net.sendrecv(sends, recvs, timeout_s=timeout, what=f"all-gather round {k}")
            last[f"ag inter {k}"] = net.bytes_sent - before
        # 3. node-local pickup of the peers' rails
        if L > 1:
            peers = [n * L + c for c in range(L) if c != l]
            g.ag_epoch += 1
            e = g.ag_epoch
            if e > 1:  # my rail block is free once my node peers finished the previous epoch
                t.wait_all([fm.ag_done(r) for r in peers], [e - 1] * len(peers), peers=peers, timeout_s=timeout,
                           what="rank {peer} to finish reading my all-gather rail")

            def rail_copies(lr: int, block: int, into_params: bool):
                dsts, srcs, sizes = [], [], []
                for m in range(N):
                    r = m * L + lr
                    for p, k in enumerate(layout.shard_numels(r)):
                        if k:
                            a, b = pptrs[p] + r * S[p] * es, block + (m * flat + offs[p]) * es
                            dsts.append(a if into_params else b)
                            srcs.append(b if into_params else a)
                            sizes.append(k * es)
                return dsts, srcs, sizes

            t.copy(*rail_copies(l, t.address(me, reg.ag_off), False))
            t.signal_all(peers, [fm.ag_ready(me)] * len(peers), [e] * len(peers))
            for r in peers:
                t.wait(fm.ag_ready(r), e, peer=r, timeout_s=timeout, what=f"rank {r}'s all-gather rail")
                cp = rail_copies(r % L, t.address(r, reg.ag_off), True)
                t.copy(*cp)
                last["ag intra"] += sum(cp[2])
            t.signal_all(peers, [fm.ag_done(me)] * len(peers), [e] * len(peers))
        st.calls["all_gather"] += 1
        st.last = last
    return order.finish()
