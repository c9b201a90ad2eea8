"""The collectives on the GPU transport (skipped without CUDA): the same contract scenarios
as on the host transport, with several processes sharing one GPU (VMM heaps exchanged as
file descriptors, copy engines, stream-memory flags) and in the single-process mode."""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_multiprocess
    from test_collectives_host import _scenarios, run_single_process_mode
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess
    from tests.test_collectives_host import _scenarios, run_single_process_mode

pytestmark = [pytest.mark.gpu, pytest.mark.multiproc,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_contract_exact_processes_sharing_one_gpu(world_size: int) -> None:
    out = run_multiprocess(_scenarios, world_size, 11, "cuda", timeout=400, env=MULTICAST_OFF)
    for r, res in enumerate(out):
        assert all(res[i] == "ok" for i in range(3)), (r, res)


def test_contract_exact_with_every_copy_list_a_graph() -> None:
    """The contract scenarios with every prepared copy list captured into a CUDA graph at
    its first use and replayed (``TIDE_TRITON_COPY_GRAPHS=always``)."""
    out = run_multiprocess(_scenarios, 2, 11, "cuda", timeout=400,
                           env={**MULTICAST_OFF, "TIDE_TRITON_COPY_GRAPHS": "always"})
    for r, res in enumerate(out):
        assert all(res[i] == "ok" for i in range(3)), (r, res)


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_reused_copy_lists_in_the_single_process_mode(monkeypatch, mode: str) -> None:
    """FSDP2's steady state (the same addresses every step) with rank threads of one process:
    every call exact (integer-valued bf16: the sums are exact) and bit-identical, and
    parameters at new addresses are prepared again and still exact.  ``auto`` (the default)
    replays no copy list as a graph there (envs.graphs_in_process: instantiating one while
    peers' streams wait deadlocked at W=4); ``always``, a user's explicit choice, replays
    them."""
    try:
        from _dist import run_threads
    except ImportError:  # pragma: no cover
        from tests._dist import run_threads
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    monkeypatch.setenv("TIDE_TRITON_COPY_GRAPHS", mode)
    W, dev = 2, torch.device("cuda", 0)
    # 42 parameters of distinct shapes (equal shapes back to back would merge into one
    # strided copy): lists of >= 8 descriptors
    shapes = [(24 + i, 16) for i in range(40)] + [(7, 3), (5,)]
    layout = ShardLayout(shapes, W)
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16).to(dev) for s in shapes]
             for _ in range(W)]
    want = [sum(grads[q][p].float() for q in range(W)) for p in range(len(shapes))]
    groups = tt.local_groups(W, timeout_s=60, devices=[dev] * W)

    def body(r: int):
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            shards = [torch.empty(s, device=dev) for s in layout.shard_shapes(r, padded=True)]
            params = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes]
            seen = []
            for step in range(4):
                if step == 3:  # new addresses: prepared again
                    params = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes]
                for x in shards:
                    x.fill_(-1.0)
                for x in params:
                    x.fill_(-3.0)
                tt.reduce_scatter(grads[r], shards, group=groups[r], op="sum")
                tt.all_gather([x[:n].to(torch.bfloat16) for x, n in zip(shards, layout.shard_rows(r))],
                              params, group=groups[r])
                tt.synchronize(groups[r], timeout_s=60)
                seen.append(([x.cpu() for x in shards], [x.cpu() for x in params]))
            return seen, groups[r].transport(dev)._copy_graphs.held()

    try:
        out = run_threads(body, W, timeout=120)
    finally:
        for g in groups:
            g.close()
    for r, (seen, graphs) in enumerate(out):
        if mode == "always":
            assert graphs >= 1, f"rank {r}: no copy list was replayed as a graph"
        else:
            assert graphs == 0, f"rank {r}: {graphs} copy lists replayed as graphs in the single-process mode"
        for step, (shards, params) in enumerate(seen):
            for p in range(len(shapes)):
                c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
                assert torch.equal(shards[p][:rows], want[p][r * c: r * c + rows].cpu()), (r, step, p)
                assert torch.equal(shards[p][rows:], torch.zeros_like(shards[p][rows:])), (r, step, p)
                assert torch.equal(params[p], want[p].to(torch.bfloat16).cpu()), (r, step, p)
            assert all(torch.equal(a, b) for a, b in zip(shards, seen[0][0]))


def test_single_process_multi_rank_mode_cuda() -> None:
    run_single_process_mode("cuda")


def test_single_process_ranks_sharing_a_stream_are_refused_on_every_rank() -> None:
    """Two rank threads of the single-process mode on one GPU, both on the default stream: a
    deadlock in waiting (each rank's wait for its peer's flag would sit in front of the peer's
    write).  Every rank raises a ValueError instead, naming the stream and how to fix it; with
    a stream each, the same calls go through."""
    try:
        from _dist import run_threads
    except ImportError:  # pragma: no cover
        from tests._dist import run_threads
    import tide_triton as tt

    W, dev = 2, torch.device("cuda", 0)
    groups = tt.local_groups(W, timeout_s=30, devices=[dev] * W)
    grads = [[torch.ones(8, 4, dtype=torch.bfloat16, device=dev)] for _ in range(W)]
    shards = [[torch.empty(4, 4, device=dev)] for _ in range(W)]

    def shared(r: int) -> str:
        try:
            tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="sum")
        except ValueError as e:
            return str(e)
        return "no error"

    def own(r: int) -> list:
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="sum")
            tt.synchronize(groups[r], timeout_s=30)
            return shards[r][0].cpu().tolist()

    try:
        errors = run_threads(shared, W, timeout=60)
        assert all("the default stream of cuda:0" in e and "its own" in e for e in errors), errors
        assert all(x == [[2.0] * 4] * 4 for x in run_threads(own, W, timeout=60))
    finally:
        for g in groups:
            g.close()


def test_side_streams_are_the_librarys_own_and_distinct_per_rank() -> None:
    """A group's side stream (``async_op``) is made by the driver, never taken from torch's
    pool (which hands the same 32 streams to every ``torch.cuda.Stream()`` in turn: a side
    stream that is also a caller's -- another rank's, in the single-process mode -- puts the
    group's flag waits in front of that caller's work).  Each rank of the single-process mode
    gets its own; an idle one is reused by a later group; async calls stay exact."""
    try:
        from _dist import run_threads
    except ImportError:  # pragma: no cover
        from tests._dist import run_threads
    import tide_triton as tt

    W, dev = 2, torch.device("cuda", 0)
    pooled = {torch.cuda.Stream(dev).cuda_stream for _ in range(70)}  # every pooled stream, twice over
    groups = tt.local_groups(W, timeout_s=30, devices=[dev] * W)
    sides = [g.side_stream(dev).cuda_stream for g in groups]
    try:
        assert len(set(sides)) == W and not set(sides) & pooled, (sides, len(pooled))
        grads = [[torch.ones(8, 4, dtype=torch.bfloat16, device=dev)] for _ in range(W)]
        shards = [[torch.empty(4, 4, device=dev)] for _ in range(W)]

        def run(r: int) -> list:
            with torch.cuda.stream(torch.cuda.Stream(dev)):
                work = tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="sum", async_op=True)
                work.wait()
                tt.synchronize(groups[r], timeout_s=30)
                return shards[r][0].cpu().tolist()
        assert all(x == [[2.0] * 4] * 4 for x in run_threads(run, W, timeout=60))
    finally:
        for g in groups:
            g.close()
    again = tt.local_groups(W, timeout_s=30, devices=[dev] * W)
    try:
        assert sorted(g.side_stream(dev).cuda_stream for g in again) == sorted(sides)  # idle: reused
    finally:
        for g in again:
            g.close()


@pytest.fixture(autouse=True)
def _collect_after_each_test():
    # Finalisers of CUDA resources run here, attributed to the test that left them.
    yield
    import gc

    gc.collect()
    torch.cuda.synchronize()
