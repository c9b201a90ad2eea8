"""Across nodes, in what order: pure-Python schedules for the multi-node all-gather and
reduce-scatter (no CUDA imports; :mod:`tide_triton.plan.check` runs and checks them).

Addressing (see :mod:`tide_triton.plan.layout`): rank ``r``'s shard of parameter ``p`` sits at
element ``r * S_p`` of ``p``'s padded unsharded storage, and its real part is
``layout.shard_numels(r)[p]`` elements (trailing ranks hold fewer, or none).  With ``L``
ranks per node, the ranks of one *rail* (local index ``l``) are ``m * L + l`` for node
``m``, so their shards of ``p`` sit at a fixed stride of ``L * S_p`` elements.  A block of
nodes on one rail is therefore ONE strided run per parameter -- :class:`Run` with
``count`` rows of ``numel`` elements, ``stride`` apart (a 2-D copy on copy engines, or
``count`` puts on the network) -- plus at most one shorter run for the rank whose shard is
partly padding.  Only real elements move; padding never travels.

Every schedule is a sequence of :class:`Step` (one round: transfers that proceed
concurrently, each reading only what its sender held before the round), each
:class:`Transfer` a list of chunks, each chunk a tuple of runs.  Runs name elements of the
*unsharded parameter* (or, for reduce-scatter, the gradient and the partial sums indexed
the same way), so received data lands in per-parameter storage directly: no flat buffer,
no copy-out.

* :class:`AllGatherPlan` -- inter-node rounds along rails (recursive doubling; Bruck for
  node counts that are not powers of two), paced in chunks of at most ``chunk_bytes``;
  then one node-local round in which every rank picks up its node peers' rails over the
  copy-engine path.
* :class:`ReduceScatterPlan` -- hierarchical two-phase: node-local reduction onto rails,
  then recursive halving of partial sums along rails (the transpose of Bruck for node
  counts that are not powers of two), window by window so the staging ring is
  ``ring_bytes`` whatever the number of nodes.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Sequence

from .layout import ShardLayout
from .topology import Topology

NodeRound = tuple[tuple[int, int, tuple[int, ...]], ...]
"""One round at node level: ``(src_node, dst_node, nodes)`` triples -- for all-gather the
nodes whose rail shards move, for reduce-scatter the destination nodes whose partial sums
move."""


# --------------------------------------------------------------------------- data
@dataclass(frozen=True, slots=True)
class Run:
    """``count`` contiguous runs of ``numel`` elements of parameter ``param``, the ``i``-th
    starting at element ``start + i * stride`` of the unsharded (padded) storage."""

    param: int
    start: int
    numel: int
    count: int = 1
    stride: int = 0

    @property
    def elems(self) -> int:
        """Elements moved: ``numel * count``."""
        return self.numel * self.count

    def pieces(self) -> Iterator[tuple[int, int, int]]:
        """The contiguous runs ``(param, start, numel)``, one per row."""
        for i in range(self.count):
            yield self.param, self.start + i * self.stride, self.numel


@dataclass(frozen=True, slots=True)
class Transfer:
    """Rank ``src`` sends ``chunks`` to rank ``dst``, one chunk after the other; each chunk
    is gated on its own signal, so at most ``max_inflight`` of them are on the wire."""

    src: int
    dst: int
    chunks: tuple[tuple[Run, ...], ...]

    @property
    def elems(self) -> int:
        return sum(r.elems for c in self.chunks for r in c)


@dataclass(frozen=True)
class Step:
    """One round: ``transfers`` proceed concurrently and read only what their senders held
    before the round."""

    label: str
    """What the round is (``"ag inter 0"``, ``"ag intra"``, ``"rs intra"``, ``"rs inter 2"``);
    the simulator counts bytes per label."""
    link: str
    """``"inter"`` (network, along rails) or ``"intra"`` (node-local: NVLink / copy engines)."""
    elem_bytes: int
    """Bytes per element on this round's wire."""
    transfers: tuple[Transfer, ...]
    window: int = 0
    """Reduce-scatter: the staging window this round belongs to (0 for all-gather)."""


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


# --------------------------------------------------------------------------- node-level rounds
def all_gather_node_rounds(nodes: int) -> tuple[NodeRound, ...]:
    """Who sends which nodes' rail shards to whom, round by round.

    Power of two (``R = log2 nodes`` rounds): recursive doubling -- in round ``k`` node
    ``n`` exchanges with ``n XOR 2^k`` the aligned block of ``2^k`` nodes it holds, so the
    data held doubles each round.  Otherwise: Bruck's all-gather -- in round ``k`` node
    ``n`` sends the first ``min(2^k, nodes - 2^k)`` nodes of the cyclic window
    ``n, n+1, ...`` it holds to node ``n - 2^k``, and receives the window of ``n + 2^k``;
    ``ceil(log2 nodes)`` rounds, and every node still sends exactly ``nodes - 1`` shards
    in total (no extra fix-up round, no node sending twice its share).  Because data lands
    at its own address in per-parameter storage, Bruck's final rotation is not needed."""
    _check_pos("nodes", nodes)
    rounds: list[NodeRound] = []
    if is_power_of_two(nodes):
        for k in range(_log2_ceil(nodes)):
            d = 1 << k
            rounds.append(tuple(
                (n, n ^ d, tuple(range(n & ~(d - 1), (n & ~(d - 1)) + d))) for n in range(nodes)))
    else:
        for k in range(_log2_ceil(nodes)):
            d = 1 << k
            cnt = min(d, nodes - d)
            rounds.append(tuple(
                (n, (n - d) % nodes, tuple((n + i) % nodes for i in range(cnt))) for n in range(nodes)))
    return tuple(rounds)


def reduce_scatter_node_rounds(nodes: int) -> tuple[NodeRound, ...]:
    """Who sends partial sums for which destination nodes to whom, round by round.

    Power of two: recursive halving -- in round ``k`` node ``n`` holds partial sums for
    the aligned block of ``nodes / 2^k`` destinations containing it, and sends the half
    not containing it to ``n XOR nodes / 2^(k+1)`` (distance ``2^(R-1-k)``), keeping and
    adding the other half.  Otherwise: the transpose of Bruck's all-gather -- rounds in
    reverse order (distance ``2^(K-1)`` first), node ``n`` sending to ``n + 2^k`` its
    partial sums for the ``min(2^k, nodes - 2^k)`` destinations ``n + 2^k, ...``; every
    destination's contributions flow up the reversed all-gather tree, so each arrives
    exactly once, in ``ceil(log2 nodes)`` rounds and ``nodes - 1`` shards sent per node."""
    _check_pos("nodes", nodes)
    rounds: list[NodeRound] = []
    if is_power_of_two(nodes):
        for k in range(_log2_ceil(nodes)):
            d = nodes >> (k + 1)
            rounds.append(tuple(
                (n, n ^ d, tuple(range((n ^ d) & ~(d - 1), ((n ^ d) & ~(d - 1)) + d)))
                for n in range(nodes)))
    else:
        for k in reversed(range(_log2_ceil(nodes))):
            d = 1 << k
            cnt = min(d, nodes - d)
            rounds.append(tuple(
                (n, (n + d) % nodes, tuple((n + d + i) % nodes for i in range(cnt)))
                for n in range(nodes)))
    return tuple(rounds)


def _segments(nodes: Sequence[int]) -> list[tuple[int, int]]:
    """``nodes`` as maximal runs of consecutive indices ``[m0, m1)``, in the given order."""
    out: list[tuple[int, int]] = []
    for m in nodes:
        if out and out[-1][1] == m:
            out[-1] = (out[-1][0], m + 1)
        else:
            out.append((m, m + 1))
    return out


# --------------------------------------------------------------------------- runs
class _RailRuns:
    """Runs of the shards of rail ``l``'s ranks on a set of nodes, over a window of each
    padded shard, clipped to the real elements."""

    def __init__(self, layout: ShardLayout, topo: Topology) -> None:
        self.layout, self.L, self.W = layout, topo.local_size, topo.world_size
        self.S = layout.padded_shard_numels
        self.rows = layout.rows_per_rank
        self.rown = layout.row_numels
        self.dim0 = tuple(s[0] for s in layout.shapes)
        self.offs = layout.flat_offsets

    def real(self, rank: int, p: int) -> int:
        return self.layout.shard_numels(rank)[p]

    def param_runs(self, p: int, a: int, b: int, l: int, segs: list[tuple[int, int]]) -> list[Run]:
        """Elements ``[a, b)`` of the shards of ranks ``m*L + l``, ``m`` in ``segs``."""
        out: list[Run] = []
        if b <= a:
            return out
        S, L, c = self.S[p], self.L, self.rows[p]
        need = -(-b // self.rown[p])  # rows a shard needs to hold all of [a, b)
        last_full = (self.dim0[p] - need) // c  # ranks <= last_full hold [a, b) entirely
        o_part = last_full + 1
        part = self.real(o_part, p) if 0 <= o_part < self.W else 0
        m_part = (o_part - l) // L if part > a and (o_part - l) % L == 0 else -1
        full_end = (last_full - l) // L + 1  # nodes below this hold [a, b) on rail l
        for m0, m1 in segs:
            e = min(m1, full_end)
            if e > m0:
                n = e - m0
                out.append(Run(p, (m0 * L + l) * S + a, b - a, n, L * S if n > 1 else 0))
            if m0 <= m_part < m1:
                out.append(Run(p, o_part * S + a, part - a))
        return out

    def window_runs(self, lo: int, hi: int, l: int, nodes: Sequence[int]) -> list[Run]:
        """Flat-shard window ``[lo, hi)`` (every rank's padded shards back to back)."""
        segs = _segments(nodes)
        out: list[Run] = []
        p = max(0, bisect.bisect_right(self.offs, lo) - 1)
        while p < len(self.S) and self.offs[p] < hi:
            a, b = max(lo - self.offs[p], 0), min(hi - self.offs[p], self.S[p])
            out.extend(self.param_runs(p, a, b, l, segs))
            p += 1
        return out

    def all_runs(self, l: int, nodes: Sequence[int]) -> list[Run]:
        segs = _segments(nodes)
        out: list[Run] = []
        for p, S in enumerate(self.S):
            out.extend(self.param_runs(p, 0, S, l, segs))
        return out

    def flat_real(self, rank: int) -> int:
        """Real elements of all of ``rank``'s shards."""
        return sum(self.layout.shard_numels(rank))


def chunk_runs(runs: Sequence[Run], cap: int) -> tuple[tuple[Run, ...], ...]:
    """Cut the stream of ``runs`` (in order) into chunks of at most ``cap`` elements.  Whole
    rows of a strided run stay one strided run; a row cut by a chunk boundary becomes two
    plain runs."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    chunks: list[tuple[Run, ...]] = []
    cur: list[Run] = []
    used = 0
    for r in runs:
        i, off, n = 0, 0, r.numel
        while i < r.count:
            room = cap - used
            if off or n > room:
                take = min(n - off, room)
                cur.append(Run(r.param, r.start + i * r.stride + off, take))
                used += take
                off += take
                if off == n:
                    i, off = i + 1, 0
            else:
                q = min(r.count - i, room // n)
                cur.append(Run(r.param, r.start + i * r.stride, n, q, r.stride if q > 1 else 0))
                used += q * n
                i += q
            if used == cap:
                chunks.append(tuple(cur))
                cur, used = [], 0
    if cur:
        chunks.append(tuple(cur))
    return tuple(chunks)


def _check_pos(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_plan_args(layout: object, topology: object) -> None:
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    if layout.world_size != topology.world_size:
        raise ValueError(
            f"topology.world_size must equal layout.world_size={layout.world_size}, got {topology.world_size}")


# --------------------------------------------------------------------------- all-gather
@dataclass(frozen=True)
class AllGatherPlan:
    """All-gather across nodes: paced recursive doubling along rails, then node-local pickup.

    Inter-node phase (``ceil(log2 nodes)`` rounds, :func:`all_gather_node_rounds`): rail
    ``l`` runs its own all-gather of the shards of its ``nodes`` ranks; after round ``k``
    (power of two) a rank holds the shards of the ranks with its local index on the aligned
    block of ``2^(k+1)`` nodes around its own -- one strided run per parameter -- and in
    round ``k`` it sends that block (``2^k`` shards per parameter) to its partner.  Each
    round is cut into chunks of at most ``chunk_bytes`` (the pacing unit: a chunk is one
    put + signal; ``max_inflight`` of them are outstanding per rank, so the bytes on the
    wire stay under ``inflight_bytes`` whatever the layer or the world size).  Data lands
    in the receiver's per-parameter storage at its final address: no staging.

    Node-local phase (one round, copy engines): every rank now holds its whole rail; it
    reads each node peer's rail (``nodes`` shards per parameter, again one strided run per
    parameter) from that peer's parameter storage, as the node-local all-gather does.

    Every rank ends with every real element of every parameter, each received once:
    ``nodes - 1`` shards over the network and ``(L - 1) * nodes`` over the node."""

    layout: ShardLayout
    topology: Topology
    elem_bytes: int = 2
    """Bytes per parameter element (bf16: 2)."""
    chunk_bytes: int = 4 << 20
    """Largest chunk of a network round, in bytes (rounded down to whole elements)."""
    max_inflight: int = 2
    """Chunks a rank may have on the wire at once (double-buffered pacing)."""

    def __post_init__(self) -> None:
        _check_plan_args(self.layout, self.topology)
        _check_pos("elem_bytes", self.elem_bytes)
        _check_pos("chunk_bytes", self.chunk_bytes)
        _check_pos("max_inflight", self.max_inflight)
        if self.chunk_bytes < self.elem_bytes:
            raise ValueError(
                f"chunk_bytes must hold at least one {self.elem_bytes}-byte element, got {self.chunk_bytes}")

    @property
    def chunk_elems(self) -> int:
        return self.chunk_bytes // self.elem_bytes

    @property
    def inflight_bytes(self) -> int:
        """Cap on one rank's bytes on the wire: ``max_inflight`` chunks."""
        return self.max_inflight * self.chunk_elems * self.elem_bytes

    @property
    def staging_bytes(self) -> int:
        """Receive staging per rank: none -- chunks land in per-parameter storage."""
        return 0

    @property
    def scheme(self) -> str:
        return "recursive doubling" if is_power_of_two(self.topology.nodes) else "Bruck"

    @cached_property
    def node_rounds(self) -> tuple[NodeRound, ...]:
        return all_gather_node_rounds(self.topology.nodes)

    @property
    def rounds(self) -> int:
        """Inter-node rounds plus the node-local round (when ``L > 1``)."""
        return len(self.node_rounds) + (1 if self.topology.local_size > 1 else 0)

    def steps(self) -> Iterator[Step]:
        rr = _RailRuns(self.layout, self.topology)
        L = self.topology.local_size
        for k, rnd in enumerate(self.node_rounds):
            transfers = []
            for l in range(L):
                for sn, dn, nodes in rnd:
                    chunks = chunk_runs(rr.all_runs(l, nodes), self.chunk_elems)
                    if chunks:
                        transfers.append(Transfer(sn * L + l, dn * L + l, chunks))
            yield Step(f"ag inter {k}", "inter", self.elem_bytes, tuple(transfers))
        if L > 1:
            all_nodes = range(self.topology.nodes)
            rail = [rr.all_runs(l, all_nodes) for l in range(L)]
            transfers = [Transfer(n * L + lp, n * L + l, (tuple(rail[lp]),))
                         for n in range(self.topology.nodes) for l in range(L) for lp in range(L)
                         if lp != l and rail[lp]]
            yield Step("ag intra", "intra", self.elem_bytes, tuple(transfers))

    def sent_bytes(self) -> dict[str, list[int]]:
        """Bytes each rank sends per round label, from the node-level rounds and the
        layout alone (no runs expanded): what :func:`tide_triton.plan.check.simulate`
        counts, at any size."""
        rr = _RailRuns(self.layout, self.topology)
        L, W, N = self.topology.local_size, self.topology.world_size, self.topology.nodes
        out: dict[str, list[int]] = {}
        for k, rnd in enumerate(self.node_rounds):
            row = out[f"ag inter {k}"] = [0] * W
            for l in range(L):
                for sn, _, nodes in rnd:
                    row[sn * L + l] += sum(rr.flat_real(m * L + l) for m in nodes) * self.elem_bytes
        if L > 1:
            row = out["ag intra"] = [0] * W
            for lp in range(L):
                rail = sum(rr.flat_real(m * L + lp) for m in range(N)) * self.elem_bytes
                for n in range(N):
                    row[n * L + lp] += (L - 1) * rail
        return out

    def chunk_counts(self) -> list[int]:
        """Chunks each rank sends over the network (all rounds), without expanding runs:
        a transfer of ``e`` elements is ``ceil(e / chunk_elems)`` chunks."""
        rr = _RailRuns(self.layout, self.topology)
        L, W = self.topology.local_size, self.topology.world_size
        out = [0] * W
        for rnd in self.node_rounds:
            for l in range(L):
                for sn, _, nodes in rnd:
                    e = sum(rr.flat_real(m * L + l) for m in nodes)
                    out[sn * L + l] += -(-e // self.chunk_elems)
        return out


# --------------------------------------------------------------------------- reduce-scatter
@dataclass(frozen=True)
class ReduceScatterPlan:
    """Reduce-scatter across nodes: node-local reduction onto rails, then recursive halving
    of partial sums along rails -- window by window, so staging does not grow with nodes.

    The flat shard coordinate (every rank's padded shards back to back, the same on every
    rank) is cut into windows of ``window_elems``.  For each window:

    * phase 1, node-local (``"rs intra"``): rank ``(n, l)`` receives from each node peer
      ``(n, l')`` its gradient slices of the window for the shards of rail ``l`` (ranks
      ``m * L + l``, all ``m``: one strided run per parameter), in ``grad_bytes``, and adds
      them (fp32, fixed order) to its own: it now holds node ``n``'s partial sums of the
      window for all ``nodes`` shards of its rail;
    * phase 2, along the rail (``"rs inter k"``, :func:`reduce_scatter_node_rounds`):
      recursive halving -- round ``k`` sends half of the destinations still held (partial
      sums in ``wire_bytes``: fp32, or bf16 to halve the network bytes) to the node at
      distance ``2^(R-1-k)`` and adds the half received; Bruck's transpose for node counts
      that are not powers of two.  Afterwards rank ``(n, l)`` holds the full sum of the
      window of its own shard, added into its fp32 shard (outside the staging).

    Staging per rank for one window: ``(L-1) * nodes`` gradient slots (phase 1), ``nodes``
    fp32 partial sums, and one receive slot (plus a pack slot when the wire is narrower than
    fp32) of the largest cross-node message; ``stages`` windows in flight.  The window
    shrinks as nodes grow (like the node-local ring's chunk), so the ring is ``ring_bytes``
    whatever the world size: more nodes, more and smaller windows, the same staging."""

    layout: ShardLayout
    topology: Topology
    ring_bytes: int = 64 << 20
    """Staging per rank, whatever the number of nodes."""
    grad_bytes: int = 2
    """Bytes per gradient element (bf16: 2): the node-local wire."""
    wire_bytes: int = 4
    """Bytes per partial-sum element on the network: 4 (fp32) or 2 (bf16)."""
    stages: int = 2
    """Windows in flight (phase 1 of window j+1 overlaps phase 2 of window j)."""
    acc_bytes: int = field(default=4, init=False)
    """Partial sums accumulate in fp32."""

    _ALIGN = 8  # window elements: a multiple of 8 keeps every slot 16-byte aligned

    def __post_init__(self) -> None:
        _check_plan_args(self.layout, self.topology)
        _check_pos("ring_bytes", self.ring_bytes)
        _check_pos("grad_bytes", self.grad_bytes)
        _check_pos("stages", self.stages)
        if self.wire_bytes not in (2, 4) or isinstance(self.wire_bytes, bool):
            raise ValueError(f"wire_bytes must be 4 (fp32) or 2 (bf16), got {self.wire_bytes!r}")
        if self.window_elems < self._ALIGN:
            raise ValueError(
                f"ring_bytes={self.ring_bytes} is too small: {self.stages} stages of a "
                f"{self.topology} topology need {self.stages * self._ALIGN * self.bytes_per_window_elem} "
                f"bytes at least")

    @property
    def scheme(self) -> str:
        return "recursive halving" if is_power_of_two(self.topology.nodes) else "Bruck transpose"

    @cached_property
    def node_rounds(self) -> tuple[NodeRound, ...]:
        return reduce_scatter_node_rounds(self.topology.nodes)

    @cached_property
    def max_message_shards(self) -> int:
        """Most destination shards in one cross-node message (``nodes / 2`` for powers of two)."""
        return max((len(d) for rnd in self.node_rounds for _, _, d in rnd), default=0)

    @property
    def bytes_per_window_elem(self) -> int:
        """Staging bytes of one window per window element (see the class docstring)."""
        L, N = self.topology.local_size, self.topology.nodes
        slots = 1 if self.wire_bytes == self.acc_bytes else 2
        return ((L - 1) * N * self.grad_bytes + N * self.acc_bytes
                + slots * self.max_message_shards * self.wire_bytes)

    @cached_property
    def window_elems(self) -> int:
        w = self.ring_bytes // (self.stages * self.bytes_per_window_elem)
        return w // self._ALIGN * self._ALIGN

    @cached_property
    def windows(self) -> tuple[tuple[int, int], ...]:
        flat, w = self.layout.flat_shard_numel, self.window_elems
        return tuple((lo, min(lo + w, flat)) for lo in range(0, flat, w))

    @property
    def staging_bytes(self) -> int:
        """Receive and partial-sum staging per rank: ``stages`` windows (<= ``ring_bytes``)."""
        return self.stages * self.window_elems * self.bytes_per_window_elem

    @property
    def rounds(self) -> int:
        """Rounds per window: the node-local one (when ``L > 1``) and the cross-node ones."""
        return len(self.node_rounds) + (1 if self.topology.local_size > 1 else 0)

    def steps(self) -> Iterator[Step]:
        rr = _RailRuns(self.layout, self.topology)
        L, N = self.topology.local_size, self.topology.nodes
        all_nodes = range(N)
        for w, (lo, hi) in enumerate(self.windows):
            if L > 1:
                rail = [rr.window_runs(lo, hi, l, all_nodes) for l in range(L)]
                transfers = tuple(Transfer(n * L + lp, n * L + l, (tuple(rail[l]),))
                                  for n in range(N) for l in range(L) for lp in range(L)
                                  if lp != l and rail[l])
                yield Step("rs intra", "intra", self.grad_bytes, transfers, w)
            for k, rnd in enumerate(self.node_rounds):
                transfers_l = []
                for l in range(L):
                    for sn, dn, dests in rnd:
                        runs = rr.window_runs(lo, hi, l, dests)
                        if runs:
                            transfers_l.append(Transfer(sn * L + l, dn * L + l, (tuple(runs),)))
                yield Step(f"rs inter {k}", "inter", self.wire_bytes, tuple(transfers_l), w)

    def sent_bytes(self) -> dict[str, list[int]]:
        """Bytes each rank sends per round label over all windows, from the node-level
        rounds and the layout alone (windows partition the flat shard, so a transfer of
        a set of shards moves all their real elements once over the windows)."""
        rr = _RailRuns(self.layout, self.topology)
        L, W, N = self.topology.local_size, self.topology.world_size, self.topology.nodes
        out: dict[str, list[int]] = {}
        if L > 1:
            row = out["rs intra"] = [0] * W
            rail = [sum(rr.flat_real(m * L + l) for m in range(N)) for l in range(L)]
            for n in range(N):
                for lp in range(L):
                    row[n * L + lp] += (sum(rail) - rail[lp]) * self.grad_bytes
        for k, rnd in enumerate(self.node_rounds):
            row = out[f"rs inter {k}"] = [0] * W
            for l in range(L):
                for sn, _, dests in rnd:
                    row[sn * L + l] += sum(rr.flat_real(m * L + l) for m in dests) * self.wire_bytes
        return out
