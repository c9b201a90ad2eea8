"""Releasing and restoring a named heap region (Slot-Reuse between steps): ``HeapRegion.release()``
gives its physical memory back on every rank, ``restore()`` maps memory at the same addresses.

Host transport (CPU, several processes): the release punches a hole into every rank's heap
file (the pages read as zeros afterwards, and the file holds fewer blocks), restore is a
no-op on the pages, views made before keep working after it, and every use while released
raises naming the region.  CUDA (marked ``gpu``): the same lifecycle over VMM memory -- no
mapping is left behind the region (own or peers') after release, the data written after
restore reads back on every peer through its own mapping.  The all-gather block (released by
Slot-Reuse with the slots) likewise: released, re-mapped by the next all-gather, exact.
"""
from __future__ import annotations

import os

import pytest
import torch

try:
    from _dist import rank_device, run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import rank_device, run_multiprocess

pytestmark = pytest.mark.multiproc


def _cuda_mapped(addr: int) -> bool:
    """Whether the driver has memory mapped at ``addr`` in this process
    (``cuMemRetainAllocationHandle`` fails on an unmapped address)."""
    from tide_triton.transport.driver import cu

    res = cu.cuMemRetainAllocationHandle(addr)
    if int(res[0]) != 0:
        return False
    cu.cuMemRelease(res[1])  # the retain took a reference
    return True


def _lifecycle(rank: int, W: int, device: str) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    dev = rank_device(rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    g = tt.init(timeout_s=60, ring_bytes=4096 * W)
    out: dict = {}
    a = g.heap_region("a", 3000 * W, dev)
    b = g.heap_region("b", 5000 * W, dev)
    t = g.transport(dev)
    out["starts_on_heap_end"] = a.end <= b.offset
    out["a"] = (a.offset, a.end)
    va = a.tensor(torch.int32)
    vb = b.tensor(torch.int32)
    va.fill_(rank + 1)
    vb.fill_(100 + rank)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    fd_blocks = None
    if dev.type == "cpu":
        fd = t._fds[rank]
        before = os.fstat(fd).st_blocks
    else:  # every rank's copy, as this process maps it: own and peers' (the driver's view)
        addrs = [t.address(p, a.offset) for p in range(W)]
        out["mapped_before"] = [_cuda_mapped(x) for x in addrs]
    a.release()
    out["released"] = (a.released, a.mapped_nbytes)
    if dev.type == "cpu":
        fd_blocks = before - os.fstat(fd).st_blocks
        out["freed_bytes"] = fd_blocks * 512
    else:
        out["mapped_after"] = [_cuda_mapped(x) for x in addrs]
    out["span"] = a.end - a.offset
    # b is untouched by a's release (it owns other segments)
    out["b_kept"] = bool((vb == 100 + rank).all())
    errors = {}
    for name, fn in (("tensor", lambda: a.tensor(torch.uint8)), ("vacate", a.vacate),
                     ("release", a.release)):
        try:
            fn()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    out["errors"] = errors
    shapes = [(W, 3), (2 * W + 1,)]
    layout = ShardLayout(shapes, W)
    grads = [torch.full(s, float(rank + 1), dtype=torch.bfloat16, device=dev) for s in shapes]
    a.restore()
    out["restored"] = (a.released, a.mapped_nbytes)
    try:
        a.restore()
        out["restore_twice"] = None
    except RuntimeError as e:
        out["restore_twice"] = str(e)
    # the view made before the release is valid again; peers see what this rank writes
    va.fill_(7 * (rank + 1))
    sync()
    g.exchange(None)
    peers = [t.heap_tensor(p, a.offset, 4, torch.int32).cpu().tolist() for p in range(W)]
    out["peers"] = peers
    # the region works as staging again after restore: equals the ring path
    for _ in range(2):
        ring = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)]
        staged = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads, ring)
        a.vacate()
        tt.reduce_scatter(grads, staged, staging=a)
        out.setdefault("staged_equal", []).append(all(torch.equal(x, y) for x, y in zip(ring, staged)))
        sync()
        a.release()
        a.restore()
    # a staged reduce-scatter into a released region is refused on every rank (the executor's
    # check: it breaks the group, so it comes last)
    a.release()
    try:
        tt.reduce_scatter(grads, [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)], staging=a)
        out["staging"] = None
    except Exception as e:  # noqa: BLE001 - the message is checked by the test
        out["staging"] = f"{type(e).__name__}: {e}"
    g.close()
    return out


def _check(out: list, W: int, device: str) -> None:
    for r, res in enumerate(out):
        assert res["starts_on_heap_end"], res
        assert res["released"] == (True, 0)
        assert res["restored"][0] is False and res["restored"][1] == res["span"]
        if device == "cpu":  # the pages written (3000 * W bytes) are gone from the file
            assert res["freed_bytes"] >= (3000 * W) // 4096 * 4096, (r, res["freed_bytes"], res["span"])
        else:  # no mapping behind the region in this process, for any rank's copy (free
            # device memory is no measure: other processes on the GPU allocate meanwhile)
            assert res["mapped_before"] == [True] * W and res["mapped_after"] == [False] * W, (r, res)
        assert res["b_kept"]
        for name in ("tensor", "vacate", "release"):
            assert res["errors"][name] is not None and "'a' is released" in res["errors"][name], res["errors"]
        assert res["staging"] is not None and "released" in res["staging"], res["staging"]
        assert res["restore_twice"] is not None and "is not released" in res["restore_twice"]
        assert res["peers"] == [[7 * (p + 1)] * 4 for p in range(W)]
        assert res["staged_equal"] == [True, True]
    assert len({res["a"] for res in out}) == 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_release_restore_lifecycle_host(world_size: int) -> None:
    _check(run_multiprocess(_lifecycle, world_size, "cpu", timeout=180), world_size, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world_size", [2, 4])
def test_release_restore_lifecycle_cuda(world_size: int) -> None:
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    _check(run_multiprocess(_lifecycle, world_size, "cuda", timeout=300, env=env), world_size, "cuda")


def test_host_release_range_rejects_partial_segments() -> None:
    from tide_triton.transport.host import HostTransport

    t = HostTransport(0, 1, lambda obj: [obj])
    try:
        t.ensure_heap(3 << 22)
        with pytest.raises(ValueError, match="whole 4194304-byte segments"):
            t.release_range(4096, 1 << 22)
        with pytest.raises(ValueError, match="nbytes must be an int >= 1"):
            t.release_range(1 << 22, 0)
        view = t.heap_tensor(0, 1 << 22, 16, torch.int64)
        view.fill_(5)
        t.release_range(1 << 22, 1 << 22)
        assert int(view.sum()) == 0  # a punched hole reads as zeros
        t.restore_range(1 << 22, 1 << 22)
        view.fill_(3)
        assert int(view.sum()) == 48
    finally:
        t.close()


# ---- the all-gather block ---------------------------------------------------------------
def _block(rank: int, W: int, device: str) -> dict:
    import tide_triton as tt
    from tide_triton.executors.ag_block import release_all_gather_block, released_block_bytes

    dev = rank_device(rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shapes = [(5 * W + 1, 3), (7,), (2 * W, 4)]
    layout = tt.ShardLayout(shapes, W)
    out: dict = {}

    def ag(g, v):
        shards = [torch.full(s, float(v + rank), dtype=torch.bfloat16, device=dev) for s in layout.shard_shapes(rank)]
        params = [torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in shapes]
        tt.all_gather(shards, params, group=g)
        tt.synchronize(g)
        sync()
        return [p.cpu() for p in params]

    bare = tt.init(timeout_s=60, ring_bytes=4096 * W)  # no regions: the block shares the ring's segment
    ag(bare, 1)
    out["bare"] = release_all_gather_block(bare, dev)
    bare.close()
    g = tt.init(timeout_s=60, ring_bytes=4096 * W)
    out["no block yet"] = release_all_gather_block(g, dev)
    g.heap_region("slot", 3000 * W, dev)
    first = ag(g, 1)
    out["values"] = sorted({float(v) for p in first for v in p.flatten().tolist()})
    out["released"] = release_all_gather_block(g, dev)
    out["counted"] = released_block_bytes(g, dev.type)
    out["again"] = release_all_gather_block(g, dev)
    t = g.transport(dev)
    if dev.type == "cuda":
        out["mapped_after"] = [_cuda_mapped(t.address(p, g.ring_layout().ag_off)) for p in range(W)]
    for step in range(2):  # re-mapped by the next all-gather, exact; and released again
        out.setdefault("equal", []).append(all(torch.equal(x, y) for x, y in zip(first, ag(g, 1))))
        out.setdefault("counted after", []).append(released_block_bytes(g, dev.type))
        if step == 0:
            out["released twice"] = release_all_gather_block(g, dev) == out["released"]
    g.close()
    return out


def _check_block(out: list, W: int) -> None:
    for r, res in enumerate(out):
        assert res["bare"] == 0 and res["no block yet"] == 0, (r, res)
        assert res["values"] == [float(v) for v in range(1, W + 1)], (r, res)
        assert res["released"] > 0 and res["counted"] == res["released"] and res["again"] == 0, (r, res)
        assert res.get("mapped_after", [False] * W) == [False] * W, (r, res)
        assert res["equal"] == [True, True] and res["counted after"] == [0, 0], (r, res)
        assert res["released twice"], (r, res)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_block_release_host(world_size: int) -> None:
    _check_block(run_multiprocess(_block, world_size, "cpu", timeout=180), world_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_block_release_cuda(world_size: int) -> None:
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    _check_block(run_multiprocess(_block, world_size, "cuda", timeout=300, env=env), world_size)
