"""The cross-node path (declared nodes) when a rank fails, is late, or calls something else.

* A rank whose cross-node call fails publishes its abort; its rail peers waiting in the host
  inter-node hop (``HostInterNode.sendrecv``) must raise it within a poll, as every other host
  wait does, not after the group's whole ``timeout_s``.
* ``tide_triton.synchronize(device="cuda")`` (a device without an index) on a group across
  nodes waits for the cross-node executor's side stream -- the stream the executor ran on,
  not one looked up (and created) under another spelling of the device.
* ``nccl_hop`` releases the communicator it made when the collective set-up fails in an
  exchange (a peer that aborted or never came): nothing is left for the process's life.
* A host hop whose send waits for a wire slot names the rank that has not read the slot's
  chunk (maybe an earlier round's peer), not the peer of the send it was trying.
* The public node-level schedules refuse a bad node count, naming it.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

try:
    from _dist import run_threads
    from test_hier_host import _CHUNK, _int, _ring_bytes
except ImportError:  # pragma: no cover
    from tests._dist import run_threads
    from tests.test_hier_host import _CHUNK, _int, _ring_bytes

from tide_triton.plan.layout import ShardLayout
from tide_triton.errors import PeerTimeoutError


# ----------------------------------------------------------------------- aborts in the hop
@pytest.mark.parametrize("queue", ["sync", "async"])
def test_a_rail_peers_abort_ends_the_host_hop_wait_at_once(monkeypatch, queue: str) -> None:
    """2 nodes x 1 rank: rank 1 fails inside its first inter-node exchange (after the call's
    check-in, so it publishes an abort); rank 0, waiting in the hop for rank 1's partial sums,
    raises ``PeerAbortedError`` naming rank 1 at once -- not after polling the wire until its
    own deadline (``timeout_s``).  With the host copy queue behind
    the caller (``async``) the check-in put the call's abort watch on the executor's
    stream-bound wrapper, where no host wait reads it: the same, through another door."""
    import tide_triton as tt
    from tide_triton.errors import PeerAbortedError
    from tide_triton.transport.internode import HostInterNode

    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", queue)
    W, L, timeout = 2, 1, 12.0
    real = HostInterNode.sendrecv

    def failing(self, sends, recvs, **kw):
        if self.rank == 1:
            raise RuntimeError("injected failure of rank 1's inter-node hop")
        return real(self, sends, recvs, **kw)

    monkeypatch.setattr(HostInterNode, "sendrecv", failing)
    groups = tt.local_groups(W, local_size=L, timeout_s=timeout, ring_bytes=max(256, _ring_bytes(W, L)),
                             chunk_bytes=_CHUNK)
    shapes = [(W * 4 + 1, 3)]
    layout = ShardLayout(shapes, W)
    gen = torch.Generator().manual_seed(3)
    grads = [[_int(s, gen) for s in shapes] for _ in range(W)]

    def body(r: int) -> tuple:
        shards = [torch.zeros(s) for s in layout.shard_shapes(r)]
        t0 = time.monotonic()
        try:
            tt.reduce_scatter(grads[r], shards, group=groups[r], op="sum")
        except Exception as e:  # noqa: BLE001 -- the test looks at it
            return e, time.monotonic() - t0
        return None, time.monotonic() - t0

    try:
        out = run_threads(body, W, timeout=3 * timeout)
    finally:
        for g in groups:
            g.close()
    err1, _ = out[1]
    assert isinstance(err1, RuntimeError) and "injected failure" in str(err1), err1
    err0, took = out[0]
    assert isinstance(err0, PeerAbortedError), repr(err0)
    assert err0.rank == 1 and "injected failure" in str(err0), str(err0)
    assert took < timeout / 2, f"rank 0 waited {took:.1f} s for a peer that had aborted (timeout_s={timeout})"


# ----------------------------------------------------------------------- synchronize's side stream
def test_synchronize_side_waits_the_executors_stream_whatever_the_device_spelling() -> None:
    """The executor runs on ``g.side_stream(tensors' device)`` (``cuda:0``); ``synchronize``
    hands ``synchronize_side`` the device as the caller spelled it.  ``"cuda"`` (no index)
    must not look up another side stream -- on a GPU ``own_streams.take`` fails on its missing
    index with a bare ``TypeError``; with an index-free key it would wait for an idle new
    stream while an ``async_op`` collective still ran on the real one."""
    from tide_triton.executors.state import ExecState
    from tide_triton.executors.across_nodes import _State, synchronize_side

    class _T:  # the node's transport as the group holds it (GlobalRanks over a CUDA transport)
        def __init__(self) -> None:
            self.inner = SimpleNamespace(device=torch.device("cuda", 0))
            self.streams: list = []

        def synchronize(self, *, timeout_s, stream):
            self.streams.append(stream)

    made: list = []

    def side_stream(device: torch.device) -> tuple:  # as Group.side_stream + own_streams.take key it
        made.append(device)
        return ("side", device.type, int(device.index))

    t = _T()
    state = ExecState(0, across_nodes={id(t): _State(SimpleNamespace(stuck=lambda: None))})
    g = SimpleNamespace(existing_transport={"cuda": t}.get, executor_state=state,
                        side_stream=side_stream, check_posted=lambda timeout_s=None: None)
    for spelled in (torch.device("cuda", 0), torch.device("cuda")):
        synchronize_side(g, spelled, 1.0)
    assert t.streams == [("side", "cuda", 0)] * 2, t.streams
    assert made == [torch.device("cuda", 0)] * 2


# ----------------------------------------------------------------------- nccl_hop's failure path
class _Comm:
    def __init__(self, lib, members, rank, exchange, *, device_index) -> None:
        self.members, self.index = tuple(members), tuple(members).index(rank)
        self.closed = self.aborted = False
        self.allocs: list = []
        exchange(None)  # the unique id's exchange (collective, as the real one)

    def mem_alloc(self, nbytes: int) -> int:
        self.allocs.append(nbytes)
        return 0x7000_0000

    def register_window(self, addr: int, nbytes: int) -> str:
        return "WIN"

    def signal(self, peer: int, stream: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("failing_exchange", [2, 3], ids=["requests", "registration"])
def test_nccl_hop_releases_its_communicator_when_an_exchange_fails(monkeypatch, failing_exchange: int) -> None:
    """2 nodes x 1 rank, ``inter_node="put_signal"``: the set-up's exchange number
    ``failing_exchange`` (2: the requests after the window memory; 3: the registrations)
    raises on every rank, as a peer's published abort or a missing peer makes it.  Every
    rank's communicator (and the window memory it holds) must be released, not leaked for
    the process's life: the hop was never handed to the group, whose close cannot reach it."""
    from tide_triton.transport import internode as inode
    from tide_triton.transport import nccl

    W = 2
    comms: dict[int, _Comm] = {}
    barrier = threading.Barrier(W, timeout=5)
    slots: list = [None] * W
    counts = [0] * W
    here = threading.local()

    def exchange(rank: int, obj: object) -> list:
        counts[rank] += 1
        if counts[rank] == failing_exchange:
            raise PeerTimeoutError(1 - rank, "the hop's set-up exchange", 1.0)
        slots[rank] = obj
        barrier.wait()
        got = list(slots)
        barrier.wait()
        return got

    def make_comm(lib, members, rank, ex, *, device_index):
        comms[rank] = c = _Comm(lib, members, rank, ex, device_index=device_index)
        return c

    lib = SimpleNamespace(version=(2, 32, 0), path="/fake/libnccl.so.2", features=SimpleNamespace(rma_landing=True))
    monkeypatch.setattr(nccl, "load", lambda path: lib)
    monkeypatch.setattr(nccl, "NcclComm", make_comm)
    t = SimpleNamespace(device=SimpleNamespace(type="cuda", index=0))

    def one(rank: int) -> object:
        here.rank = rank
        try:
            return inode.nccl_hop(t, rank, (0, 1), lambda obj: exchange(rank, obj), SimpleNamespace(cuda_stream=1),
                                  inter_node="put_signal", nccl_library=None, chunk_bytes=1 << 20,
                                  inflight_chunks=2)
        except Exception as e:  # noqa: BLE001 -- the test looks at it
            return e

    out = run_threads(one, W, timeout=10)
    for r in range(W):
        assert isinstance(out[r], PeerTimeoutError), out[r]
        c = comms[r]
        assert c.closed or c.aborted, f"rank {r}: the communicator of a failed set-up is left open"


# ----------------------------------------------------------------------- schedules' inputs
@pytest.mark.parametrize("bad, exc, msg", [(0, ValueError, "nodes must be >= 1, got 0"),
                                           (-3, ValueError, "nodes must be >= 1, got -3"),
                                           (2.0, TypeError, "nodes must be an int, got float"),
                                           (True, TypeError, "nodes must be an int, got bool")])
def test_node_rounds_refuse_a_bad_node_count(bad: object, exc: type, msg: str) -> None:
    """The public node-level schedules named no argument on a bad node count: 0 and negative
    counts returned rounds without transfers (a schedule that moves nothing), a float failed
    deep inside with ``unsupported operand type(s) for &``."""
    from tide_triton.plan.across_nodes import all_gather_node_rounds, reduce_scatter_node_rounds

    for fn in (all_gather_node_rounds, reduce_scatter_node_rounds):
        with pytest.raises(exc, match=msg):
            fn(bad)
    assert all_gather_node_rounds(1) == () == reduce_scatter_node_rounds(1)


# ----------------------------------------------------------------------- who a host hop waits for
def _host_transports(W: int, n_flags: int, heap_bytes: int) -> list:
    """``W`` host transports of one process (every heap mapped by every one), made by threads
    over a barrier all-gather; used single-threaded afterwards."""
    from tide_triton.transport.host import HostTransport

    barrier = threading.Barrier(W, timeout=10)
    slots: list = [None] * W

    def exchange(r: int, obj: object) -> list:
        slots[r] = obj
        barrier.wait()
        got = list(slots)
        barrier.wait()
        return got

    def make(r: int):
        t = HostTransport(r, W, lambda obj: exchange(r, obj), n_flags=n_flags)
        t.ensure_heap(heap_bytes)
        return t

    return run_threads(make, W, timeout=30)


def test_a_host_hop_blocked_on_its_wire_slot_names_the_rank_holding_it() -> None:
    """Rank 0 sends one chunk to rank 2, which never reads it (dead or stuck), then sends to
    rank 1: its only wire slot still holds rank 2's chunk.  The timeout must name rank 2 --
    the rank whose read it waits for -- not rank 1, which is fine (the hop named the peer of
    the send it was trying, pointing the user away from the rank at fault)."""
    from tide_triton.transport.internode import HostInterNode

    W, chunk, n_flags = 3, 64, 16
    region = 4096
    ts = _host_transports(W, n_flags, region + HostInterNode.region_bytes(chunk, 1))
    try:
        nets = [HostInterNode(t, r, W, 1, 0, region, chunk, 1) for r, t in enumerate(ts)]
        src = torch.arange(16, dtype=torch.float32)  # 64 bytes: one chunk
        nets[0].sendrecv([(2, [(src.data_ptr(), 64)])], [], timeout_s=1.0)  # packed, never read
        with pytest.raises(PeerTimeoutError) as e:
            nets[0].sendrecv([(1, [(src.data_ptr(), 64)])], [], timeout_s=0.2, what="all-gather round 1")
        assert e.value.peer == 2, str(e.value)
        assert "all-gather round 1: its read of my chunk in the wire slot my next send needs" in str(e.value)
    finally:
        for t in ts:
            t.close()


def test_cross_node_calls_that_differ_raise_at_the_next_call_where_no_flag_reaches_the_rail(monkeypatch):
    """On CUDA flag words reach node peers only; the rail peers' only link is the NCCL hop, and
    under ``agree="first"`` (no exchange for signatures agreed before) two nodes making
    different collectives as the same call would pair them -- wrong sums, no error.  Each call
    posts its identity and
    checks the rail peers' of the previous such call: both ranks raise at the next call.
    Here on the host, with its rail flag check taken away as on CUDA (two nodes of one rank)."""
    import tide_triton as tt
    from tide_triton.executors import across_nodes as hc
    from tide_triton.errors import ArgumentMismatchError

    monkeypatch.setattr(hc, "_direct_peers", lambda g, cuda: [])  # local_size 1: no node peers
    monkeypatch.setattr(hc, "_posted_peers", lambda g, cuda: hc._rail_peers(g) if g.options.agree == "first" else [])
    W = 2
    a, b = [(8, 4)], [(4, 8)]  # the same bytes, other shapes: other signatures, the same messages
    groups = tt.local_groups(W, local_size=1, agree="first", timeout_s=20)

    def rank(r: int) -> list:
        g = groups[r]
        out = []

        def rs(shapes):
            layout = ShardLayout(shapes, W)
            grads = [torch.full(s, float(r + 1), dtype=torch.bfloat16) for s in shapes]
            shards = [torch.zeros(s) for s in layout.shard_shapes(r)]
            tt.reduce_scatter(grads, shards, group=g, op="sum")
            return shards

        rs(a)
        rs(b)  # both signatures agreed: no exchange for them from now on
        mixed = rs(a if r == 0 else b)  # call #3: different collectives across the nodes
        out.append(bool(all((x == 3).all() for x in mixed)))
        try:
            rs(a)
            out.append("no error")
        except ArgumentMismatchError as e:
            out.append(str(e))
        return out

    try:
        got = run_threads(rank, W, timeout=60)
    finally:
        for g in groups:
            g.close()
    for r in range(W):
        assert "made different collectives as call #3" in got[r][1], got
        assert f"rank {1 - r}" in got[r][1], got


@pytest.mark.parametrize("broken", [False, True])
def test_a_broken_group_closes_its_nccl_hop_with_the_short_drain(broken: bool) -> None:
    """``Group.close`` gives a broken group's transports a 3 s drain (their work may wait
    forever on peers), the cross-node hop included -- not its default 30 s."""
    import tide_triton as tt
    from tide_triton.group.core import _BROKEN_DRAIN_S
    from tide_triton.executors import state as exec_state
    from tide_triton.executors.across_nodes import _State

    drains: list = []

    class _Net:
        def close(self, drain_timeout_s: float = 30.0) -> None:
            drains.append(drain_timeout_s)

    g = tt.local_groups(1, timeout_s=10)[0]
    exec_state.of(g).across_nodes[0] = _State(_Net())
    if broken:
        g._break("a test")
    g.close()
    assert drains == [_BROKEN_DRAIN_S if broken else 30.0]


def test_a_group_closes_every_executor_part_when_one_fails_and_raises_the_first_error() -> None:
    """The executors' state closes with the group part by part: a multicast buffer that fails
    to close leaves the across-nodes hop closed all the same, and ``Group.close`` raises it."""
    import tide_triton as tt
    from tide_triton.executors import state as exec_state
    from tide_triton.executors.across_nodes import _State

    closed: list = []

    class _Failing:
        def close_extra(self) -> None:
            raise RuntimeError("buffers refused to close")

    class _Net:
        def close(self) -> None:
            closed.append("net")

    g = tt.local_groups(1, timeout_s=10)[0]
    st = exec_state.of(g)
    st.multicast["cuda"] = _Failing()
    st.across_nodes[0] = _State(_Net())
    st.captured.append(object())
    with pytest.raises(RuntimeError, match="buffers refused to close"):
        g.close()
    assert closed == ["net"] and not st.captured and g.closed
