"""Copy plans: a collective's copy list, prepared once per set of addresses, shrunk before it
reaches the transport -- copies back to back on both sides merge into one, and runs of
equal-sized copies at constant strides (the experts of a MoE layer, allocated one after
another) become one strided copy -- so the descriptors a call enqueues grow with the world
size and the number of distinct parameter shapes, not with the number of parameters.
"""
from __future__ import annotations

from itertools import repeat
from typing import Any, NamedTuple, Sequence

import numpy as np

STRIDED_MIN_ROWS = 4
"""Shortest run of equal copies made one strided copy.  Below it the rows stay in the
transport's one batch call (a strided copy is one driver call of its own); not measured
yet -- bench/collectives_gpu.py reports the driver calls per collective to tune it."""

MAX_PITCH = (1 << 31) - 1
"""Largest row pitch (bytes) of a strided copy: ``CU_DEVICE_ATTRIBUTE_MAX_PITCH`` of every
NVIDIA GPU since Kepler; longer strides stay single copies."""


class Strided(NamedTuple):
    """``rows`` copies of ``nbytes``: row ``i`` from ``src + i * src_pitch`` to
    ``dst + i * dst_pitch`` (one row: a plain copy)."""

    dst: int
    src: int
    nbytes: int
    rows: int = 1
    dst_pitch: int = 0
    src_pitch: int = 0


def plan_copies(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
                min_rows: int = STRIDED_MIN_ROWS) -> list[Strided]:
    """The same bytes moved by fewer descriptors, in list order: empty copies dropped,
    neighbours back to back on both sides merged, then runs of at least ``min_rows`` copies
    of one size at constant strides (each at least the size: rows never overlap) made one
    :class:`Strided`.  Exact for any copy list whose pieces may run in any order (the
    transports' contract): every byte has the same source as before.  Lists (or int64
    arrays) longer than :data:`ARRAY_PLAN_MIN` are planned with array operations (a reduce-scatter round of a MoE
    layer on new gradient addresses: thousands of pieces), the result the same."""
    n = len(nbytes)
    if len(dsts) != n or len(srcs) != n:
        raise ValueError(f"dsts, srcs and nbytes must have one entry per copy, got {len(dsts)}, {len(srcs)} and {n}")
    if n > ARRAY_PLAN_MIN:
        return plan_copy_arrays(np.asarray(dsts, dtype=np.int64), np.asarray(srcs, dtype=np.int64),
                                np.asarray(nbytes, dtype=np.int64), min_rows)
    return _plan_lists(dsts, srcs, nbytes, min_rows)


def _plan_lists(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], min_rows: int) -> list[Strided]:
    """:func:`plan_copies` element by element (short lists)."""
    flat: list[list[int]] = []
    for d, x, b in zip(dsts, srcs, nbytes):
        if b < 0:
            raise ValueError(f"nbytes must be >= 0, got {b}")
        if not b:
            continue
        if flat and flat[-1][0] + flat[-1][2] == d and flat[-1][1] + flat[-1][2] == x:
            flat[-1][2] += b
        else:
            flat.append([int(d), int(x), int(b)])
    out: list[Strided] = []
    i, m = 0, len(flat)
    while i < m:
        d, x, b = flat[i]
        j = i + 1
        if j < m and flat[j][2] == b:
            dp, sp = flat[j][0] - d, flat[j][1] - x
            if b <= dp <= MAX_PITCH and b <= sp <= MAX_PITCH:
                while j < m and flat[j][2] == b and flat[j][0] - flat[j - 1][0] == dp \
                        and flat[j][1] - flat[j - 1][1] == sp:
                    j += 1
                if j - i >= max(2, min_rows):
                    out.append(Strided(d, x, b, j - i, dp, sp))
                    i = j
                    continue
        out.append(Strided(d, x, b))
        i += 1
    return out


ARRAY_PLAN_MIN = 64
"""Copy lists longer than this are planned by :func:`plan_copy_arrays`."""


def plan_copy_arrays(d: np.ndarray, x: np.ndarray, b: np.ndarray, min_rows: int) -> list[Strided]:
    """:func:`plan_copies` on int64 arrays: the merge of back-to-back neighbours (a copy joins
    the one before when both its ends continue it -- pairwise, as the chained merge) and the
    greedy strided runs, found from pairwise differences; a Python loop only over the runs."""
    if (b < 0).any():
        raise ValueError(f"nbytes must be >= 0, got {int(b.min())}")
    keep = b > 0
    d, x, b = d[keep], x[keep], b[keep]
    if not len(b):
        return []
    joins = np.empty(len(b), dtype=bool)
    joins[0] = False
    joins[1:] = (d[1:] == d[:-1] + b[:-1]) & (x[1:] == x[:-1] + b[:-1])
    starts = np.flatnonzero(~joins)
    d, x, b = d[starts], x[starts], np.add.reduceat(b, starts)
    m = len(b)
    # pair k (k >= 1): copy k after copy k-1 -- same size and pitches (dp, sp) >= the size
    dp, sp = np.diff(d), np.diff(x)
    same_size = b[1:] == b[:-1]
    opens = same_size & (dp >= b[:-1]) & (dp <= MAX_PITCH) & (sp >= b[:-1]) & (sp <= MAX_PITCH)
    # pair k continues pair k-1's run: same size and the same pitches
    cont = np.zeros(m, dtype=bool)  # indexed by the pair's later copy
    cont[2:] = same_size[1:] & (dp[1:] == dp[:-1]) & (sp[1:] == sp[:-1])
    # the first copy at or after k whose pair does not continue (m: none)
    idx = np.where(cont, m, np.arange(m))
    stop = np.minimum.accumulate(idx[::-1])[::-1]
    dl, xl, bl = d.tolist(), x.tolist(), b.tolist()
    if not opens.any():  # every copy single: tuples made without a Python call each (2x faster)
        return list(map(tuple.__new__, repeat(Strided), zip(dl, xl, bl, repeat(1), repeat(0), repeat(0))))
    opens_l, stop_l, dpl, spl = opens.tolist(), stop.tolist(), dp.tolist(), sp.tolist()
    least = max(2, min_rows)
    out: list[Strided] = []
    i = 0
    while i < m:
        if i + 1 < m and opens_l[i]:
            j = stop_l[i + 2] if i + 2 < m else m
            if j - i >= least:
                out.append(Strided(dl[i], xl[i], bl[i], j - i, dpl[i], spl[i]))
                i = j
                continue
        out.append(Strided(dl[i], xl[i], bl[i]))
        i += 1
    return out


def expand_copies(plan: Sequence[Strided]) -> tuple[list[int], list[int], list[int]]:
    """A plan as plain ``(dsts, srcs, nbytes)`` (strided runs row by row)."""
    dsts: list[int] = []
    srcs: list[int] = []
    sizes: list[int] = []
    for c in plan:
        for r in range(c.rows):
            dsts.append(c.dst + r * c.dst_pitch)
            srcs.append(c.src + r * c.src_pitch)
            sizes.append(c.nbytes)
    return dsts, srcs, sizes


def prepare_planned(t: Any, plan: Sequence[Strided]) -> Any:
    """``plan`` prepared by transport ``t``: strided runs as strided copies where the
    transport has them (``t.strided_copies``: the CUDA transport), row by row elsewhere."""
    if getattr(t, "strided_copies", False):
        plain = [c for c in plan if c.rows == 1]
        return t.prepare_copies([c.dst for c in plain], [c.src for c in plain], [c.nbytes for c in plain],
                                strided=[c for c in plan if c.rows > 1])
    return t.prepare_copies(*expand_copies(plan))
