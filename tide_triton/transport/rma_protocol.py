"""Paced one-sided transfers through a bounded landing ring: the program, no I/O.

One-sided RMA (NCCL's ``ncclPutSignal`` / ``ncclSignal`` / ``ncclWaitSignal``) moves bytes
between *registered windows* only -- the destination in the peer's window and, in NCCL 2.32,
the source in one of the sender's own (``ncclDevrFindWindow`` on ``localbuff``; anything else
is ``ncclInvalidArgument``).  The cross-node collectives' sources and destinations are
per-parameter storage and staging the caller allocated, which are not windows.  So each
rank owns one small window of two rings of ``n_slots`` slots of ``chunk_bytes``: a **send
ring** and a **landing ring**.  A message moves chunk by chunk: the sender packs chunk ``c``'s
pieces into send slot ``c % n_slots`` (a local copy-engine copy), puts the slot -- one
contiguous put, one signal -- into landing slot ``c % n_slots`` of the receiver, the receiver
waits for it, copies it out to its own destinations (a local copy) and frees the slot.
In-flight bytes per receiver are at most ``n_slots * chunk_bytes`` whatever the message or
the number of nodes.  A send slot is reused only after its put completed (stream order:
"at PutSignal completion ``localbuff`` is reusable").

Signals are counters, not flags: each put and each signal from rank X raises X's counter at
the receiver by one, and a wait asks for "``k`` more than waited for so far" (NCCL keeps the
running total, ``CU_STREAM_WAIT_VALUE_GEQ`` on it; signals of one peer arrive in order and
a signal implies the data of every earlier put of that peer).  Data arrivals ("chunk ``c`` is
in your slot") and frees ("your chunk ``j`` was read") share one counter per peer, so a rank
cannot wait for "a data signal" as such; instead every rank knows the peer's program --
it is a pure function of the two message sizes, which both sides know -- and waits for the
counter value at which the event it needs has happened.  :func:`peer_events` computes those
positions; :class:`LandingRing` turns one ``sendrecv`` into a list of operations.

The program of one ``sendrecv`` (at most one send peer ``dst`` and one receive peer ``src``
per call -- the cross-node plans exchange with one rail peer per round), ``n`` = ``n_slots``,
``S`` / ``R`` = the send / receive message cut into chunks:

1. if ``R``: **credit** to ``src`` (one signal): my ring is free (my stream has copied out
   everything it received before; a new sender must not write before that);
2. prologue: wait for ``dst``'s credit, pack and put chunks ``0 .. min(n, |S|)-1``;
3. for ``j = 0, 1, ...``: (a) if ``j < |R|``: wait for chunk ``j``, copy it out, and -- if the
   sender will reuse that slot in this call (``j + n < |R|``) -- signal the slot **free**;
   (b) if ``j + n < |S|``: wait for ``dst``'s free of chunk ``j``, pack and put chunk ``j + n``.

Deadlock-free for any send/receive pattern (every wait at step ``j`` names an event of step
``<= j`` whose own waits name earlier steps), and a put never lands on an unread chunk
(checked over random interleavings by tests/test_rma_protocol.py).  A chunk packs
consecutive pieces, split at chunk boundaries, so both sides -- whose pieces have the same
sizes, built from the same plan runs -- cut a message into the same chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

Iov = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class Chunk:
    """One chunk of a message: ``pieces`` as ``(address, offset in the slot, nbytes)``."""

    pieces: tuple[tuple[int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.pieces)


def cut(iov: Iov, chunk_bytes: int) -> list[Chunk]:
    """``iov`` (``(address, nbytes)`` pieces, in order) as consecutive chunks of at most
    ``chunk_bytes``: pieces are packed in order and split at chunk boundaries."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    out: list[Chunk] = []
    cur: list[tuple[int, int, int]] = []
    fill = 0
    for addr, n in iov:
        if n < 0:
            raise ValueError(f"piece at {addr:#x} has a negative size {n}")
        o = 0
        while o < n:
            take = min(n - o, chunk_bytes - fill)
            cur.append((addr + o, fill, take))
            fill += take
            o += take
            if fill == chunk_bytes:
                out.append(Chunk(tuple(cur)))
                cur, fill = [], 0
    if cur:
        out.append(Chunk(tuple(cur)))
    return out


def peer_events(n_to_peer: int, n_from_peer: int, n_slots: int) -> dict:
    """Where in peer X's signals to me each event I may wait for lies, for one ``sendrecv``.

    ``n_to_peer``: chunks I send X; ``n_from_peer``: chunks X sends me.  X's program (module
    docstring) raises my counter for X: a credit if X receives from me; then one per chunk
    of its prologue puts to me; then per step ``j`` a free of my chunk ``j`` (if ``j + n_slots
    < n_to_peer``) and its put of chunk ``j + n_slots``.  Returns ``{"credit": pos | None,
    "data": [pos per chunk X sends], "free": {j: pos}, "total": signals X sends me in this
    call}``; ``pos`` counts signals from the call's start, through the event."""
    S, R, n = n_to_peer, n_from_peer, n_slots
    pos = 0
    credit = None
    if S:
        pos += 1
        credit = pos
    data: list[int] = []
    for _ in range(min(n, R)):
        pos += 1
        data.append(pos)
    free: dict[int, int] = {}
    for j in range(max(S, R)):
        if j + n < S:
            pos += 1
            free[j] = pos
        if j + n < R:
            pos += 1
            data.append(pos)
    return {"credit": credit, "data": data, "free": free, "total": pos}


class LandingRing:
    """One rank's side of the protocol over any number of calls: the running count of
    signals each peer has sent it (``base``) and of signals it has waited for (``waited``),
    and :meth:`program`, which emits one call's operations.  Offsets are in the rank's window
    (``[landing ring | send ring]``, the same layout on every rank):

    * ``("signal", peer)`` -- raise my counter at ``peer`` (credit or free);
    * ``("wait", peer, k)`` -- wait for ``k`` more signals from ``peer`` than waited so far;
    * ``("pack", srcs, offsets, sizes)`` -- copy my pieces into my window (the send ring);
    * ``("put", peer, src_offset, dst_offset, nbytes)`` -- ``nbytes`` from my window at
      ``src_offset`` into ``peer``'s window at ``dst_offset``, then a signal;
    * ``("copy", dsts, offsets, sizes)`` -- from my window (the landing ring) to my ``dsts``.

    Every emitted operation must be executed, in order (the ledger assumes it)."""

    def __init__(self, chunk_bytes: int, n_slots: int) -> None:
        if chunk_bytes < 1 or n_slots < 1:
            raise ValueError(f"chunk_bytes and n_slots must be >= 1, got {chunk_bytes}, {n_slots}")
        self.chunk_bytes, self.n_slots = chunk_bytes, n_slots
        self.base: dict[int, int] = {}
        self.waited: dict[int, int] = {}

    @property
    def window_bytes(self) -> int:
        """The window: the landing ring, then the send ring."""
        return 2 * self.chunk_bytes * self.n_slots

    def _wait(self, ops: list, peer: int, pos: int) -> None:
        target = self.base.get(peer, 0) + pos
        k = target - self.waited.get(peer, 0)
        if k > 0:
            ops.append(("wait", peer, k))
            self.waited[peer] = target

    def program(self, send: tuple[int, Iov] | None, recv: tuple[int, Iov] | None) -> list[tuple]:
        """The operations of one ``sendrecv``: ``send`` / ``recv`` are ``(peer, iov)`` or None."""
        n, cb = self.n_slots, self.chunk_bytes
        S = cut(send[1], cb) if send else []
        R = cut(recv[1], cb) if recv else []
        dst = send[0] if S else None
        src = recv[0] if R else None
        ev = {peer: peer_events(len(S) if peer == dst else 0, len(R) if peer == src else 0, n)
              for peer in {p for p in (dst, src) if p is not None}}
        ops: list[tuple] = []
        send_ring = n * cb

        def put(c: int) -> None:
            slot = (c % n) * cb
            ps = S[c].pieces
            ops.append(("pack", [a for a, _, _ in ps], [send_ring + slot + o for _, o, _ in ps], [k for _, _, k in ps]))
            ops.append(("put", dst, send_ring + slot, slot, S[c].nbytes))

        if R:
            ops.append(("signal", src))  # credit: my landing ring is free
        for c in range(min(n, len(S))):
            if c == 0:
                self._wait(ops, dst, ev[dst]["credit"])
            put(c)
        for j in range(max(len(R), len(S))):
            if j < len(R):
                self._wait(ops, src, ev[src]["data"][j])
                slot = (j % n) * cb
                ps = R[j].pieces
                ops.append(("copy", [a for a, _, _ in ps], [slot + o for _, o, _ in ps], [k for _, _, k in ps]))
                if j + n < len(R):
                    ops.append(("signal", src))  # free: the sender reuses this slot
            if j + n < len(S):
                self._wait(ops, dst, ev[dst]["free"][j])
                put(j + n)
        for peer, e in ev.items():
            self.base[peer] = self.base.get(peer, 0) + e["total"]
        return ops
