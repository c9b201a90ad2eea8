"""The landing-ring protocol of the one-sided inter-node hop (tide_triton.transport.rma_protocol),
run on an emulated machine: every rank's operations execute in program order, ranks interleave
in random orders, signals are per-peer counters that waits compare with ``>=`` (NCCL's
semantics).  Checked: every byte reaches its destination, no put lands on a chunk its
receiver has not copied out, no schedule deadlocks -- over call sequences shaped like the
cross-node plans' rounds (pairwise exchange, recursive doubling, Bruck's shifts for node
counts that are not powers of two), with uneven sizes, empty messages and many small pieces."""
from __future__ import annotations

import random
import zlib

import pytest

from tide_triton.transport.rma_protocol import LandingRing, cut, peer_events


def test_cut_packs_pieces_and_splits_at_chunk_boundaries() -> None:
    chunks = cut([(100, 3), (200, 6), (300, 0), (400, 2)], 4)
    assert [c.pieces for c in chunks] == [((100, 0, 3), (200, 3, 1)), ((201, 0, 4),), ((205, 0, 1), (400, 1, 2))]
    assert [c.nbytes for c in chunks] == [4, 4, 3]
    assert cut([], 4) == []
    with pytest.raises(ValueError, match="chunk_bytes"):
        cut([(0, 1)], 0)


def test_peer_events_positions() -> None:
    # symmetric exchange, 3 chunks each way, 2 slots: X sends credit, puts 0 1, then
    # step 0: free 0 (my chunk 2 reuses slot 0), put 2; step 1: nothing more.
    e = peer_events(3, 3, 2)
    assert e == {"credit": 1, "data": [2, 3, 5], "free": {0: 4}, "total": 5}
    # X only receives from me: a credit, then frees of the chunks that reuse a slot
    assert peer_events(4, 0, 1) == {"credit": 1, "data": [], "free": {0: 2, 1: 3, 2: 4}, "total": 4}
    # X only sends to me
    assert peer_events(0, 2, 4) == {"credit": None, "data": [1, 2], "free": {}, "total": 2}


class _Machine:
    """Ranks with one flat memory each, a landing ring, per-(sender, receiver) counters."""

    def __init__(self, world: int, chunk_bytes: int, n_slots: int, mem_bytes: int) -> None:
        self.world = world
        self.rings = [LandingRing(chunk_bytes, n_slots) for _ in range(world)]
        self.ring_bytes = chunk_bytes * n_slots  # window: landing ring, then send ring
        self.mem = [bytearray(mem_bytes) for _ in range(world)]
        self.win = [bytearray(2 * self.ring_bytes) for _ in range(world)]
        self.pending = [[] for _ in range(world)]  # (lo, hi) put into my landing ring, not yet copied out
        self.count = {}  # (src, dst) -> signals src raised at dst
        self.waited = {}  # (me, peer) -> waited for so far (NCCL's running total)
        self.ops = [[] for _ in range(world)]

    def call(self, plan: dict[int, tuple]) -> None:
        """One sendrecv on every rank: plan[r] = (send (peer, iov) | None, recv (peer, iov) | None)."""
        for r in range(self.world):
            send, recv = plan.get(r, (None, None))
            self.ops[r].extend(self.rings[r].program(send, recv))

    def _step(self, r: int) -> bool:
        op = self.ops[r][0]
        kind = op[0]
        if kind == "wait":
            _, peer, k = op
            target = self.waited.get((r, peer), 0) + k
            if self.count.get((peer, r), 0) < target:
                return False
            self.waited[(r, peer)] = target
        elif kind == "signal":
            self.count[(r, op[1])] = self.count.get((r, op[1]), 0) + 1
        elif kind == "pack":
            _, srcs, offs, sizes = op
            for a, o, n in zip(srcs, offs, sizes):
                assert self.ring_bytes <= o and o + n <= 2 * self.ring_bytes, "pack outside the send ring"
                self.win[r][o:o + n] = self.mem[r][a:a + n]
        elif kind == "put":
            _, peer, so, off, n = op
            assert self.ring_bytes <= so and so + n <= 2 * self.ring_bytes, "put from outside the send ring"
            assert 0 <= off and off + n <= self.ring_bytes, "put outside the landing ring"
            for lo, hi in self.pending[peer]:
                assert hi <= off or off + n <= lo, f"rank {r} overwrote an unread chunk in rank {peer}'s ring"
            self.win[peer][off:off + n] = self.win[r][so:so + n]
            self.pending[peer].append((off, off + n))
            self.count[(r, peer)] = self.count.get((r, peer), 0) + 1
        elif kind == "copy":
            _, dsts, offs, sizes = op
            for d, o, n in zip(dsts, offs, sizes):
                hit = [(lo, hi) for lo, hi in self.pending[r] if lo <= o and o + n <= hi]
                assert hit, f"rank {r} copied out bytes that were never put"
                self.mem[r][d:d + n] = self.win[r][o:o + n]
                lo, hi = hit[0]
                self.pending[r].remove((lo, hi))  # what is left of the chunk stays pending
                self.pending[r] += [x for x in ((lo, o), (o + n, hi)) if x[0] < x[1]]
        self.ops[r].pop(0)
        return True

    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        live = [r for r in range(self.world) if self.ops[r]]
        while live:
            order = live[:]
            rng.shuffle(order)
            if not any(self._step(r) for r in order):
                stuck = {r: self.ops[r][0] for r in live}
                raise AssertionError(f"deadlock: {stuck}")
            live = [r for r in range(self.world) if self.ops[r]]
        assert all(not p for p in self.pending), "chunks left unread in a landing ring"


def _iov(rng: random.Random, base: int, nbytes: int, max_piece: int) -> list[tuple[int, int]]:
    """nbytes at base as random-sized consecutive-but-gapped pieces (gap of 1 byte between)."""
    out, a, left = [], base, nbytes
    while left:
        k = min(left, rng.randint(1, max_piece))
        out.append((a, k))
        a, left = a + k + 1, left - k
    return out


def _rounds(kind: str, N: int) -> list[list[tuple[int, int]]]:
    """Per round, (sender, receiver) pairs of node indices (one rail)."""
    if kind == "pair":
        return [[(0, 1), (1, 0)]] * 3
    if kind == "doubling":
        rs, k = [], 1
        while k < N:
            rs.append([(r, r ^ k) for r in range(N)])
            k *= 2
        return rs
    if kind == "bruck":
        rs, k = [], 1
        while k < N:
            rs.append([(r, (r + k) % N) for r in range(N)])
            k *= 2
        return rs
    raise ValueError(kind)


@pytest.mark.parametrize("kind, N", [("pair", 2), ("doubling", 4), ("doubling", 8), ("bruck", 3), ("bruck", 5),
                                     ("bruck", 6)])
@pytest.mark.parametrize("chunk_bytes, n_slots, max_piece", [(16, 1, 40), (16, 2, 5), (7, 3, 30), (64, 2, 200)])
def test_rounds_deliver_exactly_without_overwrite_or_deadlock(kind, N, chunk_bytes, n_slots, max_piece) -> None:
    rng = random.Random(zlib.crc32(f"{kind} {N} {chunk_bytes} {n_slots} {max_piece}".encode()))
    rounds = _rounds(kind, N)
    seg = 4096
    m = _Machine(N, chunk_bytes, n_slots, mem_bytes=2 * seg * (len(rounds) + 1))
    expect = []
    for k, pairs in enumerate(rounds):
        plan: dict[int, list] = {r: [None, None] for r in range(N)}
        for s, d in pairs:
            nbytes = rng.choice([0, rng.randint(1, 10), rng.randint(1, 400)])
            src_base, dst_base = 2 * seg * k, 2 * seg * k + seg
            seed = rng.randrange(1 << 30)
            siov = _iov(random.Random(seed), src_base, nbytes, max_piece)
            diov = [(a - src_base + dst_base, n) for a, n in siov]  # same piece sizes, other addresses
            payload = bytes(rng.randrange(256) for _ in range(sum(n for _, n in siov)))
            o = 0
            for a, n in siov:
                m.mem[s][a:a + n] = payload[o:o + n]
                o += n
            plan[s][0] = (d, siov)
            plan[d][1] = (s, diov)
            expect.append((d, diov, payload))
        m.call({r: tuple(v) for r, v in plan.items()})
    for seed in range(3):
        mm = _Machine(N, chunk_bytes, n_slots, 0)
        mm.mem = [bytearray(b) for b in m.mem]
        mm.ops = [list(o) for o in m.ops]
        mm.run(seed)
        for d, diov, payload in expect:
            got = b"".join(bytes(mm.mem[d][a:a + n]) for a, n in diov)
            assert got == payload


def test_ledger_carries_unwaited_signals_into_the_next_call() -> None:
    # Two ranks, one direction, 3 calls; only the receiver's credits and frees flow back.
    m = _Machine(2, 8, 1, 1024)
    for k in range(3):
        m.mem[0][k * 100:k * 100 + 30] = bytes(range(k, k + 30))
        m.call({0: ((1, [(k * 100, 30)]), None), 1: (None, (0, [(500 + k * 100, 30)]))})
    m.run(0)
    for k in range(3):
        assert bytes(m.mem[1][500 + k * 100:530 + k * 100]) == bytes(range(k, k + 30))
    # every signal rank 1 sent rank 0 is accounted for in rank 0's ledger
    assert m.rings[0].base[1] == m.count[(1, 0)]
    assert m.rings[1].base[0] == m.count[(0, 1)]
