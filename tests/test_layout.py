"""ShardLayout: FSDP2's dim-0 padded sharding arithmetic, checked three ways.

1. Hand-computed cases for every property, plus immutability, hashing and every validation
   branch.
2. A hypothesis property test against a plain-torch reference of FSDP's rule
   (``_chunk_with_empty``: ``torch.chunk`` padded with empty chunks; chunk 0 is the padded
   shard).
3. Against torch's own ``fully_shard`` on CPU + gloo for W in {1, 2, 3, 5, 8}: local shard
   shapes, FSDP's padded sizes, the data each rank holds, the padded storage assembled at
   offsets ``r * S_p``, FSDP's own all-gather buffer (flat offsets) and its unsharded params.
"""
from __future__ import annotations

import dataclasses
import math
import pickle
import random
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from tide_triton.plan.layout import ShardLayout

try:  # pytest's default "prepend" import mode puts tests/ on sys.path
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover - importlib mode with the repo root on sys.path
    from tests._dist import run_multiprocess


# ---------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------
# W=4 over dim0 = 5 (uneven), 1 (< W: only rank 0 holds a row), 7 (prime, last rank short)
# and 2 (< W, two ranks empty), in 1-D, 2-D and 3-D.
MIXED_SHAPES = [(5,), (1,), (7, 3), (2, 4, 3)]


@pytest.fixture
def mixed() -> ShardLayout:
    return ShardLayout(MIXED_SHAPES, 4)


def test_mixed_per_parameter_sizes(mixed: ShardLayout) -> None:
    assert mixed.shapes == ((5,), (1,), (7, 3), (2, 4, 3))
    assert mixed.world_size == 4
    assert len(mixed) == 4
    assert mixed.row_numels == (1, 1, 3, 12)
    assert mixed.numels == (5, 1, 21, 24)
    assert mixed.rows_per_rank == (2, 1, 2, 1)
    assert mixed.padded_shard_numels == (2, 1, 6, 12)
    assert mixed.padded_shapes == ((8,), (4,), (8, 3), (4, 4, 3))
    assert mixed.padded_numels == (8, 4, 24, 48)
    assert mixed.flat_offsets == (0, 2, 3, 9)
    assert mixed.flat_shard_numel == 21


@pytest.mark.parametrize(
    "rank, rows, numels",
    [
        (0, (2, 1, 2, 1), (2, 1, 6, 12)),
        (1, (2, 0, 2, 1), (2, 0, 6, 12)),
        (2, (1, 0, 2, 0), (1, 0, 6, 0)),
        (3, (0, 0, 1, 0), (0, 0, 3, 0)),
    ],
)
def test_mixed_per_rank_views(mixed: ShardLayout, rank: int, rows, numels) -> None:
    assert mixed.shard_rows(rank) == rows
    assert mixed.shard_numels(rank) == numels
    assert mixed.shard_offsets(rank) == tuple(rank * s for s in (2, 1, 6, 12))
    assert mixed.shard_shapes(rank) == ((rows[0],), (rows[1],), (rows[2], 3), (rows[3], 4, 3))
    assert mixed.shard_shapes(rank, padded=True) == ((2,), (1,), (2, 3), (1, 4, 3))
    # Cached per-rank answers stay the same on a second call.
    assert mixed.shard_rows(rank) == rows
    assert mixed.shard_numels(rank) == numels


def test_world_size_one_is_unsharded() -> None:
    lay = ShardLayout([(7,), (3, 5), (1, 2, 2)], 1)
    assert lay.rows_per_rank == (7, 3, 1)
    assert lay.shard_rows(0) == (7, 3, 1)
    assert lay.shard_shapes(0) == lay.shapes == lay.padded_shapes
    assert lay.shard_numels(0) == lay.numels == lay.padded_shard_numels == (7, 15, 4)
    assert lay.padded_numels == (7, 15, 4)
    assert lay.shard_offsets(0) == (0, 0, 0)
    assert lay.flat_offsets == (0, 7, 22)
    assert lay.flat_shard_numel == 26


@pytest.mark.parametrize(
    "shape, world_size, rows",
    [
        ((13,), 3, (5, 5, 3)),
        ((13,), 5, (3, 3, 3, 3, 1)),
        ((11, 2), 3, (4, 4, 3)),
        ((6,), 4, (2, 2, 2, 0)),  # torch.chunk makes only 3 chunks here: rank 3 is empty
        ((1, 3), 8, (1, 0, 0, 0, 0, 0, 0, 0)),
        ((8, 2), 8, (1,) * 8),  # even split: no padding
        ((9,), 8, (2, 2, 2, 2, 1, 0, 0, 0)),  # 2^k + 1
        ((7,), 8, (1, 1, 1, 1, 1, 1, 1, 0)),  # 2^k - 1
    ],
)
def test_awkward_dim0(shape, world_size: int, rows) -> None:
    lay = ShardLayout([shape], world_size)
    c = -(-shape[0] // world_size)
    row_numel = math.prod(shape[1:])
    assert lay.rows_per_rank == (c,)
    assert [lay.shard_rows(r)[0] for r in range(world_size)] == list(rows)
    assert sum(rows) == shape[0]
    assert lay.padded_shapes == ((world_size * c, *shape[1:]),)
    assert lay.padded_shard_numels == (c * row_numel,)
    assert [lay.shard_numels(r)[0] for r in range(world_size)] == [n * row_numel for n in rows]


def test_zero_sized_dims_are_accepted() -> None:
    lay = ShardLayout([(0,), (0, 4), (3, 0), (5,)], 3)
    assert lay.row_numels == (1, 4, 0, 1)
    assert lay.numels == (0, 0, 0, 5)
    assert lay.rows_per_rank == (0, 0, 1, 2)
    assert lay.padded_shard_numels == (0, 0, 0, 2)
    assert lay.padded_shapes == ((0,), (0, 4), (3, 0), (6,))
    assert lay.padded_numels == (0, 0, 0, 6)
    assert lay.flat_offsets == (0, 0, 0, 0)
    assert lay.flat_shard_numel == 2
    assert [lay.shard_rows(r) for r in range(3)] == [(0, 0, 1, 2), (0, 0, 1, 2), (0, 0, 1, 1)]
    assert lay.shard_shapes(2) == ((0,), (0, 4), (1, 0), (1,))


def test_no_parameters() -> None:
    lay = ShardLayout([], 3)
    assert len(lay) == 0
    assert lay.shapes == lay.rows_per_rank == lay.flat_offsets == ()
    assert lay.flat_shard_numel == 0
    assert lay.shard_rows(2) == lay.shard_offsets(2) == lay.shard_shapes(2) == ()


def test_shape_inputs_are_normalised_to_int_tuples() -> None:
    np = pytest.importorskip("numpy")
    lay = ShardLayout(
        (s for s in [[3, 2], torch.Size([4]), (np.int64(5), torch.tensor(2))]), 2
    )
    assert lay.shapes == ((3, 2), (4,), (5, 2))
    assert all(type(d) is int for s in lay.shapes for d in s)


def test_repr() -> None:
    assert repr(ShardLayout(MIXED_SHAPES, 4)) == "ShardLayout(4 params, world_size=4)"


# ---- immutability, equality, hashing -------------------------------------------------
def test_immutable(mixed: ShardLayout) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        mixed.world_size = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        mixed.shapes = ((1,),)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        mixed.rows_per_rank = (0,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del mixed.world_size  # type: ignore[misc]
    assert isinstance(mixed.shapes, tuple) and all(isinstance(s, tuple) for s in mixed.shapes)


def test_equality_and_hash() -> None:
    a = ShardLayout([(3, 4), (5,)], 2)
    b = ShardLayout([[3, 4], torch.Size([5])], 2)
    b.shard_rows(1)  # filling b's caches changes neither equality nor hash
    _ = b.padded_shapes
    assert a == b and hash(a) == hash(b)
    assert a != ShardLayout([(3, 4), (5,)], 3)
    assert a != ShardLayout([(5,), (3, 4)], 2)
    assert a != ShardLayout([(3, 4)], 2)
    table = {a: "plan"}
    assert table[b] == "plan"
    assert len({a, b, ShardLayout([(3, 4), (5,)], 3)}) == 2


def test_pickle_round_trip(mixed: ShardLayout) -> None:
    mixed.shard_rows(3)
    back = pickle.loads(pickle.dumps(mixed))
    assert back == mixed and hash(back) == hash(mixed)
    assert back.shard_rows(3) == mixed.shard_rows(3)


# ---- select ------------------------------------------------------------------------
def test_select(mixed: ShardLayout) -> None:
    sub = mixed.select([2, 0])
    assert sub == ShardLayout([(7, 3), (5,)], 4)
    assert sub.shard_rows(3) == (1, 0)
    assert sub.flat_offsets == (0, 6)
    assert mixed.select(i for i in range(4)) == mixed
    assert mixed.select([]) == ShardLayout([], 4)
    assert mixed.select([1, 1]).shapes == ((1,), (1,))
    assert mixed.select([-1]) == mixed.select([3])  # negative indices count from the end


@pytest.mark.parametrize("bad", [4, 17, -5])
def test_select_rejects_out_of_range(mixed: ShardLayout, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"indices must be in \[-4, 4\), got {bad}"):
        mixed.select([0, bad])


# ---------------------------------------------------------------------------------------
# Validation: one test per branch
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_below_one(world_size: int) -> None:
    with pytest.raises(ValueError, match=rf"world_size must be >= 1, got {world_size}"):
        ShardLayout([(2,)], world_size)


@pytest.mark.parametrize(
    "world_size, name", [(2.0, "float"), (True, "bool"), ("2", "str"), (None, "NoneType")]
)
def test_world_size_not_int(world_size, name: str) -> None:
    with pytest.raises(TypeError, match=rf"world_size must be an int, got {name}"):
        ShardLayout([(2,)], world_size)


@pytest.mark.parametrize("shapes, name", [(5, "int"), ("ab", "str"), (None, "NoneType")])
def test_shapes_not_a_sequence(shapes, name: str) -> None:
    with pytest.raises(TypeError, match=rf"shapes must be a sequence of shapes, got {name}"):
        ShardLayout(shapes, 2)


@pytest.mark.parametrize("shape, name", [(5, "int"), ("ab", "str"), (b"ab", "bytes")])
def test_shape_not_a_sequence(shape, name: str) -> None:
    with pytest.raises(TypeError, match=rf"shapes\[1\] must be a sequence of ints, got {name}"):
        ShardLayout([(3,), shape], 2)


def test_zero_dim_shape() -> None:
    with pytest.raises(ValueError, match=r"shapes\[1\] must have at least one dimension"):
        ShardLayout([(2,), ()], 2)
    with pytest.raises(ValueError, match=r"shapes\[0\] must have at least one dimension"):
        ShardLayout([torch.Size([])], 2)


@pytest.mark.parametrize("shape", [(-1,), (4, -1), (2, 3, -7)])
def test_negative_dim(shape) -> None:
    with pytest.raises(ValueError, match=r"shapes\[1\] must have non-negative dims, got \("):
        ShardLayout([(3,), shape], 2)


@pytest.mark.parametrize("shape", [(2.0,), (3, 1.5), ("3",), (None, 2)])
def test_non_int_dim(shape) -> None:
    with pytest.raises(TypeError, match=r"shapes\[1\] must hold ints, got \("):
        ShardLayout([(3,), shape], 2)


def test_bool_dim_rejected() -> None:
    with pytest.raises(TypeError, match=r"shapes\[0\] must hold ints"):
        ShardLayout([(True, 3)], 2)


@pytest.mark.parametrize("method", ["shard_rows", "shard_numels", "shard_offsets", "shard_shapes"])
@pytest.mark.parametrize("rank", [4, 5, -1])
def test_rank_out_of_range(mixed: ShardLayout, method: str, rank: int) -> None:
    with pytest.raises(ValueError, match=rf"rank must be in \[0, 4\), got {rank}"):
        getattr(mixed, method)(rank)


@pytest.mark.parametrize("method", ["shard_rows", "shard_numels", "shard_offsets", "shard_shapes"])
@pytest.mark.parametrize("rank, name", [(1.0, "float"), (True, "bool"), ("1", "str")])
def test_rank_not_int(mixed: ShardLayout, method: str, rank, name: str) -> None:
    with pytest.raises(TypeError, match=rf"rank must be an int, got {name}"):
        getattr(mixed, method)(rank)


def test_rank_checked_with_padded_shapes(mixed: ShardLayout) -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\), got 99"):
        mixed.shard_shapes(99, padded=True)


# ---------------------------------------------------------------------------------------
# Property test against a torch.chunk reference of FSDP's rule
# ---------------------------------------------------------------------------------------
def _chunk_with_empty(tensor: torch.Tensor, num_chunks: int) -> list[torch.Tensor]:
    """FSDP2's ``_chunk_with_empty`` (``_fsdp_common.py``) on dim 0."""
    chunks = list(torch.chunk(tensor, num_chunks, dim=0))
    while len(chunks) < num_chunks:
        chunks.append(chunks[0].new_empty(0))
    return chunks


# dim0 up to 40 with W up to 16 covers dim0 < W, dim0 = 0/1, primes and exact multiples;
# trailing dims stay small (0 included) to keep the reference tensors tiny.
_dim0 = st.integers(0, 40)
_shape = st.one_of(
    st.tuples(_dim0),
    st.tuples(_dim0, st.integers(0, 4)),
    st.tuples(_dim0, st.integers(0, 4), st.integers(1, 3)),
)


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(_shape, max_size=6), world_size=st.integers(1, 16))
def test_matches_chunk_reference(shapes, world_size: int) -> None:
    lay = ShardLayout(shapes, world_size)
    w = world_size
    assert len(lay) == len(shapes)
    assert lay.flat_offsets == tuple(sum(lay.padded_shard_numels[:i]) for i in range(len(shapes)))
    assert lay.flat_shard_numel == sum(lay.padded_shard_numels)
    for i, shape in enumerate(shapes):
        dim0, rest = shape[0], shape[1:]
        row_numel = math.prod(rest)
        full = torch.arange(math.prod(shape)).reshape(shape)
        chunks = _chunk_with_empty(full, w)
        c = chunks[0].shape[0]  # chunk 0 is the padded shard (torch.chunk returns >= 1 chunk)
        s_p = c * row_numel

        assert lay.row_numels[i] == row_numel
        assert lay.numels[i] == full.numel()
        assert lay.rows_per_rank[i] == c
        assert lay.padded_shard_numels[i] == s_p
        assert lay.padded_shapes[i] == (w * c, *rest)
        assert lay.padded_numels[i] == w * s_p
        assert 0 <= w * c - dim0 < w  # padding: fewer rows than ranks

        # Padded storage built the FSDP way: every chunk zero-padded to chunk 0's rows.
        storage = torch.zeros(w * s_p, dtype=full.dtype)
        rows_seen = 0
        for r in range(w):
            chunk = chunks[r]
            # an appended empty chunk is 1-D (0,): no rows (a real chunk keeps its ndim, so
            # rows of a (n, 0) parameter still count)
            real_rows = chunk.shape[0] if chunk.dim() == len(shape) else 0
            assert lay.shard_rows(r)[i] == real_rows
            assert lay.shard_numels(r)[i] == real_rows * row_numel == chunk.numel()
            assert lay.shard_shapes(r)[i] == (real_rows, *rest)
            assert lay.shard_shapes(r, padded=True)[i] == (c, *rest)
            off = lay.shard_offsets(r)[i]
            assert off == r * s_p  # the segments r*S_p tile [0, W*S_p) back to back
            assert off + s_p <= lay.padded_numels[i]
            if real_rows:
                assert rows_seen == r * c  # rank r's real rows start at row r*c
            storage[off : off + chunk.numel()] = chunk.reshape(-1)
            rows_seen += real_rows
        assert rows_seen == dim0
        assert sum(lay.shard_rows(r)[i] for r in range(w)) == dim0
        # Reading the real rows back at offsets r*S_p rebuilds the tensor.
        parts = [
            storage[lay.shard_offsets(r)[i] : lay.shard_offsets(r)[i] + lay.shard_numels(r)[i]]
            for r in range(w)
        ]
        assert torch.equal(torch.cat(parts), full.reshape(-1))
        # ... and the padded storage, cut to the real numel, is the tensor itself.
        assert torch.equal(storage.view(lay.padded_shapes[i])[:dim0], full)

    sub = list(range(len(shapes)))[::-1]
    assert lay.select(sub) == ShardLayout([shapes[i] for i in sub], w)


# ---------------------------------------------------------------------------------------
# Against torch's fully_shard (CPU + gloo)
# ---------------------------------------------------------------------------------------
FSDP_SEED = 20240613
# Fixed awkward shapes: dim0 = 1 and 0, dim0 < W for most W, primes 7/11/13/17, 2^k +- 1,
# 1-D/2-D/3-D; then seeded random shapes (the same on every rank: built from FSDP_SEED).
_FIXED_FSDP_SHAPES = [
    (1,), (7,), (13, 3), (2, 5), (1, 4, 3), (3, 2, 2), (11, 7, 2), (16,), (17,), (9, 1, 1),
    (5, 1), (0, 3),
]


def _fsdp_shapes(seed: int = FSDP_SEED) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    shapes = list(_FIXED_FSDP_SHAPES)
    for _ in range(10):
        ndim = rng.randint(1, 3)
        shapes.append((rng.randint(1, 23), *(rng.randint(1, 6) for _ in range(ndim - 1))))
    return shapes


def _full_value(i: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct, exactly representable values: placement is checked with torch.equal."""
    return (torch.arange(math.prod(shape), dtype=torch.float32) + 1000.0 * (i + 1)).reshape(shape)


class _ShapesModule(nn.Module):
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            setattr(self, f"p{i}", nn.Parameter(_full_value(i, shape)))


def _fsdp_param_groups(module: nn.Module) -> list:
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: a list
    if groups is None:  # torch <= 2.11: a single optional group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _fsdp_probe(mesh, pg, seed: int) -> dict:
    """Shard a module of awkward parameters with fully_shard over ``mesh`` and report what
    FSDP chose on this rank (pure data: the parent compares it with ShardLayout)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    world_size = dist.get_world_size(pg)
    shapes = _fsdp_shapes(seed)
    module = _ShapesModule(shapes)
    fully_shard(module, mesh=mesh)
    groups = _fsdp_param_groups(module)
    assert len(groups) == 1, f"expected one FSDP param group, got {len(groups)}"
    group = groups[0]
    fsdp_params = list(group.fsdp_params)
    assert len(fsdp_params) == len(shapes)

    params = []
    for i, fp in enumerate(fsdp_params):
        p = getattr(module, f"p{i}")
        assert fp.sharded_param is p, f"FSDPParam {i} is not module.p{i}"
        local = p.to_local()
        padded = fp._sharded_param_data  # 1-D padded shard: FSDP's all-gather input
        gathered = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded, group=pg)
        params.append(
            {
                "orig_size": tuple(fp._orig_size),
                "global_shape": tuple(p.shape),
                "local_shape": tuple(local.shape),
                "local_tensor_shape": tuple(p._local_tensor.shape),
                "sharded_size": tuple(fp.sharded_size),
                "padded_sharded_param_size": tuple(fp.padded_sharded_param_size),
                "padded_numel": padded.numel(),
                # the real shard is the head of the padded shard (same allocation)
                "local_at_padded_start": local.numel() == 0
                or local.data_ptr() == padded.data_ptr(),
                "local": local.detach().clone(),
                "padded_storage": torch.cat(gathered),  # segments at r * S_p
            }
        )

    # FSDP's own all-gather: catch its flat output buffer (W rows of padded shards back to
    # back) before copy-out, then let it finish.  With W = 1 FSDP skips the all-gather and
    # leaves a placeholder result (empty split sizes): nothing to catch.
    flat = None
    handle = module.unshard(async_op=True)  # type: ignore[operator]
    result = getattr(group, "_all_gather_result", None)
    if world_size > 1 and getattr(result, "all_gather_output", None) is not None:
        if result.all_gather_work is not None:
            result.all_gather_work.wait()
        flat = {
            "output": result.all_gather_output.detach().clone(),
            "split_sizes": list(result.all_gather_input_split_sizes),
        }
    handle.wait()
    unsharded = [getattr(module, f"p{i}").detach().clone() for i in range(len(shapes))]
    module.reshard()  # type: ignore[operator]
    return {"shapes": shapes, "params": params, "flat": flat, "unsharded": unsharded}


# Shard group sizes checked against fully_shard.  Spawning costs ~5 s of CPU per process
# (torch, FSDP and the torch._dynamo import fully_shard triggers), so one spawn of
# max(FSDP_WORLD_SIZES) ranks serves every W: ranks [0, W) form a subgroup and shard over a
# DeviceMesh built from it (the full world goes through init_device_mesh).
FSDP_WORLD_SIZES = (1, 2, 3, 5, 8)


def _fsdp_probe_all(rank: int, world_size: int, seed: int, sizes: tuple[int, ...]) -> dict:
    """Child body: one fully_shard probe per shard-group size W in ``sizes`` (on ranks < W)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    out = {}
    for w in sizes:
        if w == world_size:
            pg, mesh = dist.group.WORLD, init_device_mesh("cpu", (w,))
        else:
            pg = dist.new_group(list(range(w)))  # collective: every rank calls it
            mesh = DeviceMesh.from_group(pg, "cpu") if rank < w else None
        if rank < w:
            out[w] = _fsdp_probe(mesh, pg, seed)
    return out


@pytest.fixture(scope="module")
def fsdp_results() -> list[dict]:
    return run_multiprocess(
        _fsdp_probe_all, max(FSDP_WORLD_SIZES), FSDP_SEED, FSDP_WORLD_SIZES, timeout=150
    )


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", FSDP_WORLD_SIZES)
def test_matches_fully_shard(fsdp_results: list[dict], world_size: int) -> None:
    shapes = _fsdp_shapes()
    lay = ShardLayout(shapes, world_size)
    results = [fsdp_results[r][world_size] for r in range(world_size)]
    full = [_full_value(i, s) for i, s in enumerate(shapes)]

    for rank, res in enumerate(results):
        assert res["shapes"] == shapes, f"rank {rank} built different shapes"
        padded_shapes = lay.shard_shapes(rank, padded=True)
        for i, got in enumerate(res["params"]):
            where = f"rank {rank} param {i} shape {shapes[i]} W={world_size}"
            c = lay.rows_per_rank[i]
            rows = lay.shard_rows(rank)[i]
            assert got["orig_size"] == got["global_shape"] == shapes[i], where
            assert got["local_shape"] == lay.shard_shapes(rank)[i], where
            assert got["local_tensor_shape"] == lay.shard_shapes(rank)[i], where
            assert got["sharded_size"] == lay.shard_shapes(rank)[i], where
            assert got["padded_sharded_param_size"] == padded_shapes[i], where
            assert got["padded_sharded_param_size"][:1] == (c,), where
            assert got["padded_numel"] == lay.padded_shard_numels[i], where
            assert got["local"].numel() == lay.shard_numels(rank)[i], where
            assert got["local_at_padded_start"], where
            # This rank holds rows [r*c, r*c + rows) of the full parameter.
            assert torch.equal(got["local"], full[i][rank * c : rank * c + rows]), where

            # The padded storage all-gathered from every rank: rank q's segment starts at
            # q * S_p, its real part is q's rows, the rest is zero padding.
            storage = got["padded_storage"]
            assert storage.numel() == lay.padded_numels[i], where
            parts = []
            for q in range(world_size):
                off, n = lay.shard_offsets(q)[i], lay.shard_numels(q)[i]
                seg = storage[off : off + lay.padded_shard_numels[i]]
                parts.append(seg[:n])
                assert not seg[n:].any(), f"{where}: rank {q}'s padding is not zero"
            assert torch.equal(torch.cat(parts), full[i].reshape(-1)), where
            assert torch.equal(storage.view(lay.padded_shapes[i])[: shapes[i][0]], full[i]), where

        # FSDP's all-gather output: W blocks of flat_shard_numel, parameter i of rank q at
        # q * flat_shard_numel + flat_offsets[i].
        flat = res["flat"]
        if flat is None and world_size > 1:
            warnings.warn("FSDP's _all_gather_result was not reachable: flat check skipped", stacklevel=2)
        elif flat is not None:
            assert tuple(flat["split_sizes"]) == lay.padded_shard_numels
            out = flat["output"]
            assert out.numel() == world_size * lay.flat_shard_numel
            blocks = out.view(world_size, lay.flat_shard_numel)
            for i in range(len(shapes)):
                got_storage = torch.cat(
                    [blocks[q, lay.flat_offsets[i] : lay.flat_offsets[i] + lay.padded_shard_numels[i]]
                     for q in range(world_size)]
                )
                assert torch.equal(got_storage, res["params"][i]["padded_storage"]), f"param {i}"

        for i, t in enumerate(res["unsharded"]):
            assert torch.equal(t, full[i]), f"rank {rank}: unsharded param {i} differs"
