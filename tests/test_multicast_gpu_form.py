"""The NVSwitch multicast path's GPU form (``multicast_exec.path`` -> ``_create`` ->
``GpuMulticast`` -> the multimem launchers) driven on CPU against the fake driver, the kernels
replaced by their torch references (tests/fake_multicast.py), and the object's agreement.

Each test names the behaviour it pins.  Nothing here creates a real multicast object or launches
a kernel (docs/multicast.md)."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from _dist import run_threads
from fake_multicast import (FakeDriver, FakeGroup, FakeHeaps, FakeKernel, OnCuda, ThreadExchange, run_reduce,
                            run_store)

from tide_triton.runtime import device_wide
from tide_triton.executors import multicast as mcx
from tide_triton.errors import PeerTimeoutError
from tide_triton.kernels import multimem as mm
from tide_triton.plan.layout import ShardLayout
from tide_triton.transport import driver as drv
from tide_triton.transport.multicast import MulticastObject

BOUND = 256
"""Bytes bound per rank in these tests (128 bf16 elements: several chunks, split shards)."""

# Awkward shapes: a dim 0 smaller than W, a prime, 1-D, a 3-D parameter, 1 element.
SHAPES = [(7, 5), (2,), (1, 4, 3), (13, 2), (97,), (1,)]


class _IdleStream:
    def synchronize(self) -> None:
        pass


class GpuForm:
    """The fakes installed around ``multicast_exec``'s GPU form for one test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, W: int, *, multicast: str = "on") -> None:
        self.W = W
        self.fake = FakeDriver()
        self.heaps = FakeHeaps(self.fake, W, 4096 + (2 << 20) + BOUND)
        ex = ThreadExchange(W)
        self.groups = [FakeGroup(r, W, ex.of(r), multicast=multicast, timeout_s=10) for r in range(W)]
        self.device_wide_syncs: list = []
        self.settles: list = []
        self.reduce_kernel = FakeKernel(self.fake, run_reduce)
        self.store_kernel = FakeKernel(self.fake, run_store)

        def device_context(device):  # what the real one does: torch.cuda.synchronize(device), then retain
            self.device_wide_syncs.append(device)
            return drv.primary_context(device.index)

        class _Guard:
            def __init__(self, ctx):
                pass

            def __enter__(self):
                return None

            def __exit__(self, *exc):
                return None

        def settle(what, index):
            self.settles.append((what, index, len(self.reduce_kernel.launches) + len(self.store_kernel.launches)))

        for k in ("TIDE_TRITON_MULTICAST", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setattr(drv, "init", lambda: self.fake)
        monkeypatch.setattr(drv, "device_context", device_context)
        monkeypatch.setattr(drv, "CtxGuard", _Guard)
        monkeypatch.setattr(mcx, "_BOUND_BYTES", BOUND)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _IdleStream())
        monkeypatch.setattr(mm, "multimem_reduce_kernel", self.reduce_kernel)
        monkeypatch.setattr(mm, "multimem_store_kernel", self.store_kernel)
        monkeypatch.setattr(device_wide, "before", settle)
        if hasattr(mm, "_LOADED"):
            monkeypatch.setattr(mm, "_LOADED", set())
        # the launchers themselves run (their checks), on CPU tensors taken for CUDA ones
        monkeypatch.setattr(mcx, "multimem_reduce",
                            lambda mc, off, out, **kw: mm.multimem_reduce(mc, off, OnCuda(out), **kw))
        monkeypatch.setattr(mcx, "multimem_store", lambda src, mc, off: mm.multimem_store(OnCuda(src), mc, off))

    def path(self, r: int):
        return mcx.path(self.groups[r], torch.device("cuda", r), self.heaps.of(r))

    def close(self) -> None:
        for g in self.groups:
            g.close()


def _inputs(W: int, layout: ShardLayout, shard_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    # Integer values: every sum is exact in fp32 and in bf16 (what the switch returns).
    grads = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16) for s in SHAPES] for _ in range(W)]
    full = [torch.randint(-50, 51, s, generator=gen).to(shard_dtype) for s in SHAPES]
    return grads, full


def _collectives(form: GpuForm, layout: ShardLayout, grads, full, shard_dtype):
    W = form.W

    def rank(r):
        buf = form.path(r)
        assert isinstance(buf, mcx.GpuMulticast)
        shards = [torch.full(s, 7.0) for s in layout.shard_shapes(r, padded=True)]
        mcx.reduce_scatter_node(buf, grads[r], shards, layout, r, scale=0.5, accumulate=False)
        acc = [torch.ones(s) for s in layout.shard_shapes(r)]
        mcx.reduce_scatter_node(buf, grads[r], acc, layout, r, scale=None, accumulate=True)
        mine = [f[r * c: r * c + n].contiguous() for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(r))]
        params = [torch.full(s, 3.0, dtype=torch.bfloat16) for s in layout.padded_shapes]
        mcx.all_gather_node(buf, mine, params, layout, r)
        return shards, acc, params

    out = run_threads(rank, W, timeout=120)
    for r in range(W):
        shards, acc, params = out[r]
        for i, s in enumerate(SHAPES):
            c, n = layout.rows_per_rank[i], layout.shard_rows(r)[i]
            total = sum(grads[q][i].float() for q in range(W))[r * c: r * c + n]
            assert torch.equal(shards[i][:n], total * 0.5)
            assert torch.equal(shards[i][n:], torch.zeros_like(shards[i][n:]))
            assert torch.equal(acc[i], total + 1)
            padded = torch.zeros(layout.padded_shapes[i], dtype=torch.bfloat16)
            padded[:s[0]] = full[i].to(torch.bfloat16)
            assert torch.equal(params[i], padded)


@pytest.mark.parametrize("W", [2, 3])
def test_gpu_form_collectives_exact(W, monkeypatch):
    """The GPU form end to end (creation over a heap region, the launchers' checks, chunks)."""
    form = GpuForm(monkeypatch, W)
    layout = ShardLayout(SHAPES, W)
    grads, full = _inputs(W, layout, torch.float32)
    try:
        assert len(mcx.chunk_plan(layout, BOUND // 2)) > 1
        _collectives(form, layout, grads, full, torch.float32)
    finally:
        form.close()
    assert form.fake.live() == {} and form.fake.contexts == {}


def test_gpu_form_all_gather_takes_fp16_shards(monkeypatch):
    """Finding: ``eligible_ag`` looks at the parameters' dtype only, and the all-gather accepts
    fp16 shards, but ``multimem_store`` refused them (TypeError mid-call, after the check-in:
    the group broke) -- a valid call failed only because multicast was on."""
    W = 2
    form = GpuForm(monkeypatch, W)
    layout = ShardLayout(SHAPES, W)
    grads, full = _inputs(W, layout, torch.float16)
    try:
        _collectives(form, layout, grads, full, torch.float16)
    finally:
        form.close()


def test_creation_makes_no_device_wide_synchronize(monkeypatch):
    """Finding: ``_create`` took the context through ``driver.device_context``, whose
    ``torch.cuda.synchronize(device)`` waits, in the middle of a collective and without a
    deadline, for every stream of the device -- streams that may hold an earlier collective's
    waits on a peer that died.  The transport made the primary context already."""
    form = GpuForm(monkeypatch, 2)
    try:
        run_threads(form.path, 2, timeout=60)
    finally:
        form.close()
    assert form.device_wide_syncs == []
    assert form.fake.contexts == {}, "every retain released at close"


def test_barrier_has_a_deadline_naming_the_peer(monkeypatch):
    """Finding: ``GpuMulticast.barrier`` synchronised the stream with no deadline; a stream
    holding an earlier collective's wait on a dead peer held the rank forever.  It now raises
    the transport's error (naming the peer) after the group's timeout."""
    form = GpuForm(monkeypatch, 2)
    bufs = run_threads(form.path, 2, timeout=60)
    stuck = threading.Event()

    class _Stuck:
        def synchronize(self):
            stuck.wait(60)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stuck())
    form.heaps.stuck_on = 1
    buf = bufs[0]
    buf.exchange = lambda obj: [obj, obj]
    if hasattr(buf, "timeout_s"):
        buf.timeout_s = 0.5
    got: list = []

    def run():
        try:
            buf.barrier()
            got.append(None)
        except BaseException as e:  # noqa: BLE001
            got.append(e)
    th = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    th.start()
    th.join(10)
    stuck.set()
    try:
        assert got, f"the barrier still waited after {time.monotonic() - t0:.1f} s"
        assert isinstance(got[0], PeerTimeoutError) and got[0].peer == 1, got
        assert "multicast" in str(got[0])
    finally:
        th.join(5)
        form.close()


def test_first_launch_of_each_kernel_variant_settles_first(monkeypatch):
    """Finding: a kernel variant's first launch loads its module, which waits for every stream
    of the process (tide_triton.runtime.device_wide); the multimem launchers did not settle first (the
    store is launched before any barrier, behind whatever the stream holds)."""
    W = 2
    form = GpuForm(monkeypatch, W)
    layout = ShardLayout(SHAPES, W)
    grads, full = _inputs(W, layout, torch.float32)
    try:
        _collectives(form, layout, grads, full, torch.float32)
        n_settles = len(form.settles)
        assert n_settles > 0
        # every settle came before the launch it was for: the first launch of each kind
        assert form.settles[0][2] == 0
        # repeated calls load nothing new
        _collectives(form, layout, grads, full, torch.float32)
        assert len(form.settles) == n_settles
    finally:
        form.close()
    launched = {("reduce", kw["HAS_SCALE"], kw["ACCUMULATE"]) for _, _, kw in form.reduce_kernel.launches}
    assert len(launched) == 2 and n_settles >= len(launched) + 1  # two reduce variants, the store


def test_reduce_kernel_launched_without_fp_fusion(monkeypatch):
    """Finding: ``out = scale * sum + old`` compiled to one ``fma`` (one rounding) while the
    torch reference and the copy-engine path round twice (tide_triton/kernels/segments.py
    compiles its kernel with ``enable_fp_fusion=False`` for that reason)."""
    W = 2
    form = GpuForm(monkeypatch, W)
    layout = ShardLayout(SHAPES, W)
    grads, full = _inputs(W, layout, torch.float32)
    try:
        _collectives(form, layout, grads, full, torch.float32)
    finally:
        form.close()
    opts = [{k: v for k, v in kw.items() if k == "enable_fp_fusion"} for _, _, kw in form.reduce_kernel.launches]
    assert opts and all(o == {"enable_fp_fusion": False} for o in opts), opts
    pytest.importorskip("triton.backends.compiler")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    real = mm._jit(mm._multimem_reduce_kernel)
    try:
        k = triton.compile(ASTSource(fn=real, signature={
            "mc_addr": "i64", "out_ptr": "*fp32", "numel": "i64", "scale": "fp32", "HAS_SCALE": "constexpr",
            "ACCUMULATE": "constexpr", "BLOCK": "constexpr"}, constexprs={"HAS_SCALE": True, "ACCUMULATE": True,
                                                                        "BLOCK": 512}),
            target=GPUTarget("cuda", 90, 32), options=opts[0])
    except RuntimeError as e:
        pytest.skip(f"cannot compile for sm_90 here: {e}")
    assert "fma" not in k.asm["ptx"]


def test_group_with_multicast_is_collectable_after_close(monkeypatch):
    """Finding: the per-group decisions sat in a module-level ``WeakKeyDictionary`` whose value
    (the ``GpuMulticast``) holds ``g.exchange``, i.e. the group: the key never died, so every
    group that used multicast stayed alive (with its caches and zero buffer) for the process."""
    form = GpuForm(monkeypatch, 2)
    run_threads(form.path, 2, timeout=60)
    refs = [weakref.ref(g) for g in form.groups]
    form.close()
    form.groups.clear()  # the fakes' patches keep the form itself
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_creation_failure_after_the_object_releases_it_on_every_rank(monkeypatch):
    """Finding: a failure in ``_create`` after the object was made (the bound view) left the
    object bound, mapped and held, and the context retained, on that rank -- and only that
    rank raised: its peers kept (and cached) their buffers, so at the next call they took
    the multicast path while it resolved again, their exchanges paired with each other."""
    W = 2
    form = GpuForm(monkeypatch, W)
    form.heaps.fail_heap_tensor.add(1)
    errs: dict = {}

    def one(r):
        try:
            return form.path(r)
        except RuntimeError as e:
            errs[r] = str(e)
    run_threads(one, W, timeout=60)
    assert sorted(errs) == [0, 1] and all("injected" in e for e in errs.values()), errs
    assert all(g.executor_state is None or g.executor_state.multicast.get("cuda") is None
               for g in form.groups), "no rank kept buffers"
    assert form.fake.live() == {}, "released before any close"
    assert form.fake.contexts == {}
    form.close()


def test_ranks_with_different_sizes_raise_everywhere():
    """Finding: the object's ``size`` (and each rank's granularity) were not agreed: rank 0
    created the object with its size, every rank bound and mapped its own -- a rank binding
    less than the others receives none of the stores past its end, silently."""
    fake = FakeDriver()
    W = 2
    raws = []
    for r in range(W):
        raw = torch.zeros(1024 + 2 * fake.granularity, dtype=torch.uint8)
        fake.register(raw, r)
        raws.append(raw)
    ptrs = [-(-t.data_ptr() // fake.granularity) * fake.granularity for t in raws]
    ex = ThreadExchange(W)
    errs: dict = {}

    def one(r):
        try:
            MulticastObject(fake, rank=r, local_size=W, exchange=ex.of(r), cudev=r, device_index=r,
                            bind_ptr=ptrs[r], size=1024 if r == 0 else 512, timeout_s=10).close()
        except (RuntimeError, ValueError) as e:
            errs[r] = str(e)
    run_threads(one, W)
    assert sorted(errs) == [0, 1], errs
    assert all("rank 0: 1024 bytes" in e and "rank 1: 512 bytes" in e for e in errs.values()), errs
    assert fake.multicast_calls().count("cuMulticastCreate") == 0 and fake.live() == {}


def test_all_gather_enqueues_no_store_behind_a_stuck_stream(monkeypatch):
    """Finding (with the barrier's deadline): the all-gather enqueued its multicast stores
    before its first barrier, behind whatever the stream held.  A stream stuck on an earlier
    collective's wait made the barrier raise with the stores still queued; closing the group
    then unmaps the multicast range (extras close before the transports), and a close that
    releases the stuck waits (every peer aborted) would run them on an unmapped address.
    Now the stream is settled, with the deadline, before the first store."""
    W = 2
    form = GpuForm(monkeypatch, W)
    layout = ShardLayout(SHAPES, W)
    _, full = _inputs(W, layout, torch.float32)
    bufs = run_threads(form.path, W, timeout=60)
    stuck = threading.Event()

    class _Stuck:
        def synchronize(self):
            stuck.wait(60)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stuck())
    form.heaps.stuck_on = 1
    buf = bufs[0]
    buf.exchange = lambda obj: [obj, obj]
    buf.timeout_s = 0.5
    mine = [f[:n].contiguous() for f, n in zip(full, layout.shard_rows(0))]
    params = [torch.empty(s, dtype=torch.bfloat16) for s in layout.padded_shapes]
    try:
        with pytest.raises(PeerTimeoutError, match="rank 1"):
            mcx.all_gather_node(buf, mine, params, layout, 0)
        assert form.store_kernel.launches == []
    finally:
        stuck.set()
        form.close()


class _SharedBuffers:
    """:class:`~tide_triton.executors.multicast.MulticastBuffers` of plain tensors shared by rank
    threads: a store lands in every rank's buffer, a reducing load sums them all."""

    def __init__(self, bufs: list, rank: int, barrier: threading.Barrier) -> None:
        self.bufs, self.rank, self._barrier = bufs, rank, barrier
        self.numel = bufs[rank].numel()

    def local(self, offset: int, numel: int) -> torch.Tensor:
        return self.bufs[self.rank][offset:offset + numel]

    def reduce(self, offset: int, out: torch.Tensor, *, scale, accumulate: bool) -> None:
        mm.multimem_reduce_ref(self.bufs, offset, out, scale=scale, accumulate=accumulate)

    def store(self, src: torch.Tensor, offset: int) -> None:
        mm.multimem_store_ref(src, self.bufs, offset)

    def barrier(self) -> None:
        self._barrier.wait()


@pytest.mark.parametrize("collective", ["reduce_scatter", "all_gather"])
def test_the_multicast_branches_check_their_tensors_like_the_copy_engine_path(collective, monkeypatch):
    """The collectives' multicast branches run the checks the copy-engine path runs on a new
    set of addresses -- without them two shards over the same bytes sum into each other without
    an error, a shard over parameter bytes sends rows another chunk overwrote.  Every rank
    raises, naming the argument, before anything moves."""
    import tide_triton as tt
    from tide_triton.executors import multicast as multicast_exec

    W = 2
    shapes = [(6, 4), (6, 4)]
    layout = ShardLayout(shapes, W)
    bar = threading.Barrier(W, timeout=20)
    bufs = [torch.zeros(256, dtype=torch.bfloat16) for _ in range(W)]
    monkeypatch.setattr(multicast_exec, "path",
                        lambda g, device, t: _SharedBuffers(bufs, g.rank, bar))
    groups = tt.local_groups(W, timeout_s=10, multicast="on")

    def rank(r: int) -> str:
        try:
            if collective == "reduce_scatter":
                grads = [torch.ones(s, dtype=torch.bfloat16) for s in shapes]
                flat = torch.zeros(layout.shard_shapes(r)[0]).reshape(-1)
                shards = [flat.view(layout.shard_shapes(r)[0])] * 2 if r == 1 else \
                    [torch.zeros(s) for s in layout.shard_shapes(r)]
                tt.reduce_scatter(grads, shards, group=groups[r], op="sum")
            else:
                params = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
                rows = layout.rows_per_rank[0]
                bf16 = torch.bfloat16
                shard = params[0][(1 - r) * rows:(2 - r) * rows] if r == 1 else torch.ones(rows, 4, dtype=bf16)
                tt.all_gather([shard, torch.ones(rows, 4, dtype=bf16)], params, group=groups[r])
        except Exception as e:  # noqa: BLE001 - every rank must raise
            return f"{type(e).__name__}: {e}"
        return "no error"

    try:
        out = run_threads(rank, W, timeout=60)
    finally:
        for g in groups:
            g.close()
    want = "shards[1] shares memory with shards[0]" if collective == "reduce_scatter" else \
        "params[0] shares memory with shards[0]"
    assert want in out[1] or ("overlap" in out[1] and collective == "reduce_scatter"), out
    assert out[0] != "no error" and "rank 1" in out[0], out


def test_ranks_sharing_a_gpu_do_not_take_the_multicast_path():
    """Two ranks on one GPU pass every per-rank fact of the guard, and ``cuMulticastAddDevice``
    then fails on every rank: the guard compares the ranks' GPU identifiers, so ``"auto"``
    falls back instead of raising."""
    from tide_triton.transport.multicast import RankFacts, multicast_allowed, resolve_multicast

    apart = [RankFacts("auto", True, None, "gpu-a"), RankFacts("auto", True, None, "gpu-b")]
    assert multicast_allowed(apart).allowed
    shared = [RankFacts("auto", True, None, "gpu-a"), RankFacts("auto", True, None, "gpu-b"),
              RankFacts("auto", True, None, "gpu-a")]
    d = multicast_allowed(shared)
    assert not d.allowed and "ranks 0 and 2 share one GPU" in d.reason
    assert multicast_allowed([RankFacts("auto", True, None)] * 2).allowed  # unknown: not compared
    ex = ThreadExchange(2)
    out = run_threads(lambda r: resolve_multicast("auto", rank=r, exchange=ex.of(r), env={}, query=lambda: True,
                                                  device=lambda: "same-gpu"), 2)
    assert [x.allowed for x in out] == [False, False]
    ex2 = ThreadExchange(2)

    def on(r):
        try:
            resolve_multicast("on", rank=r, exchange=ex2.of(r), env={}, query=lambda: True, device=lambda: "same-gpu")
        except RuntimeError as e:
            return str(e)
        return "no error"

    assert all("share one GPU" in m for m in run_threads(on, 2)), "on: every rank raises, saying why"
