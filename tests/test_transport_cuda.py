"""tide_triton.transport.cuda: the VMM heap, copy-engine copies and stream-memory flags.

Two ways to run W ranks on one GPU, both checked the same way:

* one process, W transports (``create_local_group``): ranks' streams really overlap, so
  the ordering checks bite (a consumer that did not wait would read stale bytes);
* W processes (spawned, gloo for the exchange): the fd rendezvous (Unix socket, pidfd),
  peer mappings of another process's allocation, and flags written across processes.

Ordering checks delay the producer's copy stream with ``torch.cuda._sleep`` before its copy
and signal; the consumer waits on the flag on its own stream and must see every byte.
Patterns are int32 ``arange * 7 + rank * 1000003``: distinct per rank and per element, so
one wrong byte anywhere fails ``torch.equal``.  Every test skips without a GPU.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from tide_triton.transport import driver
from tide_triton.errors import PeerTimeoutError
from tide_triton.transport.cuda import CudaTransport


@pytest.fixture(autouse=True)
def _collect_after_each_test():
    # Finalisers of CUDA resources run here, attributed to the test that left them.
    yield
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = 1 << 26  # ~35 ms at 1.98 GHz: far longer than launching the consumer
_MIB = 1 << 20
_DATA = 4096  # heap offset of the test data: the flags (n_flags <= 512) come first


def _pattern(rank: int, numel: int, device: torch.device | str) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.int32, device=device) * 7 + rank * 1_000_003


def _free_bytes() -> int:
    free, _total = driver.check(driver.cu.cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def _own_used_bytes() -> int | None:
    """Device memory this process holds on GPU 0 (NVML's per-process count), or None where
    NVML is missing: other processes' allocations (xdist workers beside this one) then do not
    count as this process's loss, as they would in the device-wide free bytes (a neighbour's
    5 GB "lost" here)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    except Exception:  # noqa: BLE001 - no NVML: the caller falls back
        return None
    return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == os.getpid())


def _nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def group4():
    g = CudaTransport.create_local_group(4, device="cuda:0", n_flags=64, segment_bytes=2 * _MIB)
    try:
        yield g
    finally:
        CudaTransport.close_group(g)


# ---------------------------------------------------------------------------------------
# One process, four ranks
# ---------------------------------------------------------------------------------------
def test_local_heap_views_and_copies(group4):
    numel = (1 << 18) + 3  # not a multiple of anything the copy engines like
    for t in group4:
        t.ensure_heap(_DATA + 4 * numel)
    for t in group4:
        view = t.heap_tensor(t.rank, _DATA, numel, torch.int32)
        assert view.data_ptr() == t.address(t.rank, _DATA)
        assert view.device == t.device
        view.copy_(_pattern(t.rank, numel, "cuda"))
    # Every rank's view of every heap is the same address and the same bytes.
    for t in group4:
        for p in range(4):
            v = t.heap_tensor(p, _DATA, numel, torch.int32)
            assert v.data_ptr() == group4[p].address(p, _DATA)
            assert torch.equal(v, _pattern(p, numel, "cuda"))
    # Copies of whole regions, then of awkward pieces (1 byte, odd offsets, primes).
    for t in group4:
        t.fence_from()  # the fills above ran on the current stream
        outs = [torch.empty(numel, dtype=torch.int32, device="cuda") for _ in range(4)]
        t.copy([o.data_ptr() for o in outs], [t.address(p, _DATA) for p in range(4)],
               [4 * numel] * 4)
        pieces = [(1, 0), (3, 5), (4097, 11), (65537, 4096 + 1)]
        raw = torch.zeros(sum(n for n, _ in pieces), dtype=torch.uint8, device="cuda")
        dsts, srcs, sizes, pos = [], [], [], 0
        for n, off in pieces:
            dsts.append(raw.data_ptr() + pos)
            srcs.append(t.address((t.rank + 1) % 4, _DATA + off))
            sizes.append(n)
            pos += n
        t.copy(dsts, srcs, sizes)
        t.copy([], [], [])
        t.copy([raw.data_ptr()], [t.address(0, _DATA)], [0])
        t.fence_to()
        for p in range(4):
            assert torch.equal(outs[p], _pattern(p, numel, "cuda"))
        peer_bytes = _pattern((t.rank + 1) % 4, numel, "cuda").view(torch.uint8)
        expect = torch.cat([peer_bytes[off:off + n] for n, off in pieces])
        assert torch.equal(raw, expect)
    print(f"[tide paths] local: copy={group4[0]._copies.copy_path} signal={group4[0]._flags.signal_path}")


@pytest.mark.parametrize("copy_mode", ["loop", "auto"])
@pytest.mark.parametrize("signal_mode", ["copy", "auto"])
def test_local_signal_orders_copies(signal_mode, copy_mode):
    """Rank A: sleep on its copy stream, copy 64 MiB into B's heap, signal B.  Rank B waits
    on the flag on its own stream and reads at once: it must see all of A's data."""
    numel = 16 * _MIB
    g = CudaTransport.create_local_group(4, device="cuda:0", n_flags=64,
                                         signal_mode=signal_mode, copy_mode=copy_mode)
    try:
        assert g[0]._flags.signal_path == ("copy" if signal_mode == "copy" else "direct")
        if copy_mode == "loop":
            assert g[0]._copies.copy_path == "loop"
        for t in g:
            t.ensure_heap(_DATA + 4 * numel)
            t.heap_tensor(t.rank, _DATA, numel, torch.int32).fill_(-1)
        srcs = [_pattern(r, numel, "cuda") for r in range(4)]
        torch.cuda.synchronize()
        readers = [torch.cuda.Stream() for _ in range(4)]
        for epoch in (1, 2):  # flags only grow: the second round reuses the slot
            for a in g:
                b = (a.rank + 1) % 4
                a.fence_from()
                with torch.cuda.stream(a.copy_stream):
                    torch.cuda._sleep(_SLEEP_CYCLES)
                a.copy([a.address(b, _DATA)], [srcs[a.rank].data_ptr()], [4 * numel])
                a.signal(b, 7, epoch)
            got = []
            for b in g:
                s = readers[b.rank]
                b.wait(7, epoch, peer=(b.rank - 1) % 4, timeout_s=30.0, stream=s)
                with torch.cuda.stream(s):
                    got.append(b.heap_tensor(b.rank, _DATA, numel, torch.int32).clone())
            for b in g:  # bounded host waits first: a lost signal raises, never hangs
                b.synchronize(timeout_s=20.0, stream=readers[b.rank])
                assert torch.equal(got[b.rank], srcs[(b.rank - 1) % 4]), (epoch, b.rank)
                assert b.read_flag(7) == epoch
                assert b.host_wait_flag(7, epoch, (b.rank - 1) % 4, 1.0) == epoch
            for b in g:  # next round overwrites: B's readers must be done first
                b.heap_tensor(b.rank, _DATA, numel, torch.int32).fill_(-1)
            torch.cuda.synchronize()
    finally:
        _release_waits(g)
        CudaTransport.close_group(g)


def _release_waits(group) -> None:
    """After a failure: set every flag high from the host side of a fresh stream, so no
    stream stays parked on a wait (teardown would otherwise wait for it)."""
    s = torch.cuda.Stream()
    for t in group:
        if not t._closed:
            for slot in list(t._waits._pending):
                t.signal(t.rank, slot, 1 << 40, stream=s)
    s.synchronize()


def test_local_heap_growth_keeps_addresses(group4):
    numel = 1000
    for t in group4:
        t.ensure_heap(_DATA + 4 * numel)
        t.heap_tensor(t.rank, _DATA, numel, torch.int32).copy_(_pattern(t.rank, numel, "cuda"))
    ptrs = [[t.address(p, 0) for p in range(4)] for t in group4]
    size0 = group4[0].heap_nbytes()
    big = size0 + 5 * _MIB + 4  # three more 2 MiB segments
    for t in group4:
        t.ensure_heap(big)
        t.ensure_heap(big - 1)  # no-op
    assert group4[0].heap_nbytes() >= big
    assert [[t.address(p, 0) for p in range(4)] for t in group4] == ptrs
    for t in group4:
        tail = t.heap_tensor(t.rank, big - 4 * numel, numel, torch.int32)
        tail.copy_(_pattern(t.rank + 10, numel, "cuda"))
    torch.cuda.synchronize()
    for t in group4:
        for p in range(4):
            assert torch.equal(t.heap_tensor(p, _DATA, numel, torch.int32), _pattern(p, numel, "cuda"))
            assert torch.equal(t.heap_tensor(p, big - 4 * numel, numel, torch.int32),
                               _pattern(p + 10, numel, "cuda"))


def test_local_host_wait_timeout_names_peer(group4):
    t = group4[1]
    with pytest.raises(PeerTimeoutError, match="rank 2") as info:
        t.host_wait_flag(5, 1, 2, 0.05)
    assert info.value.peer == 2
    assert t.read_flag(5) == 0
    group4[2].signal(1, 5, 3, stream=None)
    assert t.host_wait_flag(5, 3, 2, 10.0) == 3
    # Flags are the first words of the heap, as every rank sees it.
    assert t._flags.flag_addr(1, 5) == group4[2].address(1, 40)
    assert group4[3].heap_tensor(1, 0, 64, torch.int64)[5].item() == 3


def test_local_validation(group4):
    t = group4[0]
    t.ensure_heap(4096)
    with pytest.raises(ValueError, match="exceeds rank 1's heap"):
        t.heap_tensor(1, t.heap_nbytes() - 4, 2, torch.int32)
    with pytest.raises(ValueError, match="offset must be a non-negative multiple of 4"):
        t.heap_tensor(1, 2, 1, torch.float32)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\)"):
        t.heap_tensor(4, 0, 1, torch.int32)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        t.heap_tensor(0, 0, 1, "float32")
    assert t.heap_tensor(0, 0, 0, torch.bfloat16).numel() == 0
    with pytest.raises(ValueError, match="one entry per copy"):
        t.copy([1, 2], [3], [4, 5])
    with pytest.raises(ValueError, match=r"slot must be an int in \[0, 64\)"):
        t.signal(1, 64, 1)
    with pytest.raises(ValueError, match="value must be an int"):
        t.signal(1, 0, -1)
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream"):
        t.signal(1, 0, 1, stream=5)
    with pytest.raises(ValueError, match="peer must be an int"):
        t.wait(0, 1, peer=9, timeout_s=1.0)
    with pytest.raises(ValueError, match="va_bytes"):
        t.ensure_heap(1 << 40)
    with pytest.raises(ValueError, match="rank must be in"):
        CudaTransport(3, 2, lambda x: [x, x], device="cuda:0")
    with pytest.raises(ValueError, match="signal_mode must be one of"):
        CudaTransport.create_local_group(2, device="cuda:0", signal_mode="fast")
    with pytest.raises(ValueError, match="must be a cuda device"):
        CudaTransport.create_local_group(2, device="cpu")


def test_local_close_is_idempotent_and_final():
    with CudaTransport(0, 1, lambda x: [x], device="cuda:0", n_flags=8) as t:
        t.ensure_heap(_MIB)
        t.signal(0, 1, 1)
        t.wait(1, 1, peer=0, timeout_s=1.0)
        t.synchronize(timeout_s=10.0)
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.ensure_heap(1)
    with pytest.raises(RuntimeError, match="closed"):
        t.heap_tensor(0, 0, 1, torch.int32)


def test_local_create_close_cycles_release_everything():
    def cycle():
        g = CudaTransport.create_local_group(4, device="cuda:0", n_flags=16, segment_bytes=2 * _MIB)
        for t in g:
            t.ensure_heap(6 * _MIB)
        g[0].signal(1, 0, 1)
        g[1].wait(0, 1, peer=0, timeout_s=10.0)
        CudaTransport.close_group(g)

    cycle()  # warm-up: lazily created driver and torch state
    torch.cuda.synchronize()
    fds, free, used = _nfds(), _free_bytes(), _own_used_bytes()
    for _ in range(30):
        cycle()
    torch.cuda.synchronize()
    assert _nfds() == fds
    if used is not None:  # this process's own count: neighbours' allocations do not show
        lost = _own_used_bytes() - used
    else:
        lost = free - _settled_free(free, 32 * _MIB)
    print(f"[tide cycles] local: {lost / _MIB:.1f} MiB lost over 30 cycles of 4 ranks")
    assert lost < 32 * _MIB, (free, lost)


# ---------------------------------------------------------------------------------------
# Several processes on the one GPU
# ---------------------------------------------------------------------------------------
def _exchange(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _mp_checks(rank: int, world: int) -> dict:
    torch.cuda.set_device(0)
    numel = (1 << 20) + 1
    out = {}
    with CudaTransport(rank, world, _exchange, device="cuda:0", n_flags=64,
                       segment_bytes=2 * _MIB) as t:
        out["paths"] = (t._copies.copy_path, t._flags.signal_path)
        t.ensure_heap(_DATA + 8 * numel)
        mine = t.heap_tensor(rank, _DATA, numel, torch.int32)
        assert mine.data_ptr() == t.address(rank, _DATA)
        mine.copy_(_pattern(rank, numel, "cuda"))
        push = _DATA + 4 * numel  # where the previous rank pushes to
        t.heap_tensor(rank, push, numel, torch.int32).fill_(-1)
        torch.cuda.synchronize()
        _exchange(None)
        # Pull every peer's region with the copy engines, and read it with kernels.
        outs = [torch.empty(numel, dtype=torch.int32, device="cuda") for _ in range(world)]
        t.copy([o.data_ptr() for o in outs], [t.address(p, _DATA) for p in range(world)],
               [4 * numel] * world)
        t.fence_to()
        for p in range(world):
            assert torch.equal(outs[p], _pattern(p, numel, "cuda")), p
            assert torch.equal(t.heap_tensor(p, _DATA, numel, torch.int32),
                               _pattern(p, numel, "cuda"))
        # Push to the next rank behind a delay, then signal it; wait for the previous one.
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        src = _pattern(rank + 100, numel, "cuda")
        t.fence_from()
        with torch.cuda.stream(t.copy_stream):
            torch.cuda._sleep(_SLEEP_CYCLES)
        t.copy([t.address(nxt, push)], [src.data_ptr()], [4 * numel])
        t.signal(nxt, 3, 1)
        reader = torch.cuda.Stream()
        t.wait(3, 1, peer=prv, timeout_s=60.0, stream=reader)
        with torch.cuda.stream(reader):
            got = t.heap_tensor(rank, push, numel, torch.int32).clone()
        t.synchronize(timeout_s=60.0, stream=reader)
        assert torch.equal(got, _pattern(prv + 100, numel, "cuda"))
        assert t.host_wait_flag(3, 1, prv, 10.0) == 1
        t.synchronize(timeout_s=60.0)
        # A flag no one sets: the host wait times out naming the peer.
        try:
            t.host_wait_flag(9, 1, nxt, 0.05)
        except PeerTimeoutError as exc:
            assert exc.peer == nxt and f"rank {nxt}" in str(exc)
        else:
            raise AssertionError("host_wait_flag did not time out")
        # Growth keeps addresses and contents; the new tail is shared too.
        ptrs = [t.address(p, 0) for p in range(world)]
        before = t.heap_nbytes()
        t.ensure_heap(before + 3 * _MIB)
        assert t.heap_nbytes() >= before + 3 * _MIB
        assert [t.address(p, 0) for p in range(world)] == ptrs
        tail = t.heap_nbytes() - 4 * 1000
        t.heap_tensor(rank, tail, 1000, torch.int32).copy_(_pattern(rank + 50, 1000, "cuda"))
        torch.cuda.synchronize()
        _exchange(None)
        for p in range(world):
            assert torch.equal(t.heap_tensor(p, _DATA, numel, torch.int32),
                               _pattern(p, numel, "cuda"))
            assert torch.equal(t.heap_tensor(p, tail, 1000, torch.int32),
                               _pattern(p + 50, 1000, "cuda"))
        torch.cuda.synchronize()
        _exchange(None)  # nobody closes while a peer still reads
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_multiprocess_transport(world):
    res = run_multiprocess(_mp_checks, world, timeout=100)
    paths = {r["paths"] for r in res}
    assert len(paths) == 1, paths
    print(f"[tide paths] {world} processes: copy={res[0]['paths'][0]} signal={res[0]['paths'][1]}")


def _settled_free(reference: int, margin: int, wait_s: float = 3.0) -> int:
    """Free device bytes, polled for up to ``wait_s`` while still ``margin`` short of
    ``reference`` (memory freed across processes can come back a moment later)."""
    deadline = time.monotonic() + wait_s
    free = _free_bytes()
    while reference - free >= margin and time.monotonic() < deadline:
        time.sleep(0.05)
        free = _free_bytes()
    return free


_ACQUIRE_RELEASE = {  # driver calls that acquire something, and the calls that give it back
    "physical memory (cuMemCreate + cuMemImportFromShareableHandle - cuMemRelease)":
        (("cuMemCreate", "cuMemImportFromShareableHandle"), ("cuMemRelease",)),
    "mappings (cuMemMap - cuMemUnmap)": (("cuMemMap",), ("cuMemUnmap",)),
    "address ranges (cuMemAddressReserve - cuMemAddressFree)": (("cuMemAddressReserve",), ("cuMemAddressFree",)),
    "streams (cuStreamCreate - cuStreamDestroy)": (("cuStreamCreate",), ("cuStreamDestroy",)),
}


def _count_driver_calls() -> dict[str, int]:
    """Wrap the driver module's acquire / release calls (every module reaches them as
    ``cu.<name>`` at call time) with counters of successful calls; returns the counters."""
    counts: dict[str, int] = {}
    names = {n for acq, rel in _ACQUIRE_RELEASE.values() for n in (*acq, *rel)}
    for name in names:
        fn = getattr(driver.cu, name, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, _name=name):
            res = _fn(*args)
            if int((res[0] if isinstance(res, tuple) else res)) == 0:
                counts[_name] = counts.get(_name, 0) + 1
            return res
        setattr(driver.cu, name, counted)
    return counts


def _held(counts: dict[str, int]) -> dict[str, int]:
    """What the counted calls acquired and did not give back, per kind."""
    return {kind: sum(counts.get(n, 0) for n in acq) - sum(counts.get(n, 0) for n in rel)
            for kind, (acq, rel) in _ACQUIRE_RELEASE.items()}


def _mp_cycles(rank: int, world: int, cycles: int) -> dict:
    """``cycles`` create/close cycles in four phases (fd passing by socket, by pidfd, no
    signal-path probe, no growth), each phase's device-memory change recorded apart, so a
    leak names the step that leaks; and this process's own driver acquisitions and releases
    counted (exact whatever else shares the GPU)."""
    torch.cuda.set_device(0)
    driver.init()
    counts = _count_driver_calls()

    def make(mode, signal_mode="auto"):
        return CudaTransport(rank, world, _exchange, device="cuda:0", n_flags=32,
                             segment_bytes=2 * _MIB, fd_passing=mode, signal_mode=signal_mode)

    pidfd = None
    try:
        make("pidfd").close()
    except RuntimeError as exc:  # every rank raises together (shared errors)
        pidfd = str(exc)
    phases = [("socket", "auto", True), ("auto" if pidfd else "pidfd", "auto", True),
              ("socket", "direct", True), ("auto", "auto", False)]
    probe = torch.empty(256, dtype=torch.int32, device="cuda")

    def cycle(mode: str, sig: str, grow: bool, i: int) -> int:
        with make(mode, sig) as t:
            if grow:
                t.ensure_heap((i % 3 + 1) * 2 * _MIB)
            if i % 10 == 0:  # a quick cross-process check now and then
                t.heap_tensor(rank, _DATA, 256, torch.int32).copy_(_pattern(rank + i, 256, "cuda"))
                torch.cuda.synchronize()
                _exchange(None)
                p = (rank + 1) % world
                t.copy([probe.data_ptr()], [t.address(p, _DATA)], [1024])
                t.fence_to()
                assert torch.equal(probe, _pattern(p + i, 256, "cuda")), i
                torch.cuda.synchronize()
                _exchange(None)
            return t.address(rank, 0)

    # Warm-up runs every kind of cycle, torch kernels included: a process's first torch
    # kernels and copies cost ~184 MiB of device memory once (H200, with a warm-up of bare
    # create/close: all of it in the first phase, 0.0 MiB over the 90 cycles after it).
    for mode, sig, grow in phases:
        cycle(mode, sig, grow, 0)
    torch.cuda.synchronize()
    _exchange(None)
    fds, free = _nfds(), _free_bytes()
    held_before = _held(counts)
    deltas, vas = [], []
    i = 0
    for mode, sig, grow in phases:
        _exchange(None)
        f0 = _free_bytes()
        for _ in range(cycles // len(phases)):
            vas.append(cycle(mode, sig, grow, i))
            i += 1
        torch.cuda.synchronize()
        _exchange(None)
        deltas.append((mode, sig, grow, (f0 - _free_bytes()) / _MIB))
    torch.cuda.synchronize()
    _exchange(None)
    raw = _free_bytes()
    settled = _settled_free(free, 32 * _MIB)
    _exchange(None)
    return {"fds": (fds, _nfds()), "free": (free, raw, settled), "pidfd": pidfd,
            "phases": deltas, "cycles": i, "distinct_va": len(set(vas)),
            "held": (held_before, _held(counts)), "creates": counts.get("cuMemCreate", 0)}


@pytest.mark.multiproc
def test_multiprocess_create_close_cycles_leak_nothing():
    res = run_multiprocess(_mp_cycles, 2, 120, timeout=120)
    info = "; ".join(f"rank {r}: phases (mode, signal, grow, MiB lost) {o['phases']}, "
                     f"{o['distinct_va']} distinct heap addresses" for r, o in enumerate(res))
    print(f"[tide cycles] {res[0]['cycles']} cycles; pidfd: {res[0]['pidfd'] or 'ok'}; {info}")
    for r, out in enumerate(res):
        before, after = out["fds"]
        assert before == after, f"rank {r}: {before} fds before, {after} after"
    assert res[0]["cycles"] >= 100
    for r, out in enumerate(res):  # exact, whatever else runs on the GPU
        before, after = out["held"]
        assert out["creates"] >= res[0]["cycles"], f"rank {r}: the driver calls were not counted ({out['creates']})"
        assert before == after, f"rank {r}: driver objects held before the cycles {before}, after {after}"
    # Both processes share the GPU: compare at points where neither holds a transport.
    free0 = min(out["free"][0] for out in res)
    raw = min(out["free"][1] for out in res)
    settled = min(out["free"][2] for out in res)
    print(f"[tide cycles] device memory lost: {(free0 - raw) / _MIB:.1f} MiB at once, "
          f"{(free0 - settled) / _MIB:.1f} MiB after settling")
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # other tests' processes move the free memory
        assert free0 - settled < 32 * _MIB, (free0, raw, settled, info)


def test_local_wide_strided_runs_exact_as_3d_sub_rows(group4):
    """Strided runs of wide rows between ranks on this GPU go as cuMemcpy3DAsync of sub-rows
    (tide_triton.transport.copies.sub_row_bytes), narrow ones as cuMemcpy2DAsync: both exact,
    eagerly and replayed from a CUDA graph."""
    from cuda.bindings import driver as cu

    K = 1 << 10
    runs = [(5, 256 * K, 512 * K, 384 * K), (4, 3 * K + 2, 8 * K, 5 * K)]  # (rows, width, dst / src pitch)
    src_bytes = sum(r * sp for r, _w, _dp, sp in runs)
    for t in group4:
        t.ensure_heap(_DATA + src_bytes)
    t, peer = group4[0], group4[1]
    src = peer.heap_tensor(1, _DATA, src_bytes, torch.uint8)
    src.copy_(torch.randint(0, 256, (src_bytes,), dtype=torch.int32, device="cuda").to(torch.uint8))
    torch.cuda.synchronize()
    outs, strided, off = [], [], 0
    for rows, width, dp, sp in runs:
        out = torch.zeros(rows * dp, dtype=torch.uint8, device="cuda")
        outs.append(out)
        strided.append((out.data_ptr(), t.address(1, _DATA + off), width, rows, dp, sp))
        off += rows * sp
    prep = t.prepare_copies([], [], [], strided=strided)
    assert [type(m) for m in prep.strided] == [cu.CUDA_MEMCPY3D, cu.CUDA_MEMCPY2D]

    def expected():
        got, o = [], 0
        for rows, width, dp, sp in runs:
            want = torch.zeros(rows * dp, dtype=torch.uint8, device="cuda")
            want.view(rows, dp)[:, :width] = src[o:o + rows * sp].view(rows, sp)[:, :width]
            got.append(want)
            o += rows * sp
        return got

    t.fence_from()
    t.copy_prepared(prep)
    t.fence_to()
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, expected()))
    for o in outs:
        o.zero_()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=side):
        t.copy_prepared(prep, stream=side, capturable=True)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, expected()))


def test_local_copies_over_adjacent_allocations_are_cut_and_exact(group4):
    """The driver refuses a copy (1-D, 2-D or 3-D, eager or captured) whose source or
    destination spans two cuMemAlloc allocations (docs/constraints.md#no-copy-spans-two-allocations).  Eight
    4 MiB tensors fill the caching allocator's 20 MiB segments five at a time: a strided run
    over the eight tensors' second halves, and one copy over two neighbours at a segment's
    seam, are cut where the segment ends -- exact, eagerly and replayed from a graph (uncut:
    CUDA_ERROR_INVALID_VALUE, docs/constraints.md#no-copy-spans-two-allocations)."""
    from cuda.bindings import driver as cu

    def base(p):
        err, b, _size = cu.cuMemGetAddressRange(cu.CUdeviceptr(p))
        assert int(err) == 0
        return int(b)

    n = _MIB
    pool = torch.cuda.MemPool()  # fresh segments, whatever other tests left cached
    with torch.cuda.use_mem_pool(pool):
        xs = [torch.arange(n, dtype=torch.int32, device="cuda").add_(i * 7919) for i in range(8)]  # 4 MiB each
    ptrs = [x.data_ptr() for x in xs]
    seams = [i for i in range(7) if ptrs[i + 1] == ptrs[i] + 4 * n and base(ptrs[i + 1]) != base(ptrs[i])]
    if len(set(ptrs[i + 1] - ptrs[i] for i in range(7))) != 1 or not seams:
        pytest.skip(f"the caching allocator placed the tensors otherwise ({[hex(p) for p in ptrs]})")
    t = group4[0]
    half = 2 * n  # bytes: the second half of each tensor
    rows = torch.zeros(8 * half, dtype=torch.uint8, device="cuda")
    pair = torch.zeros(8 * n, dtype=torch.uint8, device="cuda")
    i = seams[0]
    prep = t.prepare_copies([pair.data_ptr()], [ptrs[i]], [8 * n],
                            strided=[(rows.data_ptr(), ptrs[0] + half, half, 8, half, 4 * n)])
    assert len(prep.strided) + len(prep.nbytes) >= 3  # cut: two runs (or rows) and two copies

    def check():
        torch.cuda.synchronize()
        want_rows = torch.cat([x.view(torch.uint8)[half:] for x in xs])
        want_pair = torch.cat([xs[i].view(torch.uint8), xs[i + 1].view(torch.uint8)])
        assert torch.equal(rows, want_rows) and torch.equal(pair, want_pair)

    t.fence_from()
    t.copy_prepared(prep)
    t.fence_to()
    check()
    rows.zero_(), pair.zero_()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=side):
        t.copy_prepared(prep, stream=side, capturable=True)
    graph.replay()
    check()
