"""The pieces of the cross-node GPU path that run without a GPU: a node-local transport
addressed with global ranks (GlobalRanks, over a real one-rank host transport), and how
NcclInterNode turns messages into NCCL sends and receives (against a recording stand-in for
the communicator; the real one runs in tests/test_hier_cuda.py on a GPU)."""
from __future__ import annotations

import pytest
import torch

from tide_triton.errors import PeerTimeoutError
from tide_triton.transport.host import HostTransport
from tide_triton.transport.node_view import GlobalRanks


def test_global_ranks_translate_and_refuse_other_nodes() -> None:
    inner = HostTransport(0, 1, lambda obj: [obj], n_flags=8)
    try:
        t = GlobalRanks(inner, 6)  # global rank 6 is this node's only rank
        t.ensure_heap(4096)
        assert t.rank == 6 and t.local_size == 1 and t.heap_nbytes() == inner.heap_nbytes() > 0
        assert t.address(6, 64) == inner.address(0, 64)
        for bad in (5, 7, 0, True, "6"):
            with pytest.raises(ValueError, match=r"is not a rank of this node \(ranks 6..6\)"):
                t.address(bad, 0)
        with pytest.raises(ValueError, match="rank=7 is not a rank of this node"):
            t.signal(7, 0, 1)
        with pytest.raises(ValueError, match="peer=3 is not a rank of this node"):
            t.wait_all([0], [1], peers=[3], timeout_s=0.1)
        t.signal(6, 2, 5)
        t.signal_all([6], [3], [7])
        assert (inner.read_flag(2), inner.read_flag(3)) == (5, 7)
        t.wait(2, 5, peer=6, timeout_s=1.0)  # already there
        # a timeout names the global rank, in the error and in the message
        with pytest.raises(PeerTimeoutError, match="waiting for rank 6 .rank 6's contribution") as e:
            t.wait_all([4], [1], peers=[6], timeout_s=0.05, what="rank {peer}'s contribution")
        assert e.value.peer == 6
        x = torch.arange(4, dtype=torch.int32)
        t.copy([t.address(6, 128)], [x.data_ptr()], [16])
        assert torch.equal(t.heap_tensor(6, 128, 4, torch.int32), x)
    finally:
        inner.close()


class _RecordingComm:
    def __init__(self) -> None:
        self.calls: list = []

    def send_recv(self, sends, recvs, stream):
        self.calls.append((list(sends), list(recvs), stream))

    def close(self) -> None:
        self.calls.append("closed")


class _Stream:
    """Busy for its first two queries (work still queued), idle after."""

    cuda_stream = 1234
    queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries > 2


def _net(rank: int, rail: tuple[int, ...], chunk: int):
    from tide_triton.transport.internode import NcclInterNode

    net = object.__new__(NcclInterNode)  # no library, no GPU: only the message logic
    net.rank, net.rail, net.chunk_bytes, net.stream = rank, rail, chunk, _Stream()
    net.comm = _RecordingComm()
    net.bytes_sent = net.bytes_received = net.chunks_sent = 0
    net.watched = []
    net._watch_after = lambda peers, what: net.watched.append((peers, what))  # no CUDA events here
    return net


def test_nccl_internode_splits_pieces_in_order_and_counts() -> None:
    net = _net(rank=5, rail=(1, 5, 9, 13), chunk=100)
    net.sendrecv([(9, [(1000, 250), (5000, 0), (6000, 100)]), (1, [(7000, 30)])],
                 [(13, [(2000, 101)])], timeout_s=1.0)
    (sends, recvs, stream), = net.comm.calls
    assert stream == 1234
    # (address, bytes, index of the peer in the rail); pieces split at 100 bytes, in order
    assert sends == [(1000, 100, 2), (1100, 100, 2), (1200, 50, 2), (6000, 100, 2), (7000, 30, 0)]
    assert recvs == [(2000, 100, 3), (2100, 1, 3)]
    assert (net.bytes_sent, net.bytes_received, net.chunks_sent) == (380, 101, 5)
    assert net.watched == [((1, 9, 13), "ncclSend/ncclRecv of the inter-node hop")]
    net.sendrecv([], [(9, [(3000, 0)])], timeout_s=1.0)  # nothing to move: no NCCL group
    assert len(net.comm.calls) == 1 and len(net.watched) == 1
    with pytest.raises(ValueError, match=r"sends: rank 6 is not a rail peer of rank 5 \(rail \(1, 5, 9, 13\)\)"):
        net.sendrecv([(6, [(0, 4)])], [], timeout_s=1.0)
    with pytest.raises(ValueError, match="recvs: rank 5 is not a rail peer of rank 5"):
        net.sendrecv([], [(5, [(0, 4)])], timeout_s=1.0)
    net.close()
    assert net.stream.queries == 3 and net.comm.calls[-1] == "closed", "close waits for the stream, then destroys"


class _RmaComm:
    def __init__(self) -> None:
        self.calls: list = []

    def put_signal(self, src, nbytes, peer, window, offset, stream) -> None:
        self.calls.append(("put", src, nbytes, peer, window, offset, stream))

    def wait_signals(self, counts, stream) -> None:
        self.calls.append(("wait", dict(counts), stream))

    def signal(self, peer, stream) -> None:
        self.calls.append(("signal", peer, stream))


class _CopyTransport:
    def __init__(self) -> None:
        self.copies: list = []

    def copy(self, dsts, srcs, sizes, *, stream) -> None:
        self.copies.append((list(dsts), list(srcs), list(sizes), stream))


def test_put_signal_internode_runs_the_landing_ring_program() -> None:
    from tide_triton.transport.internode import NcclPutSignalInterNode
    from tide_triton.transport.rma_protocol import LandingRing

    net = object.__new__(NcclPutSignalInterNode)  # no library, no GPU: only the translation
    net.rank, net.rail, net.chunk_bytes, net.stream = 5, (1, 5, 9, 13), 100, _Stream()
    net.comm, net.t, net.ring = _RmaComm(), _CopyTransport(), LandingRing(100, 2)
    net.window_addr, net.window, net.puts = 0x10000, "W", 0
    net.bytes_sent = net.bytes_received = net.chunks_sent = 0
    net.watched = []
    net._watch_after = lambda peers, what: net.watched.append((peers, what))  # no CUDA events here
    net.ring.base[2] = 1  # the first signal every rail peer sends at set-up
    # rank 9 is rail index 2; 250 bytes each way in 100-byte chunks through 2 slots; the
    # window is [landing ring 0..200 | send ring 200..400]
    net.sendrecv([(9, [(1000, 250)])], [(9, [(2000, 250)])], timeout_s=1.0)
    s, W = 1234, 0x10000
    assert net.comm.calls == [
        ("signal", 2, s),                            # credit: my landing ring is free
        ("wait", {2: 2}, s),                         # the set-up signal and rank 9's credit
        ("put", W + 200, 100, 2, "W", 0, s),         # send slot 0 -> its landing slot 0
        ("put", W + 300, 100, 2, "W", 100, s),
        ("wait", {2: 1}, s),                         # its chunk 0 is in my landing slot 0
        ("signal", 2, s),                            # slot 0 is free again (its chunk 2 reuses it)
        ("wait", {2: 2}, s),                         # its chunk 1 landed and it freed my chunk 0's slot
        ("put", W + 200, 50, 2, "W", 0, s),
        ("wait", {2: 1}, s),                         # its chunk 2
    ]
    st = net.stream
    assert net.t.copies == [([W + 200], [1000], [100], st), ([W + 300], [1100], [100], st),  # packs
                            ([2000], [W], [100], st),                                      # copy out
                            ([W + 200], [1200], [50], st),                                 # pack chunk 2
                            ([2100], [W + 100], [100], st), ([2200], [W], [50], st)]
    assert (net.bytes_sent, net.bytes_received, net.chunks_sent, net.puts) == (250, 250, 3, 3)
    assert net.ring.base[2] == 6 and net.ring.waited[2] == 6
    # every wait is watched, naming the global rank it waits for
    assert net.watched == [((9,), "its ncclPutSignal/ncclSignal in the inter-node hop")] * 4
    with pytest.raises(ValueError, match=r"one peer per call, got ranks \[9, 13\]"):
        net.sendrecv([(9, [(0, 4)]), (13, [(8, 4)])], [], timeout_s=1.0)
    with pytest.raises(ValueError, match="recvs: rank 6 is not a rail peer of rank 5"):
        net.sendrecv([], [(6, [(0, 4)])], timeout_s=1.0)
    n = len(net.comm.calls)
    net.sendrecv([(9, [(0, 0)])], [(13, [])], timeout_s=1.0)  # nothing to move: no operation
    assert len(net.comm.calls) == n


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_stuck_names_the_oldest_nccl_wait_not_passed() -> None:
    from tide_triton.transport.internode import NcclInterNode

    net = object.__new__(NcclInterNode)
    net._watch = [(_Event(True), (9,), "a"), (_Event(False), (13,), "b"), (_Event(False), (1, 9), "c")]
    assert net.stuck() == ((13,), "b")
    net._watch[1][0].done = True
    assert net.stuck() == ((1, 9), "c")
    net._watch[2][0].done = True
    assert net.stuck() is None and net._watch == []


def test_synchronize_side_names_a_stuck_nccl_peer_after_the_flag_waits() -> None:
    from types import SimpleNamespace

    from tide_triton.executors.across_nodes import _State, synchronize_side
    from tide_triton.executors.state import ExecState
    from tide_triton.errors import PeerTimeoutError

    class _T:
        def __init__(self, exc):
            self.exc, self.streams = exc, []

        def synchronize(self, *, timeout_s, stream):
            self.streams.append(stream)
            if self.exc is not None:
                raise self.exc

    def group(t, stuck):
        net = SimpleNamespace(stuck=lambda: stuck)
        ex = ExecState(rank=0)
        ex.across_nodes[id(t)] = _State(net)
        return SimpleNamespace(existing_transport={"cuda": t}.get, executor_state=ex,
                               side_stream=lambda device: "SIDE", check_posted=lambda timeout_s=None: None)

    dev = torch.device("cuda", 0)
    t = _T(None)
    synchronize_side(group(t, None), dev, 1.0)  # idle: nothing raised, the side stream was waited
    assert t.streams == ["SIDE"]
    flag = PeerTimeoutError(3, "rank 3's node-local reduce-scatter contribution", 1.0)
    with pytest.raises(PeerTimeoutError) as e:  # a short flag wait is named as it is
        synchronize_side(group(_T(flag), ((9,), "x")), dev, 1.0)
    assert e.value is flag
    with pytest.raises(PeerTimeoutError, match=r"waiting for rank 9 \(its ncclPutSignal\)") as e:
        synchronize_side(group(_T(TimeoutError("busy")), ((9,), "its ncclPutSignal")), dev, 1.0)
    assert e.value.peer == 9
    with pytest.raises(PeerTimeoutError, match=r"rank 1 \(send/recv; or rank 13\)"):
        synchronize_side(group(_T(TimeoutError("busy")), ((1, 13), "send/recv")), dev, 1.0)
    with pytest.raises(TimeoutError, match="busy"):  # nothing of NCCL's is stuck: the plain timeout
        synchronize_side(group(_T(TimeoutError("busy")), None), dev, 1.0)
    nothing = SimpleNamespace(existing_transport={}.get, executor_state=None)
    synchronize_side(nothing, dev, 1.0)  # no cross-node state: no-op


def test_cuda_several_nodes_single_process_mode_is_refused() -> None:
    import tide_triton as tt

    groups = tt.local_groups(2, local_size=1)
    try:
        for g in groups:
            with pytest.raises(NotImplementedError, match="one process cannot drive several NCCL ranks"):
                g._node_transport(torch.device("cuda", 0))
    finally:
        for g in groups:
            g.close()
