"""``shard_dims`` calls given awkward tensors: errors name the caller's tensors (not the dim-0
parts the call splits them into), and a prepared collective notices its caller's tensors
changed in place (it holds views of them).  Ranks as threads; only rank 0 errs, and its peer
is told."""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads

from tide_triton.plan.layout import DimShards

W = 2
SHAPES = [(3, 4), (2, 6, 2)]
DIMS = [1, 1]


def _run(body, timeout_s: float = 10) -> list[str]:
    import tide_triton as tt

    groups = tt.local_groups(W, timeout_s=timeout_s)

    def one(r: int) -> str:
        try:
            body(r, groups[r])
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return "no error"

    try:
        return run_threads(one, W, timeout=120)
    finally:
        for g in groups:
            g.close()


def _bad_call(case: str, r: int, g) -> None:
    import tide_triton as tt

    ds = DimShards(SHAPES, DIMS, W)
    grads = [torch.ones(s) for s in SHAPES]
    shards = [torch.zeros(s) for s in ds.shard_shapes(r)]
    bad = r == 0
    if case == "shards overlap" and bad:  # shards[1] starts inside shards[0]
        n0 = shards[0].numel()
        buf = torch.zeros(n0 + shards[1].numel())
        shards = [buf[:n0].view(shards[0].shape), buf[n0 - 2:n0 - 2 + shards[1].numel()].view(shards[1].shape)]
    if case == "shard in grad" and bad:
        shards[1] = grads[1].view(-1)[:shards[1].numel()].view(shards[1].shape)
    if case == "freed grad" and bad:
        grads[1].untyped_storage().resize_(0)
    if case == "params overlap":
        buf = torch.zeros(64)
        params = [torch.zeros(s) for s in SHAPES]
        if bad:
            params = [buf[:12].view(SHAPES[0]), buf[10:34].view(SHAPES[1])]
        tt.all_gather(shards, params, group=g, shard_dims=DIMS)
    else:
        tt.reduce_scatter(grads, shards, group=g, shard_dims=DIMS)


@pytest.mark.parametrize("case, words", [
    ("shards overlap", "shards[0] and shards[1] overlap in memory"),
    ("shard in grad", "shards[1] shares memory with grads[1]"),
    ("freed grad", "ValueError: grads[1] views 96 bytes of a storage that holds 0"),
    ("params overlap", "params[0] and params[1] overlap in memory"),
])
def test_shard_dims_errors_name_the_callers_tensors(case: str, words: str) -> None:
    out = _run(lambda r, g: _bad_call(case, r, g))
    assert words in out[0], out
    assert "rank 0" in out[1], out


def _gather_into_region(r: int, g) -> None:
    import tide_triton as tt

    region = g.heap_region("slot", 4096, torch.device("cpu"))
    param = region.tensor(torch.float32, 8, 64).view(2, 4)
    # rank 1's shard lies in the parameter's first 4 elements, none of them its own entries
    # (columns 2..3): its slice 0 lands on elements 2..3, its slice 1 still to be read there
    shard = param.view(-1)[0:4].view(2, 2) if r == 1 else torch.empty(2, 2)
    shard.copy_(torch.tensor([[10.0, 11.0], [12.0, 13.0]]) + 100 * r)
    tt.all_gather([shard], [param], params_region=region, shard_dims=1, group=g)


def test_shard_dims_gather_into_region_refuses_shards_inside_the_params() -> None:
    out = _run(_gather_into_region)
    assert "params[0] shares memory with shards[0]: with params_region" in out[1], out
    assert "rank 1" in out[0], out


def test_shard_dims_calls_whose_slices_coincide_do_not_pair() -> None:
    """One (2, 3, 4) parameter on dim 1 and two (1, 3, 4) ones on dim 1 are the same slices,
    two of (3, 4): the caller's shapes are agreed, not the slices'."""
    import tide_triton as tt

    def body(r: int, g) -> None:
        shapes = [(2, 3, 4)] if r == 0 else [(1, 3, 4), (1, 3, 4)]
        ds = DimShards(shapes, 1, W)
        tt.reduce_scatter([torch.ones(s) for s in shapes], [torch.zeros(s) for s in ds.shard_shapes(r)],
                          group=g, shard_dims=1)

    out = _run(body)
    assert all(m.startswith("ArgumentMismatchError") and "(2, 3, 4)" in m and "(1, 3, 4)" in m for m in out), out


def test_one_int_shard_dims_out_of_range_names_the_int_and_the_parameter() -> None:
    with pytest.raises(ValueError) as e:
        DimShards([(4, 6), (3,)], 1, 2)
    assert "shard_dims = 1 (every parameter's dim) is not a dim of parameter 1's shape (3,)" in str(e.value)


def _prepared_then_changed(case: str, r: int, g) -> None:
    import tide_triton as tt

    ds = DimShards(SHAPES, DIMS, W)
    if case.startswith("rs"):
        grads = [torch.ones(s) for s in SHAPES]
        shards = [torch.zeros(s) for s in ds.shard_shapes(r)]
        p = tt.prepare_reduce_scatter(grads, shards, group=g, op="sum", shard_dims=DIMS)
        p.run()
        if r == 0:  # the caller's shard now lives elsewhere: the run would write the old storage
            shards[0].set_(torch.zeros(shards[0].shape))
        p.run()
        return
    shapes = [(4, 4)] if case == "ag t_" else SHAPES
    dims = [1] * len(shapes)
    mine = [torch.full(s, float(r + 1)) for s in DimShards(shapes, dims, W).shard_shapes(r)]
    params = [torch.zeros(s) for s in shapes]
    p = tt.prepare_all_gather(mine, params, group=g, shard_dims=dims)
    p.run()
    if r == 0:
        if case == "ag t_":  # same address and shape, transposed: the run would write the old layout
            params[0].t_()
        else:
            params[0].set_(torch.zeros(shapes[0]))
    p.run()


@pytest.mark.parametrize("case, words", [
    ("rs set_", "shards[0] moved"),
    ("ag set_", "params[0] moved"),
    ("ag t_", "params[0] changed in place"),
])
def test_prepared_shard_dims_run_refuses_a_caller_tensor_changed_in_place(case: str, words: str) -> None:
    out = _run(lambda r, g: _prepared_then_changed(case, r, g), timeout_s=5)
    assert out[0].startswith("ValueError") and words in out[0], out
    assert out[1] != "no error", out


# --------------------------------------------------------------------------- FSDP2 drop-in
def _edge_model():
    """Shard(2) on a 3-D weight, Shard(-1) on a 2-D one beside a Shard(0) weight in one block,
    and a block whose 2-D weight has more rows than the split may serve (the test lowers
    SPLIT_PARTS_MAX to 20: 12 + 4 + 1 slices pass, 12 + 16 + 1 do not)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.cube = nn.Parameter(torch.randn(3, 4, 6) * 0.3)  # Shard(2): 12 slices of 6
            self.wide = nn.Parameter(torch.randn(rows, 6) * 0.3)  # Shard(-1): a slice per row
            self.lin = nn.Linear(6, 6, bias=False)  # Shard(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.einsum("bd,aed->be", x, self.cube) @ self.wide[:4]
            return x + self.lin(torch.tanh(y + self.wide.sum(0)))

    return nn.Sequential(Block(4), Block(16))


def _edge_child(rank: int, W: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    import tide_triton as tt
    from tide_triton.fsdp import _torch_adapter

    _torch_adapter.SPLIT_PARTS_MAX = 20

    def train(tide: bool) -> dict:
        torch.manual_seed(0)
        model = _edge_model()
        mesh = init_device_mesh("cpu", (W,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

        def placement(p):
            return Shard(2) if p.dim() == 3 else Shard(-1) if p.dim() == 2 and p.shape[0] != 6 else None

        for block in model:  # kept unsharded after forward: the backward reuses the forward's all-gather
            fully_shard(block, mesh=mesh, mp_policy=mp, shard_placement_fn=placement, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        out: dict = {"losses": []}
        report = tt.fsdp.enable(model) if tide else None
        for step in range(2):
            if tide and step == 1:  # off and on again between steps
                tt.fsdp.disable(model)
                report = tt.fsdp.enable(model)
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randint(-4, 5, (6, 6), generator=g).float()
            loss = model(x).float().square().mean()
            loss.backward()
            out["losses"].append(loss.item())
            opt.step()
            opt.zero_grad()
        out["params"] = {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}
        if tide:
            out["report"], out["stats"] = report, tt.fsdp.stats(model)
            tt.fsdp.disable(model)
        return out

    return {"stock": train(False), "tide": train(True)}


@pytest.mark.multiproc
def test_fsdp_shard_dims_edges_equal_stock() -> None:
    """Shard(2) and Shard(-1) beside Shard(0) in one group, reshard_after_forward=False,
    disable() then enable(), bit for bit against stock; a group splitting into more than
    SPLIT_PARTS_MAX slices stays stock, saying why."""
    try:
        from _dist import run_multiprocess
    except ImportError:  # pragma: no cover
        from tests._dist import run_multiprocess

    out = run_multiprocess(_edge_child, 2, timeout=600)
    for rank, res in enumerate(out):
        tide, stock = res["tide"], res["stock"]
        rep = tide["report"]
        assert rep["0"] is None, rep
        assert "split into 29 slices" in rep["1"] and "SPLIT_PARTS_MAX = 20" in rep["1"], rep
        assert tide["stats"]["0"]["reduce_scatters"] > 0 and tide["stats"]["1"] is None, tide["stats"]
        assert tide["losses"] == stock["losses"], (rank, tide["losses"], stock["losses"])
        for n, p in stock["params"].items():
            assert torch.equal(tide["params"][n], p), (rank, n)
