"""Eager-launched prepared runs recorded once and replayed (:mod:`tide_triton.executors.recorded`), on
the host transport with the ranks as threads (a host graph stands where a GPU has a CUDA
graph; the package takes the same path): the first run on a set of addresses enqueues its
operations, the second records them and every later run replays the recording -- each run
exact and bit-identical to the eager call, beside eager calls and other prepared collectives
sharing the all-gather block; ranks replaying different collectives raise naming a peer; a
refused recording leaves the runs eager; ``$TIDE_TRITON_RUN_GRAPHS`` picks what is recorded
(``auto``: all-gathers, ``all``: reduce-scatters too, ``off``: nothing)."""
from __future__ import annotations

import logging
import time

import pytest
import torch

try:
    from _dist import run_threads
    from test_programs import (SHAPES, W, _assert_each_rank_names_another, _assert_exact, _close, _grads, _groups,
                               _refill, _spawn, _want)
except ImportError:  # pragma: no cover
    from tests._dist import run_threads
    from tests.test_programs import (SHAPES, W, _assert_each_rank_names_another, _assert_exact, _close, _grads,
                                     _groups, _refill, _spawn, _want)

import tide_triton as tt
import tide_triton.executors.prepared as programs
import tide_triton.executors.recorded as run_graph
from tide_triton.errors import GroupBrokenError
from tide_triton.transport import _once
from tide_triton.plan.layout import ShardLayout

RUNS = 5


def _count_runs(monkeypatch) -> dict[str, int]:
    """How often each rank's prepared collectives enqueue their operations one by one
    (``_run``: an eager run or a recording), by rank."""
    counts: dict[str, int] = {}
    for cls in (programs.PreparedReduceScatter, programs.PreparedAllGather):
        def counted(self, g, *a, _real=cls._run, **k):
            key = f"{g.rank}:{self.name}"
            counts[key] = counts.get(key, 0) + 1
            return _real(self, g, *a, **k)
        monkeypatch.setattr(cls, "_run", counted)
    return counts


@pytest.mark.parametrize("queue", ["sync", "async"])
def test_runs_replay_one_recording_from_the_second_run(monkeypatch, queue: str) -> None:
    """Per rank a prepared reduce-scatter and two prepared all-gathers sharing one block, run
    ``RUNS`` times with new gradient values, an eager reduce-scatter after each: every run
    exact and equal to the eager call bit for bit, both all-gathers' params equal; each
    prepared collective enqueued its operations twice (the first run, the recording) and
    replayed after that.  ``async``: the copy queue behind the caller, random delays."""
    monkeypatch.setenv("TIDE_TRITON_RUN_GRAPHS", "all")
    if queue == "async":
        monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
        monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE_JITTER_S", 200e-6)
    counts = _count_runs(monkeypatch)
    replays = {"n": 0}
    real_replay = run_graph.RunGraph.replay

    def replay(self, *a, **k):
        replays["n"] += 1
        return real_replay(self, *a, **k)

    monkeypatch.setattr(run_graph.RunGraph, "replay", replay)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(51)
    vals = _grads(gen, SHAPES)
    groups = _groups()
    state: dict[int, dict] = {}

    def prepare(r: int) -> None:
        st = state[r] = {"grads": [v.clone() for v in vals[r]],
                         "shards": [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)],
                         "params": [[torch.full(s, -3.0, dtype=torch.bfloat16) for s in SHAPES] for _ in range(2)]}
        st["rs"] = tt.prepare_reduce_scatter(st["grads"], st["shards"], group=groups[r], op="sum")
        real = [x[:n] for x, n in zip(st["shards"], layout.shard_rows(r))]
        st["ag"] = [tt.prepare_all_gather(real, ps, group=groups[r]) for ps in st["params"]]

    def step(r: int):
        st = state[r]
        for x, v in zip(st["grads"], vals[r]):
            x.copy_(v)
        for x in st["shards"]:
            x.fill_(-1.0)
        for ps in st["params"]:
            for x in ps:
                x.fill_(-3.0)
        st["rs"].run()
        st["ag"][0].run()
        st["ag"][1].run()
        eager = [torch.empty(s) for s in layout.shard_shapes(r, padded=True)]
        tt.reduce_scatter(st["grads"], eager, group=groups[r], op="sum")
        return ([x.clone() for x in st["shards"]], [[x.clone() for x in ps] for ps in st["params"]], eager)

    try:
        run_threads(prepare, W, timeout=60)
        for k in range(RUNS):
            _refill(vals, gen)
            for r, (shards, params, eager) in enumerate(run_threads(step, W, timeout=120)):
                want = [_want(vals, p) for p in range(len(SHAPES))]
                for which, ps in enumerate(params):
                    _assert_exact(layout, r, shards, ps, want, (k, which), eager=eager)
    finally:
        _close(groups)
    assert counts == {f"{r}:{name}": n for r in range(W) for name, n in
                      (("reduce_scatter (prepared)", 2), ("all_gather (prepared)", 4))}, counts
    assert replays["n"] == W * 3 * (RUNS - 1), replays  # the recording's run is a replay too


def test_runs_on_the_tensors_of_the_moment_record_per_set_of_addresses(monkeypatch) -> None:
    """The drop-in's runs (``_run_on``) on two sets of tensors in turn: each set is recorded at
    its second run and replayed after that, every run exact; past the bindings kept, the
    evicted sets' recordings go with them."""
    monkeypatch.setenv("TIDE_TRITON_RUN_GRAPHS", "all")
    counts = _count_runs(monkeypatch)
    monkeypatch.setattr(programs, "_BINDINGS_KEPT", 2)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(52)
    groups = _groups()
    preps: dict[int, dict] = {}

    def tensors(r: int, vals):
        return {"grads": [v.clone() for v in vals[r]],
                "shards": [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]}

    def prepare(r: int) -> None:
        sets = preps[r] = {"sets": [tensors(r, _grads(gen, SHAPES)) for _ in range(2)]}
        sets["rs"] = tt.collectives.prepared_reduce_scatter_call(groups[r], sets["sets"][0]["grads"],
                                                                 sets["sets"][0]["shards"], "sum", False, hold=False)

    def step(r: int, k: int, vals):
        st = preps[r]
        if k == 6:  # a third set: the oldest one is evicted, with its recording
            st["sets"][0] = tensors(r, vals)
        ts = st["sets"][k % 2]
        for x, v in zip(ts["grads"], vals[r]):
            x.copy_(v)
        for x in ts["shards"]:
            x.fill_(-1.0)
        st["rs"]._run_on(ts["grads"], ts["shards"])
        return [x.clone() for x in ts["shards"]], len(st["rs"]._graphs), len(st["rs"]._bindings)

    try:
        run_threads(prepare, W, timeout=60)
        for k in range(8):
            vals = _grads(gen, SHAPES)
            for r, (shards, graphs, bindings) in enumerate(run_threads(lambda r, k=k, v=vals: step(r, k, v), W,
                                                                       timeout=60)):
                for p in range(len(SHAPES)):
                    c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
                    assert torch.equal(shards[p][:rows], _want(vals, p)[r * c: r * c + rows]), (k, r, p)
                assert (graphs, bindings) == RECORDED[k], (k, r, graphs, bindings)
    finally:
        _close(groups)
    # set 0: runs 0 (eager), 2 (recorded), 4 (replay); set 1: 1, 3, 5 likewise; run 6 on a new
    # set evicts set 0 (the least recently run) with its recording and runs eagerly; run 7 on
    # set 1 replays its recording
    assert counts == {f"{r}:reduce_scatter (prepared)": 5 for r in range(W)}, counts


RECORDED = [(0, 1), (0, 2), (1, 2), (2, 2), (2, 2), (2, 2), (1, 2), (1, 2)]
"""(recordings, bindings) a rank holds after each run of the test above."""


def test_ranks_replaying_different_recorded_runs_raise_naming_the_peer(monkeypatch) -> None:
    """Every rank records prepared reduce-scatters A and B (two runs each), then rank 0 runs A
    while the others run B -- replays of their recordings: no rank takes the other's data,
    every rank raises naming a peer whose token did not come (or the peer that gave up first)
    within the deadline, the shards keep their values, and the group is broken afterwards."""
    monkeypatch.setenv("TIDE_TRITON_RUN_GRAPHS", "all")
    layout = ShardLayout(SHAPES, W)
    grads = _grads(torch.Generator().manual_seed(53), SHAPES)
    groups = _groups(timeout_s=3)

    def body(r: int):
        sa, sb = ([torch.empty(s) for s in layout.shard_shapes(r)] for _ in range(2))
        a = tt.prepare_reduce_scatter(grads[r], sa, group=groups[r], op="sum")
        b = tt.prepare_reduce_scatter(grads[r], sb, group=groups[r], op="sum")
        for p in (a, a, b, b):
            p.run()
        assert len(a._graphs) == len(b._graphs) == 1
        for x in sa + sb:
            x.fill_(-5.0)
        t0 = time.monotonic()
        try:
            (a if r == 0 else b).run()
        except Exception as e:  # noqa: BLE001 - checked below
            first = e
        else:
            return "no error", 0.0, None
        seconds = time.monotonic() - t0
        with pytest.raises(GroupBrokenError):
            a.run()
        return first, seconds, all(bool((x == -5.0).all()) for x in sa + sb)

    try:
        out = run_threads(body, W, timeout=120)
    finally:
        _close(groups)
    _assert_each_rank_names_another([e for e, _, _ in out])
    for r, (e, seconds, untouched) in enumerate(out):
        assert "prepared reduce-scatter" in str(e), (r, str(e))
        assert seconds < 20, (r, seconds)
        assert untouched, f"rank {r}: a replay wrote shards while its peers ran another collective"


def test_a_refused_recording_leaves_the_runs_eager(monkeypatch, caplog) -> None:
    """Where the driver refuses to record a run (here: the capture raises), nothing was
    enqueued by the attempt: that run and every later one on the addresses run eagerly,
    exact, and the recording is not tried again; the reason is logged once."""
    monkeypatch.setenv("TIDE_TRITON_RUN_GRAPHS", "all")
    counts = _count_runs(monkeypatch)
    tries = {"n": 0}

    def refusing(t, device, run):  # what record() does where the capture raises
        tries["n"] += 1
        run_graph._log_refused(RuntimeError("operation not permitted when stream is capturing\nmore"))
        return None

    monkeypatch.setattr(run_graph, "record", refusing)
    monkeypatch.setattr(_once, "_logged", set())  # log_once: every reason new again
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(54)
    vals = _grads(gen, SHAPES)
    groups = _groups()
    state: dict[int, dict] = {}

    def prepare(r: int) -> None:
        st = state[r] = {"grads": [v.clone() for v in vals[r]],
                         "shards": [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]}
        st["rs"] = tt.prepare_reduce_scatter(st["grads"], st["shards"], group=groups[r], op="sum")

    def step(r: int):
        st = state[r]
        for x, v in zip(st["grads"], vals[r]):
            x.copy_(v)
        st["rs"].run()
        return [x.clone() for x in st["shards"]]

    try:
        run_threads(prepare, W, timeout=60)
        with caplog.at_level(logging.WARNING, logger="tide_triton"):
            for k in range(4):
                _refill(vals, gen)
                for r, shards in enumerate(run_threads(step, W, timeout=60)):
                    for p in range(len(SHAPES)):
                        c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
                        assert torch.equal(shards[p][:rows], _want(vals, p)[r * c: r * c + rows]), (k, r, p)
    finally:
        _close(groups)
    assert tries["n"] == W, tries  # once per rank, at the second run
    assert counts == {f"{r}:reduce_scatter (prepared)": 4 for r in range(W)}, counts
    refused = [m for m in caplog.messages if "could not be recorded" in m]
    assert len(refused) == 1 and "stream is capturing" in refused[0], caplog.messages


BOTH = ("reduce_scatter (prepared)", "all_gather (prepared)")


def test_single_process_mode_on_a_gpu_records_nothing_by_default(caplog) -> None:
    """Several ranks of one process on a GPU: ``auto`` records nothing (an instantiation while
    peers' streams waited stopped the rank threads inside driver calls on the H200 at W=8),
    an explicit ``all`` / ``all-gathers`` is kept with one warning; one rank per process, and
    the host transport's host graphs, keep every value."""
    import logging

    from tide_triton.runtime import envs

    def mode_for(value: str, device: torch.device, ranks: int) -> str:  # as programs asks for it
        return envs.run_graphs({"TIDE_TRITON_RUN_GRAPHS": value},
                               ranks_in_process=ranks if device.type == "cuda" else 1)

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert mode_for("auto", cuda, 8) == "off"
    assert mode_for("auto", cuda, 1) == "auto"
    assert mode_for("auto", cpu, 8) == "auto"
    assert mode_for("off", cuda, 8) == "off"
    with caplog.at_level(logging.WARNING):
        assert mode_for("all", cuda, 4) == "all"
        assert mode_for("all-gathers", cuda, 4) == "all-gathers"
    warned = [m for m in caplog.messages if "making such a graph" in m]
    assert len(warned) <= 1 and all("TIDE_TRITON_RUN_GRAPHS=all" in m for m in warned), caplog.messages
    groups = _groups()
    try:
        assert [g.ranks_in_process for g in groups] == [W] * W
    finally:
        _close(groups)


@pytest.mark.parametrize("mode, recorded", [("off", ()), ("all-gathers", ("all_gather (prepared)",)),
                                            ("auto", BOTH), ("all", BOTH)])
def test_run_graphs_picks_what_is_recorded(monkeypatch, mode: str, recorded: tuple) -> None:
    """``$TIDE_TRITON_RUN_GRAPHS``: ``off`` records nothing (every run enqueues its
    operations), ``all-gathers`` the all-gathers, ``auto`` (the default) and ``all`` the
    reduce-scatters too; a bad value is refused naming the variable."""
    if mode != "auto":
        monkeypatch.setenv("TIDE_TRITON_RUN_GRAPHS", mode)
    else:
        monkeypatch.delenv("TIDE_TRITON_RUN_GRAPHS", raising=False)
    counts = _count_runs(monkeypatch)
    layout = ShardLayout(SHAPES, W)
    grads = _grads(torch.Generator().manual_seed(55), SHAPES)
    groups = _groups()

    def body(r: int) -> None:
        shards = [torch.empty(s) for s in layout.shard_shapes(r, padded=True)]
        params = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
        rs = tt.prepare_reduce_scatter(grads[r], shards, group=groups[r], op="sum")
        ag = tt.prepare_all_gather([x[:n] for x, n in zip(shards, layout.shard_rows(r))], params, group=groups[r])
        for _ in range(3):
            rs.run()
            ag.run()
        for p in (rs, ag):
            assert len(p._graphs) == (p.name in recorded), (p.name, p._graphs)
        # the kernels whose table uploads a recording waits for: the reductions, the cast
        from tide_triton.kernels.segments import Binding
        (rs_binding,), (ag_binding,) = rs._bindings.values(), ag._bindings.values()
        assert len(rs._kernels(rs_binding)) >= 1 and len(ag._kernels(ag_binding)) == 1
        assert all(isinstance(k, Binding) and k.upload_events == () for k in
                   rs._kernels(rs_binding) + ag._kernels(ag_binding))

    try:
        run_threads(body, W, timeout=60)
    finally:
        _close(groups)
    assert counts == {f"{r}:{name}": 2 if name in recorded else 3 for r in range(W)
                      for name in ("reduce_scatter (prepared)", "all_gather (prepared)")}, counts
    from tide_triton.runtime import envs
    with pytest.raises(ValueError, match="TIDE_TRITON_RUN_GRAPHS"):
        envs.run_graphs({"TIDE_TRITON_RUN_GRAPHS": "always"})

def _rank_device(rank: int) -> torch.device:
    """A child process's GPU for ``rank`` (ranks may share one), made current."""
    try:
        from _dist import rank_device
    except ImportError:  # pragma: no cover
        from tests._dist import rank_device
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    return dev


def _mismatch_child(rank: int, world_size: int, device: str) -> tuple:
    """One process per rank on CUDA: prepared reduce-scatters A and B, each run twice (the
    second run records it), then rank 0 replays A while the others replay B; whether both
    were recorded, what :func:`tide_triton.synchronize` raised and after how long (the close
    must then end: the test's own deadline)."""
    import tide_triton as tt_
    from tide_triton.errors import PeerTimeoutError as Timeout

    dev = _rank_device(rank)
    g = tt_.init(timeout_s=5, ring_bytes=4096 * world_size)
    layout = ShardLayout(SHAPES, world_size)
    grads = [torch.ones(s, dtype=torch.bfloat16, device=dev) for s in SHAPES]
    sa, sb = ([torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)] for _ in range(2))
    a = tt_.prepare_reduce_scatter(grads, sa, group=g, op="sum")
    b = tt_.prepare_reduce_scatter(grads, sb, group=g, op="sum")
    for p in (a, a, b, b):
        p.run()
    tt_.synchronize(g, timeout_s=60)
    recorded = len(a._graphs) == len(b._graphs) == 1 and all(v is not None for v in a._graphs.values())
    t0 = time.monotonic()
    (a if rank == 0 else b).run()
    try:
        tt_.synchronize(g)
    except Timeout as e:
        err = ("timeout", e.peer, str(e))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        err = (type(e).__name__, None, str(e))
    else:
        err = ("no error", None, "")
    seconds = time.monotonic() - t0
    g.close()  # releases this rank's stuck replay (its waits are pending): the close ends
    return recorded, err, seconds


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replays_of_different_recordings_raise_naming_the_peer_on_gpu() -> None:
    """On a GPU a replay's flag waits are the rank's pending waits on the caller's stream (they
    were recorded, not enqueued, at the capture): ranks replaying different recorded runs each
    get PeerTimeoutError naming the other rank from synchronize within the deadline, and the
    close releases the stuck replay and ends."""
    world = 2
    out = _spawn(_mismatch_child, world, "cuda", TIDE_TRITON_RUN_GRAPHS="all")
    for r, (recorded, (kind, peer, msg), seconds) in enumerate(out):
        assert recorded, f"rank {r}: the second runs were not recorded"
        assert kind == "timeout" and peer == 1 - r, (r, kind, peer, msg)
        assert "prepared reduce-scatter" in msg, (r, msg)
        assert seconds < 30, (r, seconds)


def _missing_rank_child(rank: int, world_size: int) -> tuple | None:
    """One process per rank on CUDA (three ranks): a prepared reduce-scatter and all-gather run
    once by all and synchronized, the reduce-scatter run again by all (its token waits passed and
    their words were reset -- pending still, nothing synchronized), then the all-gather by ranks
    0 and 1 only.  What their :func:`tide_triton.synchronize` raised, and after how long; rank 2
    then runs its all-gather late, so every stream ends and every close is clean."""
    import torch.distributed as dist

    import tide_triton as tt_
    from tide_triton.errors import PeerTimeoutError as Timeout

    dev = _rank_device(rank)
    g = tt_.init(timeout_s=60, ring_bytes=4096 * world_size)
    layout = ShardLayout(SHAPES, world_size)
    grads = [torch.ones(s, dtype=torch.bfloat16, device=dev) for s in SHAPES]
    shards = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank, padded=True)]
    params = [torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in SHAPES]
    rs = tt_.prepare_reduce_scatter(grads, shards, group=g, op="sum")
    ag = tt_.prepare_all_gather([x[:n] for x, n in zip(shards, layout.shard_rows(rank))], params, group=g)
    out = None
    try:
        rs.run()
        ag.run()
        tt_.synchronize(g, timeout_s=60)  # kernels loaded, every rank past its first runs
        rs.run()
        if rank != 2:  # rank 2 never runs its second all-gather (until the others have timed out)
            ag.run()
            t0 = time.monotonic()
            try:
                tt_.synchronize(g, timeout_s=3)
            except Timeout as e:
                out = ("timeout", e.peer, str(e), time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out = (type(e).__name__, None, str(e), time.monotonic() - t0)
            else:
                out = ("no error", None, "", time.monotonic() - t0)
        dist.barrier()
        if rank == 2:
            ag.run()
            tt_.synchronize(g, timeout_s=60)
        dist.barrier()
    finally:
        g.close()
    return out


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["off", "auto"])
def test_a_timeout_names_the_missing_rank_not_one_whose_token_wait_passed_on_gpu(mode: str) -> None:
    """Three ranks; rank 2 misses an all-gather.  Ranks 0 and 1 get PeerTimeoutError naming rank
    2 -- not the peer of a finished reduce-scatter token wait whose word its reader reset to 0,
    which reads "short" from the host until its stream is idle (progress words tell them apart;
    without them both name each other: rank 0 rank 1, rank 1 rank 0).  ``off``: eager
    runs, their waits on the copy stream; ``auto``: replayed recordings, their waits noted on the
    caller's stream with the recordings' own progress words."""
    out = _spawn(_missing_rank_child, 3, TIDE_TRITON_RUN_GRAPHS=mode)
    for r in (0, 1):
        kind, peer, msg, seconds = out[r]
        assert kind == "timeout" and peer == 2, (r, kind, peer, msg)
        assert "prepared all-gather" in msg, (r, msg)
        assert seconds < 30, (r, seconds)
    assert out[2] is None

def _async_then_sync_child(rank: int, world_size: int, rounds: int) -> tuple:
    """One process per rank on CUDA: two recorded prepared reduce-scatters run back to back,
    the first ``async_op=True`` (its replay on the group's side stream), the second on the
    caller's stream; each round's shards checked exactly (integer sums)."""
    import tide_triton as tt_

    dev = _rank_device(rank)
    g = tt_.init(timeout_s=20)
    shapes = [(2048, 1024)] * 8  # 32 MiB of bf16 gradients: several ring rounds
    layout = ShardLayout(shapes, world_size)
    ga = [torch.full(s, 1.0, dtype=torch.bfloat16, device=dev) for s in shapes]
    gb = [torch.full(s, 2.0, dtype=torch.bfloat16, device=dev) for s in shapes]
    sa, sb = ([torch.zeros(s, device=dev) for s in layout.shard_shapes(rank, padded=True)] for _ in range(2))
    a = tt_.prepare_reduce_scatter(ga, sa, group=g, op="sum")
    b = tt_.prepare_reduce_scatter(gb, sb, group=g, op="sum")
    for p in (a, a, b, b):
        p.run()  # the second run of each records it
    tt_.synchronize(g, timeout_s=60)
    recorded = all(v is not None for p in (a, b) for v in p._graphs.values()) and len(a._graphs) == 1
    wrong = []
    for i in range(rounds):
        for x in sa + sb:
            x.zero_()
        work = a.run(async_op=True)
        b.run()
        work.wait()
        tt_.synchronize(g, timeout_s=60)
        for name, shards, want in (("a", sa, 1.0 * world_size), ("b", sb, 2.0 * world_size)):
            bad = [p for p, x in enumerate(shards) if not bool((x == want).all())]
            if bad:
                wrong.append((i, name, bad[:3]))
    g.close()
    return recorded, wrong


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replay_on_the_side_stream_ends_before_the_next_run_on_another_stream() -> None:
    """A recorded reduce-scatter replayed with ``async_op=True`` runs on the group's side
    stream and forks its copies from it, not from the copy queue.  A next prepared run, on the
    caller's stream, ordered only behind the copy queue -- not behind that replay -- could push
    into a peer's ring slot the replay's sums still read.  Every
    round's sums exact."""
    out = _spawn(_async_then_sync_child, 2, 12)
    for r, (recorded, wrong) in enumerate(out):
        assert recorded, f"rank {r}: the second runs were not recorded"
        assert not wrong, (r, wrong)


class _FakeGraph:
    """``torch.cuda.CUDAGraph`` as :func:`tide_triton.executors.recorded.record` uses it, with failures
    to order (``fail``: the step that raises RuntimeError) and a log of what happened."""

    def __init__(self, log: list, fail: str | None) -> None:
        self.log, self.fail = log, fail

    def _step(self, name: str) -> None:
        self.log.append(name)
        if self.fail == name:
            raise RuntimeError(f"{name} refused (fake)")

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        assert capture_error_mode == "thread_local"
        self._step("begin")

    def capture_end(self) -> None:
        self._step("end")

    def replay(self) -> None:
        self._step("replay")


class _FakeTransport:
    def __init__(self, stream=None, log: list | None = None) -> None:
        self.noted: list = []
        self.recording = None
        self.stream = stream
        self.log = [] if log is None else log

    def recording_stream(self):
        return self.stream

    def recording_waits(self):
        import contextlib

        @contextlib.contextmanager
        def rec():
            self.recording = {}
            try:
                yield self.recording
            finally:
                self.recording = None
        return rec()

    def recording_started(self, stream) -> None:
        assert stream is self.stream and self.recording is not None
        self.log.append("started")

    def note_waits(self, waits: dict, stream) -> None:
        self.noted.append((dict(waits), stream))


@pytest.mark.parametrize("fail, raises", [(None, None), ("begin", None), ("run", None), ("end", None),
                                          ("run-value", ValueError)])
def test_recording_on_cuda_ends_its_capture_whatever_happens(monkeypatch, caplog, fail, raises) -> None:
    """The CUDA branch of ``run_graph.record`` without a GPU (torch.cuda's stream, device and
    graph stood in for): it records on the transport's own stream, never a pooled one; a capture
    the driver refuses at its beginning, during the run or at its
    end gives None (the runs stay eager, logged), and ends the capture where it began; another
    error ends the capture and propagates; a recording keeps the run's waits aside and each replay
    launches the graph and notes them on the replay's stream.  The first thing recorded is
    the transport's ``recording_started`` (the reset of the recording's progress words)."""
    import contextlib

    log: list = []

    class Stream:
        def wait_stream(self, other) -> None:
            log.append("fork")

    def pooled(device=None):
        raise AssertionError("a recording must not take one of torch's pooled streams (another rank's, maybe)")

    monkeypatch.setattr(torch.cuda, "Stream", pooled)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: _FakeGraph(log, fail))
    monkeypatch.setattr(_once, "_logged", set())  # log_once: every reason new again
    own = Stream()
    t = _FakeTransport(own, log)

    def run(stream) -> None:
        assert stream is own  # recorded on the transport's own stream
        log.append("run")
        t.recording[3] = (7, 1, 0, "rank 1's block")  # what the transport's waits put there
        if fail == "run":
            raise RuntimeError("operation not permitted when stream is capturing")
        if fail == "run-value":
            raise ValueError("a real error")

    with caplog.at_level(logging.WARNING, logger="tide_triton"):
        if raises is not None:
            with pytest.raises(raises):
                run_graph.record(t, torch.device("cuda", 0), run)
            rg = "raised"
        else:
            rg = run_graph.record(t, torch.device("cuda", 0), run)
    assert t.recording is None  # the waits' recording ended too
    began = fail != "begin"
    assert log.count("begin") == 1 and log.count("end") == (1 if began else 0), log
    if began:  # the recording's progress words are reset by its first node, before the run's
        assert log.index("begin") < log.index("started") < log.index("run"), log
    else:
        assert "started" not in log, log
    if fail is None:
        assert isinstance(rg, run_graph.RunGraph) and rg.waits == {3: (7, 1, 0, "rank 1's block")}
        replay_stream = object()
        rg.replay(t, replay_stream)
        assert log[-1] == "replay" and t.noted == [({3: (7, 1, 0, "rank 1's block")}, replay_stream)]
        assert not caplog.messages
    elif raises is None:
        assert rg is None and len([m for m in caplog.messages if "could not be recorded" in m]) == 1, caplog.messages


def _evicted_under_replay_child(rank: int, world_size: int, rounds: int) -> list:
    """One process per rank on CUDA, the drop-in's path (``_run_on``) with one binding kept:
    each round binds set A, records it, replays it with ``async_op=True`` behind a sleep on
    the group's side stream, and at once binds set C -- evicting A, whose tables the caching
    allocator hands to C's upload unless the replay's stream was recorded on them.  A's
    shards must hold A's sums, C's C's."""
    import tide_triton as tt_
    from tide_triton.executors import prepared as programs

    dev = _rank_device(rank)
    programs._BINDINGS_KEPT = 1
    g = tt_.init(timeout_s=20)
    shapes = [(512, 256)] * 6
    layout = ShardLayout(shapes, world_size)
    ga = [torch.full(s, 1.0, dtype=torch.bfloat16, device=dev) for s in shapes]
    sa = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank, padded=True)]
    from tide_triton.collectives import prepared_reduce_scatter_call

    p = prepared_reduce_scatter_call(g, ga, sa, "sum", False, hold=False)  # the drop-in's form
    side = g.side_stream(dev)
    wrong = []
    for i in range(rounds):
        gc = [torch.full(s, 3.0 + i, dtype=torch.bfloat16, device=dev) for s in shapes]  # new addresses
        sc = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank, padded=True)]
        for x in sa:
            x.zero_()
        p._run_on(ga, sa)  # bound again (evicted last round), run op by op
        p._run_on(ga, sa)  # recorded
        for x in sa:
            x.zero_()
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(5e7))  # ~25 ms: the replay waits behind it on the side stream
        work = p._run_on(ga, sa, async_op=True)  # replayed on the side stream
        p._run_on(gc, sc)  # binds C now: evicts A, uploads C's tables
        work.wait()
        tt_.synchronize(g, timeout_s=60)
        for name, shards, want in (("A", sa, 1.0 * world_size), ("C", sc, (3.0 + i) * world_size)):
            bad = [q for q, x in enumerate(shards) if not bool((x == want).all())]
            if bad:
                wrong.append((i, name, bad[:3]))
    g.close()
    return wrong


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_binding_evicted_while_its_replay_waits_on_the_side_stream_keeps_its_tables() -> None:
    """An ``async_op=True`` replay (side stream, held back by a sleep) followed at once by a
    run on new addresses that evicts the replayed binding: every round exact.  Without
    ``_Prepared._follow`` the second run's waits, on the caller's stream, take the peers'
    tokens for the first and the ranks hang (this test, on the H200).  The replay also
    records its stream on the evicted binding's tables (``Binding.keep_tables_for``); with
    that switched off this test still passed on the
    H200 (the allocator did not hand those blocks out in time), so the tables' part is
    checked by ``test_kernels.py::test_a_replay_keeps_the_tables_for_its_stream``."""
    out = _spawn(_evicted_under_replay_child, 2, 6, TIDE_TRITON_RUN_GRAPHS="all")
    for r, wrong in enumerate(out):
        assert not wrong, (r, wrong)
