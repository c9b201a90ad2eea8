"""Copies cut where their memory changes allocation.

The driver refuses a copy whose source or destination spans two allocations of
``cuMemAlloc`` (the caching allocator's segments): ``CUDA_ERROR_INVALID_VALUE`` for
``cuMemcpyAsync``, ``cuMemcpy2DAsync`` and ``cuMemcpy3DAsync`` alike, eager and under stream
capture -- and a strided run is refused as soon as its rows lie in two allocations, though
each row lies in one (docs/constraints.md#no-copy-spans-two-allocations).  The
planner merges copies that are contiguous on both sides and folds equal rows into strided
runs, over tensors that may come from adjacent segments: eight 4 MiB gradients, five to a
20 MiB segment, gave a run over two segments, and a recorded reduce-scatter failed.  VMM
mappings side by side in one reserved range (the heap, torch's expandable segments) copy
across their seams; the driver reports each mapping as its own range, so they are cut too
-- a few more descriptors, never a refused copy.

:class:`AllocationRanges` asks the driver once per allocation within one preparation;
:func:`split_strided` and :func:`split_copies` cut runs and copies at the ends it reports
(the copies checked on arrays: 0.1-0.65 ms for 1,542 copies on this project's CPU, over one
to 200 allocations).  No CUDA; the query is given (``cuMemGetAddressRange`` on CUDA, a fake in
the tests).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Sequence

import numpy as np

Run = tuple[int, int, int, int, int, int]
"""A strided run: ``(dst, src, nbytes, rows, dst_pitch, src_pitch)``."""


class AllocationRanges:
    """The end of the allocation holding an address: ``query(address)`` returns ``(base,
    size)`` or None (not device memory the driver knows: treated as unbounded), asked once
    per allocation -- allocations do not overlap, so the answers are kept sorted by base
    and looked up by bisection.  Valid for one preparation (memory may be freed after)."""

    def __init__(self, query: Callable[[int], tuple[int, int] | None]) -> None:
        self._query = query
        self._bases: list[int] = []
        self._ends: list[int] = []
        self.queries = 0

    def _ask(self, address: int) -> int | None:
        self.queries += 1
        found = self._query(address)
        if found is None:
            return None
        base, size = found
        if not base <= address < base + size:  # a driver answer that does not hold it: unknown
            return None
        j = bisect_right(self._bases, base)
        self._bases.insert(j, base)
        self._ends.insert(j, base + size)
        return base + size

    def end_of(self, address: int) -> int | None:
        i = bisect_right(self._bases, address) - 1
        if i >= 0 and address < self._ends[i]:
            return self._ends[i]
        return self._ask(address)

    def ends_of(self, addresses: np.ndarray) -> np.ndarray:
        """:meth:`end_of` of every address at once (int64; :data:`UNBOUNDED` for unknown
        memory): the addresses sorted, then one query per allocation, jumping past each
        allocation's addresses by bisection -- no Python step per address."""
        order = np.argsort(addresses, kind="stable")
        a = addresses[order]
        ends = np.empty_like(a)
        pos, n = 0, len(a)
        while pos < n:
            end = self.end_of(int(a[pos]))
            if end is None:
                nxt = int(np.searchsorted(a, a[pos], side="right"))
                ends[pos:nxt] = UNBOUNDED
            else:
                nxt = int(np.searchsorted(a, end, side="left"))
                ends[pos:nxt] = end
            pos = nxt
        out = np.empty_like(ends)
        out[order] = ends
        return out


UNBOUNDED = np.iinfo(np.int64).max
"""What :meth:`AllocationRanges.ends_of` gives for memory the driver does not know."""


def _room(end: int | None, start: int) -> int | None:
    return None if end is None else end - start


def split_copies(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int],
                 ranges: AllocationRanges) -> tuple[list[int], list[int], list[int]]:
    """The copies ``(dsts[i], srcs[i], nbytes[i])``, each cut where its source or its
    destination reaches the end of an allocation.  The check is on arrays; only the copies
    that cross an end are visited in Python, and cut there."""
    n = len(nbytes)
    if n == 0:
        return [], [], []
    d = np.fromiter(dsts, np.int64, n)
    x = np.fromiter(srcs, np.int64, n)
    b = np.fromiter(nbytes, np.int64, n)
    ends = ranges.ends_of(np.concatenate([x, d]))
    crossing = np.flatnonzero((ends[:n] - x < b) | (ends[n:] - d < b))
    if not len(crossing):
        return list(dsts), list(srcs), list(nbytes)
    d_out: list[int] = []
    x_out: list[int] = []
    b_out: list[int] = []
    prev = 0
    for i in crossing.tolist():
        d_out += dsts[prev:i]
        x_out += srcs[prev:i]
        b_out += nbytes[prev:i]
        di, xi, bi = dsts[i], srcs[i], nbytes[i]
        while bi > 0:
            m = bi
            for room in (_room(ranges.end_of(xi), xi), _room(ranges.end_of(di), di)):
                if room is not None:
                    m = min(m, room)
            d_out.append(di)
            x_out.append(xi)
            b_out.append(m)
            di, xi, bi = di + m, xi + m, bi - m
        prev = i + 1
    d_out += dsts[prev:]
    x_out += srcs[prev:]
    b_out += nbytes[prev:]
    return d_out, x_out, b_out


def _rows_within(end: int | None, start: int, nbytes: int, pitch: int, rows: int) -> int:
    """How many rows from ``start`` (every ``pitch`` bytes, ``nbytes`` each) end by ``end``."""
    if end is None:
        return rows
    if end - start < nbytes:
        return 0
    return min(rows, (end - start - nbytes) // pitch + 1)


def split_strided(runs: Sequence[Run], end_of: Callable[[int], int | None]
                  ) -> tuple[list[Run], list[tuple[int, int, int]]]:
    """``runs`` cut into runs whose rows all lie in one allocation on each side, and the
    rows left alone (a run of one row, or a row that itself crosses an allocation's end) as
    plain copies ``(dst, src, nbytes)`` -- for :func:`split_copies`."""
    out: list[Run] = []
    plain: list[tuple[int, int, int]] = []
    for dst, src, nbytes, rows, dst_pitch, src_pitch in runs:
        i = 0
        while i < rows:
            d0, s0 = dst + i * dst_pitch, src + i * src_pitch
            k = min(_rows_within(end_of(s0), s0, nbytes, src_pitch, rows - i),
                    _rows_within(end_of(d0), d0, nbytes, dst_pitch, rows - i))
            if k >= 2:
                out.append((d0, s0, nbytes, k, dst_pitch, src_pitch))
            else:
                k = 1
                plain.append((d0, s0, nbytes))
            i += k
    return out, plain
