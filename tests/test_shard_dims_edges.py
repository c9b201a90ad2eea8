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

from tide_triton.layout import DimShards

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
    ("rs set_", "shards[0] changed since it was prepared"),
    ("ag set_", "params[0] changed since it was prepared"),
    ("ag t_", "params[0] changed since it was prepared"),
])
def test_prepared_shard_dims_run_refuses_a_caller_tensor_changed_in_place(case: str, words: str) -> None:
    out = _run(lambda r, g: _prepared_then_changed(case, r, g), timeout_s=5)
    assert out[0].startswith("ValueError") and words in out[0], out
    assert out[1] != "no error", out
