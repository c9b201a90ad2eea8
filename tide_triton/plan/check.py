"""Schedule simulator: runs the cross-node schedules (:mod:`tide_triton.plan.across_nodes`)
without data and checks, element range by element range, that they are exact.

All-gather: every real element of every parameter must reach every rank exactly once,
and a rank may only send what it held before the round.  State per ``(rank, param)``: a
bitset of the ranks whose whole shard it holds, plus interval lists for shards it holds
in part (a chunk boundary cut them) -- never one entry per element.

Reduce-scatter: every element of every destination's shard must end up with exactly one
contribution from every rank.  State per ``(rank, param)``: the padded shard coordinate
cut into segments (split on demand at every range a run names), and per segment a short
list of rectangles ``(origins, contributors)`` -- bitsets over ranks meaning "this rank's
partial sums for the shards of ``origins`` include the gradients of ``contributors``".
A rank starts with its own gradient for everything; a transfer delivers the sender's
rectangles restricted to the run's origins; adding one whose contributors overlap what
the receiver already has for the same origin is a double count and is reported, so a
final contributor set equal to all ranks means each gradient counted exactly once.

Counts: bytes each rank sends and receives per round label and link class (inter-node
network / intra-node), chunks, rounds, staging.  Pure Python; a 1024-rank (128 x 8) run of
a real Llama-3.1-70B layer takes seconds to a minute.  The command line is
``python bench/simulate.py``, which prints its tables.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from .across_nodes import AllGatherPlan, ReduceScatterPlan, Run, Step
from .layout import ShardLayout
from .topology import Topology

_MAX_ERRORS = 20


@lru_cache(maxsize=4096)
def _comb(step: int, count: int) -> int:
    """Bitset with bits ``0, step, 2*step, ...`` (``count`` of them)."""
    m = 0
    for i in range(count):
        m |= 1 << (i * step)
    return m


def _low(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _ranks(mask: int, limit: int = 6) -> str:
    out = []
    while mask and len(out) < limit:
        out.append(_low(mask))
        mask &= mask - 1
    return ", ".join(map(str, out)) + (", ..." if mask else "")


@dataclass
class SimReport:
    """What a simulated schedule did and whether it was exact."""

    kind: str
    topology: str
    scheme: str
    errors: list[str] = field(default_factory=list)
    sent: dict[str, list[int]] = field(default_factory=dict)
    """Bytes each rank sent, per round label."""
    received: dict[str, list[int]] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    """Round label -> link class (``"inter"`` / ``"intra"``)."""
    rounds: int = 0
    steps: int = 0
    chunks: list[int] = field(default_factory=list)
    """Network chunks each rank sent."""
    runs: int = 0
    """Runs (strided or not) the checker processed."""
    staging_bytes: int = 0
    seconds: float = 0.0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.errors

    def error(self, msg: str) -> None:
        if len(self.errors) < _MAX_ERRORS:
            self.errors.append(str(msg))
        else:
            self.truncated = True

    def link_bytes(self, link: str, *, sent: bool = True) -> list[int]:
        """Per-rank bytes over all rounds of one link class."""
        table = self.sent if sent else self.received
        rows = [v for k, v in table.items() if self.links[k] == link]
        return [sum(col) for col in zip(*rows)] if rows else []

    def _count(self, step: Step, world: int) -> None:
        if step.label not in self.sent:
            self.sent[step.label] = [0] * world
            self.received[step.label] = [0] * world
            self.links[step.label] = step.link
        s, r = self.sent[step.label], self.received[step.label]
        for t in step.transfers:
            b = t.elems * step.elem_bytes
            s[t.src] += b
            r[t.dst] += b
            if step.link == "inter":
                self.chunks[t.src] += len(t.chunks)


class _Where:
    """Where a run travels; formatted only when an error names it."""

    __slots__ = ("label", "window", "src", "dst")

    def __init__(self, label: str, window: int | None, src: int, dst: int) -> None:
        self.label, self.window, self.src, self.dst = label, window, src, dst

    def __format__(self, spec: str) -> str:
        w = "" if self.window is None else f", window {self.window}"
        return f"{self.label}{w}, rank {self.src} -> {self.dst}"


def _check_link(step: Step, t, topo: Topology, rep: SimReport, where: _Where) -> None:
    L, W = topo.local_size, topo.world_size
    if not (0 <= t.src < W and 0 <= t.dst < W) or t.src == t.dst:
        rep.error(f"{where}: transfer between ranks {t.src} and {t.dst} of a {W}-rank group")
    elif step.link == "inter" and t.src % L != t.dst % L:
        rep.error(f"{where}: inter-node transfer leaves its rail")
    elif step.link == "intra" and t.src // L != t.dst // L:
        rep.error(f"{where}: intra-node transfer crosses nodes")


# --------------------------------------------------------------------------- run decoding
class _Decoder:
    """Turns runs into per-origin pieces and checks they stay inside real elements."""

    def __init__(self, layout: ShardLayout) -> None:
        self.W = layout.world_size
        self.S = layout.padded_shard_numels
        self.rows = layout.rows_per_rank
        self.rown = layout.row_numels
        self.dim0 = tuple(s[0] for s in layout.shapes)
        self.real = [layout.shard_numels(r) for r in range(self.W)]

    def ge_mask(self, p: int, y: int) -> int:
        """Ranks whose real shard of ``p`` holds at least ``y`` elements (``y >= 1``)."""
        if self.rows[p] == 0 or self.rown[p] == 0:
            return 0
        need = -(-y // self.rown[p])
        if need > self.rows[p]:
            return 0
        last = min((self.dim0[p] - need) // self.rows[p], self.W - 1)
        return (1 << (last + 1)) - 1 if last >= 0 else 0

    def decode(self, run: Run, rep: SimReport, where: object):
        """Yield ``(p, origins_mask, lo, hi)``: elements ``[lo, hi)`` of the shards of the
        ranks in ``origins_mask``.  Malformed runs are reported and skipped."""
        p = run.param
        if not (0 <= p < len(self.S)) or run.numel < 1 or run.count < 1 or run.start < 0 or run.stride < 0:
            rep.error(f"{where}: malformed run {run}")
            return
        S = self.S[p]
        if S and run.count > 1 and run.stride % S == 0 and run.stride > 0:
            o0, a = divmod(run.start, S)
            step = run.stride // S
            last = o0 + step * (run.count - 1)
            if a + run.numel <= S and last < self.W:
                b = a + run.numel
                mask = _comb(step, run.count) << o0
                bad = mask & ~self.ge_mask(p, b)
                if bad:
                    o = _low(bad)
                    rep.error(f"{where}: run {run} reaches past the real elements of rank {o}'s "
                              f"shard of param {p} ({self.real[o][p]} real)")
                    mask &= ~bad
                if mask:
                    yield p, mask, a, b
                return
        for _, st, n in run.pieces():  # general path: row by row, split at shard edges
            while n > 0:
                if S == 0:
                    rep.error(f"{where}: run {run} names param {p}, which has no elements")
                    return
                o, a = divmod(st, S)
                take = min(n, S - a)
                if o >= self.W:
                    rep.error(f"{where}: run {run} reaches past the padded storage of param {p}")
                    return
                if a + take > self.real[o][p]:
                    rep.error(f"{where}: run {run} reaches past the real elements of rank {o}'s "
                              f"shard of param {p} ({self.real[o][p]} real)")
                    take_ok = max(0, self.real[o][p] - a)
                    if take_ok:
                        yield p, 1 << o, a, a + take_ok
                else:
                    yield p, 1 << o, a, a + take
                st += take
                n -= take


# --------------------------------------------------------------------------- all-gather
class _GatherState:
    def __init__(self, dec: _Decoder, n_params: int) -> None:
        self.dec = dec
        W = dec.W
        self.full = [[(1 << h) if dec.real[h][p] else 0 for p in range(n_params)] for h in range(W)]
        self.part: dict[tuple[int, int], dict[int, list[tuple[int, int]]]] = {}

    def holds(self, h: int, p: int, mask: int, lo: int, hi: int) -> int:
        """The origins in ``mask`` whose ``[lo, hi)`` rank ``h`` does NOT hold."""
        missing = mask & ~self.full[h][p]
        parts = self.part.get((h, p))
        if missing and parts:
            m = missing
            while m:
                o = _low(m)
                m &= m - 1
                for x, y in parts.get(o, ()):
                    if x <= lo and hi <= y:
                        missing &= ~(1 << o)
                        break
        return missing

    def add(self, h: int, p: int, mask: int, lo: int, hi: int, rep: SimReport, where: object) -> None:
        dup = mask & self.full[h][p]
        if dup:
            o = _low(dup)
            S = self.dec.S[p]
            rep.error(f"{where}: rank {h} receives param {p} elements [{o * S + lo}, {o * S + hi}) "
                      f"(rank {o}'s shard) a second time")
            mask &= ~dup
        parts = self.part.get((h, p))
        real = self.dec.real
        whole = lo == 0
        if whole:  # shards received whole (the common case): one bitset operation
            fast = mask & ~self.dec.ge_mask(p, hi + 1)
            if parts:
                for o in parts:
                    fast &= ~(1 << o)
            self.full[h][p] |= fast
            mask &= ~fast
        m = mask
        while m:
            o = _low(m)
            m &= m - 1
            have = parts.get(o) if parts else None
            if whole and not have and hi == real[o][p]:
                self.full[h][p] |= 1 << o
                continue
            if parts is None:
                parts = self.part[(h, p)] = {}
            iv = parts.setdefault(o, [])
            i = bisect.bisect_left(iv, (lo, hi))
            if (i > 0 and iv[i - 1][1] > lo) or (i < len(iv) and iv[i][0] < hi):
                S = self.dec.S[p]
                rep.error(f"{where}: rank {h} receives param {p} elements [{o * S + lo}, {o * S + hi}) "
                          f"(rank {o}'s shard), overlapping what it already holds")
                continue
            iv.insert(i, (lo, hi))
            # merge neighbours; promote a completed shard to the bitset
            merged: list[tuple[int, int]] = []
            for x, y in iv:
                if merged and merged[-1][1] == x:
                    merged[-1] = (merged[-1][0], y)
                else:
                    merged.append((x, y))
            if merged == [(0, real[o][p])]:
                del parts[o]
                self.full[h][p] |= 1 << o
            else:
                parts[o] = merged


def simulate_all_gather(plan: AllGatherPlan, *, check: bool = True) -> SimReport:
    """Run ``plan`` and check it (``check=False``: counts only)."""
    t0 = time.perf_counter()
    layout, topo = plan.layout, plan.topology
    W = topo.world_size
    rep = SimReport("all_gather", str(topo), plan.scheme, chunks=[0] * W,
                    rounds=plan.rounds, staging_bytes=plan.staging_bytes)
    dec = _Decoder(layout)
    st = _GatherState(dec, len(layout)) if check else None
    for step in plan.steps():
        rep.steps += 1
        rep._count(step, W)
        if st is None:
            continue
        pending = []
        for t in step.transfers:
            where = _Where(step.label, None, t.src, t.dst)
            _check_link(step, t, topo, rep, where)
            for j, chunk in enumerate(t.chunks):
                if step.link == "inter" and sum(r.elems for r in chunk) > plan.chunk_elems:
                    rep.error(f"{where}: chunk {j} holds {sum(r.elems for r in chunk)} elements, "
                              f"over the {plan.chunk_elems}-element cap")
                for run in chunk:
                    rep.runs += 1
                    for p, mask, lo, hi in dec.decode(run, rep, where):
                        missing = st.holds(t.src, p, mask, lo, hi)
                        if missing:
                            o = _low(missing)
                            S = dec.S[p]
                            rep.error(f"{where}: sends param {p} elements [{o * S + lo}, {o * S + hi}) "
                                      f"(rank {o}'s shard), which rank {t.src} does not hold yet")
                        pending.append((t.dst, p, mask, lo, hi, where))
        for d, p, mask, lo, hi, where in pending:
            st.add(d, p, mask, lo, hi, rep, where)
    if st is not None:
        for h in range(W):
            for p in range(len(layout)):
                want = _all_real(dec, p)
                missing = want & ~st.full[h][p]
                if missing:
                    o = _low(missing)
                    S = dec.S[p]
                    have = st.part.get((h, p), {}).get(o, [])
                    rep.error(f"rank {h} never receives param {p} elements of rank {o}'s shard "
                              f"[{o * S}, {o * S + dec.real[o][p]}) (holds {have or 'none'}; "
                              f"{bin(missing).count('1')} shard(s) missing)")
    rep.seconds = time.perf_counter() - t0
    return rep


def _all_real(dec: _Decoder, p: int) -> int:
    cache = dec.__dict__.setdefault("_allreal", {})
    if p not in cache:
        cache[p] = sum(1 << o for o in range(dec.W) if dec.real[o][p])
    return cache[p]


# --------------------------------------------------------------------------- reduce-scatter
class _ScatterState:
    """Per (rank, param): segment bounds and per segment the rectangles
    ``[origins, contributors]`` of the rank's partial sums."""

    def __init__(self, dec: _Decoder) -> None:
        self.dec = dec
        self.st: dict[tuple[int, int], tuple[list[int], list[list[list[int]]]]] = {}

    def get(self, h: int, p: int):
        s = self.st.get((h, p))
        if s is None:
            dec = self.dec
            S = dec.S[p]
            bounds = sorted({0, S} | self._reals(p))
            rects = []
            for _x, y in zip(bounds, bounds[1:]):
                m = dec.ge_mask(p, y)
                rects.append([[m, 1 << h]] if m else [])
            s = self.st[(h, p)] = (bounds, rects)
        return s

    def _reals(self, p: int) -> set[int]:
        cache = self.__dict__.setdefault("_reals_cache", {})
        if p not in cache:
            cache[p] = {self.dec.real[o][p] for o in range(self.dec.W)}
        return cache[p]

    @staticmethod
    def split(s, x: int) -> int:
        bounds, rects = s
        i = bisect.bisect_left(bounds, x)
        if i < len(bounds) and bounds[i] == x:
            return i
        bounds.insert(i, x)
        rects.insert(i, [list(r) for r in rects[i - 1]])
        return i


def simulate_reduce_scatter(plan: ReduceScatterPlan, *, check: bool = True) -> SimReport:
    """Run ``plan`` and check it (``check=False``: counts only)."""
    t0 = time.perf_counter()
    layout, topo = plan.layout, plan.topology
    W, L, N = topo.world_size, topo.local_size, topo.nodes
    rep = SimReport("reduce_scatter", str(topo), plan.scheme, chunks=[0] * W,
                    rounds=plan.rounds * len(plan.windows), staging_bytes=plan.staging_bytes)
    dec = _Decoder(layout)
    ss = _ScatterState(dec) if check else None
    c = plan.window_elems
    slot_cap = {"intra": (L - 1) * N * c * plan.grad_bytes,
                "inter": plan.max_message_shards * c * plan.wire_bytes}
    for step in plan.steps():
        rep.steps += 1
        rep._count(step, W)
        recv: dict[int, int] = {}
        for t in step.transfers:
            recv[t.dst] = recv.get(t.dst, 0) + t.elems * step.elem_bytes
        for d, b in recv.items():
            if b > slot_cap[step.link]:
                rep.error(f"{step.label}, window {step.window}: rank {d} receives {b} bytes, over its "
                          f"{slot_cap[step.link]}-byte staging for this round")
        if ss is None:
            continue
        pending = []
        for t in step.transfers:
            where = _Where(step.label, step.window, t.src, t.dst)
            _check_link(step, t, topo, rep, where)
            for chunk in t.chunks:
                for run in chunk:
                    rep.runs += 1
                    for p, mask, lo, hi in dec.decode(run, rep, where):
                        s = ss.get(t.src, p)
                        i, j = ss.split(s, lo), ss.split(s, hi)
                        bounds, rects = s
                        for k in range(i, j):
                            got: dict[int, int] = {}
                            covered = 0
                            for om, cm in rects[k]:
                                x = om & mask
                                if x:
                                    got[x] = got.get(x, 0) | cm
                                    covered |= x
                            if covered != mask:
                                o = _low(mask & ~covered)
                                rep.error(f"{where}: sends param {p} partial sums [{bounds[k]}, "
                                          f"{bounds[k + 1]}) of rank {o}'s shard, which it does not hold")
                            pending.append((t.dst, p, bounds[k], bounds[k + 1], got, where))
        _receive(ss, dec, pending, rep)
    if ss is not None:
        _check_complete(ss, dec, W, len(layout), rep)
    rep.seconds = time.perf_counter() - t0
    return rep


def _receive(ss: _ScatterState, dec: _Decoder, pending: list, rep: SimReport) -> None:
    """A round's partial sums arrive: each (dst, param, lo, hi, got, where) of ``pending`` adds
    the contributions ``got`` (shard ranks -> contributing ranks) to what ``dst`` holds; a
    contribution it holds already is an error (a gradient counted twice)."""
    for d, p, lo, hi, got, where in pending:
        s = ss.get(d, p)
        i, j = ss.split(s, lo), ss.split(s, hi)
        for k in range(i, j):
            seg = s[1][k]
            for x, cm in got.items():
                for om2, cm2 in seg:
                    if x & om2 and cm & cm2:
                        o, src = _low(x & om2), _low(cm & cm2)
                        S = dec.S[p]
                        rep.error(f"{where}: rank {d}'s partial sums of param {p} elements "
                                  f"[{o * S + s[0][k]}, {o * S + s[0][k + 1]}) (rank {o}'s shard) "
                                  f"would count rank {src}'s gradient twice")
                        cm &= ~cm2
                if not cm:
                    continue
                for r in seg:
                    if r[0] == x:
                        r[1] |= cm
                        break
                else:
                    for r in seg:
                        if r[1] == cm:
                            r[0] |= x
                            break
                    else:
                        seg.append([x, cm])


def _check_complete(ss: _ScatterState, dec: _Decoder, W: int, n_params: int, rep: SimReport) -> None:
    """After the last round: every rank's real shard elements hold every rank's gradient."""
    ALL = (1 << W) - 1
    for d in range(W):
        for p in range(n_params):
            real = dec.real[d][p]
            if not real:
                continue
            bounds, rects = ss.get(d, p)
            bit = 1 << d
            for k in range(len(bounds) - 1):
                if bounds[k] >= real:
                    break
                have = 0
                for om, cm in rects[k]:
                    if om & bit:
                        have |= cm
                if have != ALL:
                    S = dec.S[p]
                    miss = ALL & ~have
                    rep.error(f"rank {d}'s shard of param {p}, elements [{d * S + bounds[k]}, "
                              f"{d * S + bounds[k + 1]}), lacks the gradients of "
                              f"{bin(miss).count('1')} rank(s): {_ranks(miss)}")


def simulate(plan: AllGatherPlan | ReduceScatterPlan, *, check: bool = True) -> SimReport:
    """Run and check either kind of plan."""
    if isinstance(plan, AllGatherPlan):
        return simulate_all_gather(plan, check=check)
    if isinstance(plan, ReduceScatterPlan):
        return simulate_reduce_scatter(plan, check=check)
    raise TypeError(f"plan must be an AllGatherPlan or a ReduceScatterPlan, got {type(plan).__name__}")


# --------------------------------------------------------------------------- comparisons
def fixed_shard_shapes(shapes: Sequence[Sequence[int]], world_size: int, ref_world_size: int
                       ) -> tuple[tuple[int, ...], ...]:
    """The layer stretched along dim 0 so that every rank's shard at ``world_size`` is
    exactly the shard it has at ``ref_world_size``: dim 0 becomes
    ``ceil(dim0 / ref_world_size) * world_size`` (think of it as ``world_size /
    ref_world_size`` copies of the layer in one FSDP unit).  ``rows_per_rank`` and the row
    size are unchanged, so the padded per-rank shard bytes are fixed -- the setting of the
    published claim (fixed per-GPU output size)."""
    out = []
    for s in shapes:
        c = -(-s[0] // ref_world_size)
        out.append((c * world_size, *s[1:]))
    return tuple(out)


def nccl_ring_bytes(layout: ShardLayout, local_size: int, elem_bytes: int) -> dict[str, int]:
    """NCCL's ring all-gather / reduce-scatter of FSDP2's flat buffer (padded shards,
    ``D = W * flat_shard * elem_bytes`` bytes in all).

    ``bus``: every rank sends ``(W-1)/W * D`` over its ring links (NCCL's bus bytes).
    ``per_nic``: with one ring per NIC, rail-aligned (NCCL's usual layout on rail-optimised
    clusters), a node's ring crossings are spread over its ``L`` NICs, so each rank's NIC
    carries ``(W-1)/(W*L) * D``.  NCCL's tree algorithm is all-reduce only; for
    all-gather / reduce-scatter across nodes NCCL uses rings (PAT only at one GPU per node)."""
    W = layout.world_size
    D = W * layout.flat_shard_numel * elem_bytes
    return {"total": D, "bus": (W - 1) * D // W, "per_nic": (W - 1) * D // (W * local_size)}
