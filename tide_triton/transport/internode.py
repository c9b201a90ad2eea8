"""The cross-node hop: byte streams between rail peers on different nodes.

:mod:`tide_triton.executors.across_nodes` runs the cross-node schedules; every byte between nodes
goes through one of the transports here.

:class:`InterNodeTransport` is the interface the cross-node hop needs: grouped,
two-sided ``sendrecv`` of byte streams between rail peers (as ``ncclGroupStart``;
``ncclSend``/``ncclRecv`` per peer; ``ncclGroupEnd``), chunked and paced inside the
transport.  Receivers name their own destination addresses, so data lands in
per-parameter storage without a staging copy on the interface.  On CUDA two NCCL
transports implement it, chosen by ``GroupOptions.inter_node`` (:func:`nccl_hop`):
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

import ctypes
import logging
import threading
import time
from typing import Any, Protocol, Sequence

import torch

from ..plan.heap import WIRE_HEADER, round_up, wire_ring_bytes
from ..errors import PeerTimeoutError
from .base import Transport
from .rma_protocol import LandingRing

log = logging.getLogger("tide_triton")

_CLOSE_DRAIN_S = 30.0
"""How long a closing inter-node hop waits for its stream before it aborts the communicator."""




Iov = Sequence[tuple[int, int]]
"""A byte stream as ``(address, nbytes)`` pieces, in order."""
Message = tuple[int, Iov]
"""``(peer rank, pieces)``: what one ``sendrecv`` sends to, or receives from, one peer."""

_HEADER = WIRE_HEADER  # per slot: (dst << 40 | channel sequence), global sequence, nbytes
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
        self._data_off = region_off + round_up(n_slots * _HEADER, 64)
        self._slot_stride = round_up(chunk_bytes, 64)
        self._g = 0
        self._holder: dict[int, int] = {}  # slot -> the rank its last chunk went to
        self._sent: dict[int, int] = {}
        self._recvd: dict[int, int] = {}
        self.bytes_sent = self.bytes_received = self.chunks_sent = 0

    @staticmethod
    def region_bytes(chunk_bytes: int, n_slots: int) -> int:
        return wire_ring_bytes(chunk_bytes, n_slots)

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
            held = None  # the rank whose unread chunk holds the slot my next send needs
            for peer, cur in out:
                while cur.pos < cur.total:
                    g = self._g + 1
                    slot = (g - 1) % self.n_slots
                    if g > self.n_slots and t.read_flag(self._free(slot)) < g - self.n_slots:
                        held = self._holder[slot]  # maybe not this send's peer: an earlier round's
                        break  # the slot's previous chunk is still unread
                    n = min(C, cur.total - cur.pos)
                    cur.move(self._slot(me, slot), n, out=True)
                    chan = self._sent.get(peer, 0) + 1
                    h = self._header(me, slot)
                    h[1], h[2] = g, n
                    h[0] = (peer << _CHAN_BITS) | chan  # one aligned 8-byte store, written last
                    t.signal(peer, self._ready(me), chan)
                    self._g, self._sent[peer], self._holder[slot] = g, chan, peer
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
            watch = t.watch  # the call's look for a peer's published abort, as every host wait has
            if watch is not None:
                for p in {p for p, c in inc if c.pos < c.total} | ({held} if held is not None else set()):
                    watch(p)
            if time.monotonic() > deadline:
                why = what or "inter-node sendrecv"
                late = next((p for p, c in inc if c.pos < c.total), None)
                if late is None:  # only sends are left: blocked on the reader of my next slot
                    late, why = held, f"{why}: its read of my chunk in the wire slot my next send needs"
                raise PeerTimeoutError(late, why, timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


# --------------------------------------------------------------------------- per-group state
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

    def __init__(self, rank: int, rail: Sequence[int], comm: object, stream: Any, chunk_bytes: int) -> None:
        self.rank = rank
        self.rail = tuple(rail)
        self.comm = comm
        self.stream = stream  # the stream the executor runs the collective on
        self.chunk_bytes = chunk_bytes
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

    def close(self, drain_timeout_s: float = _CLOSE_DRAIN_S) -> None:
        """Destroy the communicator once nothing of ours is left queued on it.  NCCL's
        stream-side waits have no timeout: if the stream is still busy after
        ``drain_timeout_s`` (a peer that died mid-hop), the communicator is aborted --
        which ends its stuck kernels -- instead of the process blocking in a synchronize."""
        deadline = time.monotonic() + drain_timeout_s
        while not self.stream.query():
            if time.monotonic() >= deadline:
                stuck = self.stuck()
                log.error("rank %d: the inter-node stream is still busy after %.1f s at close%s; "
                          "aborting the NCCL communicator", self.rank, drain_timeout_s,
                          f" ({stuck[1]}, waiting for ranks {list(stuck[0])})" if stuck else "")
                self.comm.abort()
                return
            time.sleep(1e-3)
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

    def __init__(self, rank: int, rail: Sequence[int], comm: object, stream: Any, chunk_bytes: int, t: Transport,
                 ring: LandingRing, window_addr: int, window: object) -> None:
        super().__init__(rank, rail, comm, stream, chunk_bytes)
        self.t = t
        self.ring = ring
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
                self._watch_after((self.rail[op[1]],),
                                  f"its ncclPutSignal/ncclSignal in {what or 'the inter-node hop'}")
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


def nccl_hop(t: Transport, rank: int, rail: Sequence[int], exchange: Any, stream: Any, *, inter_node: str,
             nccl_library: str | None, chunk_bytes: int, inflight_chunks: int) -> NcclInterNode:
    """The communicator over ``rail`` (the ranks on every node with this rank's local rank)
    and the hop over it that ``inter_node`` asks for, running on ``stream`` (the executor's);
    ``exchange(obj)``: every rank's ``obj``, collective over the whole group.
    Collective over the group, in phases separated by exchanges so that every rank takes the
    same path and none is left inside a collective NCCL call its peers never make: (1) every
    rank's request and local obstacles -- the library's features, allocating its window
    memory; (2) if none: registering the windows (collective per rail) and a first signal to
    each rail peer.  ``"auto"`` falls back to send/recv when any rank has an obstacle
    (logged once, naming it); ``"put_signal"`` raises on every rank, naming it.  An exchange
    that raises (a peer aborted, or never came) aborts the communicator first: no group holds
    it yet, so nothing else would release it."""
    global _fallback_logged
    from . import nccl  # NCCL's ctypes binding loads only where a group spans nodes

    want = inter_node
    lib = nccl.load(nccl_library)
    comm = nccl.NcclComm(lib, tuple(rail), rank, exchange, device_index=t.device.index)
    v = ".".join(map(str, lib.version))
    ring = LandingRing(chunk_bytes, inflight_chunks)
    nbytes = round_up(ring.window_bytes, 2 << 20)  # landing + send ring, whole VMM granules
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
    try:
        asked = exchange((want, why))
    except BaseException:  # a peer aborted or never came: the hop is nobody's, release it here
        comm.abort()
        raise
    odd = next((r for r, (w, _) in enumerate(asked) if w != want), None)
    if odd is not None:
        comm.close()
        raise ValueError(f"GroupOptions.inter_node differs between ranks: rank {rank} has {want!r}, "
                         f"rank {odd} has {asked[odd][0]!r}")
    if want == "send_recv":
        return NcclInterNode(rank, rail, comm, stream, chunk_bytes)
    whys = [w for _, w in asked]
    window = None
    if not any(whys):
        try:
            window = comm.register_window(addr, nbytes)
            handle = int(stream.cuda_stream)
            for i in range(len(comm.members)):
                if i != comm.index:
                    comm.signal(i, handle)  # a first signal: RMA works between us (counted below)
        except Exception as e:  # noqa: BLE001 -- reported to every rank below
            why = f"NCCL {v}: {e}"
        try:
            whys = exchange(why)
        except BaseException:
            comm.abort()  # local: a peer may never come to a collective close
            raise
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
        return NcclInterNode(rank, rail, comm, stream, chunk_bytes)
    for i in range(len(comm.members)):  # the first signals are the peers' first events
        if i != comm.index:
            ring.base[i] = 1
    return NcclPutSignalInterNode(rank, rail, comm, stream, chunk_bytes, t, ring, addr, window)
