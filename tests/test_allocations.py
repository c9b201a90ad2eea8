"""Copies cut where their memory changes allocation (tide_triton/transport/allocations.py):
the driver refuses any copy spanning two ``cuMemAlloc`` allocations, so every copy and
strided run the planner merged across one is cut there -- and the cut pieces move exactly the
same bytes.  CPU: a fake driver query over made-up allocations."""
from __future__ import annotations

import random

import pytest
import torch

from tide_triton.transport.allocations import AllocationRanges, split_copies, split_strided

ALLOCS = [(0, 100), (100, 200), (300, 50), (1000, 4096)]  # (base, size); 350..1000 and >= 5096 unknown


def _query(allocs):
    calls = []

    def query(address):
        calls.append(address)
        for base, size in allocs:
            if base <= address < base + size:
                return base, size
        return None
    return query, calls


def _alloc_of(address):
    return next(((b, b + s) for b, s in ALLOCS if b <= address < b + s), None)


def test_a_copy_over_two_allocations_is_cut_at_the_seam_on_either_side() -> None:
    query, calls = _query(ALLOCS)
    ends = AllocationRanges(query)
    # source 50..150 spans allocations 0 and 100; destination 1000.. lies in one
    assert split_copies([1000], [50], [100], ends) == ([1000, 1050], [50, 100], [50, 50])
    # destination 290..310 crosses 300 (the gap 300 is an allocation start); source unknown memory
    assert split_copies([290], [400], [20], ends) == ([290, 300], [400, 410], [10, 10])
    # memory the driver does not know (host memory): left whole
    assert split_copies([5000], [6000], [64], ends) == ([5000], [6000], [64])


def test_the_driver_is_asked_once_per_allocation() -> None:
    query, calls = _query(ALLOCS)
    ends = AllocationRanges(query)
    for a in (10, 20, 99, 0, 150, 120, 1100, 5000):
        ends.end_of(a)
    known = [c for c in calls if _alloc_of(c) is not None]
    assert len(known) == 3 and ends.queries == len(calls), calls  # 0, 100, 1000: once each
    # on arrays: one query per allocation, whatever the number of addresses
    import numpy as np

    from tide_triton.transport.allocations import UNBOUNDED

    query, calls = _query(ALLOCS)
    ends = AllocationRanges(query)
    addrs = np.array([1100, 10, 6000, 99, 150, 0, 120, 6000, 299, 1200], dtype=np.int64)
    got = ends.ends_of(addrs)
    assert got.tolist() == [5096, 100, UNBOUNDED, 100, 300, 100, 300, UNBOUNDED, 300, 5096]
    assert len([c for c in calls if _alloc_of(c) is not None]) == 3 and len(calls) == 4, calls


def test_a_strided_run_over_two_allocations_becomes_two_runs_and_lone_rows_plain_copies() -> None:
    query, _ = _query([(0, 4096), (4096, 4096)])
    ends = AllocationRanges(query)
    # 8 rows of 512 B every 1024 B from 0: rows 0-3 in the first allocation, 4-7 in the second
    runs, plain = split_strided([(1 << 20, 0, 512, 8, 512, 1024)], ends.end_of)
    assert runs == [((1 << 20), 0, 512, 4, 512, 1024), ((1 << 20) + 2048, 4096, 512, 4, 512, 1024)]
    assert plain == []
    # 3 rows from 3072: row 0 alone in the first allocation -> a plain copy, rows 1-2 a run
    runs, plain = split_strided([(1 << 20, 3072, 512, 3, 512, 1024)], ends.end_of)
    assert plain == [(1 << 20, 3072, 512)] and runs == [((1 << 20) + 512, 4096, 512, 2, 512, 1024)]
    # a row that itself crosses the seam (3584..4608) is a plain copy, cut later by split_copies
    runs, plain = split_strided([(1 << 20, 2560, 1024, 2, 1024, 1024)], ends.end_of)
    assert runs == [] and plain == [(1 << 20, 2560, 1024), ((1 << 20) + 1024, 3584, 1024)]
    assert split_copies(*zip(*plain[1:]), ends) == ([(1 << 20) + 1024, (1 << 20) + 1536], [3584, 4096],
                                                           [512, 512])


@pytest.mark.parametrize("seed", range(20))
def test_cut_copies_move_exactly_the_same_bytes_and_each_lies_in_one_allocation(seed: int) -> None:
    """Random allocations (some adjacent, some with gaps), random merged copies and strided
    runs over them: the cut pieces, applied to a byte array, give the same result as the
    uncut copies, and no piece spans an allocation's end on either side."""
    rng = random.Random(seed)
    allocs, at = [], 0
    while at < 60_000:
        size = rng.choice([64, 512, 1000, 4096, 7000])
        if rng.random() < 0.7:
            allocs.append((at, size))
        at += size + (0 if rng.random() < 0.6 else rng.choice([8, 100]))
    space = at + 8192
    src = torch.randint(0, 255, (space,), dtype=torch.uint8)
    copies = []
    runs = []
    for _ in range(8):
        b = rng.randint(1, 6000)
        copies.append((rng.randint(0, space - b - 1) // 2 * 2, rng.randint(0, space - b - 1), b))
    for _ in range(4):
        nb, rows = rng.randint(1, 700), rng.randint(2, 9)
        dp, sp = nb + rng.randint(0, 300), nb + rng.randint(0, 300)
        runs.append((rng.randint(0, space - rows * dp - 1), rng.randint(0, space - rows * sp - 1), nb, rows, dp, sp))

    def apply(plain, strided):
        dst = torch.zeros(space, dtype=torch.uint8)
        for d, x, b in plain:
            dst[d:d + b] = src[x:x + b]
        for d, x, b, rows, dp, sp in strided:
            for i in range(rows):
                dst[d + i * dp:d + i * dp + b] = src[x + i * sp:x + i * sp + b]
        return dst

    query, _ = _query(allocs)
    ends = AllocationRanges(query)
    cut_runs, rows = split_strided(runs, ends.end_of)
    d, x, b = split_copies([c[0] for c in copies + rows], [c[1] for c in copies + rows],
                           [c[2] for c in copies + rows], ends)
    # the same bytes: the runs and copies do not overlap on the destination side in general,
    # so compare each uncut copy / run with its own cut pieces, one at a time
    for c in copies:
        pd, px, pb = split_copies([c[0]], [c[1]], [c[2]], AllocationRanges(_query(allocs)[0]))
        assert torch.equal(apply(list(zip(pd, px, pb)), []), apply([c], []))
    for run in runs:
        e = AllocationRanges(_query(allocs)[0])
        rr, rp = split_strided([run], e.end_of)
        pd, px, pb = split_copies([c[0] for c in rp], [c[1] for c in rp], [c[2] for c in rp], e)
        assert torch.equal(apply(list(zip(pd, px, pb)), rr), apply([], [run]))

    def within(a, n):
        first = next(((lo, lo + s) for lo, s in allocs if lo <= a < lo + s), None)
        return first is None or a + n <= first[1]
    for dd, xx, bb in zip(d, x, b):
        assert within(dd, bb) and within(xx, bb), (dd, xx, bb)
    for dd, xx, nb, nrows, dp, sp in cut_runs:
        assert nrows >= 2
        assert within(dd, (nrows - 1) * dp + nb) and within(xx, (nrows - 1) * sp + nb)
