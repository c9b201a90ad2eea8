"""How ``transport.internode.nccl_hop`` picks the cross-node hop, without a GPU or NCCL.

``load`` and ``NcclComm`` are replaced by fakes, and the ranks of a multi-node group run as
threads of this process over a Barrier-based all-gather, so the decision is taken
collectively as on a real rig.  Checked: ``inter_node="send_recv"`` never touches windows;
``"auto"`` falls back to send/recv on every rank (and logs the rank at fault) when one rank's
library lacks RMA or one rank's window registration fails; ``"put_signal"`` then raises on
every rank, naming that rank, and closes the communicator; when everything works every rank
gets the put/signal hop with a window of whole 2 MiB granules, a first signal to each other
rail member (by rail index) and its landing ring's ledger counting those signals."""
from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest

from tide_triton.group.core import GroupOptions
from tide_triton.transport import internode as inode
from tide_triton.transport import nccl

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads

CHUNK, INFLIGHT = 1_000_000, 3  # 2 * 3 MB = 6 MB of window -> 3 granules of 2 MiB
WINDOW_BYTES = 3 << 21
_here = threading.local()  # which rank the current thread plays


class _World:
    """The fakes' shared state: one all-gather over every rank, what each rank's comm did."""

    def __init__(self, world: int, local: int, *, no_rma=(), bad_window=(), bad_alloc=(), asks=None) -> None:
        self.world, self.local, self.no_rma, self.bad_window = world, local, set(no_rma), set(bad_window)
        self.bad_alloc, self.asks = set(bad_alloc), asks or {}
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=5)
        self.comms: dict[int, _FakeComm] = {}
        self.loaded: list = []

    def exchange(self, rank: int, obj: object) -> list:
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return out

    def load(self, path):
        self.loaded.append(path)
        return SimpleNamespace(version=(2, 32, 0), path="/fake/libnccl.so.2",
                               features=SimpleNamespace(rma_landing=_here.rank not in self.no_rma))

    def rail(self, rank: int) -> tuple[int, ...]:
        return tuple(range(rank % self.local, self.world, self.local))


class _FakeComm:
    def __init__(self, lib, members, rank, exchange, *, device_index) -> None:
        self.w = _here.world
        self.members, self.rank, self.index = tuple(members), rank, tuple(members).index(rank)
        self.device_index, self.windows, self.signals, self.closed = device_index, [], [], False
        self.allocs: list = []
        exchange(b"uid" if self.index == 0 else None)  # collective, as the real one
        self.w.comms[rank] = self

    def mem_alloc(self, nbytes: int) -> int:
        self.allocs.append(nbytes)
        if self.rank in self.w.bad_alloc:
            raise nccl.NcclError("ncclMemAlloc", 1, "unhandled cuda error")
        return 0x7000_0000 + self.rank

    def register_window(self, addr: int, nbytes: int):
        assert addr == 0x7000_0000 + self.rank and self.allocs == [nbytes]
        self.windows.append(nbytes)
        if self.rank in self.w.bad_window:
            raise nccl.NcclError("ncclCommWindowRegister", 5, "invalid usage")
        return "WIN"

    def signal(self, peer: int, stream: int) -> None:
        self.signals.append((peer, stream))

    def close(self) -> None:
        self.closed = True


def _run(monkeypatch, w: _World, inter_node: str) -> dict:
    """``nccl_hop`` on every rank of ``w``, one thread each: rank -> hop or exception."""
    monkeypatch.setattr(nccl, "load", w.load)
    monkeypatch.setattr(nccl, "NcclComm", _FakeComm)
    def opts(rank: int) -> GroupOptions:
        return GroupOptions(inter_node=w.asks.get(rank, inter_node), chunk_bytes=CHUNK, inflight_chunks=INFLIGHT)

    t = SimpleNamespace(device=SimpleNamespace(type="cuda", index=0))

    def one(rank: int) -> object:
        _here.rank, _here.world = rank, w
        o = opts(rank)
        rail = tuple(range(rank % w.local, w.world, w.local))
        try:
            return inode.nccl_hop(t, rank, rail, lambda obj: w.exchange(rank, obj), SimpleNamespace(cuda_stream=1234),
                                  inter_node=o.inter_node, nccl_library=o.nccl_library, chunk_bytes=o.chunk_bytes,
                                  inflight_chunks=o.inflight_chunks)
        except Exception as e:  # noqa: BLE001 -- the test looks at it
            return e

    out = dict(enumerate(run_threads(one, w.world, timeout=10)))  # a rank that does not finish: error
    assert w.loaded == [None] * w.world  # GroupOptions.nccl_library, on every rank
    for r, c in w.comms.items():
        assert c.members == w.rail(r) and c.device_index == 0
    return out


def _run_logged(monkeypatch, caplog, w: "_World", inter_node: str) -> dict:
    """:func:`_run` with the once-only fallback warning re-armed and warnings captured."""
    monkeypatch.setattr(inode, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="tide_triton"):
        return _run(monkeypatch, w, inter_node)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tide_triton" and r.levelno == logging.WARNING]


def _assert_send_recv(w: _World, out: dict) -> None:
    for r, net in out.items():
        assert type(net) is inode.NcclInterNode and net.path == "send_recv", (r, net)
        assert net.comm is w.comms[r] and not net.comm.closed
        assert net.rail == w.rail(r) and net.stream.cuda_stream == 1234


@pytest.mark.parametrize("world", [4, 6])
def test_send_recv_asked_touches_no_window(monkeypatch, caplog, world) -> None:
    w = _World(world, 2, no_rma=[1])  # even a library without RMA: it is not asked for
    out = _run(monkeypatch, w, "send_recv")
    _assert_send_recv(w, out)
    assert all(c.windows == c.allocs == c.signals == [] for c in w.comms.values())
    assert _warnings(caplog) == []


def test_auto_falls_back_everywhere_when_one_library_lacks_rma(monkeypatch, caplog) -> None:
    w = _World(4, 2, no_rma=[3])
    out = _run_logged(monkeypatch, caplog, w, "auto")
    _assert_send_recv(w, out)  # ranks 0..2 could have, but the decision is collective
    assert all(c.windows == [] and c.signals == [] for c in w.comms.values())
    msgs = _warnings(caplog)
    assert msgs and all("rank 3:" in m and "lacks one-sided RMA" in m for m in msgs)


def test_put_signal_refused_on_every_rank_naming_the_one_without_rma(monkeypatch) -> None:
    w = _World(6, 2, no_rma=[1])
    out = _run(monkeypatch, w, "put_signal")
    for r, e in out.items():
        assert isinstance(e, RuntimeError), (r, e)
        assert 'inter_node="put_signal" is not available: rank 1: NCCL 2.32.0' in str(e)
    assert all(c.closed and c.windows == [] for c in w.comms.values())


def test_auto_falls_back_everywhere_when_one_window_fails(monkeypatch, caplog) -> None:
    w = _World(6, 2, bad_window=[4])
    out = _run_logged(monkeypatch, caplog, w, "auto")
    _assert_send_recv(w, out)
    assert all(c.windows == [WINDOW_BYTES] for c in w.comms.values())  # everyone tried
    assert w.comms[4].signals == []  # the failing rank got no further
    msgs = _warnings(caplog)
    assert msgs and all("rank 4: NCCL 2.32.0: ncclCommWindowRegister failed" in m for m in msgs)


def test_put_signal_refused_when_one_window_fails(monkeypatch) -> None:
    w = _World(4, 2, bad_window=[2])
    out = _run(monkeypatch, w, "put_signal")
    assert all(isinstance(e, RuntimeError) and "rank 2: NCCL 2.32.0: ncclCommWindowRegister" in str(e)
               for e in out.values()), out
    assert all(c.closed for c in w.comms.values())


@pytest.mark.parametrize("inter_node", ["auto", "put_signal"])
@pytest.mark.parametrize("world", [4, 6])
def test_put_signal_when_everything_works(monkeypatch, caplog, inter_node, world) -> None:
    w = _World(world, 2)
    out = _run_logged(monkeypatch, caplog, w, inter_node)
    assert _warnings(caplog) == []
    for r, net in out.items():
        assert type(net) is inode.NcclPutSignalInterNode and net.path == "put_signal", (r, net)
        c = net.comm
        assert c is w.comms[r] and not c.closed and c.index == r // 2
        assert c.windows == [WINDOW_BYTES]
        assert (net.window_addr, net.window) == (0x7000_0000 + r, "WIN")
        others = [i for i in range(world // 2) if i != c.index]  # rail indices, not ranks
        assert c.signals == [(i, 1234) for i in others]
        assert net.ring.base == {i: 1 for i in others}
        assert (net.ring.chunk_bytes, net.ring.n_slots) == (CHUNK, INFLIGHT)


def test_auto_falls_back_before_any_registration_when_one_allocation_fails(monkeypatch, caplog) -> None:
    # Registration is collective per rail: a rank whose memory allocation failed must not
    # leave its rail peers inside ncclCommWindowRegister -- nobody registers.
    w = _World(4, 2, bad_alloc=[1])
    out = _run_logged(monkeypatch, caplog, w, "auto")
    _assert_send_recv(w, out)
    assert all(c.allocs == [WINDOW_BYTES] and c.windows == [] and c.signals == [] for c in w.comms.values())
    msgs = _warnings(caplog)
    assert msgs and all("rank 1: NCCL 2.32.0: ncclMemAlloc failed" in m for m in msgs)


def test_ranks_asking_for_different_hops_raise_everywhere(monkeypatch) -> None:
    w = _World(4, 2, asks={2: "send_recv"})
    out = _run(monkeypatch, w, "auto")
    for r, e in out.items():
        assert isinstance(e, ValueError) and "GroupOptions.inter_node differs between ranks" in str(e), (r, e)
        assert ("rank 0 has 'auto'" in str(e)) if r == 2 else ("rank 2 has 'send_recv'" in str(e)), (r, e)
    assert all(c.closed and c.windows == [] for c in w.comms.values())
