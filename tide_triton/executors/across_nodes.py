"""Across nodes: ``reduce_scatter`` and ``all_gather`` for a group of several nodes.

:mod:`tide_triton.collectives` dispatches here (after every rank has agreed on the
arguments) when the group's topology has more than one node.  The contract is the node-local
one, unchanged; the schedules are :class:`~tide_triton.plan.across_nodes.AllGatherPlan` and
:class:`~tide_triton.plan.across_nodes.ReduceScatterPlan` (checked by :mod:`tide_triton.plan.check`).

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

The inter-node hop
    Every byte between nodes goes through a transport of :mod:`tide_triton.transport.internode`:
    :class:`~tide_triton.transport.internode.HostInterNode` on the host (``/dev/shm``), on CUDA
    NCCL's one-sided put/signal or its send/recv (``GroupOptions.inter_node``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from . import state
from . import ring
from ..runtime.checks import RS_APART, check_bound
from .work import Streams, Work, prepare_padding_zeros
from ..group.core import Group
from ..plan.heap import CrossNode, ag_block_end
from ..plan.across_nodes import AllGatherPlan, ReduceScatterPlan, _RailRuns
from ..kernels.segments import Binding, SegmentProgram, Span
from ..plan.layout import ShardLayout
from ..plan.schedule import peer_slot
from ..errors import PeerTimeoutError
from ..transport.internode import HostInterNode, NcclInterNode, nccl_hop

@dataclass
class _State:
    net: "HostInterNode | NcclInterNode"
    calls: dict = field(default_factory=lambda: {"reduce_scatter": 0, "all_gather": 0})
    last: dict = field(default_factory=dict)
    """Bytes this rank moved in its last collective, per round label (see :func:`stats`)."""

    close_broken = True
    """:meth:`Group.close` passes a broken group's shorter drain to :meth:`close_extra`."""

    def close_extra(self, drain_timeout_s: float | None = None) -> None:
        """Called by :meth:`Group.close`: destroys the NCCL communicator, if any, once its
        stream drained (``drain_timeout_s``: a broken group's shorter wait; then it aborts)."""
        close = getattr(self.net, "close", None)
        if close is not None:
            close() if drain_timeout_s is None else close(drain_timeout_s=drain_timeout_s)


def _existing_state(g: Group, device_type: str) -> "tuple[object, _State] | tuple[None, None]":
    """The transport and cross-node state of ``device_type``, if a collective made them."""
    t = g.existing_transport(device_type)
    ex = state.existing(g)
    st = ex.across_nodes.get(id(t)) if t is not None and ex is not None else None
    return (t, st) if st is not None else (None, None)


def _state(g: Group, t: object) -> _State:
    """The across-nodes state of transport ``t``, made on first use (closed with the group)."""
    made = state.of(g).across_nodes
    st = made.get(id(t))
    if st is None:
        st = made[id(t)] = _make_state(g, t)
    return st


def _make_state(g: Group, t: object) -> _State:
    o = g.options
    if getattr(t, "device", torch.device("cpu")).type == "cuda":
        side = g.side_stream(t.device)  # the stream the executor runs on (work.Streams)
        rail = g.topology.rail(g.topology.local_rank(g.rank))
        return _State(nccl_hop(t, g.rank, rail, g.exchange, side, inter_node=o.inter_node,
                               nccl_library=o.nccl_library, chunk_bytes=o.chunk_bytes,
                               inflight_chunks=o.inflight_chunks))
    return _State(HostInterNode(t, g.rank, g.world_size, g.local_size, g.flags.n_flags,
                                g.cross_node_layout().net_off, o.chunk_bytes, o.inflight_chunks))


def stats(group: Group, device: object = "cpu") -> dict:
    """This rank's counters of the cross-node path: calls of each collective, and the bytes
    its last collective moved per round label -- ``"ag inter k"`` / ``"rs inter k"``: sent
    to the rail peer in round ``k`` (what :meth:`AllGatherPlan.sent_bytes` and
    :meth:`ReduceScatterPlan.sent_bytes` predict); ``"rs intra"``: gradient bytes pushed to
    node peers; ``"ag intra"``: bytes read from node peers' rails.  ``"inter_node"``: how
    bytes crossed -- ``"put_signal"`` or ``"send_recv"`` (NCCL), ``"host"`` (shared memory)."""
    _, st = _existing_state(group, torch.device(device).type)
    if st is None:
        return {"reduce_scatter": 0, "all_gather": 0, "last": {}}
    return {**st.calls, "last": dict(st.last), "inter_node": st.net.path, "bytes_sent": st.net.bytes_sent,
            "bytes_received": st.net.bytes_received, "chunks_sent": st.net.chunks_sent}


def synchronize_side(g: Group, device: torch.device, timeout_s: float) -> None:
    """Wait for the cross-node executor's side stream (:func:`tide_triton.synchronize`):
    after ``timeout_s`` a ``PeerTimeoutError`` names the peer of a node-local flag wait that
    is still short, else of the oldest NCCL wait that has not passed."""
    t, st = _existing_state(g, device.type)
    if st is None:
        return
    # the executor's side stream is keyed by the tensors' device (with its index): look it up
    # by the device the transport drives, whatever spelling the caller used ("cuda")
    device = getattr(getattr(t, "inner", t), "device", device)
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
    # the work is done: the last call's identity against the rail peers' (Group.check_in_posted)
    g.check_posted(timeout_s)


@lru_cache(maxsize=32)
def _rs_plan(layout: ShardLayout, topo: object, ring_bytes: int, grad_bytes: int, stages: int) -> ReduceScatterPlan:
    return ReduceScatterPlan(layout, topo, ring_bytes=ring_bytes, grad_bytes=grad_bytes, wire_bytes=4, stages=stages)


@lru_cache(maxsize=32)
def _ag_plan(layout: ShardLayout, topo: object, elem_bytes: int, chunk_bytes: int, inflight: int) -> AllGatherPlan:
    return AllGatherPlan(layout, topo, elem_bytes=elem_bytes, chunk_bytes=chunk_bytes, max_inflight=inflight)


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
    runs = tuple(Span(d, off, i, 0, n) for i, (d, off, _, n) in enumerate(pieces))
    prog = SegmentProgram(runs, n_dst=len(dst_ptrs), n_src=len(pieces))
    src_ptrs = tuple(pc[2][c] for c in range(k) for pc in pieces)
    dst_stub = (torch.empty(0, dtype=dst_dtype, device=device),) * len(dst_ptrs)
    src_stub = (torch.empty(0, dtype=src_dtype, device=device),) * len(src_ptrs)
    return Binding(prog, dst_stub, src_stub, k, max_ctas, known_ptrs=(dst_ptrs, src_ptrs))


def _rail_peers(g: Group) -> list[int]:
    """The ranks of this rank's rail: the same local rank on every other node."""
    L, me = g.local_size, g.rank
    return [r for r in range(me % L, g.world_size, L) if r != me]


def _direct_peers(g: Group, cuda: bool) -> list[int]:
    """The ranks whose call identity this rank checks through flag words
    (:meth:`Group.check_in`): its node's ranks, and on the host (whose transport spans every
    node) its rail's ranks."""
    L, me = g.local_size, g.rank
    first = me - me % L
    peers = [r for r in range(first, first + L) if r != me]
    t = None if cuda else g.existing_transport("cpu")
    if t is not None and t.local_size == g.world_size:
        peers += _rail_peers(g)
    return peers


def _posted_peers(g: Group, cuda: bool) -> list[int]:
    """The ranks whose call identity no flag word reaches -- on CUDA the rail peers, whose
    only link is the NCCL hop -- checked through posted identities, one call late
    (:meth:`Group.check_in_posted`), under ``agree="first"``; with ``"always"`` the call's
    agreement compared every rank's already."""
    return _rail_peers(g) if cuda and g.options.agree == "first" else []


def _check_in(g: Group, ident: object, cuda: bool) -> None:
    """This call's identity checked with every rank it exchanges data with, before any of
    its data moves (the rail peers on CUDA: one call late, see :func:`_posted_peers`)."""
    g.check_in(ident, _direct_peers(g, cuda))
    posted = _posted_peers(g, cuda)
    if posted:
        g.check_in_posted(posted)


def _pieces(runs) -> list[tuple[int, int, int]]:
    return [pc for r in runs for pc in r.pieces()]


# --------------------------------------------------------------------------- reduce-scatter
class _RsWindows:
    """Where a cross-node reduce-scatter's window ``[lo, hi)`` lies for this rank: its stage's
    staging (the node peers' grad slots, then the partial sums P and the receive slot R, fp32)
    and each element's place in it."""

    def __init__(self, g: Group, t: object, reg: CrossNode, plan: ReduceScatterPlan, layout: ShardLayout,
                 gb: int) -> None:
        topo = plan.topology
        self.g, self.t, self.reg, self.plan, self.layout = g, t, reg, plan, layout
        self.L, self.N, self.me = topo.local_size, topo.nodes, g.rank
        self.n, self.l = divmod(self.me, self.L)
        self.win = plan.window_elems
        self.rr = _RailRuns(layout, topo)
        self.mx = g.options.max_ctas
        self.slot_b = self.N * self.win * gb  # one contributor's slot (gb-byte grads): the rail's N shards
        self.p_rel = (self.L - 1) * self.slot_b  # partial sums P, fp32, after the grad slots
        self.r_rel = self.p_rel + self.N * self.win * 4  # receive slot R, fp32
        self.stage_b = self.r_rel + plan.max_message_shards * self.win * 4
        if plan.stages * self.stage_b > plan.ring_bytes:
            raise RuntimeError("internal error: cross-node staging exceeds ring_bytes")
        self.peers = [self.n * self.L + c for c in range(self.L) if c != self.l]

    def where(self, e: int, p: int) -> tuple[int, int, int]:
        """Element ``e`` of parameter ``p``'s padded storage: (node, flat position, a)."""
        r, a = divmod(e, self.layout.padded_shard_numels[p])
        return r // self.L, self.layout.flat_offsets[p] + a, a

    def stage_base(self, w: int) -> int:
        return self.reg.rs_off + (w % self.plan.stages) * self.stage_b

    def pieces(self, lo: int, hi: int, lr: int, nodes) -> list[tuple[int, int, int]]:
        return _pieces(self.rr.window_runs(lo, hi, lr, nodes))


def _rs_pushes_and_sum(ws: _RsWindows, w: int, lo: int, hi: int, gptrs: tuple[int, ...], gdt: torch.dtype,
                       device: torch.device) -> tuple[dict, Binding]:
    """Window ``w``'s node-local step: my gradient slices of node peer d's rail into d's slot for
    me (per peer ``(prepared copies, bytes)``), and the sum of the ``L`` contributions in local
    order 0..L-1 (mine read in place) into P."""
    t, gb, sb, win = ws.t, gdt.itemsize, ws.stage_base(w), ws.win
    pushes = {}
    for d in ws.peers:
        base = t.address(d, sb + peer_slot(ws.l, d % ws.L) * ws.slot_b)
        dsts, srcs, sizes = [], [], []
        for p, e, k in ws.pieces(lo, hi, d % ws.L, range(ws.N)):
            m, x, _ = ws.where(e, p)
            dsts.append(base + (m * win + x - lo) * gb)
            srcs.append(gptrs[p] + e * gb)
            sizes.append(k * gb)
        pushes[d] = (t.prepare_copies(dsts, srcs, sizes), sum(sizes))
    P = t.address(ws.me, sb + ws.p_rel)
    pcs = []
    for p, e, k in ws.pieces(lo, hi, ws.l, range(ws.N)):
        m, x, _ = ws.where(e, p)
        pos = m * win + x - lo
        srcs = tuple(gptrs[p] + e * gb if c == ws.l else
                     t.address(ws.me, sb + peer_slot(c, ws.l) * ws.slot_b) + pos * gb for c in range(ws.L))
        pcs.append((0, pos, srcs, k))
    return pushes, _binding(torch.float32, gdt, (P,), pcs, ws.L, ws.mx, device)


def _rs_rounds(ws: _RsWindows, w: int, lo: int, hi: int, device: torch.device) -> tuple[list, dict]:
    """Window ``w``'s rounds along the rail: per round the partial sums sent for its
    destinations, the receives and the addition of what arrives; and ``fuse`` -- what the last
    round receives for this rank's own window (added in the final kernel), by P position."""
    t, sb, win, n, l = ws.t, ws.stage_base(w), ws.win, ws.n, ws.l
    P, R = t.address(ws.me, sb + ws.p_rel), t.address(ws.me, sb + ws.r_rel)
    rounds = []
    fuse: dict = {}
    for k, rnd in enumerate(ws.plan.node_rounds):
        last_round = k == len(ws.plan.node_rounds) - 1
        sends, recvs, adds = [], [], []
        for sn, dn, dests in rnd:
            if sn == n:
                iov = []
                for m in dests:
                    for p, e, c in ws.pieces(lo, hi, l, [m]):
                        _, x, _ = ws.where(e, p)
                        iov.append((P + (m * win + x - lo) * 4, c * 4))
                sends.append((dn * ws.L + l, iov))
            if dn == n:
                iov = []
                for j, m in enumerate(dests):
                    for p, e, c in ws.pieces(lo, hi, l, [m]):
                        _, x, _ = ws.where(e, p)
                        rpos, ppos = j * win + x - lo, m * win + x - lo
                        iov.append((R + rpos * 4, c * 4))
                        if last_round and m == n:
                            fuse[ppos] = R + rpos * 4
                        else:
                            adds.append((0, ppos, (P + ppos * 4, R + rpos * 4), c))
                recvs.append((sn * ws.L + l, iov))
        rounds.append((sends, recvs, _binding(torch.float32, torch.float32, (P,), adds, 2, ws.mx, device)))
    return rounds, fuse


def _prepare_rs(g: Group, t: object, reg: CrossNode, plan: ReduceScatterPlan, layout: ShardLayout,
                gptrs: tuple[int, ...], shard_ptrs: tuple[int, ...], gdt: torch.dtype, sdt: torch.dtype,
                device: torch.device) -> list:
    """Per window: node-local pushes, the node-local reduction, each round's messages and
    addition, and the final reduction into the shards -- everything that depends only on
    addresses (cached by the caller)."""
    ws = _RsWindows(g, t, reg, plan, layout, gdt.itemsize)
    windows = []
    for w, (lo, hi) in enumerate(plan.windows):
        pushes, local = _rs_pushes_and_sum(ws, w, lo, hi, gptrs, gdt, device)
        rounds, fuse = _rs_rounds(ws, w, lo, hi, device)
        # my window's full sums into my shards: held + received (the last round), scaled
        P = t.address(ws.me, ws.stage_base(w) + ws.p_rel)
        fin = []
        for p, e, k in ws.pieces(lo, hi, ws.l, [ws.n]):
            _, x, a = ws.where(e, p)
            ppos = ws.n * ws.win + x - lo
            fin.append((p, a, (P + ppos * 4, fuse[ppos]) if fuse else (P + ppos * 4,), k))
        final = _binding(sdt, torch.float32, shard_ptrs, fin, 2 if fuse else 1, ws.mx, device)
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
    plan = _rs_plan(layout, topo, ring_bytes, gdt.itemsize, g.options.stages)
    reg = g.cross_node_layout()
    t.ensure_heap(reg.ag_off)
    if staging is not None:
        reg = dataclasses.replace(reg, rs_off=staging.offset)
    st = _state(g, t)
    gptrs = tuple(map(torch.Tensor.data_ptr, grads_l))
    shard_ptrs = tuple(map(torch.Tensor.data_ptr, shards_l))
    snumels = tuple(map(torch.Tensor.numel, shards_l))
    key = ("hier rs", layout, gdt, sdt, gptrs, shard_ptrs, snumels, reg.rs_off, ring_bytes, g.options.stages)
    prep = g.cached(key)
    if prep is None:  # with the zero-fill of padded shards' padding (used without accumulate)
        check_bound("grads", grads_l, "shards", shards_l, apart=RS_APART)
        prep = g.cache(key, (_prepare_rs(g, t, reg, plan, layout, gptrs, shard_ptrs, gdt, sdt, device),
                             prepare_padding_zeros(g, t, shard_ptrs, snumels, layout.shard_numels(me),
                                                   sdt.itemsize, device)))
    prep, padding = prep
    # copy graphs captured before any flag wait (CopyGraphs.warm_replays)
    t.warm_replays([padding[0] if padding else None] + [c for pushes, *_ in prep for c, _n in pushes.values()])
    order = Streams(g, t, device, stream, async_op, whole_on_side=True)
    t = order.t
    with order.kernels():
        if not accumulate and padding is not None:  # padding rows of padded shards become zero
            t.copy_prepared(padding[0])
        fm, timeout, S = g.flags, g.options.timeout_s, plan.stages
        peers = [n * L + c for c in range(L) if c != me % L]
        net = st.net
        last = {"rs intra": 0, **{f"rs inter {k}": 0 for k in range(len(plan.node_rounds))}}
        flags = ring.Counters(g, staging=staging)
        _check_in(g, t, order.cuda)  # this call's identity, before any of its data moves
        flags.begin_staging(t, peers)  # nobody writes into a node peer's region before it vacated it
        for w, (pushes, local, rounds, final) in enumerate(prep):
            s, v = w % S, flags.value(w)
            if peers:
                flags.wait_free(t, s, peers, f"rank {{peer}} to free cross-node reduce-scatter slot (stage {s})")
                for d in peers:
                    copies, nbytes = pushes[d]
                    t.copy_prepared(copies)
                    last["rs intra"] += nbytes
                    t.signal(d, fm.rs_ready(s, me), v)
                    flags.pushed_to(d, s, v)
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
        flags.rounds_done(len(prep), order.compute)
        st.calls["reduce_scatter"] += 1
        st.last = last
    return order.finish()


# --------------------------------------------------------------------------- all-gather
@dataclass
class _PreparedAG:
    own: object          # my shard into my params: prepared copies, or the cast's Binding
    pads: object         # zeros into my missing rows (prepared copies)
    rounds: list         # per round along the rail: (sends, recvs) messages
    publish: object      # my rail into my heap block (prepared copies)
    pickups: list        # per node peer r: (r, prepared copies from r's block, bytes)


def _prepare_ag(g: Group, t: object, reg: CrossNode, plan: AllGatherPlan, layout: ShardLayout,
                pptrs: tuple[int, ...], sptrs: tuple[int, ...], have: tuple[int, ...], zero: int,
                pdt: torch.dtype, sdt: torch.dtype, device: torch.device) -> _PreparedAG:
    """Every copy list, message and binding of the cross-node all-gather that depends only on
    addresses (cached by the caller)."""
    topo = plan.topology
    L, N, me = topo.local_size, topo.nodes, g.rank
    n, l = divmod(me, L)
    es = pdt.itemsize
    S, offs, flat = layout.padded_shard_numels, layout.flat_offsets, layout.flat_shard_numel
    real = layout.shard_numels(me)
    if pdt == sdt:
        own = t.prepare_copies([pptrs[p] + me * S[p] * es for p in range(len(layout))], list(sptrs),
                               [k * es for k in have])
    else:
        own = _binding(pdt, sdt, pptrs, [(p, me * S[p], (x,), k) for p, (x, k) in enumerate(zip(sptrs, have)) if k],
                       1, g.options.max_ctas, device)
    pads = [(p, k, r - k) for p, (k, r) in enumerate(zip(have, real)) if r > k]
    pad_copies = t.prepare_copies([pptrs[p] + (me * S[p] + k) * es for p, k, _ in pads], [zero] * len(pads),
                                  [m * es for _, _, m in pads])
    rr = _RailRuns(layout, topo)
    rounds = []
    for rnd in plan.node_rounds:
        sends, recvs = [], []
        for sn, dn, nodes in rnd:
            if sn == n or dn == n:
                iov = [(pptrs[p] + e * es, c * es) for p, e, c in _pieces(rr.all_runs(l, nodes))]
                if sn == n:
                    sends.append((dn * L + l, iov))
                if dn == n:
                    recvs.append((sn * L + l, iov))
        rounds.append((sends, recvs))

    def rail_copies(lr: int, block: int, into_params: bool) -> tuple[object, int]:
        dsts, srcs, sizes = [], [], []
        for m in range(N):
            r = m * L + lr
            for p, k in enumerate(layout.shard_numels(r)):
                if k:
                    a, b = pptrs[p] + r * S[p] * es, block + (m * flat + offs[p]) * es
                    dsts.append(a if into_params else b)
                    srcs.append(b if into_params else a)
                    sizes.append(k * es)
        return t.prepare_copies(dsts, srcs, sizes), sum(sizes)

    peers = [n * L + c for c in range(L) if c != l]
    publish = rail_copies(l, t.address(me, reg.ag_off), False)[0] if L > 1 else None
    pickups = [(r, *rail_copies(r % L, t.address(r, reg.ag_off), True)) for r in peers]
    return _PreparedAG(own, pad_copies, rounds, publish, pickups)


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
    es = pdt.itemsize
    reg = g.cross_node_layout()
    t.ensure_heap(ag_block_end(reg.ag_off, N * layout.flat_shard_numel * es))
    st = _state(g, t)
    net = st.net
    fm, timeout = g.flags, g.options.timeout_s
    pptrs = tuple(map(torch.Tensor.data_ptr, params_l))
    sptrs = tuple(map(torch.Tensor.data_ptr, shards_l))
    have = tuple(min(x.numel(), k) for x, k in zip(shards_l, layout.shard_numels(me)))
    missing = max((r - k for k, r in zip(have, layout.shard_numels(me))), default=0)
    zero = g.zeros(device, missing * es).data_ptr() if missing else 0
    plan = _ag_plan(layout, topo, es, g.options.chunk_bytes, g.options.inflight_chunks)
    key = ("hier ag", layout, pdt, sdt, pptrs, sptrs, have, zero, reg.ag_off, g.options.chunk_bytes,
           g.options.inflight_chunks)
    prep = g.cached(key)
    if prep is None:
        check_bound("shards", shards_l, "params", params_l)
        prep = g.cache(key, _prepare_ag(g, t, reg, plan, layout, pptrs, sptrs, have, zero, pdt, sdt, device))
    t.warm_replays([prep.own if pdt == sdt else None, prep.pads, prep.publish,
                    *(copies for _r, copies, _n in prep.pickups)])  # graphs before any flag wait
    last = {**{f"ag inter {k}": 0 for k in range(len(plan.node_rounds))}, "ag intra": 0}
    order = Streams(g, t, device, stream, async_op, whole_on_side=True)
    t = order.t
    with order.kernels():
        _check_in(g, t, order.cuda)  # this call's identity, before any of its data moves
        # 1. my shard into my params (cast on SMs when the dtypes differ); missing rows are zero
        if pdt == sdt:
            t.copy_prepared(prep.own)
        else:
            prep.own.launch(check_addresses=False)
        t.copy_prepared(prep.pads)
        # 2. rounds along my rail, params to params
        for k, (sends, recvs) in enumerate(prep.rounds):
            before = net.bytes_sent
            net.sendrecv(sends, recvs, timeout_s=timeout, what=f"all-gather round {k}")
            last[f"ag inter {k}"] = net.bytes_sent - before
        # 3. node-local pickup of the peers' rails
        if L > 1:
            peers = [r for r, _, _ in prep.pickups]
            e = ring.Counters(g).next_epoch()
            if e > 1:  # my rail block is free once my node peers finished the previous epoch
                t.wait_all([fm.ag_done(r) for r in peers], [e - 1] * len(peers), peers=peers, timeout_s=timeout,
                           what="rank {peer} to finish reading my all-gather rail")
            t.copy_prepared(prep.publish)
            t.signal_all(peers, [fm.ag_ready(me)] * len(peers), [e] * len(peers))
            for r, copies, nbytes in prep.pickups:
                t.wait(fm.ag_ready(r), e, peer=r, timeout_s=timeout, what=f"rank {r}'s all-gather rail")
                t.copy_prepared(copies)
                last["ag intra"] += nbytes
            t.signal_all(peers, [fm.ag_done(me)] * len(peers), [e] * len(peers))
        st.calls["all_gather"] += 1
        st.last = last
    return order.finish()
