"""Parameters sharded on a dim other than 0 (FSDP2's ``Shard(dim)``, MoE experts on dim 1).

The layout (:class:`tide_triton.plan.layout.DimShards`) against a plain-torch chunking; the public
collectives with ``shard_dims`` on awkward sizes (the sharded dim not divisible by W, smaller
than W, an empty outer dim, a negative dim, mixed with dim-0 parameters), ranks as threads;
and the FSDP2 drop-in on a torchtitan-like MoE model whose experts a ``shard_placement_fn``
puts on ``Shard(1)``, against stock FSDP2 on 2 and 4 processes (gloo, CPU).  Every gradient
value is a small integer in bf16 where the check is bit for bit, so every sum is exact.
"""
from __future__ import annotations

import logging

import pytest
import torch

try:
    from _dist import LogLines, assert_same, run_multiprocess, run_threads, train
except ImportError:  # pragma: no cover
    from tests._dist import LogLines, assert_same, run_multiprocess, run_threads, train

from tide_triton.plan.layout import DimShards, ShardLayout

# (shape, shard dim): dim 1 not divisible by W, dim 1 below W, 2-D on its last dim, a dim-0
# parameter between them, dim 2 of a 4-D one, an empty outer dim, a negative dim
AWKWARD = [((2, 5, 3), 1), ((3, 2, 4), 1), ((4, 7), 1), ((7, 5), 0), ((2, 3, 2, 5), 2), ((0, 4, 2), 1),
           ((6, 3), -1), ((1, 1, 3), 1)]


def _piece(t: torch.Tensor, k: int, rank: int, c: int) -> torch.Tensor:
    """Rank ``rank``'s real entries of dim ``k`` (FSDP2's chunking: ``c`` each, the last short)."""
    start = min(rank * c, t.shape[k])
    return t.narrow(k, start, max(0, min(t.shape[k] - rank * c, c)))


# --------------------------------------------------------------------------- layout
@pytest.mark.parametrize("W", [1, 2, 3, 4, 5])
def test_dim_shards_parts_cover_each_ranks_entries_in_place(W: int) -> None:
    shapes, dims = [s for s, _ in AWKWARD], [k for _, k in AWKWARD]
    ds = DimShards(shapes, dims, W)
    lay = ds.layout
    assert ds.dims == tuple(k % len(s) for s, k in AWKWARD)
    assert len(lay) == sum(ds.parts) and lay.world_size == W
    for i, (s, k) in enumerate(zip(shapes, ds.dims)):
        full = torch.arange(max(1, torch.Size(s).numel()))[:torch.Size(s).numel()].view(s)
        parts = list(range(ds.starts[i], ds.starts[i] + ds.parts[i]))
        assert all(lay.shapes[p] == ds.part_shapes[i] for p in parts)
        for r in range(W):
            want = _piece(full, k, r, ds.rows_per_rank[i])
            assert tuple(want.shape) == ds.shard_shapes(r)[i]
            padded = ds.shard_shapes(r, padded=True)[i]
            assert padded[k] == -(-s[k] // W) and padded[:k] == s[:k] and padded[k + 1:] == s[k + 1:]
            # the parts' dim-0 rows of rank r, slice by slice, are the rank's entries
            flat = full.reshape(-1)
            got = []
            for j, p in enumerate(parts):
                start = j * lay.numels[p] + r * lay.padded_shard_numels[p]
                got.append(flat[start:start + lay.shard_numels(r)[p]])
            assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=full.dtype),
                               want.contiguous().reshape(-1)), (s, k, r)


def test_dim_shards_of_dim_0_is_the_shard_layout() -> None:
    shapes = [(7, 5), (3,), (1, 4, 3)]
    ds = DimShards(shapes, None, 3)
    assert ds.trivial and ds.layout == ShardLayout(shapes, 3)
    assert DimShards(shapes, 0, 3).layout == ShardLayout(shapes, 3)
    assert not DimShards(shapes, [0, 0, 1], 3).trivial


@pytest.mark.parametrize("dims, err, words", [
    ([0, 2], ValueError, "shard_dims[1] = 2 is not a dim of parameter 1's shape (4, 6) (valid: -2..1)"),
    ([0, -3], ValueError, "shard_dims[1] = -3"),
    ([0], ValueError, "one entry per parameter (2), got 1"),
    ([0, 1.0], TypeError, "shard_dims[1] must be an int, got float"),
    ("1", TypeError, "got str"),
    (True, TypeError, "got True"),
])
def test_dim_shards_rejects_bad_dims(dims, err, words) -> None:
    with pytest.raises(err) as e:
        DimShards([(3,), (4, 6)], dims, 2)
    assert words in str(e.value)


# --------------------------------------------------------------------------- public collectives
def _int(shape, gen, dtype=torch.bfloat16):
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


@pytest.mark.parametrize("W, local", [(3, None), (4, None), (4, 2)], ids=["W3", "W4", "2x2-nodes"])
def test_collectives_with_shard_dims_are_exact(W: int, local: int | None) -> None:
    import tide_triton as tt

    shapes, dims = [s for s, _ in AWKWARD], [k for _, k in AWKWARD]
    ds = DimShards(shapes, dims, W)
    # a small ring: chunks across parts; two declared nodes: the cross-node schedules
    groups = tt.local_groups(W, local_size=local, timeout_s=60, ring_bytes=256 * W)
    gen = torch.Generator().manual_seed(W)
    grads = [[_int(s, gen) for s in shapes] for _ in range(W)]
    full = [torch.randn(s, generator=gen) for s in shapes]
    total = [sum(grads[r][p].float() for r in range(W)) for p in range(len(shapes))]
    prev = [[_int(s, gen, torch.float32) for s in ds.shard_shapes(r)] for r in range(W)]

    def body(r: int) -> dict:
        g = groups[r]
        out = {}
        for padded in (False, True):
            shards = [torch.full(s, -1.0) for s in ds.shard_shapes(r, padded=padded)]
            tt.reduce_scatter(grads[r], shards, group=g, op="avg", shard_dims=dims)
            out["rs", padded] = shards
        acc = [x.clone() for x in prev[r]]
        tt.reduce_scatter(grads[r], acc, group=g, op="sum", accumulate=True, shard_dims=dims)
        out["acc"] = acc
        mine = [_piece(f, k, r, c).contiguous() for f, k, c in zip(full, ds.dims, ds.rows_per_rank)]
        for pdt in (torch.bfloat16, torch.float32):  # a cast at the sender, or plain copies
            params = [torch.full(s, 7.0, dtype=pdt) for s in shapes]
            tt.all_gather(mine, params, group=g, shard_dims=dims)
            out["ag", pdt] = params
        # params passed padded along their sharded dim (W * c entries): the padding arrives as zeros
        padded_params = [torch.full(ds.shard_shapes(0, padded=True)[p], 7.0) for p in range(len(shapes))]
        padded_params = [x.repeat_interleave(W, dim=k) if x.shape[k] else x for x, k in zip(padded_params, ds.dims)]
        tt.all_gather(mine, padded_params, group=g, shard_dims=dims)
        out["ag padded"] = padded_params
        if local is not None:  # prepared collectives are node-local
            return out
        out["prs"] = [torch.zeros(s) for s in ds.shard_shapes(r, padded=True)]
        out["pag"] = [torch.zeros(s) for s in shapes]
        prs = tt.prepare_reduce_scatter(grads[r], out["prs"], group=g, op="sum", shard_dims=dims)
        pag = tt.prepare_all_gather(mine, out["pag"], group=g, shard_dims=dims)
        for x in out["prs"] + out["pag"]:
            x.fill_(3.0)
        prs.run()
        pag.run()
        return out

    res = run_threads(body, W, timeout=300)
    for r in range(W):
        o = res[r]
        for p, (k, c) in enumerate(zip(ds.dims, ds.rows_per_rank)):
            want = _piece(total[p], k, r, c)
            n = want.shape[k]
            for padded in (False, True):
                got = o["rs", padded][p]
                assert torch.equal(got.narrow(k, 0, n), want * (1.0 / W)), (r, p, padded)
                assert bool((got.narrow(k, n, got.shape[k] - n) == 0).all()), (r, p, "padding zero")
            assert torch.equal(o["acc"][p], want + prev[r][p]), (r, p, "accumulate")
            assert torch.equal(o["ag", torch.bfloat16][p], full[p].to(torch.bfloat16)), (r, p)
            assert torch.equal(o["ag", torch.float32][p], full[p]), (r, p)
            pp = o["ag padded"][p]
            assert pp.shape[k] == W * c and torch.equal(pp.narrow(k, 0, full[p].shape[k]), full[p]), (r, p)
            assert bool((pp.narrow(k, full[p].shape[k], W * c - full[p].shape[k]) == 0).all()), (r, p)
            if local is None:
                assert torch.equal(o["prs"][p].narrow(k, 0, n), want), (r, p, "prepared")
                assert torch.equal(o["pag"][p], full[p]), (r, p, "prepared all-gather")
    for g in groups:
        g.close()


@pytest.mark.parametrize("case, words", [
    ("shape", "shards[0] must have shape (2, 3, 3), got (2, 2, 3) (parameter 0 of shape (2, 5, 3) is sharded on dim 1"),
    ("dim", "shard_dims[1] = 3 is not a dim of parameter 1's shape (4, 7)"),
    ("mismatch", "ArgumentMismatchError"),
])
def test_bad_shard_dims_raise_on_every_rank(case: str, words: str) -> None:
    import tide_triton as tt

    W = 2
    groups = tt.local_groups(W, timeout_s=20)
    shapes = [(2, 5, 3), (4, 7)]

    def body(r: int) -> str:
        dims = [1, 1]
        if case == "dim" and r == 1:
            dims = [1, 3]
        if case == "mismatch" and r == 1:
            dims = [2, 1]  # rank 1 places parameter 0 otherwise: its shards fit its own dims
        try:
            ds = DimShards(shapes, [1, 1] if case != "mismatch" else dims, W)
            shards = [torch.zeros(s) for s in ds.shard_shapes(r, padded=True)]
            if case == "shape" and r == 0:
                shards[0] = torch.zeros(2, 2, 3)
            tt.reduce_scatter([torch.ones(s) for s in shapes], shards, group=groups[r], shard_dims=dims)
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return "no error"

    out = run_threads(body, W, timeout=60)
    for r, msg in enumerate(out):
        assert msg != "no error", (r, out)
    if case == "mismatch":
        assert all(m.startswith(words) and "shard dims" in m for m in out), out
    else:
        bad = 0 if case == "shape" else 1
        assert words in out[bad], out
        assert f"rank {bad}" in out[1 - bad], out  # the peer is told who failed
    for g in groups:
        g.close()


# --------------------------------------------------------------------------- FSDP2 drop-in
VOCAB, DIM, HIDDEN, BS, SEQ, LR = 13, 8, 12, 2, 4, 1e-2


def _moe_model(n_experts: int):
    """A torchtitan-like MoE model: embedding, blocks of (RMSNorm, router, experts [E, hidden,
    dim] / [E, dim, hidden] as grouped SwiGLU weights, a shared expert), final norm, head."""
    from torch import nn

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(n_experts, HIDDEN, DIM) * 0.3)
            self.w2 = nn.Parameter(torch.randn(n_experts, DIM, HIDDEN) * 0.3)
            self.w3 = nn.Parameter(torch.randn(n_experts, HIDDEN, DIM) * 0.3)

        def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            h = torch.einsum("td,ehd->teh", x, self.w1)
            h = torch.nn.functional.silu(h) * torch.einsum("td,ehd->teh", x, self.w3)
            y = torch.einsum("teh,edh->ted", h, self.w2)
            return (y * weights.unsqueeze(-1)).sum(1)

    class MoEBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(DIM)
            self.router = nn.Linear(DIM, n_experts, bias=False)
            self.experts = Experts()
            self.shared = nn.Linear(DIM, DIM, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            h = self.norm(x).reshape(b * s, d)
            scores = torch.softmax(self.router(h).float(), dim=-1).to(h.dtype)
            top = torch.topk(scores, min(2, n_experts), dim=-1)
            weights = torch.zeros_like(scores).scatter(1, top.indices, top.values)
            return x + (self.experts(h, weights) + self.shared(h)).reshape(b, s, d)

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList([MoEBlock(), MoEBlock()])
            self.norm = nn.RMSNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    return MoE()


def _moe_shard(model, W: int, mp, device: str, always_shard1: bool = False) -> None:
    """As torchtitan shards MoE experts when the FSDP ranks outnumber the experts: Shard(1).
    Block 0 keeps its experts in the block's group (Shard(0) and Shard(1) parameters in one
    group); block 1 gives them a group of their own inside the block's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh(device, (W,))
    n_experts = model.layers[0].experts.w1.shape[0]
    experts = {id(p) for layer in model.layers for p in layer.experts.parameters()}

    def placement(param):
        return Shard(1) if id(param) in experts and (W > n_experts or always_shard1) else None

    b0, b1 = model.layers
    fully_shard(b0, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
    fully_shard(b1.experts, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
    fully_shard(b1, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _full(t) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    local = t.to_local().detach().float().cpu().contiguous()  # gathered on the CPU: gloo
    (k,) = [p.dim for p in t.placements if isinstance(p, Shard)]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return torch.cat(parts, dim=k).clone()


def _moe_train(rank: int, W: int, n_experts: int, device: str, mp_kind: str, tide: bool, steps: int,
               micro=(True,), prepared: bool = False, slot_reuse: bool = False, always_shard1: bool = False) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import Shard

    import tide_triton as tt

    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp_kind == "bf16"
          else MixedPrecisionPolicy())
    torch.manual_seed(0)
    model = _moe_model(n_experts).to(device)
    _moe_shard(model, W, mp, device, always_shard1)
    placements = {n: str(p.placements[0]) for n, p in model.named_parameters()}
    assert placements["layers.0.experts.w1"] == str(Shard(1)) and placements["layers.0.router.weight"] == str(Shard(0))
    handler = LogLines(logging.NOTSET).attach()
    if slot_reuse:  # block 1, its experts' group and the next block are unsharded at once
        tt.fsdp.SLOT_POOL = 3
    report = tt.fsdp.enable(model, prepared=prepared, slot_reuse=slot_reuse) if tide else None
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def loss_of(step: int, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * (10 * step + i) + rank)
        tokens = torch.randint(0, VOCAB, (BS, SEQ + 1), generator=g).to(device)
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    losses, grads = train(model, opt, steps, loss_of, sync=model.set_requires_gradient_sync, full=_full, micro=micro)
    handler.detach()
    out = {"losses": losses, "grads": grads, "params": {n: _full(p.detach()) for n, p in model.named_parameters()},
           "report": report, "log": handler.lines, "stats": tt.fsdp.stats(model) if tide else None}
    if tide:
        tt.fsdp.disable(model)
    return out


def _moe_child(rank: int, W: int, n_experts: int, scenarios: tuple[str, ...], device: str = "cpu",
               always_shard1: bool = False) -> dict:
    if device == "cuda":
        torch.cuda.set_device(0)
    out = {}
    for s in scenarios:
        kw: dict = {"bf16": dict(mp_kind="bf16", steps=2), "fp32": dict(mp_kind="fp32", steps=2),
                    "accum": dict(mp_kind="bf16", steps=2, micro=(False, True, True)),
                    "prepared": dict(mp_kind="bf16", steps=2, micro=(True, True), prepared=True),
                    "slot": dict(mp_kind="bf16", steps=2, slot_reuse=True)}[s]
        kw["always_shard1"] = always_shard1
        out[s] = {"stock": _moe_train(rank, W, n_experts, device, tide=False, **kw),
                  "tide": _moe_train(rank, W, n_experts, device, tide=True, **kw)}
    return out


# W=2: one expert (W > E), every scenario bit for bit; W=4: three experts, Shard(1) over 4 ranks,
# bf16 bit for bit (sums of 4 bf16 values are exact in fp32; fp32 ones are rounded in another
# order by gloo: a tolerance there).
_MOE_PLAN = {2: (1, ("bf16", "fp32", "accum", "prepared", "slot")), 4: (3, ("bf16",))}


@pytest.mark.multiproc
@pytest.mark.cpu_torch  # the drop-in end to end: the CPU kernels as plain torch, the product's path
@pytest.mark.parametrize("W", sorted(_MOE_PLAN))
def test_fsdp_serves_shard1_experts_equal_to_stock(W: int) -> None:
    n_experts, scenarios = _MOE_PLAN[W]
    _check_moe(run_multiprocess(_moe_child, W, n_experts, scenarios, timeout=600), scenarios, W, 0.0)


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("W", [2, 4])
def test_fsdp_serves_shard1_experts_on_one_gpu(W: int) -> None:
    """The same on the CUDA path (processes sharing cuda:0, gloo), with enough experts on
    Shard(1) (more than STRIDED_MIN_ROWS) that each rank's slices of an expert weight move as one
    strided copy (cuMemcpy2DAsync).  A GPU's stock run is not bit-reproducible (atomics in some
    backward kernels): test_fsdp's GPU tolerance."""
    from tide_triton.executors.copy_plan import STRIDED_MIN_ROWS

    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    scenarios = ("bf16", "fp32", "accum", "prepared", "slot") if W == 2 else ("bf16", "fp32")
    out = run_multiprocess(_moe_child, W, STRIDED_MIN_ROWS + 2, scenarios, "cuda", True, timeout=500, env=env)
    _check_moe(out, scenarios, W, 1e-4)


def _check_moe(out: list[dict], scenarios: tuple[str, ...], W: int, base: float) -> None:
    for s in scenarios:
        tol = max(base, 2e-5 if (s == "fp32" and W > 2) else 0.0)
        for rank, res in enumerate(out):
            tide, stock = res[s]["tide"], res[s]["stock"]
            assert tide["report"] and all(v is None for v in tide["report"].values()), (s, tide["report"])
            assert tide["log"] == [], (s, tide["log"])
            for name, st in tide["stats"].items():  # every group, the experts' too, on tide_triton
                assert st["all_gathers"] > 0 and st["reduce_scatters"] > 0, (s, name, st)
                if s == "prepared":
                    assert st["prepared_runs"] == st["all_gathers"] + st["reduce_scatters"], (s, name, st)
                if s == "accum":
                    assert st["direct_accumulations"] > 0, (s, name, st)
                if s == "slot":
                    assert st["staged_reduce_scatters"] == st["reduce_scatters"], (s, name, st)
            assert_same(tide["losses"], stock["losses"], f"{s} losses rank {rank}", tol)
        assert_same(out[0][s]["tide"]["grads"], out[0][s]["stock"]["grads"], f"{s} last-step grads", tol)
        assert_same(out[0][s]["tide"]["params"], out[0][s]["stock"]["params"], f"{s} params", tol)


def test_shard1_pulls_are_one_strided_copy_per_rank_and_parameter() -> None:
    """The all-gather's copy plan for experts [E, d, h] on Shard(1): each rank's E slices of
    c*h elements land at the parameter's pitch d*h from its block (back to back, pitch c*h) --
    one strided copy (cuMemcpy2DAsync on CUDA) per rank, the same bytes as the parts' copies."""
    from tide_triton.executors.copy_plan import STRIDED_MIN_ROWS, expand_copies, plan_copies
    from tide_triton.executors.prepare import _Addresses, _gather_template

    W, es, (E, d, h) = 4, 2, (STRIDED_MIN_ROWS + 2, 12, 5)
    ds = DimShards([(E, d, h), (7, 3)], [1, 0], W)
    c = ds.rows_per_rank[0]
    expert, other = 1 << 20, 1 << 24
    pptrs = [expert + o * d * h * es for o in range(E)] + [other]  # the parts' addresses
    blocks = [(1 << 32) * (r + 1) for r in range(W)]
    ranks, (rank_of, param, dst_off, src_off, size) = _gather_template(ds.layout, None, es, None)
    plan = plan_copies(_Addresses(pptrs).plus(param, dst_off), _Addresses(blocks).plus(rank_of, src_off), size)
    strided = [x for x in plan if x.rows > 1]
    assert len(strided) == W, plan
    for r, x in enumerate(strided):
        assert (x.dst, x.src, x.nbytes, x.rows) == (expert + r * c * h * es, blocks[r], c * h * es, E), x
        assert (x.dst_pitch, x.src_pitch) == (d * h * es, c * h * es), x
    singles = list(zip(*expand_copies(plan)))
    parts = list(zip(*expand_copies(plan_copies(_Addresses(pptrs).plus(param, dst_off),
                                                _Addresses(blocks).plus(rank_of, src_off), size, min_rows=10 ** 9))))
    assert sorted(singles) == sorted(parts)


def test_shard1_pushes_are_one_strided_copy_per_peer_and_parameter() -> None:
    """The reduce-scatter's pushes of experts [E, d, h] on Shard(1): each peer's E slices of
    c*h elements are read at the gradient's pitch d*h into its slot (back to back) -- one
    strided copy per peer and round, nothing staged or transposed on the sender."""
    from tide_triton.executors.copy_plan import STRIDED_MIN_ROWS, plan_copies
    from tide_triton.executors.prepare import _Addresses, _push_template
    from tide_triton.plan.schedule import ring_plan

    W, es, me, (E, d, h) = 4, 2, 1, (STRIDED_MIN_ROWS + 1, 8, 3)
    ds = DimShards([(E, d, h)], 1, W)
    c = ds.rows_per_rank[0]
    plan = ring_plan(ds.layout, 1 << 16, es, 2)  # a ring that holds everything: one round
    grad = 1 << 20
    gptrs = [grad + o * d * h * es for o in range(E)]
    slots = [(1 << 32) * (k + 1) for k in range(W)]
    ((dests, (dest_of, param, slot_off, const, size)),) = _push_template(plan, me, es)
    assert dests == [r for r in range(W) if r != me]
    copies = plan_copies(_Addresses(slots).plus(dest_of, slot_off), _Addresses(gptrs).plus(param, const), size)
    assert len(copies) == W - 1, copies
    for k, (dest, x) in enumerate(zip(dests, copies)):
        assert (x.dst, x.src, x.nbytes, x.rows) == (slots[k], grad + dest * c * h * es, c * h * es, E), x
        assert (x.dst_pitch, x.src_pitch) == (c * h * es, d * h * es), x
