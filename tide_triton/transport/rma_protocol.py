"""Paced one-sided transfers through a bounded landing ring: the program, no I/O.

One-sided RMA (NCCL's ``ncclPutSignal`` / ``ncclSignal`` / ``ncclWaitSignal``) can only write
into a peer's *registered window*; the destinations of the cross-node collectives are
per-parameter storage and staging the caller allocated, which is not.  So each rank owns a
small window, its **landing ring** of ``n_slots`` slots of ``chunk_bytes``, and a message
moves chunk by chunk: the sender puts chunk ``c`` into slot ``c % n_slots`` of the receiver's
ring, the receiver waits for it, copies it out to its own destinations (a local copy-engine
copy) and frees the slot.  In-flight bytes per receiver are at most ``n_slots * chunk_bytes``
whatever the message or the number of nodes.

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
2. prologue: wait for ``dst``'s credit, put chunks ``0 .. min(n, |S|)-1``;
3. for ``j = 0, 1, ...``: (a) if ``j < |R|``: wait for chunk ``j``, copy it out, and -- if the
   sender will reuse that slot in this call (``j + n < |R|``) -- signal the slot **free**;
   (b) if ``j + n < |S|``: wait for ``dst``'s free of chunk ``j``, put chunk ``j + n``.

Deadlock-free for any send/receive pattern (every wait at step ``j`` names an event of step
``<= j`` whose own waits name earlier steps), and a put never lands on an unread chunk
(checked exhaustively over interleavings by tests/test_rma_protocol.py).  Pieces of a
message are put one by one (each put signals once); a chunk packs consecutive pieces, split
at chunk boundaries, so both sides -- whose pieces have the same sizes, built from the same
plan runs -- cut a message into the same chunks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Chunk", "cut", "peer_events", "LandingRing"]

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


def peer_events(n_to_peer: Sequence[int], n_from_peer: Sequence[int], n_slots: int) -> dict:
    """Where in peer X's signals to me each event I may wait for lies, for one ``sendrecv``.

    ``n_to_peer``: puts per chunk of what I send to X (empty if nothing); ``n_from_peer``:
    puts per chunk of what X sends me.  X's program (module docstring) raises my counter for
    X: a credit if X receives from me; then its prologue puts to me; then per step ``j`` a
    free of my chunk ``j`` (if ``j + n_slots < len(n_to_peer)``) and the puts of its chunk
    ``j + n_slots``.  Returns ``{"credit": pos | None, "data": [pos per chunk X sends],
    "free": {j: pos}, "total": signals X sends me in this call}``; ``pos`` counts signals from
    the call's start, through the event."""
    S, R, n = len(n_to_peer), len(n_from_peer), n_slots
    pos = 0
    credit = None
    if S:
        pos += 1
        credit = pos
    data: list[int] = []
    for c in range(min(n, R)):
        pos += n_from_peer[c]
        data.append(pos)
    free: dict[int, int] = {}
    for j in range(max(S, R)):
        if j + n < S:
            pos += 1
            free[j] = pos
        if j + n < R:
            pos += n_from_peer[j + n]
            data.append(pos)
    return {"credit": credit, "data": data, "free": free, "total": pos}


class LandingRing:
    """One rank's side of the protocol over any number of calls: the running count of
    signals each peer has sent it (``base``) and of signals it has waited for (``waited``),
    and :meth:`program`, which emits one call's operations:

    * ``("signal", peer)`` -- raise my counter at ``peer`` (credit or free);
    * ``("wait", peer, k)`` -- wait for ``k`` more signals from ``peer`` than waited so far;
    * ``("put", peer, src, offset, nbytes)`` -- ``nbytes`` from my ``src`` into ``peer``'s
      ring at ``offset``, then a signal (one put per piece);
    * ``("copy", dsts, offsets, sizes)`` -- from my ring at ``offsets`` to my ``dsts``.

    Every emitted operation must be executed, in order (the ledger assumes it)."""

    def __init__(self, chunk_bytes: int, n_slots: int) -> None:
        if chunk_bytes < 1 or n_slots < 1:
            raise ValueError(f"chunk_bytes and n_slots must be >= 1, got {chunk_bytes}, {n_slots}")
        self.chunk_bytes, self.n_slots = chunk_bytes, n_slots
        self.base: dict[int, int] = {}
        self.waited: dict[int, int] = {}

    @property
    def ring_bytes(self) -> int:
        return self.chunk_bytes * self.n_slots

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
        ev = {}
        for peer in {p for p in (dst, src) if p is not None}:
            to = [len(c.pieces) for c in S] if peer == dst else []
            frm = [len(c.pieces) for c in R] if peer == src else []
            ev[peer] = peer_events(to, frm, n)
        ops: list[tuple] = []

        def put(c: int) -> None:
            slot = (c % n) * cb
            for addr, off, k in S[c].pieces:
                ops.append(("put", dst, addr, slot + off, k))

        if R:
            ops.append(("signal", src))  # credit: my ring is free
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
