"""Declared topologies on the GPU (skipped without CUDA and an NCCL that runs several ranks
on one GPU): every process drives one rank on the one GPU, each node's ranks share a
node-local CUDA transport (VMM heaps, copy engines, stream-memory flags) and the rails talk
through NCCL: one-sided ncclPutSignal into landing rings, or grouped ncclSend / ncclRecv.  The checks are
tests/test_hier_host.py's, bit
for bit (integer-valued bf16), with the plans' byte counts per round.

Run on the H200 with NCCL >= 2.30 in place of torch's (docs/benchmarks.md, "NCCL library") and
``NCCL_MULTI_RANK_GPU_ENABLE=1``.  Two settings of NCCL's transports: its default (on one GPU
NCCL picks its intra-node paths) and ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1``, which sends
the inter-node hop through NCCL's socket network transport."""
from __future__ import annotations


import pytest
import torch

try:
    from _dist import nccl_problem, run_multiprocess
    from test_hier_host import _hier
except ImportError:  # pragma: no cover
    from tests._dist import nccl_problem, run_multiprocess
    from tests.test_hier_host import _hier

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _child(rank: int, W: int, local: int, inter_node: str) -> dict:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    out = _hier(None, rank, W, local, 11 + W, device="cuda", inter_node=inter_node)
    out.pop("shm_left", None)
    return out


# nodes, local ranks, NCCL's transports (default: its intra-node paths; socket: P2P and SHM
# off, so send/recv crosses NCCL's socket network transport), the inter-node hop asked for
CASES = [(2, 2, "default", "put_signal"), (3, 2, "default", "put_signal"), (4, 2, "default", "put_signal"),
         (2, 2, "default", "send_recv"), (4, 2, "default", "send_recv"), (2, 2, "socket", "send_recv"),
         (2, 2, "socket", "auto")]


@pytest.mark.parametrize("nodes, local, net, inter_node", CASES, ids=[f"{n}x{l}-{t}-{p}" for n, l, t, p in CASES])
def test_declared_topology_exact_on_gpu(nodes: int, local: int, net: str, inter_node: str) -> None:
    W = nodes * local
    why = nccl_problem(W)
    if why:
        pytest.skip(why)
    from tide_triton.transport import nccl

    if inter_node == "put_signal" and not nccl.load().features.rma_landing:
        pytest.skip(f"NCCL {nccl.load().version} has no one-sided RMA with windows")
    env = {**MULTICAST_OFF, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    if net == "socket":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    out = run_multiprocess(_child, W, local, inter_node, timeout=300, env=env)
    assert sum(o["bytes_sent"] for o in out) == sum(o["bytes_received"] for o in out) > 0
    assert len({o["rs_count"] for o in out}) == 1
    assert all(o["chunks"] > 1 for o in out), "tiny wire chunks must split the messages"
    paths = {o["inter_node"] for o in out}
    assert len(paths) == 1, f"ranks took different inter-node paths: {paths}"
    if inter_node != "auto":
        assert paths == {inter_node}
    print(f"{nodes}x{local} {net} inter_node={inter_node}: took {paths.pop()}")


def _late_rank(rank: int, W: int, local: int) -> dict:
    """Rank W-1 joins a reduce-scatter 6 s late: the others' ``synchronize(timeout_s=2)``
    names who they wait for, then every rank finishes once it has joined."""
    import time

    import torch.distributed as dist

    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout
    from tide_triton.errors import PeerTimeoutError

    torch.cuda.set_device(0)
    # agree="first": the late call's signature is known, so no host exchange holds the others
    g = tt.init(local_size=local, timeout_s=60, chunk_bytes=1 << 20, agree="first")
    shapes = [(W * 64, 256), (W * 8 + 3,)]
    layout = ShardLayout(shapes, W)
    grads = [torch.ones(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    shards = [torch.empty(s, device="cuda") for s in layout.shard_shapes(rank)]
    tt.reduce_scatter(grads, shards, op="sum", group=g)  # set-up (communicators, windows) everywhere
    tt.synchronize(g)
    dist.barrier()
    from tide_triton.executors import across_nodes
    out: dict = {"path": across_nodes.stats(g, "cuda")["inter_node"]}
    if rank == W - 1:
        time.sleep(6)
    tt.reduce_scatter(grads, shards, op="sum", group=g)
    if rank != W - 1:
        try:
            tt.synchronize(g, timeout_s=2)
            out["err"] = None
        except PeerTimeoutError as e:
            out["err"] = (e.peer, str(e))
    tt.synchronize(g)  # completes once the late rank has joined
    out["exact"] = all(bool((x[:k] == W).all()) for x, k in
                       zip([s.view(-1) for s in shards], [n for n in layout.shard_numels(rank)]))
    g.close()
    return out


def test_a_late_rank_is_named_by_synchronize_across_nodes() -> None:
    W, local = 4, 2
    why = nccl_problem(W)
    if why:
        pytest.skip(why)
    env = {**MULTICAST_OFF, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    out = run_multiprocess(_late_rank, W, local, timeout=120, env=env)
    print([o.get("err") for o in out], out[0]["path"])
    assert all(o["exact"] for o in out)
    # rank 2 waits for rank 3's node-local push (a flag); rank 1 for its rail peer 3 (NCCL);
    # rank 0 for its rail peer 2, itself held up by rank 3 (NCCL)
    assert [o["err"][0] for o in out[:3]] == [2, 3, 3], out


def _mixed_calls(rank: int, W: int, local: int) -> dict:
    """Two signatures agreed, then the nodes make different collectives as one call: the
    next call raises on every rank (identities posted one call late, the NCCL hop being the
    rail peers' only link)."""
    import tide_triton as tt
    from tide_triton.errors import ArgumentMismatchError
    from tide_triton.plan.layout import ShardLayout

    torch.cuda.set_device(0)
    g = tt.init(local_size=local, timeout_s=60, chunk_bytes=1 << 20, agree="first")
    node = rank // local

    def rs(shapes):
        layout = ShardLayout(shapes, W)
        grads = [torch.full(s, 1.0, dtype=torch.bfloat16, device="cuda") for s in shapes]
        shards = [torch.zeros(s, device="cuda") for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads, shards, group=g, op="sum")

    a, b = [(W * 64, 256)], [(W * 128, 128)]  # the same bytes, other signatures
    rs(a)
    rs(b)
    tt.synchronize(g)
    rs(a if node == 0 else b)  # call #3 differs across the nodes, the same within each
    out: dict = {}
    try:
        rs(a)
        tt.synchronize(g)
        out["err"] = None
    except ArgumentMismatchError as e:
        out["err"] = str(e)
    try:
        g.close()
    except Exception as e:  # noqa: BLE001 - a broken group may report its state on close
        out["close"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.parametrize("local", [1, 2])
def test_nodes_making_different_calls_raise_on_every_rank(local: int) -> None:
    W = 2 * local
    why = nccl_problem(W)
    if why:
        pytest.skip(why)
    env = {**MULTICAST_OFF, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    out = run_multiprocess(_mixed_calls, W, local, timeout=180, env=env)
    for r, o in enumerate(out):
        assert o["err"] is not None and "made different collectives as call #3" in o["err"], (r, out)
