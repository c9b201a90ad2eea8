"""Host cost of a collective independent of the parameter count: copy plans
(:func:`tide_triton.executors.copy_plan.plan_copies`) merge back-to-back copies and make runs of equal
copies one strided copy, exactly.

* The plan moves every byte from the same source as the list it replaces (random lists on a
  byte buffer, and the collectives themselves: results bit-identical with and without plans).
* On the real workloads with parameters allocated back to back (FSDP2's padded
  all-gather outputs, a flat gradient buffer), the descriptors of an all-gather and of a
  reduce-scatter round are O(W x distinct shape runs), not O(W x parameters): counted here
  at full size (pure Python, no tensors) before and after.
"""
from __future__ import annotations

import random

import pytest
import torch

try:
    from _dist import run_multiprocess, run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess, run_threads

import tide_triton.collectives as coll
import tide_triton.executors.prepare as node_prepare
from tide_triton.executors.copy_plan import STRIDED_MIN_ROWS, Strided, expand_copies, plan_copies, prepare_planned
from tide_triton.plan.heap import ring as heap_ring
from tide_triton.plan.layout import ShardLayout
from tide_triton.plan.schedule import ring_plan
from tide_triton.plan.workloads import layer_shapes, scaled_shapes


# ------------------------------------------------------------------------------ the planner
def _apply(buf: bytearray, dsts, srcs, sizes) -> bytearray:
    """Copies of one batch read the buffer as it was before the batch (any order is allowed)."""
    src = bytes(buf)
    out = bytearray(buf)
    for d, x, n in zip(dsts, srcs, sizes):
        out[d:d + n] = src[x:x + n]
    return out


def _random_copies(rng: random.Random, size: int):
    """Disjoint destinations in the upper half, sources in the lower half: runs back to back,
    runs at constant strides (equal sizes), awkward sizes (1, primes), empty copies."""
    dsts, srcs, sizes = [], [], []
    d, x = size // 2, 0
    while True:
        kind = rng.choice(["plain", "contig", "strided", "empty"])
        n = rng.choice([1, 2, 3, 7, 16, 31])
        rows = rng.randint(1, 9)
        gap_d, gap_s = rng.choice([0, 0, 1, 5]), rng.choice([0, 1, 4])
        if d + rows * (n + gap_d) >= size or x + rows * (n + gap_s) >= size // 2:
            return dsts, srcs, sizes
        for _ in range(rows if kind in ("contig", "strided") else 1):
            dsts.append(d)
            srcs.append(x)
            sizes.append(0 if kind == "empty" else n)
            d += n + (gap_d if kind == "strided" else 0)
            x += n + (gap_s if kind == "strided" else 0)
        d += rng.choice([0, 3])
        x += rng.choice([0, 2])


@pytest.mark.parametrize("seed", range(12))
def test_plan_moves_the_same_bytes(seed: int) -> None:
    rng = random.Random(seed)
    size = 4096
    buf = bytearray(rng.randrange(256) for _ in range(size))
    dsts, srcs, sizes = _random_copies(rng, size)
    plan = plan_copies(dsts, srcs, sizes, min_rows=rng.choice([2, STRIDED_MIN_ROWS]))
    assert _apply(buf, *expand_copies(plan)) == _apply(buf, dsts, srcs, sizes)
    assert len(plan) <= sum(1 for n in sizes if n)
    assert all(c.rows == 1 or (c.dst_pitch >= c.nbytes and c.src_pitch >= c.nbytes) for c in plan)


def test_plan_merges_and_strides() -> None:
    # back to back on both sides: one copy; back to back on one side only: kept apart
    assert plan_copies([100, 110], [0, 10], [10, 5]) == [Strided(100, 0, 15)]
    assert plan_copies([100, 110], [0, 20], [10, 5]) == [Strided(100, 0, 10), Strided(110, 20, 5)]
    # 5 equal copies at strides (30, 8): one strided copy; 3 stay plain below min_rows=4
    rows = plan_copies([1000 + 30 * i for i in range(5)], [8 * i for i in range(5)], [8] * 5)
    assert rows == [Strided(1000, 0, 8, 5, 30, 8)]
    assert len(plan_copies([1000 + 30 * i for i in range(3)], [8 * i for i in range(3)], [8] * 3)) == 3
    # a source pitch below the size (rows would overlap) never makes a strided copy
    assert all(c.rows == 1 for c in plan_copies([0, 100, 200, 300, 400], [0] * 5, [8] * 5))


def test_plan_validation() -> None:
    with pytest.raises(ValueError, match="one entry per copy, got 2, 1 and 1"):
        plan_copies([0, 1], [0], [1])
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -3"):
        plan_copies([0], [0], [-3])


# ------------------------------------------------------------------------------ descriptor counts
class _Counting:
    """A transport stand-in for the prepare functions: addresses in a flat space, the
    prepared copies kept as plans (descriptors = plan entries)."""

    strided_copies = True

    def __init__(self, heap_bytes: int) -> None:
        self.heap_bytes = heap_bytes

    def address(self, rank: int, offset: int) -> int:
        return (1 << 44) + rank * self.heap_bytes + offset

    def prepare_copies(self, dsts, srcs, nbytes, *, strided=()):
        return [Strided(d, x, n) for d, x, n in zip(dsts, srcs, nbytes)] + list(strided)


class _G:
    def __init__(self, W: int) -> None:
        self.world_size = W


def _runs(sizes) -> int:
    """Descriptors of one rank's copies when maximal runs of consecutive equal sizes are one
    strided copy each (runs shorter than STRIDED_MIN_ROWS: one copy per row)."""
    lengths: list[int] = []
    for i, s in enumerate(sizes):
        if i and sizes[i - 1] == s:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return sum(1 if n >= STRIDED_MIN_ROWS else n for n in lengths)


def _contiguous(numels, es: int, base: int = 1 << 40) -> tuple[int, ...]:
    out, acc = [], base
    for n in numels:
        out.append(acc)
        acc += n * es
    return tuple(out)


MODELS = ("llama-3.1-70b", "qwen3-30b-a3b", "synthetic-moe-256e")


@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("model", MODELS)
def test_all_gather_descriptors_are_o_of_w(model: str, W: int) -> None:
    layout = ShardLayout(layer_shapes(model), W)
    es = 2
    pptrs = _contiguous(layout.padded_numels, es)  # FSDP2's padded outputs, back to back
    reg = heap_ring(64, W, 1 << 20, 2, 0)
    batches = node_prepare.prepare_all_gather(_G(W), _Counting(1 << 36), layout, pptrs, es, None, reg.ag_off)
    after = sum(len(b) for b in batches)
    before = sum(1 for r in range(W) for n in layout.shard_numels(r) if n)
    bound = W * (_runs(layout.padded_shard_numels) + 1)  # +1: the last rank's short rows
    assert after <= bound, (model, W, before, after)
    if len(layout) > 100:  # the MoE layers: the plan removes the parameter count
        assert after * 20 <= before, (model, W, before, after)


@pytest.mark.parametrize("W", [2, 4, 8])
@pytest.mark.parametrize("model", MODELS)
def test_reduce_scatter_push_descriptors_are_o_of_w(model: str, W: int) -> None:
    layout = ShardLayout(layer_shapes(model), W)
    es, ring_bytes, stages = 2, 256 << 20, 2
    gptrs = _contiguous(layout.padded_numels, es)  # a flat gradient buffer (padded rows)
    reg = heap_ring(64, W, ring_bytes, stages, 0)
    plan = ring_plan(layout, ring_bytes, es, stages)
    t = _Counting(1 << 36)
    for me in range(W):
        rounds = node_prepare.push_plans(me, plan, t.address, reg, gptrs, es)
        for j, p in enumerate(rounds):
            pieces = [[layout.padded_shard_numels[pc.param] for pc in plan.chunks[d][j]]
                      for d in range(W) if d != me and j < len(plan.chunks[d])]
            bound = sum(_runs(x) + 2 for x in pieces)  # +2: a chunk's first and last pieces are partial
            assert len(p) <= bound, (model, W, me, j, len(p), bound)
        before = sum(len(plan.chunks[d][j]) for d in range(W) if d != me for j in range(len(plan.chunks[d])))
        after = sum(len(p) for p in rounds)
        if len(layout) > 100:  # the MoE layers (measured: Qwen3 W=8 2807 -> 238, 256 experts 5432 -> 133)
            assert after * 8 <= before, (model, W, me, before, after)


# ------------------------------------------------------------------------------ exact end to end
def _flat_views(shapes, dtype, fill=None, gen=None, device="cpu"):
    """Tensors of ``shapes`` carved back to back out of one buffer (as FSDP2 allocates)."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if fill is None:
        flat = torch.randint(-8, 9, (sum(numels),), generator=gen).to(dtype).to(device)
    else:
        flat = torch.full((sum(numels),), fill, dtype=dtype, device=device)
    out, o = [], 0
    for s, n in zip(shapes, numels):
        out.append(flat[o:o + n].view(s))
        o += n
    return out


def _planned_and_unplanned(rank: int, world_size: int, W: int, device: str) -> dict:
    """Both runs of test_planned_collectives_exact_and_bit_identical in this process (a
    spawned child on the GPU): the W ranks are threads of it (single-process mode)."""
    import tide_triton as tt

    full = scaled_shapes("synthetic-moe-256e", 32)
    shapes = list(full[:1 + 3 * 16]) + list(full[-2:])
    layout = ShardLayout(shapes, W)
    gen = torch.Generator().manual_seed(W)
    dev = torch.device(device)
    grads = [_flat_views(shapes, torch.bfloat16, gen=gen, device=dev) for _ in range(W)]
    counts: list[tuple[int, int]] = []
    real_plan = node_prepare.plan_copies

    def counting(dsts, srcs, sizes, **k):
        p = real_plan(dsts, srcs, sizes, **k)
        counts.append((sum(1 for n in sizes if n), len(p)))
        return p

    def unplanned(dsts, srcs, sizes, **k):  # lists, or arrays for long push rounds
        return [Strided(int(d), int(x), int(n)) for d, x, n in zip(dsts, srcs, sizes) if n]

    def run(plan_fn):
        node_prepare.plan_copies = plan_fn
        # On the GPU a stuck wait must end in an error naming the rank well inside the test
        # timeout of bench/gpu_tests.sh.
        groups = tt.local_groups(W, timeout_s=20 if dev.type == "cuda" else 60, ring_bytes=4096 * W,
                                 devices=[dev] * W if dev.type == "cuda" else None)

        def body(r: int):
            if dev.type == "cuda":  # every rank its own compute stream, as on its own GPU
                with torch.cuda.stream(torch.cuda.Stream(dev)):
                    return ranked(r)
            return ranked(r)

        def ranked(r: int):
            shards = _flat_views(layout.shard_shapes(r, padded=True), torch.float32, fill=-1.0, device=dev)
            tt.reduce_scatter(grads[r], shards, group=groups[r], op="sum")
            tt.reduce_scatter(grads[r], shards, group=groups[r], op="sum")  # cached
            params = _flat_views(layout.padded_shapes, torch.bfloat16, fill=-3.0, device=dev)
            mine = [x.to(torch.bfloat16) for x in shards]
            tt.all_gather(mine, params, group=groups[r])
            tt.all_gather(mine, params, group=groups[r])
            if dev.type == "cuda":
                tt.synchronize(groups[r], timeout_s=60)
            return [x.cpu() for x in shards], [x.cpu() for x in params]

        try:
            return run_threads(body, W, timeout=40 if dev.type == "cuda" else 300)
        finally:
            for g in groups:
                g.close()
            node_prepare.plan_copies = real_plan

    planned = run(counting)
    plain = run(unplanned)
    return {"planned": planned, "plain": plain, "counts": counts, "shapes": shapes,
            "grads": [[x.cpu() for x in gr] for gr in grads]}


@pytest.mark.multiproc
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("W", [2, 3])
def test_planned_collectives_exact_and_bit_identical(W: int, device: str) -> None:
    """Single-process mode (host transport; on a GPU the CUDA transport's strided copies):
    a slice of the 256-expert layer (scaled for the interpreter: 1 router + 16 experts x 3 +
    norms) reduce-scattered and all-gathered with plans and without (every copy its own
    descriptor); results equal bit for bit and equal to the contract; the planned calls hand
    the transport fewer descriptors.

    On the GPU the W rank threads run in a fresh spawned process with eager module loading.
    On an H200 under lazy loading the rank threads stopped in ``Tensor.to``
    (a kernel's first launch loads its module, which synchronizes the context while the
    ranks' streams wait on each other) -- 3 of 3 runs under load; 3 of 3 passed with
    ``CUDA_MODULE_LOADING=EAGER`` (tide_triton.group.single_process._lazy_loading_problem)."""
    if device == "cuda":
        out = run_multiprocess(_planned_and_unplanned, 1, W, device, timeout=240,
                               env={"CUDA_DEVICE_MAX_CONNECTIONS": "32", "CUDA_MODULE_LOADING": "EAGER"})[0]
    else:
        out = _planned_and_unplanned(0, 1, W, device)
    planned, plain, counts, shapes, grads = (out[k] for k in ("planned", "plain", "counts", "shapes", "grads"))
    layout = ShardLayout(shapes, W)
    for r in range(W):
        for a, b in zip(planned[r][0] + planned[r][1], plain[r][0] + plain[r][1]):
            assert torch.equal(a, b)
        for p in range(len(shapes)):  # the contract: the sum over ranks, then gathered
            want = sum(grads[q][p].float().cpu() for q in range(W))
            c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
            assert torch.equal(planned[r][0][p][:rows], want[r * c: r * c + rows])
            got = planned[r][1][p][:shapes[p][0]]
            assert torch.equal(got, want.to(torch.bfloat16))
    if W == 2:  # at W=3 the scaled experts' three matrices pad to two sizes: no equal runs to stride
        assert sum(a for a, _ in counts) > 2 * sum(b for _, b in counts), counts


# ------------------------------------------------------------------------------ steady state
@pytest.mark.multiproc
def test_a_step_of_many_modules_prepares_nothing_the_second_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """An FSDP2 step all-gathers and reduce-scatters every module once (the drop-in keeps one
    group for all of them): from the second step on, every call must find its preparation
    cached.  With the cache too small (8 entries) a step of more than a few modules would
    evict each entry before its next use and re-prepare every call."""
    import tide_triton as tt

    W, modules = 2, 12  # 3 cache entries per module and step
    shapes = [[(4 + m % 3, 3), (5,)] for m in range(modules)]
    layouts = [ShardLayout(s, W) for s in shapes]
    prepared = {"ag": 0, "rs": 0}
    real_ag, real_rs = node_prepare.prepare_all_gather, node_prepare.prepare_reduce_scatter

    def count(kind, fn):
        def wrapped(*a, **k):
            prepared[kind] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(node_prepare, "prepare_all_gather", count("ag", real_ag))
    monkeypatch.setattr(node_prepare, "prepare_reduce_scatter", count("rs", real_rs))
    groups = tt.local_groups(W, timeout_s=60, ring_bytes=4096 * W)
    tensors = [[(_flat_views(lay.shard_shapes(r, padded=True), torch.bfloat16, fill=1.0),
                 _flat_views(lay.padded_shapes, torch.bfloat16, fill=0.0),
                 _flat_views(sh, torch.bfloat16, fill=float(r + 1)),
                 _flat_views(lay.shard_shapes(r), torch.float32, fill=0.0))
                for lay, sh in zip(layouts, shapes)] for r in range(W)]
    counts = []
    try:
        for _ in range(2):
            before = dict(prepared)
            run_threads(lambda r: [(tt.all_gather(sh, p, group=groups[r]),
                                       tt.reduce_scatter(gr, out, group=groups[r], op="sum"))
                                      for sh, p, gr, out in tensors[r]], W)
            counts.append({k: prepared[k] - before[k] for k in prepared})
    finally:
        for g in groups:
            g.close()
    assert counts[0] == {"ag": W * modules, "rs": W * modules}, counts
    assert counts[1] == {"ag": 0, "rs": 0}, counts


# ----------------------------------------------------------------- garbage-collector passes
def _gc_passes():
    """Counting from an empty young generation (tide_triton.bench.measure.GcPasses)."""
    import gc

    from tide_triton.bench.measure import GcPasses

    gc.collect()
    return GcPasses()


def test_argument_checks_hold_no_object_per_parameter() -> None:
    """The checks of a call (full tensors, shards, the layout lookup) make each tensor's shape
    object one at a time: with a shape per parameter alive at once, every ~700 parameters
    started a garbage-collector pass -- 4 per all-gather of the 256-expert layer, and now and
    then a full pass of ~70 ms over the whole process inside one call
    (docs/constraints.md#garbage-collector-passes)."""
    from tide_triton.runtime.checks import check_gather_shards, check_shapes

    W, me = 2, 0
    shapes = [(4 + i % 3, 2) for i in range(3000)]
    layout = ShardLayout(shapes, W)
    full = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
    shards = [torch.zeros(s) for s in layout.shard_shapes(me, padded=True)]
    for first in (True, False):  # the first round builds (and caches) the layout and its shapes
        with _gc_passes() as passes:
            for _ in range(1 if first else 5):
                _, _, _, _, lay = coll._full_and_shards("grads", full, shards, W)
                check_shapes("shards", shards, lay.shard_shapes(me), lay.shard_shapes(me, padded=True))
                check_gather_shards(shards, lay, me)
    assert lay == layout
    assert passes.count == 0, passes.count


@pytest.mark.multiproc
def test_a_prepared_all_gather_of_many_parameters_starts_no_gc_pass() -> None:
    """End to end on the host transport (the 256-expert layer's 771 parameters, scaled):
    once prepared, all-gathers start (almost) no garbage-collector pass -- 4 per call before."""
    import gc
    import threading

    import tide_triton as tt
    from tide_triton.bench.measure import GcPasses

    W, calls = 2, 10
    shapes = scaled_shapes("synthetic-moe-256e", 64)
    layout = ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=60)
    ready = threading.Barrier(W)
    passes = GcPasses()

    def body(r: int) -> None:
        shards = [torch.zeros(s, dtype=torch.bfloat16) for s in layout.shard_shapes(r, padded=True)]
        params = [torch.zeros(s, dtype=torch.bfloat16) for s in layout.padded_shapes]
        for _ in range(2):
            tt.all_gather(shards, params, group=groups[r])
        if ready.wait() == 0:
            gc.collect()  # count from an empty young generation
            passes.start()
        ready.wait()
        for _ in range(calls):
            tt.all_gather(shards, params, group=groups[r])

    try:
        run_threads(body, W, timeout=120)
    finally:
        passes.stop()
        for g in groups:
            g.close()
    assert passes.count <= 2, f"{passes.count} passes in {calls} calls of {W} ranks"


@pytest.mark.multiproc
def test_prepared_padding_zero_fill_runs_every_call() -> None:
    """Padded shards' padding becomes zero on every call, also when a prepared (cached)
    reduce-scatter is replayed after the caller wrote into the padding; with ``accumulate``
    the padding is left as it is.  (The zero-fill is a copy list from the group's zero buffer,
    prepared once per set of addresses: work.prepare_padding_zeros.)"""
    import tide_triton as tt

    W, shapes = 3, [(7, 3), (5,), (4, 2, 2)]
    layout = ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=60)

    def body(r: int) -> list:
        grads = [torch.full(s, float(r + 1), dtype=torch.bfloat16) for s in shapes]
        shards = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
        rows = layout.shard_rows(r)
        seen = []
        for acc in (False, False, True):
            for x, n in zip(shards, rows):
                x[n:] = 7.0  # the caller's garbage in the padding
            tt.reduce_scatter(grads, shards, group=groups[r], op="sum", accumulate=acc)
            seen.append([x[n:].clone() for x, n in zip(shards, rows)])
        return seen

    try:
        out = run_threads(body, W, timeout=300)
    finally:
        for g in groups:
            g.close()
    padded_somewhere = False
    for r in range(W):
        for call, acc in enumerate((False, False, True)):
            for pad in out[r][call]:
                padded_somewhere |= pad.numel() > 0
                assert bool((pad == (7.0 if acc else 0.0)).all()), (r, call, pad)
    assert padded_somewhere


def test_copy_graphs_off_by_default_where_ranks_share_a_process() -> None:
    """``auto`` captures no copy graph when several ranks of one process drive the GPU (an
    instantiation while peers' streams wait deadlocked on the H200 at W=4); ``always`` and
    ``off`` are kept as asked, and one rank per process keeps ``auto``.  The transport passes
    its in-process rank count (``CudaTransport.create_local_group``: all of them; on the GPU
    ``test_collectives_cuda.py::test_reused_copy_lists_in_the_single_process_mode``)."""
    from tide_triton.runtime import envs

    def mode(value: str, ranks: int) -> str:
        return envs.copy_graphs({"TIDE_TRITON_COPY_GRAPHS": value}, ranks_in_process=ranks)

    assert mode("auto", 1) == "auto"
    assert mode("auto", 2) == "off"
    assert mode("auto", 4) == "off"
    assert mode("always", 4) == "always"
    assert mode("off", 1) == "off"


def test_single_process_mode_beyond_the_hardware_queues_is_warned_about(monkeypatch, caplog) -> None:
    """Ranks of one process needing more streams than CUDA's 32 hardware queues (W >= 16) get
    a warning saying streams will share queues and where the limit is; fewer get none (the
    variable is already at 32 here, as the benches set it).  Without CUDA nothing is said."""
    import logging

    from tide_triton.group.single_process import hardware_queues

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="tide_triton"):
        hardware_queues(2 * 15 + 2)
        assert not caplog.messages
        hardware_queues(2 * 16 + 2)
    assert len(caplog.messages) == 1 and "34 streams" in caplog.messages[0], caplog.messages
    assert "beyond 15 ranks run one process per rank" in caplog.messages[0], caplog.messages
    caplog.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="tide_triton"):
        hardware_queues(2 * 16 + 2)
    assert not caplog.messages


def test_only_local_groups_sets_the_hardware_queues_and_only_where_unset(monkeypatch) -> None:
    """``local_groups`` sets ``CUDA_DEVICE_MAX_CONNECTIONS`` to 2W+2 (at least 8, at most 32)
    where it is unset and CUDA not initialised; a value the user set stays, and deciding
    (``hardware_queues``) or making a group writes nothing."""
    import os

    import tide_triton as tt
    from tide_triton.group.single_process import hardware_queues

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert hardware_queues(2 * 5 + 2) == 12 and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    for W, want in ((5, "12"), (2, "12")):  # raised once, never lowered
        groups = tt.local_groups(W, timeout_s=30)
        for g in groups:
            g.close()
        assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == want, W
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "9")  # the user's: too few, kept (warned)
    groups = tt.local_groups(5, timeout_s=30)
    for g in groups:
        g.close()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "9"


# ------------------------------------------------------------------------------ 3-D sub-rows
def test_sub_row_bytes_rule() -> None:
    """Same-GPU strided runs of wide rows are cut into the largest power-of-two sub-rows (64 to
    512 KiB, at most half a row) dividing the row and both pitches; narrow rows stay 2-D."""
    from tide_triton.transport.copies import sub_row_bytes

    K = 1 << 10
    assert sub_row_bytes(1536 * K, 3072 * K, 1536 * K) == 512 * K  # Qwen3's expert rows, W=2
    assert sub_row_bytes(384 * K, 3072 * K, 384 * K) == 128 * K  # W=8: at most half a row
    assert sub_row_bytes(256 * K, 1024 * K, 256 * K) == 128 * K
    assert sub_row_bytes(256 * K, 1024 * K, 256 * K + 64 * K) == 64 * K  # the source pitch decides
    assert sub_row_bytes(127 * K, 1024 * K, 127 * K) is None  # below 128 KiB rows
    assert sub_row_bytes(192 * K + 2, 1024 * K, 192 * K + 2) is None  # no 64 KiB divisor


def _emulate(buf: bytearray, m) -> None:
    """What the driver does with a CUDA_MEMCPY2D / CUDA_MEMCPY3D struct (device pointers as
    offsets into ``buf``)."""
    from cuda.bindings import driver as cu

    depth = m.Depth if isinstance(m, cu.CUDA_MEMCPY3D) else 1
    src0, dst0 = int(m.srcDevice), int(m.dstDevice)
    src = bytes(buf)
    for z in range(depth):
        zs = z * m.srcPitch * (m.srcHeight if depth > 1 else 0)
        zd = z * m.dstPitch * (m.dstHeight if depth > 1 else 0)
        for y in range(m.Height):
            a, b = src0 + zs + y * m.srcPitch, dst0 + zd + y * m.dstPitch
            buf[b:b + m.WidthInBytes] = src[a:a + m.WidthInBytes]


@pytest.mark.parametrize("on_gpu", [True, False])
def test_same_gpu_strided_run_moves_the_same_bytes_as_3d_sub_rows(on_gpu: bool) -> None:
    """The 3-D struct of a same-GPU strided run moves exactly the 2-D run's bytes (checked on an
    emulation of the driver's semantics); a run with an end on another GPU stays 2-D."""
    import contextlib
    import types

    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as cu

    from tide_triton.transport.copies import Copies

    K = 1 << 10
    rows, width, dpitch, spitch = 3, 256 * K, 512 * K, 384 * K
    stub = types.SimpleNamespace(_cu=cu, _guard=contextlib.nullcontext(), _on_this_gpu=lambda a: on_gpu)
    src0, dst0 = 0, rows * spitch
    m = Copies._strided_struct(stub, dst0, src0, width, rows, dpitch, spitch)
    assert isinstance(m, cu.CUDA_MEMCPY3D if on_gpu else cu.CUDA_MEMCPY2D)
    if on_gpu:
        assert (m.WidthInBytes, m.Height, m.Depth) == (128 * K, 2, rows)
    rng = random.Random(3)
    buf = bytearray(rng.randrange(256) for _ in range(dst0 + rows * dpitch))
    want = bytearray(buf)
    for r in range(rows):
        want[dst0 + r * dpitch:dst0 + r * dpitch + width] = buf[src0 + r * spitch:src0 + r * spitch + width]
    _emulate(buf, m)
    assert buf == want


@pytest.mark.parametrize("seed", range(40))
def test_array_planner_equals_the_element_planner(seed: int) -> None:
    """Long copy lists are planned with array operations: the same plan, entry for entry, as
    the element-by-element planner (merges, strided runs, runs cut short, empty copies)."""
    import numpy as np

    from tide_triton.executors.copy_plan import _plan_lists, plan_copy_arrays

    def _plan(d, x, b):
        return plan_copy_arrays(*(np.asarray(v, dtype=np.int64) for v in (d, x, b)), 4)

    rng = random.Random(seed)
    dsts, srcs, sizes = _random_copies(rng, rng.choice([600, 4096, 20000]))
    for min_rows in (2, 3, STRIDED_MIN_ROWS):
        want = _plan_lists(dsts, srcs, sizes, min_rows)
        got = plan_copy_arrays(np.asarray(dsts, dtype=np.int64), np.asarray(srcs, dtype=np.int64),
                               np.asarray(sizes, dtype=np.int64), min_rows)
        assert got == want, (seed, min_rows)
        assert all(type(v) is int for c in got for v in c)
    # no run at all (every size different): every copy single, as Strided tuples
    d, x, b = [10_000 * i for i in range(100)], [7_000 * i for i in range(100)], [8 + i for i in range(100)]
    got = _plan(d, x, b)
    assert got == _plan_lists(d, x, b, 4) and all(type(c) is Strided and c.rows == 1 for c in got)
    # strided runs back to back with other runs, equal sizes whose pitch changes mid-run
    d = [1000 + 40 * i for i in range(6)] + [2000 + 24 * i for i in range(5)]
    x = [8 * i for i in range(11)]
    assert plan_copy_arrays(*(np.asarray(v, dtype=np.int64) for v in (d, x, [8] * 11)), 4) == \
        _plan_lists(d, x, [8] * 11, 4)


def test_array_planner_refuses_negative_sizes() -> None:
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -3"):
        plan_copies(list(range(0, 800, 8)), list(range(0, 800, 8)), [8] * 99 + [-3])


# ------------------------------------------------------------------------------ templates
def _push_reference(W, me, plan, address, reg, gptrs, Sp, es):
    """push_plans as it was before its templates: piece by piece."""
    out = []
    for j in range(plan.rounds):
        s = j % plan.stages
        dsts, srcs, sizes = [], [], []
        for d in range(W):
            if d == me or j >= len(plan.chunks[d]):
                continue
            dst0 = address(d, reg.slot(s, me, d))
            for pc in plan.chunks[d][j]:
                dsts.append(dst0 + pc.slot_off * es)
                srcs.append(gptrs[pc.param] + (d * Sp[pc.param] + pc.start) * es)
                sizes.append(pc.numel * es)
        out.append(plan_copies(dsts, srcs, sizes))
    return out


def _gather_reference(W, me, t, layout, pptrs, es, source, block_off):
    """prepare_all_gather's prepared batches as they were before its template: the copies rank
    by rank, parameter by parameter."""
    offs, S = layout.flat_offsets, layout.padded_shard_numels
    dsts, srcs, sizes = [], [], []
    for r in range(W):
        if source is not None and r == me:
            continue
        base = t.address(r, block_off if source is None else source[0])
        for p, n in enumerate(layout.shard_numels(r)):
            if n:
                dsts.append(pptrs[p] + r * S[p] * es)
                srcs.append(base + (offs[p] * es if source is None else source[1][p] + r * S[p] * es))
                sizes.append(n * es)
    plan = plan_copies(dsts, srcs, sizes)
    return [prepare_planned(t, plan[i:i + node_prepare.AG_BATCH]) for i in range(0, len(plan), node_prepare.AG_BATCH)]


@pytest.mark.parametrize("W", [2, 3, 8])
@pytest.mark.parametrize("model", MODELS)
def test_templates_give_the_piece_by_piece_plans(model: str, W: int) -> None:
    """The push, reduction and all-gather templates (made once per plan or layout, addresses
    added per call on arrays or lists) give the same plans and pointer lists as building them
    piece by piece -- on back-to-back and on scattered addresses, every rank, twice (the
    second call from the kept templates), with a parameters' region too."""
    import types

    layout = ShardLayout(layer_shapes(model), W)
    es, ring_bytes, stages = 2, 256 << 20, 2
    reg = heap_ring(64, W, ring_bytes, stages, 0)
    plan = ring_plan(layout, ring_bytes, es, stages)
    t = _Counting(1 << 36)
    Sp = layout.padded_shard_numels
    rng = random.Random(W)
    region = tuple(_contiguous(layout.padded_numels, es, 0))
    for me in ([0, W - 1] if W > 2 else range(W)):
        g = types.SimpleNamespace(world_size=W, rank=me)
        for scattered in (False, True):
            for call in range(2):
                base = (1 << 40) + call * (1 << 34)
                gptrs = tuple(p + (rng.randrange(1, 64) * 512 * i if scattered else 0)
                              for i, p in enumerate(_contiguous(layout.padded_numels, es, base)))
                got = node_prepare.push_plans(me, plan, t.address, reg, gptrs, es)
                assert got == _push_reference(W, me, plan, t.address, reg, gptrs, Sp, es), (me, scattered)
                for source in (None, (reg.ag_off, region)):
                    got = node_prepare.prepare_all_gather(g, t, layout, gptrs, es, source, reg.ag_off)
                    want = _gather_reference(W, me, t, layout, gptrs, es, source, reg.ag_off)
                    assert got == want, (me, scattered, source is None)
                for j, (param, own_off, slot_off) in enumerate(node_prepare._reduce_template(plan, me, es)):
                    pieces = plan.chunks[me][j]
                    assert list(node_prepare._Addresses(gptrs).plus(param, own_off)) == \
                        [gptrs[pc.param] + (me * Sp[pc.param] + pc.start) * es for pc in pieces]
                    assert list(node_prepare._shifted(slot_off, 4096)) == [4096 + pc.slot_off * es for pc in pieces]
