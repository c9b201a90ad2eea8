"""Declared topologies on the GPU (skipped without CUDA and an NCCL that runs several ranks
on one GPU): every process drives one rank on the one GPU, each node's ranks share a
node-local CUDA transport (VMM heaps, copy engines, stream-memory flags) and the rails talk
through NCCL (grouped ncclSend / ncclRecv).  The checks are tests/test_hier_host.py's, bit
for bit (integer-valued bf16), with the plans' byte counts per round.

Run on the H200 with NCCL >= 2.30 in place of torch's (bench/NOTES.md) and
``NCCL_MULTI_RANK_GPU_ENABLE=1``.  Two settings of NCCL's transports: its default (on one GPU
NCCL picks its intra-node paths) and ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``, which sends
the inter-node hop through NCCL's socket network transport."""
from __future__ import annotations

import os

import pytest
import torch

try:
    from _dist import run_multiprocess
    from test_hier_host import _hier
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess
    from tests.test_hier_host import _hier

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _nccl_problem(world_size: int) -> str | None:
    from tide_triton.transport import nccl

    try:
        lib = nccl.load()
    except OSError as e:
        return f"no NCCL: {e}"
    if torch.cuda.device_count() < world_size:
        if not lib.features.multi_rank_per_gpu:
            return f"NCCL {'.'.join(map(str, lib.version))} cannot run several ranks on one GPU (needs >= 2.30)"
        if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            return "several ranks per GPU need NCCL_MULTI_RANK_GPU_ENABLE=1"
    return None


def _child(rank: int, W: int, local: int) -> dict:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    out = _hier(None, rank, W, local, 11 + W, device="cuda")
    out.pop("shm_left", None)
    return out


CASES = [(2, 2, "default"), (4, 2, "default"), (2, 2, "socket")]  # nodes, local, NCCL transports


@pytest.mark.parametrize("nodes, local, net", CASES, ids=[f"{n}x{l}-{t}" for n, l, t in CASES])
def test_declared_topology_exact_on_gpu(nodes: int, local: int, net: str) -> None:
    W = nodes * local
    why = _nccl_problem(W)
    if why:
        pytest.skip(why)
    env = {**MULTICAST_OFF, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    if net == "socket":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    out = run_multiprocess(_child, W, local, timeout=300, env=env)
    assert sum(o["bytes_sent"] for o in out) == sum(o["bytes_received"] for o in out) > 0
    assert len({o["rs_count"] for o in out}) == 1
    assert all(o["chunks"] > 1 for o in out), "tiny wire chunks must split the messages"
