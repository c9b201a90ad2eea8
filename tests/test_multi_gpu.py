"""Ranks on several GPUs (skipped with fewer than two): the CUDA transport's cross-device
paths -- peer access granted at creation, copy-engine copies between devices, flags written
into another GPU's memory, the kernel pushes' stores into another GPU's slots -- through the
public reduce_scatter / all_gather, exact.

Placements: round-robin (rank r on cuda:(r % n), the torchrun convention) at W = 2, 3, and a
mixed one (two ranks on cuda:0, one on cuda:1).  Shapes are awkward on purpose: dim 0
smaller than W, a prime, padding rows.  Integer-valued bf16 grads sum exactly in fp32."""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

from tide_triton.plan.layout import ShardLayout

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu, pytest.mark.multiproc]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHAPES = [(7, 3), (1, 5), (13,), (8, 4)]


def _grads(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16) for s in SHAPES]


def _exact(rank: int, W: int, devices: list[int], rs_push: str = "auto") -> dict:
    import tide_triton as tt

    dev = torch.device("cuda", devices[rank])
    torch.cuda.set_device(dev)
    tt.init(timeout_s=60, rs_push=rs_push)
    layout = ShardLayout(SHAPES, W)
    grads = [g.to(dev) for g in _grads(rank)]
    full = [sum(_grads(r)[i].float() for r in range(W)) for i in range(len(SHAPES))]
    out = {}
    for it in range(2):  # the second call reuses the prepared copies and grown heaps
        shards = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads, shards, op="sum")
        tt.synchronize(device=dev)
        torch.cuda.synchronize(dev)
        rows = layout.rows_per_rank
        want = [f[rank * rows[i]: rank * rows[i] + s.shape[0]] for i, (f, s) in enumerate(zip(full, shards))]
        out[f"rs{it}"] = all(torch.equal(s.cpu(), w) for s, w in zip(shards, want))
        params = [torch.empty(s, device=dev) for s in SHAPES]
        tt.all_gather(shards, params)
        tt.synchronize(device=dev)
        torch.cuda.synchronize(dev)
        out[f"ag{it}"] = all(torch.equal(p.cpu(), f) for p, f in zip(params, full))
    out["device"] = str(dev)
    return out


def _placements() -> list:
    n = max(torch.cuda.device_count(), 2)
    return [
        pytest.param(2, [r % n for r in range(2)], id="W2-round-robin"),
        pytest.param(3, [r % n for r in range(3)], id="W3-round-robin"),
        pytest.param(3, [0, 0, 1], id="W3-mixed-two-on-gpu0"),
    ]


@pytest.mark.parametrize("rs_push", ["copy_engine", "kernel"])
@pytest.mark.parametrize("W, devices", _placements())
def test_reduce_scatter_and_all_gather_exact_across_gpus(W: int, devices: list[int], rs_push: str) -> None:
    """``rs_push="kernel"``: the reduce-scatter's pushes are the segment kernel's stores into
    the peers' slots -- across GPUs, SM stores over NVLink instead of copy engines."""
    out = run_multiprocess(_exact, W, devices, rs_push, timeout=300, env=MULTICAST_OFF)
    for r, res in enumerate(out):
        assert res["device"] == f"cuda:{devices[r]}"
        assert all(res[k] for k in ("rs0", "ag0", "rs1", "ag1")), (r, res)


def test_single_process_group_spreads_over_gpus_and_moves_bytes_across() -> None:
    # create_local_group without a device: rank r on cuda:(r % n); a copy from rank 0's heap
    # into rank 1's (another GPU) and a flag written there, waited on by rank 1's stream.
    from tide_triton.transport.cuda import CudaTransport

    n = torch.cuda.device_count()
    group = CudaTransport.create_local_group(2, n_flags=8, segment_bytes=2 << 20)
    try:
        assert [t.device.index for t in group] == [0, 1 % n]
        for t in group:
            t.ensure_heap(1 << 20)
        a, b = group
        src = a.heap_tensor(0, 4096, 1024, torch.int32)
        src.copy_(torch.arange(1024, dtype=torch.int32, device=a.device))
        torch.cuda.synchronize(a.device)
        a.copy([a.address(1, 8192)], [a.address(0, 4096)], [4096])
        a.signal(1, 3, 7)
        b.wait(3, 7, peer=0, timeout_s=30)
        b.synchronize(timeout_s=30)
        a.synchronize(timeout_s=30)
        got = b.heap_tensor(1, 8192, 1024, torch.int32).cpu()
        assert torch.equal(got, torch.arange(1024, dtype=torch.int32))
        assert b.read_flag(3) == 7
    finally:
        CudaTransport.close_group(group)
