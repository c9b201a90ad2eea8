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
    t = types.SimpleNamespace(
        rank=1, device=torch.device("cuda", 0), _peers=None, _local=True, _closed=False,
        options=types.SimpleNamespace(timeout_s=0.5),
        _words=types.SimpleNamespace(user_off=4096),
        _heap=types.SimpleNamespace(spans_in=lambda s, e: [(s, e - s)], unmap_range=lambda s, e: None),
        _sig=types.SimpleNamespace(stuck_peers=lambda: set(stuck_peers)),
        _check_open=lambda: None, _drain=lambda timeout_s: True,
    )
    for name in ("busy_error", "_user_range", "release_range"):
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
