"""The host transport with its copy queue behind the caller (``transport.host.COPY_QUEUE = "async"``):
the ordering a GPU has -- copies, signals and waits of the copy queue run later, in order, on
a worker thread, while the compute stream's work (kernels, the host) runs at once.  A race
between the two that the synchronous host transport hides shows here: the prepared
all-gather's cast overwriting its block while a slow peer still reads the previous run (as on
a GPU) fails here deterministically without the block-free wait and passes with it.
Also run this way: the contract scenarios, the prepared collectives' exactness tests and the
FSDP2 drop-in (Slot-Reuse, prepared mode, declared nodes)."""
from __future__ import annotations

import time

import pytest
import torch

try:
    from _dist import run_multiprocess, run_threads
    from test_collectives_host import _scenarios
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess, run_threads
    from tests.test_collectives_host import _scenarios

import tide_triton as tt
from tide_triton.plan.layout import ShardLayout

ASYNC = {"tide_triton.transport.host.COPY_QUEUE": "async"}
"""The copy queue behind the caller, as ``run_multiprocess(attrs=...)`` sets it in its children."""
SHAPES = [(37, 5), (3,), (53, 2), (64,)]
RUNS = 4


def test_the_queue_runs_behind_the_caller_and_fences_wait_for_it(monkeypatch) -> None:
    """A queued copy has not happened when ``copy`` returns (the worker is held), ``fence_to``
    waits until it has; a compute-stream operation (``stream=host_compute``) happens at once;
    a queued wait that times out is raised by the next fence, naming the peer."""
    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
    groups = tt.local_groups(2, timeout_s=5)
    try:
        def make(r: int):
            t = groups[r].transport(torch.device("cpu"))  # collective
            t.ensure_heap(4096)
            return t

        t = run_threads(make, 2, timeout=60)[0]
        assert t.host_compute is not None
        src, dst = t.heap_tensor(0, 0, 4, torch.float32), t.heap_tensor(0, 64, 4, torch.float32)
        src.copy_(torch.arange(4.0))
        held = [True]

        def hold(_rank, _name):
            while held[0]:
                time.sleep(0.001)

        t.queue_delay = hold
        t.copy([dst.data_ptr()], [src.data_ptr()], [16])
        time.sleep(0.05)
        assert torch.equal(dst, torch.zeros(4)), "the copy ran before its queue got to it"
        t.signal(0, 3, 7, stream=t.host_compute)
        assert t.read_flag(3) == 7, "a compute-stream signal waited for the queue"
        held[0] = False
        t.fence_to(t.host_compute)
        assert torch.equal(dst, torch.arange(4.0))
        t.queue_delay = None
        t.wait(5, 1, peer=1, timeout_s=0.2, what="rank {peer}'s test flag")
        with pytest.raises(tt.PeerTimeoutError, match="rank 1"):
            t.fence_to(t.host_compute)
    finally:
        for g in groups:
            g.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_contract_exact_with_the_copy_queue_behind(world_size: int) -> None:
    """The eager collectives' contract scenarios (reduce-scatter: ops, padded shards,
    accumulate, bf16 shards; all-gather: padded / unpadded, casts) with every rank's copy
    queue behind its caller and each queued operation delayed up to 300 us at random."""
    out = run_multiprocess(_scenarios, world_size, 13, timeout=400,
                           attrs={**ASYNC, "tide_triton.transport.host.COPY_QUEUE_JITTER_S": 300e-6})
    for r, res in enumerate(out):
        assert all(res[i] == "ok" for i in range(3)), (r, res)


def _slow_rank_one(rank: int, name: str) -> None:
    if rank == 1 and name == "copy":
        time.sleep(0.03)


def _back_to_back(monkeypatch, prepared: bool) -> list:
    """Two all-gathers of one block size (fp32 shards -> bf16 params: the cast writes the
    block from the caller's side) run alternately with no synchronization, rank 1's copies
    30 ms late; returns each run's params per rank."""
    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
    W = 2
    layout = ShardLayout(SHAPES, W)
    groups = tt.local_groups(W, timeout_s=30, ring_bytes=1024 * W)
    try:
        def rank(r: int) -> list:
            g = groups[r]
            g.transport(torch.device("cpu")).queue_delay = _slow_rank_one  # made here: collective
            shards = [[torch.zeros(s) for s in layout.shard_shapes(r)] for _ in range(2)]
            params = [[torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES] for _ in range(2)]
            preps = ([tt.prepare_all_gather(shards[i], params[i], group=g) for i in range(2)]
                     if prepared else None)
            out = []
            for k in range(RUNS):
                for i in range(2):
                    for x in shards[i]:
                        x.fill_(float(k * 16 + i * 4 + r))
                    if prepared:
                        preps[i].run()
                    else:
                        tt.all_gather(shards[i], params[i], group=g)
                    out.append([torch.unique(x).tolist() for x in params[i]])
            g.transport(torch.device("cpu")).fence_to(None)
            return out

        return run_threads(rank, W, timeout=120)
    finally:
        for g in groups:
            g.close()


def _wrong_runs(out: list) -> list:
    bad = []
    for r, runs in enumerate(out):
        for n, run in enumerate(runs):
            k, i = divmod(n, 2)
            want = [float(k * 16 + i * 4 + q) for q in range(2)]
            if any(v != want for v in run):
                bad.append((r, k, i, run))
    return bad


@pytest.mark.parametrize("prepared", [False, True], ids=["eager", "prepared"])
def test_all_gathers_back_to_back_with_a_slow_peer(monkeypatch, prepared: bool) -> None:
    """Every run delivers that run's values: the block a rank casts into is not written
    again before the slow peer has read it."""
    assert _wrong_runs(_back_to_back(monkeypatch, prepared)) == []


def test_the_queue_shows_the_race_the_block_free_wait_prevents(monkeypatch) -> None:
    """The harness can fail: without the prepared all-gather's wait for its block's previous
    run, the slow peer reads the next run's values."""
    import tide_triton.executors.prepared as programs

    monkeypatch.setattr(programs.PreparedAllGather, "_block_free", lambda self: [None])
    bad = _wrong_runs(_back_to_back(monkeypatch, prepared=True))
    assert any(r == 1 for r, *_ in bad), bad


@pytest.mark.parametrize("name, kwargs", [
    ("test_prepared_runs_are_exact_and_equal_the_eager_calls", {"rs_push": "kernel"}),
    ("test_prepared_collectives_alternate_and_accumulate", {}),
    ("test_unheld_prepared_collectives_run_on_the_tensors_of_the_moment", {}),
], ids=["exact-kernel-pushes", "alternate", "unheld"])
def test_prepared_collectives_with_the_copy_queue_behind(monkeypatch, name: str, kwargs: dict) -> None:
    """tests/test_programs.py's exactness scenarios again, every rank's copy queue behind its
    caller and each queued operation delayed up to 200 us at random (the first with the
    reduce-scatters' pushes by the segment kernel, queued behind the caller like copies)."""
    try:
        import test_programs
    except ImportError:  # pragma: no cover
        from tests import test_programs
    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE_JITTER_S", 200e-6)
    getattr(test_programs, name)(**kwargs)


@pytest.mark.multiproc
@pytest.mark.parametrize("declared_nodes", [False, True], ids=["one-node", "2x2-nodes"])
def test_fsdp_drop_in_with_the_copy_queue_behind(declared_nodes: bool) -> None:
    """The FSDP2 drop-in against stock FSDP2 with every rank's copy queue behind its caller
    (random delays up to 200 us): W=2 bf16 and fp32 steps, Slot-Reuse and prepared collectives;
    4 ranks as 2 nodes of 2 (the cross-node executor, Slot-Reuse staging)."""
    try:
        from test_fsdp import _check, _child
    except ImportError:  # pragma: no cover
        from tests.test_fsdp import _check, _child
    attrs = {**ASYNC, "tide_triton.transport.host.COPY_QUEUE_JITTER_S": 200e-6}
    env = {}
    if declared_nodes:
        world, plan = 4, ("fp32", "slot")
        env["LOCAL_WORLD_SIZE"] = "2"
    else:
        world, plan = 2, ("bf16", "fp32", "slot", "prepared")
    out = run_multiprocess(_child, world, "cpu", plan, timeout=400, env=env, attrs=attrs)
    _check(out, world)


def test_captured_all_gathers_replayed_back_to_back_with_a_slow_peer(monkeypatch) -> None:
    """Replays of a host graph holding two prepared all-gathers that share one block (a cast
    each), back to back, rank 1's copies 30 ms late: every run delivers its own values -- a
    captured run ends joined (the caller waits for its quiescent end), which is all that
    orders the next cast into the block, within a replay and across replays."""
    from tide_triton.runtime.host_capture import HostGraph, capture

    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
    W = 2
    layout = ShardLayout(SHAPES, W)
    groups = tt.local_groups(W, timeout_s=30, ring_bytes=1024 * W)

    def rank(r: int) -> list:
        g = groups[r]
        shards = [[torch.zeros(s) for s in layout.shard_shapes(r)] for _ in range(2)]
        params = [[torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES] for _ in range(2)]
        preps = [tt.prepare_all_gather(shards[i], params[i], group=g) for i in range(2)]
        for p in preps:
            p.run()
        graph = HostGraph()
        with capture(graph):
            for p in preps:
                p.run()
        g.transport(torch.device("cpu")).queue_delay = _slow_rank_one
        out = []
        for k in range(RUNS):
            for i in range(2):
                for x in shards[i]:
                    x.fill_(float(k * 16 + i * 4 + r))
            graph.replay()
            out += [[torch.unique(x).tolist() for x in params[i]] for i in range(2)]
        return out

    try:
        assert _wrong_runs(run_threads(rank, W, timeout=120)) == []
    finally:
        for g in groups:
            g.close()


def _copy_queue_of_a_transport(rank: int, world_size: int) -> tuple:
    group = tt.local_groups(1, timeout_s=30)[0]
    try:
        t = group.transport(torch.device("cpu"))
        return t.host_compute is not None, t.queue_delay is not None
    finally:
        group.close()


@pytest.mark.multiproc
def test_run_multiprocess_attrs_put_every_childs_copy_queue_behind_its_caller() -> None:
    """``run_multiprocess(attrs=...)`` sets the switch in each child before its transports are
    made: the copy queue runs behind the caller there, with its random delays."""
    out = run_multiprocess(_copy_queue_of_a_transport, 2, timeout=120,
                           attrs={**ASYNC, "tide_triton.transport.host.COPY_QUEUE_JITTER_S": 300e-6})
    assert out == [(True, True), (True, True)], out


def test_an_unknown_copy_queue_value_is_refused(monkeypatch) -> None:
    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "later")
    group = tt.local_groups(1, timeout_s=30)[0]
    try:
        with pytest.raises(ValueError, match=r"transport\.host\.COPY_QUEUE must be 'sync' or 'async', got 'later'"):
            group.transport(torch.device("cpu"))
    finally:
        group.close()
