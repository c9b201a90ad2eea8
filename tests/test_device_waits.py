"""Device-wide waits have deadlines too: ``driver.wait_with_deadline`` runs a blocking
synchronize in a helper thread and raises an error naming what it waited for once the
deadline passes -- a stream stuck on a dead peer's flag would otherwise hold the process
forever.  Used by the CUDA transport's ``release_range`` (Slot-Reuse's release between steps)
and by ``Group.zeros``.  CPU: the synchronize is replaced by a stand-in that blocks."""
from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from tide_triton.errors import PeerTimeoutError
from tide_triton.transport import driver
from tide_triton.transport.cuda import CudaTransport
from tide_triton.transport.heap_rounds import HeapRounds


def test_a_quick_wait_returns_and_its_error_is_raised_in_the_caller() -> None:
    ran = []
    driver.wait_with_deadline(lambda: ran.append(1), 5.0, lambda: AssertionError("no timeout expected"))
    assert ran == [1]
    boom = ValueError("from the wait")

    def fails() -> None:
        raise boom

    with pytest.raises(ValueError) as info:
        driver.wait_with_deadline(fails, 5.0, lambda: AssertionError("no timeout expected"))
    assert info.value is boom


def test_a_stuck_wait_ends_in_the_callers_error_at_the_deadline() -> None:
    release = threading.Event()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="device still busy"):
            driver.wait_with_deadline(lambda: release.wait(30), 0.3, lambda: TimeoutError("device still busy"))
        assert time.monotonic() - t0 < 5
    finally:
        release.set()


def _stand_in_transport(stuck_peers: set[int]) -> types.SimpleNamespace:
    """What ``CudaTransport.release_range`` reads of itself, without a GPU."""
    heap = types.SimpleNamespace(spans_in=lambda s, e: [(s, e - s)], unmap_range=lambda s, e: None)
    t = types.SimpleNamespace(
        rank=1, device=torch.device("cuda", 0), _peers=None, _local=True, _closed=False,
        options=types.SimpleNamespace(timeout_s=0.5),
        _rounds=HeapRounds(heap, None, None, rank=1, local_size=2, user_off=4096, zero_words=lambda: None),
        _waits=types.SimpleNamespace(stuck_peers=lambda: set(stuck_peers)),
        _check_open=lambda: None, _drain=lambda timeout_s: True,
    )
    for name in ("busy_error", "_settle_for_release", "release_range"):
        setattr(t, name, types.MethodType(getattr(CudaTransport, name), t))
    return t


def test_release_range_names_the_peer_its_stuck_streams_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``torch.cuda.synchronize`` without a deadline (here: 20 s stuck, then a silent
    return).  Now: ``PeerTimeoutError`` naming rank 3 after the transport's 0.5 s."""
    release = threading.Event()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: release.wait(20))
    t = _stand_in_transport({3, 5})
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerTimeoutError, match=r"waiting for rank 3 \(release_range: cuda:0 still busy: "
                                                   r"this rank's streams wait for ranks \[3, 5\]\)") as info:
            t.release_range(0, 2 << 20)
        assert info.value.peer == 3
        assert time.monotonic() - t0 < 10
    finally:
        release.set()


def test_release_range_without_known_peers_says_the_device_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: release.wait(20))
    try:
        with pytest.raises(TimeoutError, match=r"rank 1: release_range: cuda:0 still busy after 0.5 s"):
            _stand_in_transport(set()).release_range(0, 2 << 20)
    finally:
        release.set()


class _Stream:
    def __init__(self, busy_for_s: float) -> None:
        self.until = time.monotonic() + busy_for_s

    def query(self) -> bool:
        return time.monotonic() >= self.until

    def synchronize(self) -> None:  # what close() used to call: it waits as long as the stream
        time.sleep(max(0.0, self.until - time.monotonic()))


class _Comm:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def close(self) -> None:
        self.calls.append("close")

    def abort(self) -> None:
        self.calls.append("abort")


def test_inter_node_close_aborts_a_communicator_whose_stream_stays_stuck(caplog: pytest.LogCaptureFixture) -> None:
    """NCCL's stream-side waits have no timeout: a hop whose peer died leaves its stream busy.
    Before: close() synchronized the stream (forever).  Now: after its drain time it aborts
    the communicator, logging the peers of the oldest operation still waiting."""
    from tide_triton.transport.internode import NcclInterNode

    comm = _Comm()
    hop = NcclInterNode(0, (0, 2), comm, _Stream(busy_for_s=60), chunk_bytes=1 << 20)
    hop.stuck = lambda: ((2,), "ncclSend/ncclRecv of the reduce-scatter")  # what its events would say
    t0 = time.monotonic()
    with caplog.at_level("ERROR", logger="tide_triton"):
        hop.close(drain_timeout_s=0.3)
    assert time.monotonic() - t0 < 5
    assert comm.calls == ["abort"]
    assert ("still busy after 0.3 s at close (ncclSend/ncclRecv of the reduce-scatter, waiting for ranks [2]); "
            "aborting the NCCL communicator") in caplog.text

    done = _Comm()  # a stream that drains in time: the communicator is destroyed normally
    NcclInterNode(0, (0, 2), done, _Stream(busy_for_s=0.05), chunk_bytes=1 << 20).close(drain_timeout_s=5)
    assert done.calls == ["close"]
