"""The NCCL host-API table (tide_triton.transport.nccl) without a GPU: library discovery and
its precedence, version and feature detection, required vs optional symbols, errors -- against
stub libraries compiled here (skipped without a C compiler), and against a real libnccl when
one is at hand ($TIDE_TRITON_NCCL_LIBRARY or the nvidia-nccl wheel)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tide_triton.transport import nccl

STUB = r"""
#include <stdlib.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetVersion(int* v) { *v = atoi(getenv("STUB_NCCL_VERSION")); return 0; }
int ncclGetUniqueId(ncclUniqueId* u) {
  if (getenv("STUB_NCCL_FAIL")) return 3;
  for (int i = 0; i < 128; i++) u->internal[i] = (char)i; return 0; }
const char* ncclGetErrorString(int r) { return r == 3 ? "internal error - please report this issue" : "no error"; }
int ncclCommInitRank(void** c, int n, ncclUniqueId id, int r) { return 0; }
#ifdef DESTROY_WAITS
/* ncclCommDestroy as NCCL's own waits for the other member: returns once both members of
   communicator c (its handle: 1, 2, ...) have called it */
#include <pthread.h>
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int destroyed[16];
int ncclCommDestroy(void* c) {
  long i = (long)c;
  pthread_mutex_lock(&mu); destroyed[i]++; pthread_cond_broadcast(&cv);
  while (destroyed[i] < 2) pthread_cond_wait(&cv, &mu);
  pthread_mutex_unlock(&mu); return 0; }
int stub_destroyed(long i) { pthread_mutex_lock(&mu); int n = destroyed[i]; pthread_mutex_unlock(&mu); return n; }
#else
int ncclCommDestroy(void* c) { return 0; }
#endif
int ncclCommAbort(void* c) { return 0; }
#ifndef NO_SEND
int ncclSend(const void* b, size_t n, int t, int p, void* c, void* s) { return 0; }
#endif
int ncclRecv(void* b, size_t n, int t, int p, void* c, void* s) { return 0; }
int ncclGroupStart(void) { return 0; }
int ncclGroupEnd(void) { return 0; }
#ifdef ONE_SIDED
int ncclCommWindowRegister(void* c, void* b, size_t n, void** w, int f) { return 0; }
int ncclCommWindowDeregister(void* c, void* w) { return 0; }
int ncclPutSignal(const void* b, size_t n, int t, int p, void* w, size_t o, int s, int x, unsigned f, void* c,
                  void* st) { return 0; }
int ncclWaitSignal(int n, void* d, void* c, void* s) { return 0; }
int ncclSignal(int p, int s, int x, unsigned f, void* c, void* st) { return 0; }
#endif
#ifdef MEM
static char arena[4096];
int ncclMemAlloc(void** p, size_t n) { *p = arena; return n <= sizeof(arena) ? 0 : 1; }
int ncclMemFree(void* p) { return 0; }
#endif
"""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> dict[str, Path]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build stub NCCL libraries")
    d = tmp_path_factory.mktemp("stub_nccl")
    src = d / "stub.c"
    src.write_text(STUB)
    out = {}
    for name, flags in {"plain": [], "one_sided": ["-DONE_SIDED", "-DMEM"], "one_sided_nomem": ["-DONE_SIDED"],
                        "broken": ["-DNO_SEND"], "destroy_waits": ["-DDESTROY_WAITS", "-pthread"]}.items():
        lib = d / f"libnccl_{name}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", *flags, "-o", str(lib), str(src)], check=True)
        out[name] = lib
    return out


def test_discovery_precedence(tmp_path, monkeypatch) -> None:
    a, b, w = tmp_path / "a.so", tmp_path / "b.so", tmp_path / "wheel.so"
    for f in (a, b, w):
        f.write_bytes(b"")
    monkeypatch.setattr(nccl, "_wheel_library", lambda: w)
    monkeypatch.setenv(nccl.ENV_LIBRARY, str(b))
    assert nccl.find_library(a) == (str(a), "path argument")
    assert nccl.find_library() == (str(b), f"${nccl.ENV_LIBRARY}")
    monkeypatch.delenv(nccl.ENV_LIBRARY)
    assert nccl.find_library() == (str(w), "nvidia-nccl wheel")
    monkeypatch.setattr(nccl, "_wheel_library", lambda: None)
    assert nccl.find_library() == ("libnccl.so.2", "system loader")


def test_explicit_path_that_does_not_exist_is_an_error(tmp_path, monkeypatch) -> None:
    with pytest.raises(FileNotFoundError, match="from the path argument does not exist"):
        nccl.find_library(tmp_path / "nope.so")
    monkeypatch.setenv(nccl.ENV_LIBRARY, str(tmp_path / "nope.so"))
    with pytest.raises(FileNotFoundError, match=r"from the \$TIDE_TRITON_NCCL_LIBRARY does not exist"):
        nccl.find_library()


@pytest.mark.parametrize("lib, version, one_sided, windows, multi, rma", [
    ("plain", 22809, False, False, False, False),       # torch 2.11's NCCL: send/recv fallback
    ("one_sided", 22809, False, True, False, False),    # symbols may exist before the version supports RMA
    ("one_sided", 22902, True, True, False, True),
    ("one_sided", 23203, True, True, True, True),
    ("one_sided_nomem", 23203, True, True, True, False),  # no ncclMemAlloc: no landing ring
    ("plain", 23203, False, False, True, False),        # new version, optional symbols missing
])
def test_features_follow_version_and_symbols(stubs, monkeypatch, lib, version, one_sided, windows, multi,
                                             rma) -> None:
    monkeypatch.setenv("STUB_NCCL_VERSION", str(version))
    got = nccl.NcclLibrary(stubs[lib])
    assert got.version == (version // 10000, version // 100 % 100, version % 100)
    f = got.features
    assert (f.one_sided, f.windows, f.multi_rank_per_gpu, f.rma_landing) == (one_sided, windows, multi, rma)
    assert got.found_by == "path argument"
    if lib == "plain":  # the optional entry point is absent: asking for it names it
        with pytest.raises(RuntimeError, match="has no ncclPutSignal"):
            got.fn("ncclPutSignal")


def test_unique_id_and_errors(stubs, monkeypatch) -> None:
    monkeypatch.setenv("STUB_NCCL_VERSION", "23203")
    lib = nccl.NcclLibrary(stubs["plain"])
    uid = lib.unique_id()
    assert len(uid) == 128 and uid[:4] == bytes([0, 1, 2, 3])
    monkeypatch.setenv("STUB_NCCL_FAIL", "1")
    with pytest.raises(nccl.NcclError, match=r"ncclGetUniqueId failed: internal error .* \(ncclResult 3\)"):
        lib.unique_id()


def test_a_library_without_the_required_api_is_refused(stubs, monkeypatch) -> None:
    monkeypatch.setenv("STUB_NCCL_VERSION", "23203")
    with pytest.raises(OSError, match="is not a usable NCCL: missing ncclSend"):
        nccl.NcclLibrary(stubs["broken"])


def test_version_encodings() -> None:
    assert nccl._version_tuple(23203) == (2, 32, 3)
    assert nccl._version_tuple(22809) == (2, 28, 9)
    assert nccl._version_tuple(2708) == (2, 7, 8)  # before 2.9: major*1000 + minor*100 + patch


def _real_library() -> str | None:
    env = os.environ.get(nccl.ENV_LIBRARY)
    if env and Path(env).is_file():
        return env
    wheel = nccl._wheel_library()
    return str(wheel) if wheel else None


@pytest.mark.skipif(_real_library() is None, reason="no real libnccl at hand (set $TIDE_TRITON_NCCL_LIBRARY)")
def test_real_library_loads_and_makes_unique_ids() -> None:
    lib = nccl.load(_real_library())
    assert lib.version >= (2, 18, 0)
    assert len(lib.unique_id()) == 128
    if lib.version >= (2, 29, 2):
        assert lib.features.one_sided and lib.features.windows


class _ThreadExchange:
    """An all-gather of objects among ``n`` threads (what the group's exchange does)."""

    def __init__(self, n: int) -> None:
        import threading

        self.n = n
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=30)

    def for_rank(self, rank: int):
        def exchange(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return exchange


def _comm_on_every_rank(lib, W: int, L: int, device_of) -> list:
    """Every rank of W (nodes of L) makes its rail communicator; returns each rank's error."""
    import threading

    ex = _ThreadExchange(W)
    errs: list = [None] * W

    def body(rank: int) -> None:
        rail = tuple(m * L + rank % L for m in range(W // L))
        try:
            nccl.NcclComm(lib, rail, rank, ex.for_rank(rank), device_index=device_of(rank))
        except Exception as e:  # noqa: BLE001 - compared below
            errs[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errs


def test_several_ranks_per_gpu_under_old_nccl_raise_on_every_rank(stubs, monkeypatch) -> None:
    # torch 2.11's NCCL (2.28.9): W=4 as 2 nodes x 2; rail (0, 2) shares GPU 0, rail (1, 3)
    # does not -- every rank raises the same error before ncclCommInitRank, naming the
    # library's version and path and the two ways to point the project at another.
    monkeypatch.setenv("STUB_NCCL_VERSION", "22809")
    monkeypatch.setattr(nccl, "_device_key", lambda i: f"dev-{i}")
    lib = nccl.NcclLibrary(stubs["plain"])
    errs = _comm_on_every_rank(lib, 4, 2, device_of=lambda r: {0: 0, 1: 1, 2: 0, 3: 2}[r])
    assert all(isinstance(e, RuntimeError) for e in errs), errs
    msg = str(errs[3])
    assert "ranks [0, 2] share a GPU" in msg and "NCCL >= 2.30" in msg
    assert "2.28.9" in msg and str(stubs["plain"]) in msg
    assert "TIDE_TRITON_NCCL_LIBRARY" in msg and "GroupOptions(nccl_library=" in msg
    assert {str(e).rsplit("(rank", 1)[0] for e in errs} == {msg.rsplit("(rank", 1)[0]}


class _FakeLib:
    def __init__(self, version: tuple[int, int, int]) -> None:
        self.version, self.path, self.found_by = version, "/x/libnccl.so.2", "test"


def test_placement_check_passes_one_rank_per_gpu_or_new_nccl() -> None:
    shared = [(b"u", "dev-0", (0, 1)), (None, "dev-0", (0, 1))]
    distinct = [(b"u", "dev-0", (0, 1)), (None, "dev-1", (0, 1))]
    nccl.check_placement(_FakeLib((2, 28, 9)), distinct, 0)
    nccl.check_placement(_FakeLib((2, 30, 0)), shared, 0)
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] share a GPU .* NCCL is 2\.29\.7 from /x/libnccl\.so\.2"):
        nccl.check_placement(_FakeLib((2, 29, 7)), shared, 1)


def _bare_comm(lib, handle: int, members: tuple, rank: int) -> "nccl.NcclComm":
    """A communicator object around ``handle`` as ncclCommInitRank would leave it (no GPU)."""
    import ctypes

    comm = object.__new__(nccl.NcclComm)
    comm.lib, comm.members, comm.index = lib, members, members.index(rank)
    comm._comm, comm._closed, comm._windows, comm._memory = ctypes.c_void_p(handle), False, [], []
    return comm


@pytest.mark.parametrize("opposite", [False, True], ids=["same-order", "opposite-order"])
def test_closing_communicators_in_another_order_ends_within_the_deadline(stubs, monkeypatch, caplog,
                                                                          opposite) -> None:
    # Two ranks, two communicators whose destroy waits for the other member (as NCCL's does).
    # Closed in the same order: quick, nothing logged.  In opposite orders each waits for the
    # other forever -- unless close has a deadline: then an error names the rank and the
    # members, the process goes on, and the destroys left behind still end once both called.
    import ctypes
    import threading
    import time

    monkeypatch.setenv("STUB_NCCL_VERSION", "23203")
    lib = nccl.NcclLibrary(stubs["destroy_waits"])
    raw = ctypes.CDLL(str(stubs["destroy_waits"]))
    base = 3 if opposite else 5  # handles not used by the other case (the stub counts per handle)
    comms = {r: [_bare_comm(lib, base + k, (0, 1), r) for k in (0, 1)] for r in (0, 1)}
    if opposite:
        comms[1].reverse()
    ended: dict[int, float] = {}
    t0 = time.monotonic()

    close_deadline = 0.5 if opposite else 30.0  # in step, no close waits long (a loaded CI machine too)

    def close_all(rank: int) -> None:
        for c in comms[rank]:
            c.close(deadline_s=close_deadline)
        ended[rank] = time.monotonic() - t0

    with caplog.at_level("ERROR", logger="tide_triton"):
        threads = [threading.Thread(target=close_all, args=(r,), daemon=True) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert sorted(ended) == [0, 1], "a rank's close did not return"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    if not opposite:
        assert errors == [], (errors, ended)
        return
    assert errors, "opposite orders must log an error"
    assert all("did not end within 0.5 s" in m and "ranks [0, 1]" in m for m in errors), errors
    assert {m.split(":", 1)[0] for m in errors} <= {"rank 0", "rank 1"}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(raw.stub_destroyed(base + k) == 2 for k in (0, 1)):
        time.sleep(0.01)
    assert [raw.stub_destroyed(base + k) for k in (0, 1)] == [2, 2], "a destroy left behind never ended"


def test_a_close_where_no_thread_may_start_tears_down_here(stubs, monkeypatch) -> None:
    # Python >= 3.12 refuses to start a thread in an atexit handler (where groups close at
    # exit): the communicator is then destroyed in the calling thread, not leaked.
    import ctypes
    import threading

    monkeypatch.setenv("STUB_NCCL_VERSION", "23203")
    lib = nccl.NcclLibrary(stubs["destroy_waits"])
    raw = ctypes.CDLL(str(stubs["destroy_waits"]))
    comm = _bare_comm(lib, 9, (0, 1), 0)
    other = threading.Thread(target=raw.ncclCommDestroy, args=(ctypes.c_void_p(9),), daemon=True)
    other.start()  # the other member's destroy, waiting for this one

    def refuse(self) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    comm.close(deadline_s=0.5)
    other.join(10)
    assert raw.stub_destroyed(9) == 2 and comm._closed and not other.is_alive()


def test_close_none_releases_the_windows_and_leaves_only_the_communicator(stubs, monkeypatch) -> None:
    # nccl.CLOSE = "none" (a diagnostic switch): the windows and memory go as always,
    # only the communicator is left to process exit -- no destroy is called.
    import ctypes

    monkeypatch.setenv("STUB_NCCL_VERSION", "23203")
    monkeypatch.setattr(nccl, "CLOSE", "none")
    lib = nccl.NcclLibrary(stubs["destroy_waits"])
    raw = ctypes.CDLL(str(stubs["destroy_waits"]))
    comm = _bare_comm(lib, 11, (0, 1), 0)
    comm._windows.append(ctypes.c_void_p(1))
    comm.close(deadline_s=5)
    assert comm._windows == [] and raw.stub_destroyed(11) == 0


def test_groups_close_newest_first() -> None:
    # Closing a group destroys its NCCL communicators, whose other members must destroy them
    # in the same order: at exit and at destroy_process_group groups close in the reverse of
    # their (collective, so rank-agreed) creation order, not in the address order of a set.
    import weakref

    import tide_triton as tt
    from tide_triton.group import core as group_mod
    from tide_triton.group import process_groups

    first = tt.local_groups(2, timeout_s=30)
    second = tt.local_groups(2, timeout_s=30)
    closed: list = []
    real_close = group_mod.Group.close

    def recording_close(self) -> None:
        closed.append(self)
        real_close(self)

    ours: weakref.WeakSet = weakref.WeakSet(first + second)
    try:
        import unittest.mock as mock

        with mock.patch.object(process_groups, "_ALL", ours), \
                mock.patch.object(group_mod.Group, "close", recording_close):
            process_groups._close_all()
    finally:
        for g in first + second:
            g.close()
    assert len(closed) == 4
    assert {id(g) for g in closed[:2]} == {id(g) for g in second}
    assert {id(g) for g in closed[2:]} == {id(g) for g in first}


def test_a_part_failing_to_close_leaves_the_heaps_closed_and_raises() -> None:
    import tide_triton as tt

    class Failing:
        def close_extra(self) -> None:
            raise RuntimeError("communicator refused to close")

    groups = tt.local_groups(2, timeout_s=30)
    try:
        import torch

        try:
            from _dist import run_threads
        except ImportError:  # pragma: no cover
            from tests._dist import run_threads

        run_threads(lambda r: groups[r].transport(torch.device("cpu")), 2, timeout=60)  # collective
        for g in groups:
            g._extras["failing"] = Failing()
        transports = [g._transports.copy() for g in groups]
        assert all(transports)
        for g in groups:
            with pytest.raises(RuntimeError, match="communicator refused to close"):
                g.close()
            assert g.closed and not g._transports
    finally:
        for g in groups:
            g.close()
