"""Prepared runs, their recordings and captures (host transport, the ranks as threads): what a
group keeps for captured runs is let go at its close, and recorded runs of prepared collectives
sharing one all-gather block stay exact beside user captures and eager calls in any order, with
the copy queue behind the caller."""
from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

try:
    from _dist import run_threads
    from test_programs import SHAPES, W, _close, _grads, _groups, _want
except ImportError:  # pragma: no cover
    from tests._dist import run_threads
    from tests.test_programs import SHAPES, W, _close, _grads, _groups, _want

import tide_triton as tt
from tide_triton.executors import state as exec_state
from tide_triton.runtime.host_capture import HostGraph, capture
from tide_triton.plan.layout import ShardLayout


def test_a_closed_group_lets_go_of_its_captured_collectives() -> None:
    """A captured run keeps its prepared collective (and with it the tensors it holds and its
    bindings' tables) in the group "until the group closes" (docs/collectives.md): after
    ``close()`` the group holds none of them, though the caller still holds the group."""
    layout = ShardLayout(SHAPES, W)
    grads = _grads(torch.Generator().manual_seed(71), SHAPES)
    groups = _groups()

    def body(r: int):
        shards = [torch.zeros(s) for s in layout.shard_shapes(r, padded=True)]
        rs = tt.prepare_reduce_scatter(grads[r], shards, group=groups[r], op="sum")
        rs.run()  # once outside the capture
        graph = HostGraph()
        with capture(graph):
            rs.run()
        graph.replay()
        assert any(p is rs for p in exec_state.of(groups[r]).captured)
        return weakref.ref(rs)

    try:
        refs = run_threads(body, W, timeout=60)
    finally:
        _close(groups)
    gc.collect()
    assert all(not exec_state.of(g).captured for g in groups), [exec_state.of(g).captured for g in groups]
    assert all(ref() is None for ref in refs), "a closed group still holds its captured prepared collectives"


@pytest.mark.parametrize("seed", [1, 2])
def test_recorded_and_captured_runs_sharing_a_block_stay_exact_in_any_order(monkeypatch, seed: int) -> None:
    """Per rank a prepared reduce-scatter and two prepared all-gathers sharing one block (one
    casts fp32 -> bf16 on the caller's side, one stages bf16 copies on the copy queue), a user
    capture of the casting one and of the reduce-scatter, and an eager all-gather: every step
    runs them in a new order (the same on every rank), the reduce-scatter recorded or replayed
    from the user's graph -- every result exact, the copy queue behind the caller with random
    delays."""
    monkeypatch.setenv("TIDE_TRITON_RUN_GRAPHS", "all")
    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
    monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE_JITTER_S", 200e-6)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(70 + seed)
    vals = _grads(gen, SHAPES)
    groups = _groups()
    st: dict[int, dict] = {}

    def prepare(r: int) -> None:
        d = st[r] = {"grads": [v.clone() for v in vals[r]],
                     "shards": [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)],
                     "bshards": [torch.zeros(s, dtype=torch.bfloat16) for s in layout.shard_shapes(r, padded=True)],
                     "p1": [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES],
                     "p2": [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES]}
        d["rs"] = tt.prepare_reduce_scatter(d["grads"], d["shards"], group=groups[r], op="sum")
        rows = layout.shard_rows(r)
        d["ag1"] = tt.prepare_all_gather([x[:n] for x, n in zip(d["shards"], rows)], d["p1"], group=groups[r])
        d["ag2"] = tt.prepare_all_gather([x[:n] for x, n in zip(d["bshards"], rows)], d["p2"], group=groups[r])
        for p in (d["rs"], d["ag1"], d["ag2"]):
            p.run()
        d["g_ag1"], d["g_rs"] = HostGraph(), HostGraph()
        with capture(d["g_ag1"]):
            d["ag1"].run()
        with capture(d["g_rs"]):
            d["rs"].run()

    rng = random.Random(seed)
    try:
        run_threads(prepare, W, timeout=60)
        for step in range(8):
            vals = _grads(gen, SHAPES)
            bvals = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16)
                      for s in layout.shard_shapes(r, padded=True)] for r in range(W)]
            order = rng.sample(["ag1", "ag2", "eager", "g_ag1"], 4)
            rs_way = rng.choice(["run", "g_rs"])

            def body(r: int, order=order, rs_way=rs_way, vals=vals, bvals=bvals):
                d = st[r]
                for x, v in zip(d["grads"], vals[r]):
                    x.copy_(v)
                for x, v in zip(d["bshards"], bvals[r]):
                    x.copy_(v)
                d["rs"].run() if rs_way == "run" else d["g_rs"].replay()
                out = {}
                for o in order:
                    if o == "eager":
                        ps = [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES]
                        tt.all_gather([x[:n] for x, n in zip(d["shards"], layout.shard_rows(r))], ps, group=groups[r])
                        out[o] = ps
                        continue
                    ps = d["p2" if o == "ag2" else "p1"]
                    for x in ps:
                        x.zero_()
                    d[o].replay() if o.startswith("g_") else d[o].run()
                    out[o] = [x.clone() for x in ps]
                return [x.clone() for x in d["shards"]], out

            for r, (shards, out) in enumerate(run_threads(body, W, timeout=120)):
                for p in range(len(SHAPES)):
                    want = _want(vals, p)
                    c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
                    assert torch.equal(shards[p][:rows], want[r * c: r * c + rows]), (step, r, p)
                    for k in ("ag1", "eager", "g_ag1"):
                        assert torch.equal(out[k][p], want.to(torch.bfloat16)), (step, r, p, k, order)
                    got = torch.cat([bvals[q][p][:layout.shard_rows(q)[p]] for q in range(W)]).view(SHAPES[p])
                    assert torch.equal(out["ag2"][p], got), (step, r, p, "ag2", order)
        assert all(len(st[r][k]._graphs) == 1 for r in range(W) for k in ("rs", "ag1", "ag2"))
    finally:
        _close(groups)
