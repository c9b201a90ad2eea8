"""tide_triton.reduce_scatter / all_gather on the host transport: several processes, gloo
bootstrap, shared-memory heaps, Triton kernels under the interpreter.

Every value is an integer-valued bf16 (|x| <= 8), so every sum is exact in fp32 and the
checks are bit for bit against a plain-torch construction of the contract.  One spawn per
world size runs every scenario (spawning W processes costs seconds; the scenarios cost
milliseconds), with a small receive ring so layouts take many chunks and stages wrap.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

try:
    from _dist import run_multiprocess, run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess, run_threads

from tide_triton.executors import state as exec_state
from tide_triton.plan.layout import ShardLayout
from tide_triton.plan.schedule import ring_plan

pytestmark = pytest.mark.multiproc


def _shape_sets(W: int, seed: int) -> list[list[tuple[int, ...]]]:
    rng = random.Random(seed)
    fixed = [(7, 5), (3,), (1, 4, 3), (13, 2), (2 * W + 1, 3), (max(1, W - 1), 2), (97,)]
    sets = [fixed]
    for _ in range(2):
        shapes = []
        for _ in range(rng.randint(1, 6)):
            d0 = rng.choice([1, 2, 3, 5, 7, 11, 13, W - 1 if W > 1 else 1, W, W + 1, 3 * W + 2])
            rest = rng.choice([(), (1,), (3,), (2, 3), (17,)])
            shapes.append((d0, *rest))
        sets.append(shapes)
    return sets


def _int_tensor(shape, gen, dtype=torch.bfloat16, device="cpu"):
    return torch.randint(-8, 9, shape, generator=gen).to(dtype).to(device)


def _expected_shard(grads_all, p, rank, layout, scale, prev=None):
    W = layout.world_size
    full = grads_all[0][p].float().cpu().clone()
    for r in range(1, W):
        full += grads_all[r][p].float().cpu()
    c, rows = layout.rows_per_rank[p], layout.shard_rows(rank)[p]
    want = full[rank * c: rank * c + rows]
    if scale is not None:
        want = want * scale
    if prev is not None:
        want = want + prev
    return want


def _scenarios(rank: int, W: int, seed: int, device: str = "cpu") -> dict:
    import tide_triton as tt

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)

    g = tt.init(timeout_s=60, ring_bytes=512 * W)  # tiny ring: many chunks, stages wrap
    results = {}
    for si, shapes in enumerate(_shape_sets(W, seed)):
        layout = ShardLayout(shapes, W)
        gen = torch.Generator().manual_seed(seed * 100 + si)
        grads_all = [[_int_tensor(s, gen, device=dev) for s in shapes] for _ in range(W)]  # same on every rank
        for op, scale in [("sum", None), ("avg", 1.0 / W), (0.5, 0.5)]:
            for padded in (False, True):
                shards = [torch.full(s, -5.0, device=dev) for s in layout.shard_shapes(rank, padded=padded)]
                tt.reduce_scatter(grads_all[rank], shards, op=op)
                for p, x in enumerate(shards):
                    x = x.cpu()
                    rows = layout.shard_rows(rank)[p]
                    want = _expected_shard(grads_all, p, rank, layout, scale)
                    assert torch.equal(x[:rows], want), (si, op, padded, p)
                    assert bool((x[rows:] == 0).all()), f"padding not zeroed: set {si} param {p}"
        # accumulate into existing shards (gradient accumulation), bf16 shards too
        for sdt in (torch.float32, torch.bfloat16):
            prev = [_int_tensor(s, gen, sdt, dev) for s in layout.shard_shapes(rank, padded=True)]
            shards = [x.clone() for x in prev]
            tt.reduce_scatter(grads_all[rank], shards, op="sum", accumulate=True)
            for p, x in enumerate(shards):
                x = x.cpu()
                rows = layout.shard_rows(rank)[p]
                want = _expected_shard(grads_all, p, rank, layout, None, prev[p][:rows].float().cpu())
                assert torch.equal(x[:rows].float(), want.to(sdt).float()), (si, "accumulate", sdt, p)
                assert torch.equal(x[rows:], prev[p][rows:].cpu()), "accumulate must keep padding rows"
        # determinism with non-integer inputs: two runs, same bits
        rgrads = [torch.randn(s, generator=gen).to(torch.bfloat16).to(dev) for s in shapes]
        a = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
        b = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(rgrads, a)
        tt.reduce_scatter(rgrads, b)
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "repeated runs differ"
        # all_gather: padded/unpadded shards, full/padded params, same dtype and fp32 -> bf16
        full = [torch.randn(s, generator=gen) for s in shapes]
        for padded_shards in (False, True):
            mine = []
            for f, c, n, s in zip(full, layout.rows_per_rank, layout.shard_rows(rank), shapes):
                x = torch.zeros((c if padded_shards else n, *s[1:]))
                x[:n] = f[rank * c: rank * c + n]
                mine.append(x.to(dev))
            for pdt in (torch.float32, torch.bfloat16):
                for padded_params in (False, True):
                    pshapes = layout.padded_shapes if padded_params else layout.shapes
                    params = [torch.full(s, -9.0, dtype=pdt, device=dev) for s in pshapes]
                    tt.all_gather(mine, params)
                    for p, (x, f) in enumerate(zip(params, full)):
                        x = x.cpu()
                        assert torch.equal(x[: f.shape[0]], f.to(pdt)), (si, padded_shards, pdt, padded_params, p)
                        if padded_params:
                            assert bool((x[f.shape[0]:] == 0).all()), "padding rows of a padded param"
        results[si] = "ok"
    if dev.type == "cuda":
        tt.synchronize(timeout_s=60)
    results["rounds"] = exec_state.of(g).rs_count
    g.close()
    shm = [n for n in os.listdir("/dev/shm") if n.startswith("tide_triton.")]
    results["shm_left"] = shm
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_contract_exact(world_size: int) -> None:
    out = run_multiprocess(_scenarios, world_size, 7, timeout=240)
    for r, res in enumerate(out):
        assert all(res[i] == "ok" for i in range(3)), (r, res)
        assert res["shm_left"] == [], f"rank {r} left shared memory behind: {res['shm_left']}"
    assert len({res["rounds"] for res in out}) == 1


# ----------------------------------------------------------------------- errors, no hangs
def _bad_input(rank: int, W: int, case: str) -> str:
    import tide_triton as tt

    g = tt.init(timeout_s=30)
    shapes = [(6, 4), (5,)]
    layout = ShardLayout(shapes, W)
    grads = [torch.ones(s, dtype=torch.bfloat16) for s in shapes]
    shards = [torch.empty(s) for s in layout.shard_shapes(rank)]
    if case == "shapes differ" and rank == 1:
        grads = [torch.ones((7, 4), dtype=torch.bfloat16), grads[1]]
        shards = [torch.empty(s) for s in ShardLayout([(7, 4), (5,)], W).shard_shapes(rank)]
    if case == "dtype" and rank == 1:
        shards[0] = shards[0].to(torch.int32)
    if case == "shard shape" and rank == 1:
        shards[1] = torch.empty(9)
    if case == "lengths" and rank == 1:
        shards = shards[:1]
    try:
        tt.reduce_scatter(grads, shards)
    except Exception as e:  # every rank must raise, none may hang
        msg = f"{type(e).__name__}: {e}"
    else:
        msg = "no error"
    # the group stays usable after an agreed failure
    good = [torch.empty(s) for s in layout.shard_shapes(rank)]
    tt.reduce_scatter([torch.ones(s, dtype=torch.bfloat16) for s in shapes], good, op="sum")
    assert all(bool((x == W).all()) for x in good)
    g.close()
    return msg


@pytest.mark.parametrize("case, local, remote", [
    ("shapes differ", "ranks disagree", "ranks disagree"),
    ("dtype", r"shards\[0\] must be", "rank 1 rejected its arguments: TypeError: shards"),
    ("shard shape", r"shards\[1\] must have shape", "rank 1 rejected its arguments: ValueError: shards"),
    ("lengths", "shards must have 2 entries", "rank 1 rejected its arguments: ValueError: shards must have 2"),
])
def test_bad_input_raises_on_every_rank(case: str, local: str, remote: str) -> None:
    import re

    msgs = run_multiprocess(_bad_input, 3, case, timeout=120)
    assert re.search(local, msgs[1]), msgs[1]
    for r in (0, 2):
        assert re.search(remote, msgs[r]), (r, msgs[r])


def _dead_peer(rank: int, W: int, which: str) -> str:
    import tide_triton as tt
    from tide_triton.errors import PeerTimeoutError

    g = tt.init(timeout_s=3)
    shapes = [(8, 4)]
    layout = ShardLayout(shapes, W)
    grads = [torch.ones(s, dtype=torch.bfloat16) for s in shapes]
    shards = [torch.empty(s) for s in layout.shard_shapes(rank)]
    tt.reduce_scatter(grads, shards)  # everyone alive: fine
    if rank == 2:
        # Die mid-collective: after the agreement, at the first data movement.
        t = g.transport(torch.device("cpu"))
        t.copy = lambda *a, **k: os._exit(0)
    try:
        if which == "all_gather":
            tt.all_gather(shards, [torch.empty(s) for s in shapes])
        else:
            tt.reduce_scatter(grads, shards)
    except PeerTimeoutError as e:
        return f"timeout peer={e.peer}: {e}"
    return "no error"


@pytest.mark.parametrize("which", ["all_gather", "reduce_scatter"])
def test_dead_peer_gives_survivors_a_timeout_naming_it(which: str) -> None:
    out = run_multiprocess(_dead_peer, 3, which, timeout=120, may_die=(2,))
    assert out[2] is None
    for r in (0, 1):
        assert out[r].startswith("timeout peer=2: timed out after 3.0 s waiting for rank 2"), out


# ----------------------------------------------------------------------- staging bound
@pytest.mark.parametrize("ring_bytes", [1 << 16, 64 << 20])
def test_receive_staging_is_constant_in_world_size(ring_bytes: int) -> None:
    # Fixed per-rank shard size (the Llama-like shape grows with W), fixed ring: the
    # staging bytes never exceed ring_bytes, for any W.
    for W in (2, 4, 8, 16, 64):
        layout = ShardLayout([(1024 * W, 64), (W * 3 + 1,)], W)
        plan = ring_plan(layout, ring_bytes, 2, 2)
        assert plan.staging_elems() * 2 <= ring_bytes
        assert plan.staging_elems() * 2 >= ring_bytes - 2 * W * 16  # rounding only
        for d in range(W):  # every real element of every destination is covered once
            covered = {}
            for chunk in plan.chunks[d]:
                assert sum(pc.numel for pc in chunk) <= plan.chunk_elems
                for pc in chunk:
                    covered.setdefault(pc.param, []).append((pc.start, pc.numel))
            for p, n in enumerate(layout.shard_numels(d)):
                runs = sorted(covered.get(p, []))
                pos = 0
                for start, numel in runs:
                    assert start == pos
                    pos += numel
                assert pos == n


# ----------------------------------------------------------------------- one process, W ranks
def run_single_process_mode(device: str = "cpu") -> None:
    # local_groups: one thread per rank, each with its own heap, the same collective code.
    import tide_triton as tt

    W = 4
    dev = torch.device(device)
    groups = tt.local_groups(W, timeout_s=30, ring_bytes=512 * W,
                             devices=[dev] * W if dev.type == "cuda" else None)  # all on one GPU
    shapes = [(7, 5), (3,), (1, 4, 3), (13, 2), (97,)]
    layout = ShardLayout(shapes, W)
    gen = torch.Generator().manual_seed(3)
    grads = [[_int_tensor(s, gen, device=dev) for s in shapes] for _ in range(W)]
    full = [torch.randn(s, generator=gen).to(dev) for s in shapes]

    def body(r: int) -> tuple:
        shards = [torch.full(s, -1.0, device=dev) for s in layout.shard_shapes(r, padded=True)]
        tt.reduce_scatter(grads[r], shards, group=groups[r], op="avg")
        mine = [f[r * c: r * c + n] for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(r))]
        params = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes]
        tt.all_gather(mine, params, group=groups[r])
        if dev.type == "cuda":
            tt.synchronize(groups[r], timeout_s=30)
        return [x.cpu() for x in shards], [x.cpu() for x in params]

    def rank_main(r: int) -> tuple:
        if dev.type == "cuda":  # every rank its own compute stream, as on its own GPU
            with torch.cuda.stream(torch.cuda.Stream(dev)):
                return body(r)
        return body(r)

    out = run_threads(rank_main, W, timeout=60)
    for r in range(W):
        shards, params = out[r]
        for p in range(len(shapes)):
            rows = layout.shard_rows(r)[p]
            assert torch.equal(shards[p][:rows], _expected_shard(grads, p, r, layout, 1.0 / W))
            assert bool((shards[p][rows:] == 0).all())
            assert torch.equal(params[p], full[p].to(torch.bfloat16).cpu())
    for g in groups:
        g.close()


def test_single_process_multi_rank_mode() -> None:
    run_single_process_mode("cpu")
