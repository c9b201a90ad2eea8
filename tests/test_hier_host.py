"""Declared topologies on the host transport: the cross-node reduce_scatter / all_gather
(tide_triton.executors.across_nodes) run for real, in several processes joined by gloo, with the
inter-node hop emulated over shared memory (HostInterNode).

Every value is an integer-valued bf16 (|x| <= 8), so sums are exact in fp32 in any order and
the checks are bit for bit against a plain-torch construction of the unchanged contract.
Each check also reads the executor's byte counters: the bytes every rank sent across
"nodes" in every round must be exactly what the plans predict, which fails if the flat
node-local path ran instead or a round moved the wrong data.  A tiny ring and a tiny wire
chunk (48 bytes: chunks split elements) force several windows and many chunks.
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
from tide_triton.plan.across_nodes import AllGatherPlan, ReduceScatterPlan
from tide_triton.plan.layout import ShardLayout
from tide_triton.plan.topology import Topology

pytestmark = pytest.mark.multiproc

_CHUNK = 48  # wire chunk: not a multiple of 4-byte partial sums, so elements straddle chunks


def _shapes(W: int, seed: int) -> list[tuple[int, ...]]:
    """dim0 < W (ranks with empty shards), 1-D and 3-D, primes, a random extra."""
    rng = random.Random(seed)
    shapes = [(W - 1, 3), (13,), (2, 2, 5), (W + 1, 2)]
    shapes.append((rng.choice([1, 3, 5, 7, 11, W, 3 * W + 2]), *rng.choice([(), (1,), (3,)])))
    return shapes


def _ring_bytes(W: int, L: int, windows_elems: int = 8) -> int:
    """A ring whose bf16 windows hold ``windows_elems`` elements."""
    plan = ReduceScatterPlan(ShardLayout([(W,)], W), Topology(W, L), ring_bytes=1 << 20)
    return plan.stages * windows_elems * plan.bytes_per_window_elem


def _int(shape, gen, dtype=torch.bfloat16):
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


def _expected(grads_all, p, rank, layout, scale=None, prev=None):
    full = grads_all[0][p].float().clone()
    for g in grads_all[1:]:
        full += g[p].float()
    c, rows = layout.rows_per_rank[p], layout.shard_rows(rank)[p]
    want = full[rank * c: rank * c + rows]
    if scale is not None:
        want = want * scale
    return want if prev is None else want + prev


def _hier(pg, rank: int, W: int, L: int, seed: int, device: str = "cpu", **options) -> dict:
    """Every check of a declared topology; ``device="cuda"``: the same on the GPU path
    (node-local CUDA transport + NCCL between nodes), tensors moved there and back."""
    import tide_triton as tt
    from tide_triton.executors import across_nodes as hc

    g = tt.init(pg, local_size=L, timeout_s=30, ring_bytes=_ring_bytes(W, L), chunk_bytes=_CHUNK, **options)
    dev = torch.device(device)

    def on(xs):
        return [x.to(dev, copy=True) for x in xs]  # never the caller's tensor itself
    assert (g.local_size, g.nodes) == (L, W // L)
    topo = g.topology
    shapes = _shapes(W, seed)
    layout = ShardLayout(shapes, W)
    gen = torch.Generator().manual_seed(seed)
    grads_all = [[_int(s, gen) for s in shapes] for _ in range(W)]  # the same on every rank
    mine_gen = torch.Generator().manual_seed(1000 + rank)  # draws that differ between ranks
    rs_plan = ReduceScatterPlan(layout, topo, ring_bytes=g.options.ring_bytes, grad_bytes=2)
    rs_bytes = rs_plan.sent_bytes()
    assert len(rs_plan.windows) >= 3, "the test wants several windows"
    out: dict = {"windows": len(rs_plan.windows)}

    def check_rs_bytes(what):
        st = hc.stats(g, device)
        assert st["last"] == {k: v[rank] for k, v in rs_bytes.items()}, (what, st["last"], rs_bytes)
        assert any(v[rank] for k, v in rs_bytes.items() if "inter" in k) or sum(layout.shard_numels(rank)) == 0

    calls = 0
    # ops x padded/unpadded x fp32/bf16 shards x accumulate (fresh shards: padding zeroed;
    # accumulate: the old value added, padding rows kept)
    for op, scale, padded, sdt, acc in [("sum", None, False, torch.float32, False),
                                        ("avg", 1.0 / W, True, torch.float32, False),
                                        (0.5, 0.5, True, torch.bfloat16, True)]:
        prev = [_int(s, mine_gen, sdt) for s in layout.shard_shapes(rank, padded=padded)]
        shards = on(prev)
        tt.reduce_scatter(on(grads_all[rank]), shards, op=op, accumulate=acc, group=g)
        calls += 1
        for p, x in enumerate(shards):
            x = x.cpu()
            rows = layout.shard_rows(rank)[p]
            want = _expected(grads_all, p, rank, layout, scale, prev[p][:rows].float() if acc else None)
            assert torch.equal(x[:rows].float(), want.to(sdt).float()), (op, padded, sdt, acc, p)
            if acc:
                assert torch.equal(x[rows:], prev[p][rows:]), "accumulate must keep padding rows"
            else:
                assert bool((x[rows:] == 0).all()), f"padding not zeroed: param {p}"
        check_rs_bytes(op)
    # non-integer gradients: repeated runs bit-identical, and (two nodes) the documented
    # order: node partial sums in local-rank order, then own node + other node
    rg_all = [[torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes] for _ in range(W)]
    a = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
    b = [torch.empty(s, device=dev) for s in layout.shard_shapes(rank)]
    mine_rg = on(rg_all[rank])
    tt.reduce_scatter(mine_rg, a, op="sum", group=g)
    tt.reduce_scatter(mine_rg, b, op="sum", group=g)
    a, b = [x.cpu() for x in a], [x.cpu() for x in b]
    calls += 2
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "repeated runs differ"
    if topo.nodes == 2:
        n = rank // L
        for p, x in enumerate(a):
            node = [rg_all[m * L][p].float().clone() for m in range(2)]
            for m in range(2):
                for c in range(1, L):
                    node[m] += rg_all[m * L + c][p].float()
            full = node[n] + node[1 - n]
            c_, rows = layout.rows_per_rank[p], layout.shard_rows(rank)[p]
            assert torch.equal(x, full[rank * c_: rank * c_ + rows]), f"summation order, param {p}"
    # all_gather: padded/unpadded shards, full/padded params, same dtype and fp32 -> bf16
    full = [torch.randn(s, generator=gen) for s in shapes]
    ag_calls = 0
    for padded_shards, pdt, padded_params in [(False, torch.float32, False), (True, torch.float32, True),
                                              (False, torch.bfloat16, True), (True, torch.bfloat16, False)]:
        mine = []
        for f, c, n_, s in zip(full, layout.rows_per_rank, layout.shard_rows(rank), shapes):
            x = torch.zeros((c if padded_shards else n_, *s[1:]))
            x[:n_] = f[rank * c: rank * c + n_]
            mine.append(x)
        pshapes = layout.padded_shapes if padded_params else layout.shapes
        params = [torch.full(s, -9.0, dtype=pdt, device=dev) for s in pshapes]
        shards_in = on(mine)
        for again in (False, True):  # the second call reuses what the first prepared
            if again:
                for x in params:
                    x.fill_(-9.0)
            tt.all_gather(shards_in, params, group=g)
            ag_calls += 1
            for p, (x, f) in enumerate(zip([x.cpu() for x in params], full)):
                assert torch.equal(x[: f.shape[0]], f.to(pdt)), (padded_shards, pdt, padded_params, again, p)
                if padded_params:
                    assert bool((x[f.shape[0]:] == 0).all()), "padding rows of a padded param"
        ag_layout = ShardLayout(pshapes, W)
        want = AllGatherPlan(ag_layout, topo, elem_bytes=pdt.itemsize).sent_bytes()
        last = hc.stats(g, device)["last"]
        for k in range(len(AllGatherPlan(ag_layout, topo).node_rounds)):
            assert last[f"ag inter {k}"] == want[f"ag inter {k}"][rank], (k, last, want)
        # node-local pickup: this rank reads every node peer's whole rail
        l = rank % L
        read = sum(sum(ag_layout.shard_numels(m * L + lp)) for m in range(topo.nodes)
                   for lp in range(L) if lp != l) * pdt.itemsize
        assert last["ag intra"] == read, (last, read)
    st = hc.stats(g, device)
    assert (st["reduce_scatter"], st["all_gather"]) == (calls, ag_calls), st
    assert st["bytes_sent"] > 0 and st["chunks_sent"] > 0
    out.update(bytes_sent=st["bytes_sent"], bytes_received=st["bytes_received"], chunks=st["chunks_sent"],
               rs_count=exec_state.of(g).rs_count, inter_node=st["inter_node"])
    g.close()
    out["shm_left"] = [n for n in os.listdir("/dev/shm") if n.startswith("tide_triton.")]
    return out


# ----------------------------------------------------------------------- bad topologies
def _bad_topologies(rank: int, W: int) -> dict:
    import tide_triton as tt

    def attempt(**kw):
        try:
            tt.init(timeout_s=30, **kw).close()
        except Exception as e:  # every rank must raise, none may hang
            return f"{type(e).__name__}: {e}"
        return "no error"

    import torch.distributed as dist

    out = {
        "not a multiple": attempt(local_size=3),
        "zero": attempt(local_size=0),
        "not an int": attempt(local_size="2"),
        "one rank differs": attempt(local_size=4 if rank == 2 else 2),
        "one rank bad": attempt(local_size=3 if rank == 1 else 2),
    }
    for case, env in [("env not a multiple", "3"), ("env not an int", "two"), ("env zero", "0")]:
        os.environ["LOCAL_WORLD_SIZE"] = env
        out[case] = attempt()
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # a good one: 4 nodes of 2, from the environment
    g = tt.init(timeout_s=30)
    out["from env"] = (g.local_size, g.nodes)
    g.close()
    # sub-groups: nodes from LOCAL_WORLD_SIZE and the global ranks
    for name, ranks in [("sub consecutive", [0, 1, 2, 3]), ("sub one per node", [0, 2, 4, 6])]:
        pg = dist.new_group(ranks)
        if rank in ranks:
            g = tt.init(pg, timeout_s=30)
            out[name] = (g.local_size, g.nodes)
            g.close()
    os.environ["LOCAL_WORLD_SIZE"] = str(W)
    return out


# ----------------------------------------------------------------------- one spawn for all
TOPOLOGIES = [(2, 2), (3, 2), (4, 2), (2, 3)]  # nodes x local


def _all(rank: int, W: int) -> dict:
    """Every declared topology on a sub-group of the first ``nodes * local`` ranks (spawning
    processes costs seconds per topology; the CI budget is tight), then the bad ones."""
    import traceback

    import torch.distributed as dist

    out: dict = {}
    for nodes, local in TOPOLOGIES:
        n = nodes * local
        pg = dist.new_group(list(range(n)))  # every rank takes part in creating it
        if rank < n:
            try:
                out[(nodes, local)] = _hier(pg, rank, n, local, 11 + n)
            except Exception:  # reported per topology; peers time out (timeout_s) and go on
                out[(nodes, local)] = traceback.format_exc()
        dist.barrier()
    out["bad"] = _bad_topologies(rank, W)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_multiprocess(_all, 8, timeout=400)


@pytest.mark.parametrize("nodes, local", TOPOLOGIES, ids=[f"{n}x{l}" for n, l in TOPOLOGIES])
def test_declared_topology_exact(results: list[dict], nodes: int, local: int) -> None:
    out = [res[(nodes, local)] for res in results[: nodes * local]]
    for r, o in enumerate(out):
        assert isinstance(o, dict), f"rank {r}:\n{o}"
    # what crossed "nodes" was received exactly once: totals agree over the ranks
    assert sum(o["bytes_sent"] for o in out) == sum(o["bytes_received"] for o in out) > 0
    assert len({o["rs_count"] for o in out}) == 1
    for r, o in enumerate(out):
        assert o["chunks"] > 1, "tiny wire chunks must split the messages"
        assert o["shm_left"] == [], f"rank {r} left shared memory behind: {o['shm_left']}"


def test_bad_topologies_rejected_on_every_rank(results: list[dict]) -> None:
    for r, res in enumerate(results):
        o = res["bad"]
        assert o["not a multiple"] == "ValueError: world_size must be a multiple of local_size=3, got 8", o
        assert o["zero"] == "ValueError: local_size must be >= 1, got 0", o
        assert o["not an int"] == "TypeError: local_size must be an int, got str", o
        assert o["one rank differs"].startswith("ValueError: ranks disagree on the topology"), o
        assert "pass the same local_size" in o["one rank differs"]
        if r == 1:
            assert o["one rank bad"] == "ValueError: world_size must be a multiple of local_size=3, got 8", o
        else:
            assert o["one rank bad"] == ("ValueError: rank 1 rejected the topology: ValueError: world_size must "
                                         "be a multiple of local_size=3, got 8"), o
        assert o["env not a multiple"] == "ValueError: world_size=8 must be a multiple of LOCAL_WORLD_SIZE, got '3'"
        assert o["env not an int"] == "ValueError: LOCAL_WORLD_SIZE must be an int, got 'two'"
        assert o["env zero"] == "ValueError: LOCAL_WORLD_SIZE must be >= 1, got '0'"
        assert o["from env"] == (2, 4)
        assert o.get("sub consecutive", (2, 2)) == (2, 2) and o.get("sub one per node", (1, 4)) == (1, 4), o
        assert ("sub consecutive" in o) == (r < 4) and ("sub one per node" in o) == (r % 2 == 0), o


def test_options_and_local_groups_validation() -> None:
    import tide_triton as tt

    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 16, got 8"):
        tt.GroupOptions(chunk_bytes=8)
    with pytest.raises(ValueError, match="inflight_chunks must be an int >= 1, got 0"):
        tt.GroupOptions(inflight_chunks=0)
    with pytest.raises(ValueError, match="world_size must be a multiple of local_size=3, got 4"):
        tt.local_groups(4, local_size=3)
    groups = tt.local_groups(2)  # one node unless declared, whatever LOCAL_WORLD_SIZE says
    assert [(g.local_size, g.nodes) for g in groups] == [(2, 1), (2, 1)]
    for g in groups:
        g.close()


def test_local_groups_devices_are_checked() -> None:
    """``local_groups(devices=...)`` places rank r on devices[r] (e.g. every rank on one GPU
    of several); a list of the wrong length or a non-CUDA entry is refused before any
    thread starts, naming the entry."""
    import tide_triton as tt

    with pytest.raises(ValueError, match="devices must name one CUDA device per rank: 3 entries, got 2"):
        tt.local_groups(3, devices=["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match=r"devices\[1\] must be a CUDA device such as 'cuda:0', got cpu"):
        tt.local_groups(2, devices=["cuda:0", "cpu"])
    with pytest.raises(ValueError, match="devices must be a sequence of 2 CUDA devices"):
        tt.local_groups(2, devices="cuda:0")
    with pytest.raises(ValueError, match=r"devices\[0\] must be a CUDA device such as 'cuda:0', got 'gpu7'"):
        tt.local_groups(2, devices=["gpu7", "cuda:0"])
    groups = tt.local_groups(2, devices=["cuda:1", torch.device("cuda", 0)])
    try:
        assert groups[0]._local.devices() == [torch.device("cuda", 1), torch.device("cuda", 0)]
        assert "the devices given to local_groups" in groups[0]._local.placement()
    finally:
        for g in groups:
            g.close()


def test_single_process_mode_refuses_lazy_module_loading(monkeypatch) -> None:
    """Lazy module loading deadlocked the single-process mode on an H200 (a rank thread's
    first launch of a kernel synchronizes the context while the ranks' streams wait on each
    other): a CUDA transport of several ranks in one process refuses it, with an error that
    says how to fix it (the driver reads the variable once, at cuInit: the library cannot)."""
    import tide_triton as tt
    from tide_triton.group import single_process
    from tide_triton.transport import driver

    assert single_process._lazy_loading_problem(1, True) is None  # one rank waits on no one
    assert single_process._lazy_loading_problem(2, False) is None
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.setattr(driver, "module_loading_is_lazy", lambda: True)
    groups = tt.local_groups(2, timeout_s=10)
    try:
        with pytest.raises(RuntimeError) as e:
            groups[1].transport(torch.device("cuda", 0))
        msg = str(e.value)
        assert msg.startswith("single-process mode (local_groups) with 2 ranks needs eager CUDA module loading")
        assert "CUDA_MODULE_LOADING=unset: LAZY, torch default" in msg
        assert "Set CUDA_MODULE_LOADING=EAGER in the environment before the process's first CUDA call" in msg
        assert "torch.cuda.is_available() is already too late" in msg
        assert "one process per rank (torchrun)" in msg
    finally:
        for g in groups:
            g.close()


def test_single_process_mode_with_declared_nodes() -> None:
    # local_groups(local_size=...): the same cross-node executor, ranks as threads.
    import tide_triton as tt
    from tide_triton.executors import across_nodes as hc

    W, L = 4, 2
    groups = tt.local_groups(W, local_size=L, timeout_s=30, ring_bytes=_ring_bytes(W, L), chunk_bytes=_CHUNK)
    shapes = _shapes(W, 5)
    layout = ShardLayout(shapes, W)
    gen = torch.Generator().manual_seed(5)
    grads = [[_int(s, gen) for s in shapes] for _ in range(W)]
    full = [torch.randn(s, generator=gen) for s in shapes]

    def body(r: int) -> tuple:
        shards = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
        tt.reduce_scatter(grads[r], shards, group=groups[r], op="avg")
        mine = [f[r * c: r * c + n] for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(r))]
        params = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        tt.all_gather(mine, params, group=groups[r])
        return shards, params, hc.stats(groups[r])

    out = run_threads(body, W)
    for r in range(W):
        shards, params, st = out[r]
        assert (st["reduce_scatter"], st["all_gather"]) == (1, 1) and st["bytes_sent"] > 0, st
        for p in range(len(shapes)):
            rows = layout.shard_rows(r)[p]
            assert torch.equal(shards[p][:rows], _expected(grads, p, r, layout, 1.0 / W))
            assert bool((shards[p][rows:] == 0).all())
            assert torch.equal(params[p], full[p].to(torch.bfloat16))
    for g in groups:
        g.close()


def _mixed_params(rank: int, W: int, L: int) -> str:
    import tide_triton as tt
    from tide_triton.errors import ArgumentMismatchError

    g = tt.init(local_size=L, timeout_s=30)
    shapes = [(W + 1, 3)]  # padded rows differ from the full ones
    layout = ShardLayout(shapes, W)
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank, padded=True)]
    params = [torch.empty(s) for s in (layout.padded_shapes if rank == 1 else shapes)]
    try:
        tt.all_gather(shards, params, group=g)
        return "no error"
    except ArgumentMismatchError as e:
        return str(e)
    finally:
        g.close()


def test_cross_node_all_gather_refuses_mixed_full_and_padded_params_on_every_rank() -> None:
    out = run_multiprocess(_mixed_params, 4, 2, timeout=120)
    for r, msg in enumerate(out):
        # the message names the argument and the ranks with their values
        assert msg.startswith("ranks disagree on all_gather's params shapes: "), (r, msg)
        assert "rank 1: ((8, 3),)" in msg and "ranks 0, 2, 3: ((5, 3),)" in msg, (r, msg)
