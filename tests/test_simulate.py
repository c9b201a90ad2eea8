"""Cross-node schedules, run through the simulator: exact (each element once, each gradient
counted once) on many topologies and awkward layouts; byte counts against closed forms;
staging constant as nodes grow; and the checker itself must catch broken schedules."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import random
import time
from pathlib import Path

import pytest

from tide_triton.plan.across_nodes import (
    AllGatherPlan,
    ReduceScatterPlan,
    Run,
    Transfer,
    all_gather_node_rounds,
    chunk_runs,
    reduce_scatter_node_rounds,
)
from tide_triton.plan.layout import ShardLayout
from tide_triton.plan.check import fixed_shard_shapes, nccl_ring_bytes, simulate
from tide_triton.plan.topology import Topology
from tide_triton.plan.workloads import layer_shapes


def _simulator_main():
    """``main`` of the simulator's command line, ``bench/simulate.py``."""
    spec = importlib.util.spec_from_file_location("simulate_bench", Path(__file__).resolve().parents[1] / "bench"
                                                  / "simulate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


main = _simulator_main()

# nodes x local: one node (1 x 8), one rank per node (8 x 1, 7 x 1), powers of two (2 x 2,
# 4 x 2) and not (3 x 2, 5 x 4, 6 x 8, 2 x 3), and the trivial 1 x 1.
TOPOLOGIES = [(1, 8), (8, 1), (7, 1), (2, 2), (4, 2), (3, 2), (5, 4), (6, 8), (2, 3), (1, 1)]

# Awkward shapes: dim 0 smaller than W (trailing ranks hold nothing), 1-D and 3-D, primes,
# a 1-element parameter, an empty one (dim 0 = 0) and one with empty rows.
AWKWARD = [(70, 30), (1, 5), (131,), (0, 4), (20, 2, 3), (29,), (1,), (3, 0), (64, 64)]


def _nz(table: dict[str, list[int]]) -> dict[str, list[int]]:
    """Rounds that move something (a layout with no elements moves nothing at all)."""
    return {k: v for k, v in table.items() if any(v)}


def _plans(shapes, nodes, local, *, chunk_bytes=40, windows=6, wire_bytes=4):
    W = nodes * local
    layout = ShardLayout(shapes, W)
    topo = Topology(W, local)
    ag = AllGatherPlan(layout, topo, elem_bytes=2, chunk_bytes=chunk_bytes)
    # a ring small enough for several windows (window elements are multiples of 8)
    probe = ReduceScatterPlan(layout, topo, ring_bytes=1 << 30, wire_bytes=wire_bytes)
    per = probe.stages * probe.bytes_per_window_elem
    win = max(8, -(-layout.flat_shard_numel // windows) // 8 * 8)
    rs = ReduceScatterPlan(layout, topo, ring_bytes=per * win, wire_bytes=wire_bytes)
    return ag, rs


@pytest.mark.parametrize("nodes,local", TOPOLOGIES)
def test_exact_on_awkward_layouts(nodes: int, local: int) -> None:
    ag, rs = _plans(AWKWARD, nodes, local)
    r = simulate(ag)
    assert r.ok, r.errors
    assert _nz(r.sent) == _nz(ag.sent_bytes()) and r.chunks == ag.chunk_counts()
    for wire in (4, 2):
        _, rs = _plans(AWKWARD, nodes, local, wire_bytes=wire)
        assert len(rs.windows) > 1
        r = simulate(rs)
        assert r.ok, r.errors
        assert _nz(r.sent) == _nz(rs.sent_bytes())


def test_exact_on_random_layouts() -> None:
    # Random shape sets (1-3 dims, dims 0..40, some dim 0 < W) on random topologies,
    # random chunk caps and window counts; seeded so a failure reproduces.
    rng = random.Random(1234)
    for _ in range(25):
        nodes, local = rng.choice([(n, l) for n in range(1, 10) for l in (1, 2, 3, 4, 8)])
        shapes = [tuple(rng.choice([0, 1, 2, 3, 5, 7, 16, 31, 40]) if d else rng.randint(0, 40)
                        for d in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
        ag, rs = _plans(shapes, nodes, local, chunk_bytes=rng.choice([2, 6, 64, 1 << 20]),
                        windows=rng.randint(1, 5), wire_bytes=rng.choice([2, 4]))
        for plan in (ag, rs):
            r = simulate(plan)
            assert r.ok, (nodes, local, shapes, r.errors)
            assert _nz(r.sent) == _nz(plan.sent_bytes())


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 128])
def test_node_rounds(nodes: int) -> None:
    R = math.ceil(math.log2(nodes)) if nodes > 1 else 0
    for rounds in (all_gather_node_rounds(nodes), reduce_scatter_node_rounds(nodes)):
        assert len(rounds) == R
        sent = [0] * nodes
        for rnd in rounds:
            assert sorted(s for s, _, _ in rnd) == list(range(nodes))  # each node sends once a round
            assert sorted(d for _, d, _ in rnd) == list(range(nodes))  # and receives once
            for s, _d, moved in rnd:
                sent[s] += len(moved)
        assert sent == [nodes - 1] * nodes  # no node sends more than its share
    if nodes & (nodes - 1) == 0:  # powers of two: pairwise exchanges, distance 2^k / 2^(R-1-k)
        for k, rnd in enumerate(all_gather_node_rounds(nodes)):
            assert all(d == s ^ (1 << k) and len(m) == 1 << k for s, d, m in rnd)
        for k, rnd in enumerate(reduce_scatter_node_rounds(nodes)):
            assert all(d == s ^ (nodes >> (k + 1)) and len(m) == nodes >> (k + 1) for s, d, m in rnd)


@pytest.mark.parametrize("nodes,local", [(2, 2), (4, 2), (8, 4), (16, 8)])
def test_bytes_match_closed_form(nodes: int, local: int) -> None:
    # Every shard full (dim 0 a multiple of W): per rank, the network carries nodes - 1
    # shards, the node (L - 1) * nodes; reduce-scatter the same in its wire dtype.
    W = nodes * local
    layout = ShardLayout([(3 * W, 5), (W,), (2 * W, 2, 2)], W)
    shard = layout.flat_shard_numel
    topo = Topology(W, local)
    ag = AllGatherPlan(layout, topo, elem_bytes=2, chunk_bytes=64)
    r = simulate(ag)
    assert r.ok, r.errors
    assert r.link_bytes("inter") == [(nodes - 1) * shard * 2] * W
    assert r.link_bytes("inter", sent=False) == [(nodes - 1) * shard * 2] * W
    assert r.link_bytes("intra") == [(local - 1) * nodes * shard * 2] * W
    assert r.rounds == int(math.log2(nodes)) + 1
    assert r.chunks == [sum(-(-(shard << k) // 32) for k in range(int(math.log2(nodes))))] * W
    for wire in (4, 2):
        rs = ReduceScatterPlan(layout, topo, ring_bytes=1 << 16, wire_bytes=wire)
        r = simulate(rs)
        assert r.ok, r.errors
        assert r.link_bytes("inter") == [(nodes - 1) * shard * wire] * W
        assert r.link_bytes("intra") == [(local - 1) * nodes * shard * 2] * W
        assert r.rounds == (int(math.log2(nodes)) + 1) * len(rs.windows)
        # each halving round sends half the previous one
        per_round = [r.sent[f"rs inter {k}"][0] for k in range(int(math.log2(nodes)))]
        assert per_round == [(nodes >> (k + 1)) * shard * wire for k in range(len(per_round))]


def test_staging_constant_as_nodes_grow() -> None:
    # Fixed per-rank shard (the published setting): FSDP2's fp32 reduce-scatter input grows
    # with W, the windowed ring stays under ring_bytes and nearly constant.
    base = layer_shapes("llama-3.1-70b")
    ring = 64 << 20
    staging, fsdp = [], []
    for nodes in (2, 4, 8, 16, 128):
        W = nodes * 8
        layout = ShardLayout(fixed_shard_shapes(base, W, 16), W)
        rs = ReduceScatterPlan(layout, Topology(W, 8), ring_bytes=ring)
        staging.append(rs.staging_bytes)
        fsdp.append(nccl_ring_bytes(layout, 8, 4)["total"])
    assert all(s <= ring for s in staging)
    assert min(staging) >= 0.99 * ring
    assert fsdp == [fsdp[0] * n // 2 for n in (2, 4, 8, 16, 128)]


def test_staging_bound_checked_on_a_real_layer() -> None:
    layout = ShardLayout(fixed_shard_shapes(layer_shapes("llama-3.1-70b"), 32, 16), 32)
    rs = ReduceScatterPlan(layout, Topology(32, 8), ring_bytes=16 << 20, wire_bytes=2)
    r = simulate(rs)  # also checks every round fits its staging slot
    assert r.ok, r.errors
    assert r.staging_bytes <= 16 << 20


def test_fixed_shard_shapes_keep_the_shard() -> None:
    base = layer_shapes("wan2.2-14b")
    ref = ShardLayout(base, 16)
    for W in (16, 32, 48, 1024):
        lay = ShardLayout(fixed_shard_shapes(base, W, 16), W)
        assert lay.padded_shard_numels == ref.padded_shard_numels
        assert lay.flat_shard_numel == ref.flat_shard_numel


def test_1024_ranks() -> None:
    # 128 nodes x 8: element-exact in ~2 s (a small layout keeps CI fast; the CLI runs
    # the real layers).
    W = 1024
    layout = ShardLayout([(4096, 8), (1000,), (999, 3), (5,)], W)
    topo = Topology(W, 8)
    t0 = time.perf_counter()
    r = simulate(AllGatherPlan(layout, topo, chunk_bytes=4096))
    assert r.ok, r.errors
    rs = ReduceScatterPlan(layout, topo, ring_bytes=5120 * 16, wire_bytes=2)  # 16-element windows
    r2 = simulate(rs)
    assert r2.ok, r2.errors
    assert len(rs.windows) >= 2
    assert time.perf_counter() - t0 < 30


# --------------------------------------------------------------------------- the checker fails
class _Mutated:
    """A plan whose steps pass through ``fn`` (a list of steps in, a list out)."""

    @staticmethod
    def of(plan, fn):
        cls = type(plan)
        sub = type("Mutated" + cls.__name__, (cls,), {"steps": lambda self: iter(fn(list(cls.steps(self))))})
        return sub(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan) if f.init})


def _edit_transfer(steps, si, ti, fn):
    s = steps[si]
    ts = list(s.transfers)
    ts[ti] = fn(ts[ti])
    steps[si] = dataclasses.replace(s, transfers=tuple(ts))
    return steps


def _drop_last_run(t: Transfer) -> Transfer:
    chunks = list(t.chunks)
    chunks[-1] = chunks[-1][:-1]
    return Transfer(t.src, t.dst, tuple(chunks))


@pytest.mark.parametrize("nodes,local", [(4, 2), (3, 2)])
def test_checker_catches_a_dropped_run(nodes: int, local: int) -> None:
    ag, rs = _plans(AWKWARD, nodes, local)
    r = simulate(_Mutated.of(ag, lambda s: _edit_transfer(s, 0, 3, _drop_last_run)))
    assert not r.ok and "never receives" in r.errors[-1]
    r = simulate(_Mutated.of(rs, lambda s: _edit_transfer(s, 1, 0, _drop_last_run)))
    assert not r.ok and "lacks the gradients of" in r.errors[0]


def test_checker_catches_duplicates_and_causality() -> None:
    ag, rs = _plans(AWKWARD, 4, 2)
    # the same transfer twice: elements arrive a second time / gradients counted twice
    def dup(s):
        return _edit_transfer(s, 0, 0, lambda t: Transfer(t.src, t.dst, t.chunks + t.chunks))

    r = simulate(_Mutated.of(ag, dup))
    assert not r.ok and "a second time" in r.errors[0]
    r = simulate(_Mutated.of(rs, dup))
    assert not r.ok and any("twice" in e for e in r.errors)
    assert any("over its" in e and "staging" in e for e in r.errors)  # and overflows the ring
    # rounds out of order: a rank forwards data before it has it
    r = simulate(_Mutated.of(ag, lambda s: [s[1], s[0]] + s[2:]))
    assert not r.ok and any("does not hold yet" in e for e in r.errors)


def test_checker_catches_bad_runs() -> None:
    ag, rs = _plans(AWKWARD, 2, 2)
    S = ag.layout.padded_shard_numels
    # rank 3 holds no rows of param 1 ((1, 5) over 4 ranks): a run there is past the real elements
    def past(s):
        return _edit_transfer(s, 0, 0, lambda t: Transfer(t.src, t.dst, t.chunks + (((Run(1, 3 * S[1], 5),),))))

    r = simulate(_Mutated.of(ag, past))
    assert not r.ok and "past the real elements of rank 3's shard of param 1" in r.errors[0]
    r = simulate(_Mutated.of(ag, lambda s: _edit_transfer(
        s, 0, 0, lambda t: Transfer(t.src, t.dst, ((Run(0, 0, 0),),)))))
    assert not r.ok and "malformed run" in r.errors[0]
    # an inter-node transfer that leaves its rail
    r = simulate(_Mutated.of(ag, lambda s: _edit_transfer(s, 0, 0, lambda t: Transfer(t.src, t.dst ^ 1, t.chunks))))
    assert not r.ok and "leaves its rail" in r.errors[0]
    # a chunk over the pacing cap
    r = simulate(_Mutated.of(ag, lambda s: _edit_transfer(
        s, 0, 0, lambda t: Transfer(t.src, t.dst, (tuple(x for c in t.chunks for x in c),)))))
    assert not r.ok and "over the 20-element cap" in r.errors[0]


def test_chunk_runs() -> None:
    runs = [Run(0, 0, 5, 3, 20), Run(1, 7, 4)]
    chunks = chunk_runs(runs, 7)
    assert all(sum(r.elems for r in c) <= 7 for c in chunks)
    def flat(rs):
        return [e for r in rs for (p, st, n) in r.pieces() for e in ((p, i) for i in range(st, st + n))]

    assert flat([r for c in chunks for r in c]) == flat(runs)
    assert chunk_runs(runs, 100) == (tuple(runs),)
    with pytest.raises(ValueError, match="cap must be >= 1, got 0"):
        chunk_runs(runs, 0)


def test_plan_validation() -> None:
    lay, topo = ShardLayout([(8, 2)], 4), Topology(4, 2)
    with pytest.raises(ValueError, match="topology.world_size must equal layout.world_size=4, got 8"):
        AllGatherPlan(lay, Topology(8, 2))
    with pytest.raises(TypeError, match="layout must be a ShardLayout, got list"):
        ReduceScatterPlan([(8, 2)], topo)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="topology must be a Topology, got int"):
        AllGatherPlan(lay, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes must hold at least one 4-byte element, got 2"):
        AllGatherPlan(lay, topo, elem_bytes=4, chunk_bytes=2)
    with pytest.raises(ValueError, match="max_inflight must be >= 1, got 0"):
        AllGatherPlan(lay, topo, max_inflight=0)
    with pytest.raises(ValueError, match=r"wire_bytes must be 4 \(fp32\) or 2 \(bf16\), got 8"):
        ReduceScatterPlan(lay, topo, wire_bytes=8)
    with pytest.raises(ValueError, match="ring_bytes=100 is too small"):
        ReduceScatterPlan(lay, topo, ring_bytes=100)
    with pytest.raises(TypeError, match="ring_bytes must be an int, got float"):
        ReduceScatterPlan(lay, topo, ring_bytes=1e6)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plan must be an AllGatherPlan or a ReduceScatterPlan, got str"):
        simulate("plan")  # type: ignore[arg-type]


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "wan2.2-14b", "--ranks", "16", "32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["world_size"]) for r in rows] == [
        ("layer", 16), ("layer", 32), ("fixed-shard", 16), ("fixed-shard", 32)]
    assert all(r["checked"] and not r["errors"] for r in rows)
    fixed = [r for r in rows if r["mode"] == "fixed-shard"]
    assert fixed[0]["shard_bytes"] == fixed[1]["shard_bytes"]
    assert fixed[1]["fsdp2_rs_input_bytes"] == 2 * fixed[0]["fsdp2_rs_input_bytes"]
    assert abs(fixed[1]["rs_staging_bytes_fp32"] - fixed[0]["rs_staging_bytes_fp32"]) < 0.01 * (64 << 20)


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "llama-3.1-70b", "--ranks", "16", "--fixed-ref", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 16 | 2 x 8 |" in out and "exact" in out and "fixed-shard" not in out


def test_cli_model_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--model", "llama"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "invalid choice: 'llama'" in err and "llama-3.1-70b" in err and "qwen3-30b-a3b" in err


def test_cli_progress_and_header(capsys: pytest.CaptureFixture[str]) -> None:
    # Progress goes to stderr (plain lines when not a terminal), one line per checked piece;
    # the header on stdout names the sizes actually used.
    assert main(["--model", "wan2.2-14b", "--ranks", "16", "--fixed-ref", "0", "--ring-bytes", str(32 << 20)]) == 0
    cap = capsys.readouterr()
    assert "reduce-scatter staging 32 MiB per rank" in cap.out.splitlines()[0]
    assert "layer W=16 (2 x 8): checking the all-gather" in cap.err
    assert "layer W=16 (2 x 8): checking the reduce-scatter" in cap.err
