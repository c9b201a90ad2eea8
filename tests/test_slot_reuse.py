"""Slot-Reuse at the collectives level: named heap regions (``Group.heap_region``) and
``reduce_scatter(..., staging=region)`` on the host transport, several processes.

Integer-valued bf16 inputs (|x| <= 8): every sum is exact, so the staged reduce-scatter must
equal the ring one bit for bit.  The hand-over tests check that a writer waits for the
owner's ``vacate()`` (nothing lands in the owner's copy before it) and that a region never
vacated gives ``PeerTimeoutError`` naming the owner.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

pytestmark = pytest.mark.multiproc

_SENTINEL = 0x5A


def _vacate(region, *, late: float | None, seen: dict):
    """Hand ``region`` over now, or -- ``late`` seconds from now, from a thread that is
    returned -- after recording whether it was still untouched (``seen["untouched"]``)."""
    if late is None:
        region.vacate()
        return None

    def later() -> None:  # still "using" the region: nobody may write into it yet
        time.sleep(late)
        seen["untouched"] = bool((region.tensor(torch.uint8) == _SENTINEL).all())
        seen["t"] = time.monotonic()
        region.vacate()

    th = threading.Thread(target=later)
    th.start()
    return th


def _int_tensor(shape, gen, dtype=torch.bfloat16):
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


def _shape_sets(W: int):
    return [
        [(7, 5), (3,), (1, 4, 3), (13, 2), (2 * W + 1, 3), (max(1, W - 1), 2), (97,)],
        [(W, 17), (3 * W + 2,), (5, 1)],
    ]


def _equivalence(rank: int, W: int) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    g = tt.init(timeout_s=60, ring_bytes=512 * W)
    out: dict = {}
    # A small region (many chunks, both stages wrap) and one the size of the layout's
    # unsharded bf16 storage -- what the FSDP2 drop-in stages in.
    small = g.heap_region("small", 64 * W, "cpu")
    again = g.heap_region("small", 64 * W, "cpu")
    out["same_object"] = again is small
    out["offsets"] = (small.offset, small.nbytes)
    for si, shapes in enumerate(_shape_sets(W)):
        layout = ShardLayout(shapes, W)
        big = g.heap_region(f"unsharded{si}", sum(layout.padded_shard_numels) * W * 2, "cpu")
        gen = torch.Generator().manual_seed(11 + si)
        grads_all = [[_int_tensor(s, gen) for s in shapes] for _ in range(W)]
        mine = grads_all[rank]
        combos = [(small, "sum", False, False), (small, "avg", True, False), (small, 0.25, False, True),
                  (small, "sum", True, True), (big, "avg", False, False), (big, "sum", True, True)]
        for region, op, padded, accumulate in combos:
                        prev = [_int_tensor(s, gen, torch.float32) for s in layout.shard_shapes(rank, padded=padded)]
                        ring = [x.clone() for x in prev]
                        staged = [x.clone() for x in prev]
                        tt.reduce_scatter(mine, ring, op=op, accumulate=accumulate)
                        region.tensor(torch.uint8).fill_(_SENTINEL)
                        region.vacate()
                        tt.reduce_scatter(mine, staged, op=op, accumulate=accumulate, staging=region)
                        for p, (a, b) in enumerate(zip(ring, staged)):
                            assert torch.equal(a, b), (si, region.key, op, padded, accumulate, p)
                        # the peers' contributions went through the region (not the ring)
                        assert bool((region.tensor(torch.uint8) != _SENTINEL).any()), region.key
        # the ring result itself is right (sum over ranks, my rows)
        shards = [torch.empty(s) for s in layout.shard_shapes(rank)]
        big.vacate()
        tt.reduce_scatter(mine, shards, op="sum", staging=big)
        for p, x in enumerate(shards):
            c, n = layout.rows_per_rank[p], layout.shard_rows(rank)[p]
            want = sum(ga[p].float() for ga in grads_all)[rank * c: rank * c + n]
            assert torch.equal(x, want), (si, p)
        # regions are left alone by the all-gather block and the ring
        keep = big.tensor(torch.uint8).clone()
        full = [torch.randn(s, generator=torch.Generator().manual_seed(99)) for s in shapes]  # same on all ranks
        sh = [f[rank * c: rank * c + n].clone() for f, c, n in
              zip(full, layout.rows_per_rank, layout.shard_rows(rank))]
        params = [torch.empty(s) for s in shapes]
        tt.all_gather(sh, params)
        assert all(torch.equal(a, b) for a, b in zip(params, full))
        tt.reduce_scatter(mine, [torch.empty(s) for s in layout.shard_shapes(rank)])
        assert torch.equal(big.tensor(torch.uint8), keep), "a collective wrote into a named region"
        out[si] = "ok"
    out["uses"] = (small.uses, small.vacated)
    g.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_staged_reduce_scatter_equals_ring(world_size: int) -> None:
    out = run_multiprocess(_equivalence, world_size, timeout=180)
    for r, res in enumerate(out):
        assert res[0] == "ok" and res[1] == "ok", (r, res)
        assert res["same_object"]
        assert res["uses"] == (8, 8)
    assert len({res["offsets"] for res in out}) == 1, "a region must have the same offset on every rank"


def _handover(rank: int, W: int, delay: float) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    g = tt.init(timeout_s=60)
    shapes = [(4 * W, 8), (3 * W + 1,)]
    layout = ShardLayout(shapes, W)
    region = g.heap_region("params", sum(layout.padded_shard_numels) * W * 2, "cpu")
    view = region.tensor(torch.uint8)
    view.fill_(_SENTINEL)
    gen = torch.Generator().manual_seed(3)
    grads_all = [[_int_tensor(s, gen) for s in shapes] for _ in range(W)]
    owner = W - 1
    seen: dict = {}
    th = _vacate(region, late=delay if rank == owner else None, seen=seen)
    shards = [torch.empty(s) for s in layout.shard_shapes(rank)]
    t0 = time.monotonic()
    tt.reduce_scatter(grads_all[rank], shards, op="sum", staging=region)
    took = time.monotonic() - t0
    if th is not None:
        th.join()
    for p, x in enumerate(shards):
        c, n = layout.rows_per_rank[p], layout.shard_rows(rank)[p]
        assert torch.equal(x, sum(ga[p].float() for ga in grads_all)[rank * c: rank * c + n])
    res = {"took": took, "written_after": bool((view != _SENTINEL).any()), **seen}
    g.close()
    res["never"] = _never_vacated(rank, W)
    return res


@pytest.mark.parametrize("world_size", [2, 3])
def test_writers_wait_for_the_owners_vacate_and_time_out_naming_it(world_size: int) -> None:
    delay = 1.5
    out = run_multiprocess(_handover, world_size, delay, timeout=120)
    owner = out[-1]
    assert owner["untouched"], "a peer wrote into the owner's region before it was vacated"
    assert owner["written_after"], "the peers' contributions never reached the owner's region"
    for r in range(world_size - 1):
        assert out[r]["took"] >= delay * 0.8, (r, out[r]["took"])
    # A region rank 1 never vacates: its writers time out naming it (same spawn).
    for r, res in enumerate(out):
        msg = res["never"]
        if r == 1:
            # its contributions never came: the writers' aborts name why (they waited for rank 1)
            assert msg.startswith(("peer=0", "peer=2", "aborted by 0", "aborted by 2")), msg
            assert "vacate" in msg or msg.startswith("peer="), msg
        else:  # its own timeout, or -- racing with it -- rank 1's abort: rank 1 waits for this
            # writer's contribution while the writer waits for rank 1's vacate, so whichever
            # deadline passes first names the other; either way the error names rank 1
            assert msg.startswith("peer=1: timed out after 2.0 s waiting for rank 1 (rank 1 to vacate "
                                  "staging region 'params'") or msg.startswith("aborted by 1:"), (r, msg)


def _never_vacated(rank: int, W: int) -> str:
    import tide_triton as tt
    from tide_triton.group.core import Group, GroupOptions
    from tide_triton.errors import PeerTimeoutError

    g = Group(None, GroupOptions(timeout_s=2.0))
    region = g.heap_region("params", 4096, "cpu")
    if rank != 1:
        region.vacate()
    grads = [torch.ones(6 * W, 3, dtype=torch.bfloat16)]
    shards = [torch.empty(6, 3)]
    try:
        tt.reduce_scatter(grads, shards, group=g, staging=region)
        return "no error"
    except PeerTimeoutError as e:
        return f"peer={e.peer}: {e}"
    except tt.PeerAbortedError as e:  # a writer that timed out on rank 1 tells rank 1 at once
        return f"aborted by {e.rank}: {e}"
    finally:
        g.close()


def _bad_args(rank: int, W: int) -> dict:
    import tide_triton as tt

    g = tt.init(timeout_s=30)
    out: dict = {}
    grads = [torch.ones(4 * W, 2, dtype=torch.bfloat16)]
    shards = [torch.empty(4, 2)]
    tiny, ok = g.heap_region("tiny", 16, "cpu"), g.heap_region("ok", 4096, "cpu")
    for case in ("type", "small"):  # only rank 1 passes a bad staging
        staging = {"type": "not a region", "small": tiny}[case] if rank == 1 else ok
        ok.vacate()
        try:
            tt.reduce_scatter(grads, shards, staging=staging)
            out[case] = "no error"
        except (TypeError, ValueError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    msgs = []
    for args in (("", 10, "cpu"), ("k", 0, "cpu"), ("k", 10, "meta")):
        try:
            g.heap_region(*args)
            msgs.append("no error")
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    g.heap_region("k", 10, "cpu")
    try:
        g.heap_region("k", 11, "cpu")
        msgs.append("no error")
    except ValueError as e:
        msgs.append(str(e))
    out["region"] = msgs
    g.close()
    return out


def test_bad_staging_and_region_arguments_raise_on_every_rank() -> None:
    import re

    out = run_multiprocess(_bad_args, 3, timeout=120)
    for case, local in (("type", r"TypeError: staging must be None or a HeapRegion"),
                        ("small", r"ValueError: ring_bytes=16 is too small")):
        assert re.match(local, out[1][case]), out[1][case]
        for r in (0, 2):
            assert re.match(r"PeerArgumentError: rank 1 rejected its arguments", out[r][case]), (r, out[r][case])
    for res in out:
        msgs = res["region"]
        assert msgs[0].startswith("TypeError: key must be a non-empty str"), msgs
        assert msgs[1].startswith("ValueError: nbytes must be an int >= 1"), msgs
        assert msgs[2].startswith("ValueError: device must be a CPU or CUDA device"), msgs
        assert msgs[3] == "heap region 'k' exists with 10 bytes, fewer than nbytes=11", msgs


def _across_nodes(rank: int, W: int, L: int, delay: float) -> dict:
    """Slot-Reuse with a declared topology of W / L nodes: the staged cross-node
    reduce-scatter equals the ring one bit for bit, its staging goes through the region, the
    all-gather block and the ring leave the region alone, and a node peer waits for the
    owner's vacate (ranks of other nodes never write into it, so they do not wait)."""
    import tide_triton as tt
    from tide_triton.executors import across_nodes as hc
    from tide_triton.plan.layout import ShardLayout
    try:
        from test_hier_host import _ring_bytes
    except ImportError:  # pragma: no cover
        from tests.test_hier_host import _ring_bytes

    ring = _ring_bytes(W, L)
    g = tt.init(local_size=L, timeout_s=60, ring_bytes=ring, chunk_bytes=48)
    out: dict = {}
    shapes = _shape_sets(W)[0]
    layout = ShardLayout(shapes, W)
    small = g.heap_region("small", ring, "cpu")  # same size as the ring: several windows
    big = g.heap_region("big", 2 * sum(layout.padded_shard_numels) * W * 2, "cpu")
    gen = torch.Generator().manual_seed(5)
    grads_all = [[_int_tensor(s, gen) for s in shapes] for _ in range(W)]
    mine = grads_all[rank]
    for region, op, padded, accumulate in [(small, "sum", False, False), (small, 0.25, True, True),
                                           (big, "avg", True, False)]:
        prev = [_int_tensor(s, gen, torch.float32) for s in layout.shard_shapes(rank, padded=padded)]
        ringed, staged = [x.clone() for x in prev], [x.clone() for x in prev]
        tt.reduce_scatter(mine, ringed, op=op, accumulate=accumulate)
        region.tensor(torch.uint8).fill_(_SENTINEL)
        region.vacate()
        tt.reduce_scatter(mine, staged, op=op, accumulate=accumulate, staging=region)
        for p, (a, b) in enumerate(zip(ringed, staged)):
            assert torch.equal(a, b), (region.key, op, padded, accumulate, p)
        assert bool((region.tensor(torch.uint8) != _SENTINEL).any()), region.key
    # the region is left alone by the all-gather block and by the ring
    keep = big.tensor(torch.uint8).clone()
    full = [torch.randn(s, generator=torch.Generator().manual_seed(99)) for s in shapes]
    sh = [f[rank * c: rank * c + n].clone() for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(rank))]
    params = [torch.empty(s) for s in shapes]
    tt.all_gather(sh, params)
    assert all(torch.equal(a, b) for a, b in zip(params, full))
    tt.reduce_scatter(mine, [torch.empty(s) for s in layout.shard_shapes(rank)])
    assert torch.equal(big.tensor(torch.uint8), keep), "a collective wrote into a named region"
    # hand-over: rank L-1 (node 0) vacates late; its node peers wait, other nodes do not
    owner = L - 1
    big.tensor(torch.uint8).fill_(_SENTINEL)
    th = _vacate(big, late=delay if rank == owner else None, seen=out)
    shards = [torch.empty(s) for s in layout.shard_shapes(rank)]
    t0 = time.monotonic()
    tt.reduce_scatter(mine, shards, op="sum", staging=big)
    out["took"] = time.monotonic() - t0
    if th is not None:
        th.join()
    for p, x in enumerate(shards):
        c, n = layout.rows_per_rank[p], layout.shard_rows(rank)[p]
        assert torch.equal(x, sum(ga[p].float() for ga in grads_all)[rank * c: rank * c + n])
    out["uses"] = (small.uses, big.uses, big.vacated)
    out["path"] = hc.stats(g)["inter_node"]
    g.close()
    return out


@pytest.mark.parametrize("nodes, local", [(2, 2), (3, 2)])
def test_slot_reuse_across_nodes(nodes: int, local: int) -> None:
    W, delay = nodes * local, 1.0
    out = run_multiprocess(_across_nodes, W, local, delay, timeout=240)
    assert out[local - 1]["untouched"], "a node peer wrote into the owner's region before it was vacated"
    for r, res in enumerate(out):
        assert res["uses"] == (2, 2, 2) and res["path"] == "host", (r, res)
        if r < local and r != local - 1:  # the owner's node peers waited for its vacate
            assert res["took"] >= delay * 0.8, (r, res["took"])
