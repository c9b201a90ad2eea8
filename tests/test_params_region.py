"""``all_gather(shards, params, params_region=region)``: the parameters live in a heap region
(the FSDP2 drop-in's Slot-Reuse slots), each rank writes its own rows in place and the peers
read them from its copy -- no all-gather block.  Host transport, several processes.

* Results equal the block path's bit for bit and the contract (integer-valued data; padded
  and unpadded shards and parameters; a bf16 -> bf16 copy and an fp32 -> bf16 cast), over
  repeated calls alternating two regions, and no all-gather block is ever mapped.
* ``vacate()`` of a region the peers read from waits until each has finished reading (a slow
  peer: the owner's hand-over comes after the peer's reads), and names the peer when it
  never finishes within the group's timeout.
* Bad arguments raise on every rank, naming the argument.
"""
from __future__ import annotations

import re
import time

import pytest
import torch

try:
    from _dist import rank_device, run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import rank_device, run_multiprocess

pytestmark = pytest.mark.multiproc

_KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # gpu: skipped without CUDA


def _device(kind: str, rank: int) -> torch.device:
    return rank_device(rank) if kind == "cuda" else torch.device("cpu")

_SENTINEL = 0x5A


def _finish(g, dev: torch.device) -> None:
    """The rank's queued GPU work is done (a stuck peer raises, naming it), then the group closes."""
    if dev.type == "cuda":
        import tide_triton as tt

        tt.synchronize(g)
    g.close()


def _shape_sets(W: int):
    return [
        [(7, 5), (3,), (1, 4, 3), (13, 2), (2 * W + 1, 3), (max(1, W - 1), 2), (97,)],
        [(W, 17), (3 * W + 2,), (5, 1), (5, 1), (5, 1), (5, 1)],  # equal shapes: strided pulls
    ]


def _views(region, shapes, dtype, gap: int):
    """Tensors of ``shapes`` in ``region``, ``gap`` elements apart (the same on every rank)."""
    out, off = [], gap * dtype.itemsize
    for s in shapes:
        n = int(torch.Size(s).numel())
        out.append(region.tensor(dtype, n, off).view(s))
        off += (n + gap) * dtype.itemsize
    return out


def _region_bytes(layout, gap: int) -> int:
    return (layout.world_size * sum(layout.padded_shard_numels) + gap * (len(layout) + 1)) * 4


def _equal_to_block(rank: int, W: int, kind: str) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    dev = _device(kind, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = tt.init(timeout_s=60)
    out: dict = {}
    for si, shapes in enumerate(_shape_sets(W)):
        layout = ShardLayout(shapes, W)
        gap = 3 + si
        regions = [g.heap_region(f"slot{si}.{k}", _region_bytes(layout, gap), dev) for k in range(2)]
        gen = torch.Generator().manual_seed(7 + si)
        combos = [(True, True, torch.bfloat16), (False, False, torch.bfloat16),
                  (True, False, torch.float32), (False, True, torch.float32)]
        for it, (padded_params, padded_shards, sdt) in enumerate(combos * 2):
            region = regions[it % 2]  # two slots, used in turn (FSDP2's pool)
            # the same on every rank (one generator, seeded alike)
            full = [torch.randint(-64, 65, s, generator=gen).to(torch.bfloat16).to(dev) for s in shapes]
            pshapes = layout.padded_shapes if padded_params else shapes
            region.tensor(torch.uint8).fill_(_SENTINEL)
            params = _views(region, pshapes, torch.bfloat16, gap)
            ref = [torch.full(s, -1.0, dtype=torch.bfloat16, device=dev) for s in pshapes]
            shards = []
            for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(rank)):
                x = torch.zeros((c if padded_shards else n, *f.shape[1:]), dtype=sdt, device=dev)
                x[:n] = f[rank * c: rank * c + n].to(sdt)
                shards.append(x)
            tt.all_gather(shards, ref)  # the block path
            tt.all_gather(shards, params, params_region=region)
            for p, (a, b, f) in enumerate(zip(params, ref, full)):
                d0 = f.shape[0]
                assert torch.equal(a[:d0], f), (si, it, p)
                assert torch.equal(a[:d0], b[:d0]), (si, it, p)
            region.vacate()  # the peers have read my rows (or this waits for them)
        # the staged reduce-scatter after a vacate reads what the peers wrote, not my rows
        grads = [torch.full(s, float(rank + 1), dtype=torch.bfloat16, device=dev) for s in shapes]
        red = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads, red, op="sum", staging=regions[0])
        assert all(bool((x == W * (W + 1) / 2).all()) for x in red), si
        out[si] = "ok"
    _finish(g, dev)
    return out


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_from_region_equals_block_path(world_size: int, kind: str) -> None:
    out = run_multiprocess(_equal_to_block, world_size, kind, timeout=240)
    for r, res in enumerate(out):
        assert res[0] == "ok" and res[1] == "ok", (r, res)


def _no_block(rank: int, W: int, kind: str) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    dev = _device(kind, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = tt.init(timeout_s=60)
    shapes = [(6, 4), (5,)]
    layout = ShardLayout(shapes, W)
    region = g.heap_region("slot", _region_bytes(layout, 0), dev)
    params = _views(region, layout.padded_shapes, torch.float32, 0)
    shards = [torch.full(s, float(rank), device=dev) for s in layout.shard_shapes(rank, padded=True)]
    for _ in range(3):
        tt.all_gather(shards, params, params_region=region)
        region.vacate()
    t = g.transport(dev)
    out = {"heap": t.heap_nbytes(), "regions_end": g.heap_regions_end,
           "rows": [float(params[0][r * 3, 0].item()) for r in range(W)]}
    _finish(g, dev)
    return out


@pytest.mark.parametrize("kind", _KINDS)
def test_no_all_gather_block_is_mapped(kind: str) -> None:
    out = run_multiprocess(_no_block, 2, kind, timeout=120)
    for res in out:
        assert res["heap"] == res["regions_end"], res  # nothing mapped past the region
        assert res["rows"] == [0.0, 1.0], res


def _padding_stays_in_the_shard(rank: int, W: int, kind: str) -> dict:
    """Parameters passed unpadded, back to back in the region with data of the caller right
    after the last one; shards padded (FSDP2's layout), copied and cast.  The last ranks'
    shard padding lies past the end of an unpadded parameter: it must not be written there."""
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    dev = _device(kind, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = tt.init(timeout_s=60)
    shapes = [(2 * W + 1, 3), (3 * W - 1,), (W - 1, 2), (W + 1, 1)]  # the last rank: fewer rows, or none
    layout = ShardLayout(shapes, W)
    numel = sum(layout.numels)
    region = g.heap_region("slot", (numel + 64) * 2, dev)
    params = _views(region, shapes, torch.bfloat16, 0)  # gap 0 after the first: back to back
    theirs = region.tensor(torch.bfloat16, 32, numel * 2)  # the caller's data right after the last parameter
    full = [(torch.arange(int(torch.Size(s).numel())) % 61 - 30).to(torch.bfloat16).view(s).to(dev) for s in shapes]
    out: dict = {"ok": []}
    for sdt in (torch.bfloat16, torch.float32):  # a copy, then the cast kernel
        for p in params:
            p.fill_(-99)
        theirs.fill_(7)
        shards = []
        for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(rank)):
            x = torch.full((c, *f.shape[1:]), 55.0, dtype=sdt, device=dev)  # padding rows: 55
            x[:n] = f[rank * c: rank * c + n].to(sdt)
            shards.append(x)
        tt.all_gather(shards, params, params_region=region)
        if dev.type == "cuda":
            tt.synchronize(g)
        out["ok"].append(all(torch.equal(p, f) for p, f in zip(params, full)))
        out.setdefault("theirs", []).append(sorted(set(theirs.float().tolist())))
        region.vacate()
    _finish(g, dev)
    return out


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_padding_is_never_written_past_an_unpadded_parameter(world_size: int, kind: str) -> None:
    """The last rank's padding rows (55) must not land on the next parameter's first rows in
    its own copy, nor on the caller's data after the last one (silently: every check would
    pass and the gathered parameters be right, the bytes after them not)."""
    out = run_multiprocess(_padding_stays_in_the_shard, world_size, kind, timeout=240)
    for r, res in enumerate(out):
        assert res["ok"] == [True, True], (r, res)
        assert res["theirs"] == [[7.0], [7.0]], (r, res)


def _vacate_waits(rank: int, W: int, how: str) -> dict:
    """Rank 1 is slow to read rank 0's rows (its pulls from rank 0's heap sleep first); rank
    0's all-gather returns at once, then it vacates its copy."""
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    g = tt.init(timeout_s=3 if how == "never" else 60)
    shapes = [(8, 4), (5,)]
    layout = ShardLayout(shapes, W)
    region = g.heap_region("slot", _region_bytes(layout, 0), "cpu")
    params = _views(region, layout.padded_shapes, torch.float32, 0)
    shards = [torch.full(s, float(rank + 1)) for s in layout.shard_shapes(rank, padded=True)]
    out: dict = {}
    t = g.transport(torch.device("cpu"))
    if rank == 1:
        real = t.copy_prepared
        lo = t.address(0, 0)
        hi = lo + t.heap_nbytes()

        def slow(prepared, **k):
            if any(lo <= s < hi for s in prepared[1]):  # a pull from rank 0's copy
                time.sleep(1.5 if how == "late" else 6.0)
                out["pulled_at"] = time.time()
            return real(prepared, **k)
        t.copy_prepared = slow
    tt.all_gather(shards, params, params_region=region)
    out["returned_at"] = time.time()
    if how == "overwrite":  # rank 0 gathers again at once: not over its rows under rank 1's read (the
        # epoch wait before staging; the call-identity check-in of call #2 orders it as well)
        out["first"] = [sorted({float(v) for v in x.flatten().tolist()}) for x in params]
        if rank == 1:
            t.copy_prepared = real
        tt.all_gather([x + 10 for x in shards], params, params_region=region)
        out["params"] = [sorted({float(v) for v in x.flatten().tolist()}) for x in params]
        g.close()
        return out
    if rank == 0:
        try:
            region.vacate()
            out["vacate"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out["vacate"] = f"{type(e).__name__}: {e}"
        out["vacated_at"] = time.time()
    out["params"] = [sorted({float(v) for v in x.flatten().tolist()}) for x in params]
    if how == "late":
        if rank == 1:
            region.vacate()
        grads = [torch.full(s, 2.0, dtype=torch.bfloat16) for s in shapes]
        red = [torch.empty(s) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads, red, op="sum", staging=region)
        out["staged"] = sorted({float(v) for x in red for v in x.flatten().tolist()})
    if how == "never" and rank == 1:
        time.sleep(1.0)  # rank 0 has given up; its memory stays mapped here until the read is done
    g.close()
    return out


def test_vacate_waits_for_a_slow_reader() -> None:
    r0, r1 = run_multiprocess(_vacate_waits, 2, "late", timeout=120)
    assert r0["vacate"] == "ok", r0
    assert r0["returned_at"] < r1["pulled_at"], (r0, r1)  # rank 0 was done before rank 1 read
    assert r0["vacated_at"] >= r1["pulled_at"], (r0, r1)  # ... and vacated only after it had
    for res in (r0, r1):
        assert res["params"] == [[1.0, 2.0], [1.0, 2.0]], res
        assert res["staged"] == [4.0], res


def test_next_all_gather_waits_for_a_slow_reader() -> None:
    for res in run_multiprocess(_vacate_waits, 2, "overwrite", timeout=120):
        assert res["first"] == [[1.0, 2.0], [1.0, 2.0]], res  # rank 1 read rank 0's first rows
        assert res["params"] == [[11.0, 12.0], [11.0, 12.0]], res


def test_vacate_names_a_reader_that_never_finishes() -> None:
    r0, _ = run_multiprocess(_vacate_waits, 2, "never", timeout=120)
    assert r0["vacate"].startswith("PeerTimeoutError"), r0
    assert "rank 1" in r0["vacate"] and "heap region 'slot'" in r0["vacate"], r0
    assert 2.5 < r0["vacated_at"] - r0["returned_at"] < 5.5, r0


def _bad_args(rank: int, W: int) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    g = tt.init(timeout_s=30)
    other = tt.local_groups(1)[0]
    shapes = [(6, 4), (5,)]
    layout = ShardLayout(shapes, W)
    region = g.heap_region("slot", _region_bytes(layout, 2), "cpu")
    foreign = other.heap_region("slot", _region_bytes(layout, 2), "cpu")
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank, padded=True)]
    inside = _views(region, layout.padded_shapes, torch.float32, 0)
    shifted = _views(region, layout.padded_shapes, torch.float32, 2)
    outside = [torch.zeros(s) for s in layout.padded_shapes]
    cases = {
        "type": lambda: tt.all_gather(shards, inside, params_region="slot" if rank == 1 else region),
        "outside": lambda: tt.all_gather(shards, outside if rank == 1 else inside, params_region=region),
        "foreign": lambda: tt.all_gather(shards, inside, params_region=foreign if rank == 1 else region),
        "offsets": lambda: tt.all_gather(shards, shifted if rank == 1 else inside, params_region=region),
        "missing": lambda: tt.all_gather(shards, inside, params_region=None if rank == 1 else region),
        # rank 1's first shard is its own rows of params[0] (shifted by one element: overlapping)
        "overlap": lambda: tt.all_gather([inside[0].view(-1)[8 * rank + 1: 8 * rank + 9].view(2, 4), shards[1]]
                                         if rank == 1 else shards, inside, params_region=region),
        "ok": lambda: tt.all_gather(shards, inside, params_region=region),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out[name] = f"{type(e).__name__}: {e}"
    region.release()
    try:
        tt.all_gather(shards, inside, params_region=region)
        out["released"] = "ok"
    except Exception as e:  # noqa: BLE001
        out["released"] = f"{type(e).__name__}: {e}"
    other.close()
    g.close()
    return out


def test_bad_params_region_raises_on_every_rank() -> None:
    out = run_multiprocess(_bad_args, 3, timeout=120)
    for case, local in (("type", r"TypeError: params_region must be None or a HeapRegion"),
                        ("outside", r"ValueError: params\[0\] must lie inside params_region 'slot'"),
                        ("foreign", r"ValueError: params_region region 'slot' belongs to another tide_triton group"),
                        ("overlap", r"ValueError: shards\[0\] overlaps this rank's rows of params\[0\]")):
        assert re.match(local, out[1][case]), (case, out[1][case])
        for r in (0, 2):
            assert re.match(r"PeerArgumentError: rank 1 rejected its arguments", out[r][case]), (r, case, out[r][case])
    for res in out:
        assert res["offsets"].startswith("ArgumentMismatchError: ranks disagree on all_gather's params_region"), res
        assert "ArgumentMismatchError" in res["missing"] and "params_region" in res["missing"], res
        assert res["ok"] == "ok", res
        assert res["released"].startswith("ValueError: params_region region 'slot' is released"), res


def _across_nodes(rank: int, W: int) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    g = tt.init(timeout_s=30, local_size=1)
    layout = ShardLayout([(4, 2)], W)
    region = g.heap_region("slot", _region_bytes(layout, 0), "cpu")
    params = _views(region, layout.padded_shapes, torch.float32, 0)
    try:
        tt.all_gather([torch.zeros(2, 2)], params, params_region=region)
        msg = "ok"
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
    g.close()
    return {"msg": msg}


def test_params_region_needs_one_node() -> None:
    for res in run_multiprocess(_across_nodes, 2, timeout=120):
        assert res["msg"].startswith("ValueError: params_region needs a group of one node"), res


def _slow_reader_on_gpu(rank: int, W: int) -> dict:
    """Three ranks on the GPU: rank 1's pulls of the peers' rows are held back on its copy
    stream (``torch.cuda._sleep`` before each pull batch), while rank 2 stages a
    reduce-scatter into rank 0's region right after rank 0 vacated it.  Rank 0's vacate must
    wait (on its stream) for rank 1's reads, or rank 1 reads rank 2's gradients as rank 0's
    parameters."""
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    g = tt.init(timeout_s=60)
    shapes = [(W * 512, 256)]
    layout = ShardLayout(shapes, W)
    region = g.heap_region("slot", _region_bytes(layout, 0), dev)
    params = _views(region, layout.padded_shapes, torch.bfloat16, 0)
    shards = [torch.full(s, float(rank + 1), dtype=torch.bfloat16, device=dev)
              for s in layout.shard_shapes(rank, padded=True)]
    grads = [torch.full(s, 100.0, dtype=torch.bfloat16, device=dev) for s in shapes]
    red = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
    pacer = g.pacer(dev)
    real = pacer.before
    if rank == 1:
        def slow(j, t, timeout_s):
            with torch.cuda.stream(t.copy_stream):
                torch.cuda._sleep(400_000_000)  # a few hundred ms of the copy queue
            return real(j, t, timeout_s)
        pacer.before = slow
    tt.all_gather(shards, params, params_region=region)
    pacer.before = real
    seen = params[0].clone()  # stream-ordered after the pulls
    region.vacate()
    tt.reduce_scatter(grads, red, op="sum", staging=region)
    tt.synchronize(g)
    want = torch.arange(1, W + 1, device=dev).repeat_interleave(512).view(-1, 1).expand(-1, 256)
    out = {"rows_ok": bool(torch.equal(seen.float(), want.float())),
           "rows_seen": sorted({float(v) for v in seen[:, 0].tolist()}),
           "sums_ok": bool((red[0] == 100.0 * W).all())}
    g.close()
    return out


@pytest.mark.gpu
def test_vacate_waits_for_a_slow_reader_on_the_gpu() -> None:
    for r, res in enumerate(run_multiprocess(_slow_reader_on_gpu, 3, timeout=240)):
        assert res["rows_ok"] and res["sums_ok"], (r, res)
