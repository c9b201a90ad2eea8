"""Placement, packing and accumulation kernels: exact against their plain-torch ``*_ref``
and against an independent construction from FSDP2's sharding rule.

Every destination is poisoned with ``SENTINEL`` first: padding positions (and anything past
the real rows) must keep it, every real position must be overwritten.  Source padding is
filled with NaN, so a kernel that reads padding shows it in its output.  Values are small
integers (``int_tensor``), so sums, x0.5 and x2 are exact in every dtype and
``scale=1/3`` rounds the same way in the kernel and the reference (one fp32 multiply):
every comparison is bit for bit, on a GPU too: the kernel is compiled without fp
contraction, so ``old + scale * sum`` rounds twice like the reference
(``test_scale_then_add_rounds_like_the_ref`` pins that case).

Under the Triton interpreter a launch costs a few ms per tile (256 elements) and per block
(64 elements), so the tensors are a few thousand elements and the full cross product of
the axes (hundreds of cases per kernel) is replaced by a seeded, balanced sample: each
value of each axis appears in several cases (see ``_balanced_grid``).
"""
from __future__ import annotations

import math
import random
import warnings
from typing import Callable, Sequence

import pytest
import torch

try:  # pytest's default "prepend" import mode puts tests/ on sys.path
    from conftest import HAS_CUDA, int_tensor, interpreting, workload_layouts
except ImportError:  # pragma: no cover - importlib mode with the repo root on sys.path
    from tests.conftest import HAS_CUDA, int_tensor, interpreting, workload_layouts

from tide_triton import (
    ShardLayout,
    accumulate_shards,
    accumulate_shards_ref,
    bind_accumulate_shards,
    bind_pack_shards,
    bind_place_shards,
    pack_shards,
    pack_shards_ref,
    place_shards,
    place_shards_ref,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SENTINEL = -77.0
NAN = float("nan")

# (source dtype, destination dtype): bf16 copies, the fused fp32 -> bf16 cast (RNE), the
# widening casts of mixed-precision reduction, and plain fp32.
DTYPE_PAIRS = [(BF16, BF16), (FP32, BF16), (BF16, FP32), (FP16, FP32), (FP32, FP32)]
WORLD_SIZES = [1, 2, 3, 5, 8]
MAX_CTAS = [None, 1, 3]
SCALES = [None, 0.5, 1 / 3, 2.0]


def _dn(dtype: torch.dtype) -> str:
    return {BF16: "bf16", FP16: "fp16", FP32: "fp32"}[dtype]


# ---------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------
# One shape per case whose per-rank segment straddles the interpreter's BLOCK (64) and
# tile (256): every rank of (W*n,) holds exactly n elements; rows of 64 hit the block
# boundary row by row; (3W-1, 3, 43) gives 387 per rank (two tiles), the last rank 258.
BOUNDARY_SHAPES: dict[str, Callable[[int], tuple[int, ...]]] = {
    "63": lambda w: (w * 63,),
    "64": lambda w: (w * 64,),
    "65": lambda w: (w * 65,),
    "255": lambda w: (w * 255,),
    "256": lambda w: (w * 256,),
    "257": lambda w: (w * 257,),
    "4x64": lambda w: (w * 4 + 1, 64),
    "3x3x43": lambda w: (w * 3 - 1, 3, 43),
}


def _awkward_pool(w: int) -> list[tuple[int, ...]]:
    """Small awkward shapes: dim 0 = 1 (only rank 0 holds rows; Wan's [1, 6, 5120] kind),
    dim 0 < W (trailing ranks empty), primes, an uneven last rank, 1-D and 3-D, and
    zero-numel parameters."""
    return [
        (1,), (1, 7), (1, 6, 13),
        (max(1, w - 1), 5), (max(1, w // 2), 3, 2),
        (13,), (7, 11), (3, 5, 7), (31,),
        (2 * w + 1, 3), (3 * w - 1,),
        (0, 4), (5, 0),
    ]


def _case_shapes(w: int, boundary: str, rng: random.Random) -> list[tuple[int, ...]]:
    shapes = [BOUNDARY_SHAPES[boundary](w)] + rng.sample(_awkward_pool(w), 3)
    rng.shuffle(shapes)  # flat offsets (and so source alignment) differ from case to case
    return shapes


def _balanced_grid(n: int, seed: int, **axes: Sequence) -> list[dict]:
    """``n`` cases; column ``a`` cycles through shuffled copies of ``axes[a]``, so every
    value appears ``n // len(values)`` times or once more, in random combinations."""
    rng = random.Random(seed)
    cols = {}
    for name, values in axes.items():
        col: list = []
        while len(col) < n:
            block = list(values)
            rng.shuffle(block)
            col += block
        cols[name] = col[:n]
    return [{name: cols[name][i] for name in axes} | {"seed": seed * 1000 + i} for i in range(n)]


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bits (so -0.0 != 0.0 and NaN == the same NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    g, w = _bits(got.detach().cpu()), _bits(want.detach().cpu())
    if not torch.equal(g, w):
        bad = (g != w).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {g.numel()} elements differ; first at {i}: "
            f"got {got.cpu()[i].item()!r}, want {want.cpu()[i].item()!r}"
        )


def _rows(shape: Sequence[int], w: int, r: int) -> tuple[int, int]:
    """FSDP2's rule, restated: (padded rows c, real rows of rank r)."""
    c = -(-shape[0] // w)
    return c, max(0, min(shape[0] - r * c, c))


def _padded(x: torch.Tensor, w: int, fill: float = NAN) -> torch.Tensor:
    """``x`` padded along dim 0 to ``w * c`` rows of ``fill``."""
    c, _ = _rows(x.shape, w, 0)
    out = torch.full((w * c, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    out[: x.shape[0]] = x
    return out


def _flat(parts: list[torch.Tensor], slack: int, dtype: torch.dtype, device) -> torch.Tensor:
    pieces = [p.reshape(-1) for p in parts] + [torch.full((slack,), NAN, dtype=dtype, device=device)]
    return torch.cat(pieces)


def _check_poison(t: torch.Tensor, written: torch.Tensor, what: str) -> None:
    """Positions outside ``written`` keep SENTINEL; inside none does."""
    flat = t.detach().reshape(-1).float().cpu()
    assert bool((flat[~written] == SENTINEL).all()), f"{what}: a padding position was written"
    assert not bool((flat[written] == SENTINEL).any()), f"{what}: a real position was not written"


def _ranks_arg(kind: str, w: int, rng: random.Random):
    if kind == "all":
        return None, list(range(w))
    if kind == "int":
        r = rng.randrange(w)
        return r, [r]
    if kind == "reversed":
        return list(reversed(range(w))), list(reversed(range(w)))
    k = rng.randint(1, max(1, w - 1))
    sub = rng.sample(range(w), k)
    return sub, sub


# ---------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------
PLACE_CASES = _balanced_grid(
    48, 1,
    dtypes=DTYPE_PAIRS, w=WORLD_SIZES,
    src=["flat", "flat+slack", "shards-padded", "shards-unpadded", "shards-mixed"],
    dst=["full", "padded", "mixed"],
    ranks=["all", "subset", "int", "reversed"],
    max_ctas=MAX_CTAS, boundary=list(BOUNDARY_SHAPES),
)


def _case_id(c: dict) -> str:
    s, d = c["dtypes"]
    rest = "-".join(f"{c[k]}" for k in c if k not in ("dtypes", "seed", "w"))
    return f"{_dn(s)}>{_dn(d)}-W{c['w']}-{rest}"


@pytest.mark.parametrize("case", PLACE_CASES, ids=_case_id)
def test_place_shards_exact(case: dict, device: torch.device) -> None:
    src_dt, dst_dt = case["dtypes"]
    w = case["w"]
    rng = random.Random(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    shapes = _case_shapes(w, case["boundary"], rng)
    layout = ShardLayout(shapes, w)
    ranks, rank_list = _ranks_arg(case["ranks"], w, rng)

    full = [int_tensor(s, src_dt, device, generator=gen) for s in shapes]
    padded = [_padded(x, w) for x in full]
    srcs: list = []
    for r in rank_list:
        shards = []
        for p, s in enumerate(shapes):
            c, rows = _rows(s, w, r)
            kind = case["src"]
            pad = kind.startswith("flat") or kind == "shards-padded" or (
                kind == "shards-mixed" and rng.random() < 0.5)
            shards.append(padded[p][r * c: r * c + (c if pad else rows)].clone())
        if case["src"].startswith("flat"):
            slack = rng.randint(1, 70) if case["src"] == "flat+slack" else 0
            srcs.append(_flat(shards, slack, src_dt, device))
        else:
            srcs.append(shards)

    def dst_shape(p: int) -> tuple[int, ...]:
        pad = case["dst"] == "padded" or (case["dst"] == "mixed" and p % 2 == 0)
        return layout.padded_shapes[p] if pad else layout.shapes[p]

    params = [torch.full(dst_shape(p), SENTINEL, dtype=dst_dt, device=device) for p in range(len(shapes))]
    ref = [t.clone() for t in params]
    place_shards(srcs, params, layout, ranks=ranks, max_ctas=case["max_ctas"])
    place_shards_ref(srcs, ref, layout, ranks=ranks)

    for p, s in enumerate(shapes):
        assert_bits_equal(params[p], ref[p], f"params[{p}] {s} vs place_shards_ref")
        # Independent: rank r's real rows land at rows [r*c, r*c + rows) of the parameter.
        want = torch.full_like(params[p], SENTINEL)
        written = torch.zeros(params[p].shape, dtype=torch.bool)
        for r in rank_list:
            c, rows = _rows(s, w, r)
            want[r * c: r * c + rows] = full[p][r * c: r * c + rows].to(dst_dt)
            written[r * c: r * c + rows] = True
        assert_bits_equal(params[p], want, f"params[{p}] {s} vs the sharded parameter")
        _check_poison(params[p], written.reshape(-1), f"params[{p}] {s}")


# ---------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------
PACK_CASES = _balanced_grid(
    40, 2,
    dtypes=DTYPE_PAIRS, w=WORLD_SIZES,
    grads=["full", "padded", "mixed"],
    ranks=["all", "subset", "int", "reversed"],
    max_ctas=MAX_CTAS, boundary=list(BOUNDARY_SHAPES),
)


@pytest.mark.parametrize("case", PACK_CASES, ids=_case_id)
def test_pack_shards_exact(case: dict, device: torch.device) -> None:
    src_dt, dst_dt = case["dtypes"]
    w = case["w"]
    rng = random.Random(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    shapes = _case_shapes(w, case["boundary"], rng)
    layout = ShardLayout(shapes, w)
    ranks, rank_list = _ranks_arg(case["ranks"], w, rng)

    full = [int_tensor(s, src_dt, device, generator=gen) for s in shapes]
    grads = [
        _padded(x, w) if case["grads"] == "padded" or (case["grads"] == "mixed" and p % 2) else x
        for p, x in enumerate(full)
    ]
    F = layout.flat_shard_numel
    slack = rng.randint(0, 70)
    out = torch.full((len(rank_list) * F + slack,), SENTINEL, dtype=dst_dt, device=device)
    ref = out.clone()
    pack_shards(grads, out, layout, ranks if ranks is not None else rank_list, max_ctas=case["max_ctas"])
    pack_shards_ref(grads, ref, layout, ranks if ranks is not None else rank_list)
    assert_bits_equal(out, ref, "out vs pack_shards_ref")

    # Independent: block j holds rank_list[j]'s real rows of every gradient at flat_offsets.
    want = torch.full_like(out, SENTINEL)
    written = torch.zeros(out.shape, dtype=torch.bool)
    off = 0
    offsets = []
    for s in shapes:
        offsets.append(off)
        off += _rows(s, w, 0)[0] * math.prod(s[1:])
    assert off == F
    for j, r in enumerate(rank_list):
        for p, s in enumerate(shapes):
            c, rows = _rows(s, w, r)
            piece = full[p][r * c: r * c + rows].reshape(-1)
            o = j * F + offsets[p]
            want[o: o + piece.numel()] = piece.to(dst_dt)
            written[o: o + piece.numel()] = True
    assert_bits_equal(out, want, "out vs the sharded gradients")
    _check_poison(out, written, "out")


# ---------------------------------------------------------------------------------------
# Accumulation
# ---------------------------------------------------------------------------------------
ACC_CASES = _balanced_grid(
    64, 3,
    dtypes=DTYPE_PAIRS, w=WORLD_SIZES,
    src=["flat", "flat+slack", "grads-full", "grads-padded", "grads-mixed"],
    shards=["padded", "unpadded", "mixed"],
    k=[1, 2, 3], scale=SCALES, accumulate=[False, True], rank=["first", "last", "random"],
    max_ctas=MAX_CTAS, boundary=list(BOUNDARY_SHAPES),
)


def _acc_sources(case, layout, shapes, rank, src_dt, device, rng, gen):
    """K contributions, each as flat slots or per-parameter gradients, and the full
    gradients they were cut from."""
    w = layout.world_size
    srcs, grads_full = [], []
    for _ in range(case["k"]):
        full = [int_tensor(s, src_dt, device, generator=gen) for s in shapes]
        grads_full.append(full)
        if case["src"].startswith("flat"):
            parts = []
            for x in full:
                c, _ = _rows(x.shape, w, rank)
                parts.append(_padded(x, w)[rank * c: (rank + 1) * c])
            slack = rng.randint(1, 70) if case["src"] == "flat+slack" else 0
            srcs.append(_flat(parts, slack, src_dt, device))
        else:
            pad = {"grads-full": lambda p: False, "grads-padded": lambda p: True,
                   "grads-mixed": lambda p: p % 2 == 1}[case["src"]]
            srcs.append([_padded(x, w) if pad(p) else x for p, x in enumerate(full)])
    return srcs, grads_full


def _assert_matches_ref(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert_bits_equal(got, want, what)


@pytest.mark.parametrize("case", ACC_CASES, ids=_case_id)
def test_accumulate_shards_exact(case: dict, device: torch.device) -> None:
    src_dt, dst_dt = case["dtypes"]
    w = case["w"]
    rng = random.Random(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    shapes = _case_shapes(w, case["boundary"], rng)
    layout = ShardLayout(shapes, w)
    rank = {"first": 0, "last": w - 1, "random": rng.randrange(w)}[case["rank"]]
    srcs, grads_full = _acc_sources(case, layout, shapes, rank, src_dt, device, rng, gen)

    shards, written = [], []
    for p, s in enumerate(shapes):
        c, rows = _rows(s, w, rank)
        pad = case["shards"] == "padded" or (case["shards"] == "mixed" and p % 2 == 0)
        shard = torch.full((c if pad else rows, *s[1:]), SENTINEL, dtype=dst_dt, device=device)
        if case["accumulate"]:
            shard[:rows] = int_tensor((rows, *s[1:]), dst_dt, device, generator=gen)
        mask = torch.zeros(shard.shape, dtype=torch.bool)
        mask[:rows] = True
        shards.append(shard)
        written.append(mask.reshape(-1))
    old = [t.clone() for t in shards]
    ref = [t.clone() for t in shards]
    accumulate_shards(srcs, shards, layout, rank, scale=case["scale"], accumulate=case["accumulate"],
                      max_ctas=case["max_ctas"])
    accumulate_shards_ref(srcs, ref, layout, rank, scale=case["scale"], accumulate=case["accumulate"])

    for p, s in enumerate(shapes):
        _assert_matches_ref(shards[p], ref[p], f"shards[{p}] {s} vs accumulate_shards_ref")
        # Independent: the real rows are [old +] scale * sum_k of rank's rows of each gradient.
        c, rows = _rows(s, w, rank)
        acc = sum(g[p][rank * c: rank * c + rows].float() for g in grads_full)
        if case["scale"] is not None:
            acc = acc * case["scale"]
        if case["accumulate"]:
            acc = acc + old[p][:rows].float()
        want = old[p].clone()
        want[:rows] = acc.to(dst_dt)
        _assert_matches_ref(shards[p], want, f"shards[{p}] {s} vs the summed gradients")
        if not case["accumulate"]:
            _check_poison(shards[p], written[p], f"shards[{p}] {s}")
        else:
            flat = shards[p].reshape(-1).float().cpu()
            assert bool((flat[~written[p]] == SENTINEL).all()), f"shards[{p}]: padding written"


# ---------------------------------------------------------------------------------------
# fp32 -> bf16 rounding and special values
# ---------------------------------------------------------------------------------------
def _rounding_probe(n: int, seed: int) -> torch.Tensor:
    """Random normals over many binades, plus exact bf16 ties (half an ulp above a bf16
    value, odd and even mantissas) and their neighbours one fp32 ulp either side."""
    g = torch.Generator().manual_seed(seed)
    m = n // 4
    base = torch.randn(m, generator=g).to(BF16).float()  # low 16 bits zero
    tie_bits = base.view(torch.int32) | 0x8000
    ties = torch.cat([tie_bits, tie_bits - 1, tie_bits + 1]).view(torch.float32)
    k = n - ties.numel()
    x = torch.randn(k, generator=g) * torch.exp2(torch.randint(-30, 30, (k,), generator=g).float())
    return torch.cat([x, ties])[torch.randperm(n, generator=g)]


def _specials() -> torch.Tensor:
    f = torch.finfo(FP32)
    vals = [
        0.0, -0.0, float("inf"), float("-inf"), NAN, -NAN,
        f.tiny, -f.tiny, f.tiny / 2, -f.tiny / 3, 1e-40, -1e-40, 1.4e-45, -1.4e-45,  # denormals
        f.max, -f.max, 3.3895313892515355e38,  # rounds to inf; bf16's max (exact)
        3.3961e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-8 + 2**-20,
    ]
    # NaNs whose payload sits in the low 16 bits only (a rounding add would carry them
    # into inf or -0.0), a signalling one, and all-ones.
    nan_bits = [0x7F800001, 0x7F80FFFF, -0x007FFFFF, 0x7FFFFFFF, -1]
    return torch.cat([torch.tensor(vals, dtype=FP32), torch.tensor(nan_bits, dtype=torch.int32).view(FP32)])


def _assert_same_as_torch_cast(got: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """``got`` is bit-equal to ``x.to(got.dtype)``; NaN only needs to stay NaN (torch's CPU
    cast and the kernels pick different NaN bit patterns)."""
    want = x.to(got.dtype)
    nan = torch.isnan(want.float())
    assert torch.equal(torch.isnan(got.float()), nan), f"{what}: NaN positions differ"
    assert_bits_equal(torch.where(nan, 0, got), torch.where(nan, 0, want), what)


def _run_one_param(kernel: str, x: torch.Tensor, dst_dtype: torch.dtype, w: int = 1) -> torch.Tensor:
    """Push a 1-D ``x`` through ``kernel`` as a single parameter of dim0 = numel (rank 0
    holds all of it at W=1) and return the destination."""
    layout = ShardLayout([(x.numel(),)], w)
    if kernel == "place":
        out = torch.full((x.numel(),), SENTINEL, dtype=dst_dtype, device=x.device)
        place_shards([x], [out], layout)
    elif kernel == "pack":
        out = torch.full((x.numel(),), SENTINEL, dtype=dst_dtype, device=x.device)
        pack_shards([x], out, layout, 0)
    else:
        out = torch.full((x.numel(),), SENTINEL, dtype=dst_dtype, device=x.device)
        accumulate_shards([x], [out], layout, 0)
    return out


KERNELS = ["place", "pack", "accumulate"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_fp32_to_bf16_is_round_to_nearest_even(kernel: str, device: torch.device) -> None:
    # 700 values: past two tiles, so unmasked blocks and the masked tail both round.
    x = _rounding_probe(700, seed=11).to(device)
    got = _run_one_param(kernel, x, BF16)
    _assert_same_as_torch_cast(got, x, f"{kernel} fp32 -> bf16")


def test_fp32_to_bf16_rne_after_reduction(device: torch.device) -> None:
    # K = 3 random fp32 contributions, scaled: the fp32 result rounds like torch's cast.
    x = [_rounding_probe(300, seed=s).to(device) for s in (1, 2, 3)]
    layout = ShardLayout([(300,)], 1)
    out = torch.full((300,), SENTINEL, dtype=BF16, device=device)
    accumulate_shards(x, [out], layout, 0, scale=1 / 3)
    acc = (x[0] + x[1] + x[2]) * (1 / 3)
    _assert_same_as_torch_cast(out, acc, "accumulate K=3 fp32 -> bf16")


@pytest.mark.parametrize("dst", [BF16, FP32, FP16], ids=_dn)
@pytest.mark.parametrize("kernel", KERNELS)
def test_fp32_special_values(kernel: str, dst: torch.dtype, device: torch.device) -> None:
    # inf, -0.0, NaN, denormals, overflow to inf: the cast (or copy) of torch, bit for bit.
    x = _specials().to(device)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)
        got = _run_one_param(kernel, x, dst)
    _assert_same_as_torch_cast(got, x, f"{kernel} fp32 specials -> {_dn(dst)}")


@pytest.mark.parametrize("src,dst", [(BF16, BF16), (BF16, FP32), (FP16, FP32), (FP16, FP16)],
                         ids=lambda d: _dn(d))
def test_narrow_source_special_values(src: torch.dtype, dst: torch.dtype, device: torch.device) -> None:
    # Normal specials of bf16/fp16 sources (fp16 denormals included: the interpreter
    # converts fp16 through numpy); bf16 denormals: see the next test.
    vals = [0.0, -0.0, float("inf"), float("-inf"), NAN, 1.0, -3.5, 1e-3, 448.0]
    if src == FP16:
        vals += [6e-8, -6e-8, 3e-5, 65504.0]
    x = torch.tensor(vals, dtype=FP32).to(src).to(device)
    for kernel in KERNELS:
        got = _run_one_param(kernel, x, dst)
        _assert_same_as_torch_cast(got, x, f"{kernel} {_dn(src)} specials -> {_dn(dst)}")


@pytest.mark.parametrize("dst", [BF16, FP32], ids=_dn)
def test_bf16_source_denormals(dst: torch.dtype, device: torch.device) -> None:
    x = torch.tensor([1e-40, -1e-40, 1e-39, 5e-39, 1e-38], dtype=FP32).to(BF16).to(device)
    got = _run_one_param("place", x, dst)
    _assert_same_as_torch_cast(got, x, f"bf16 denormals -> {_dn(dst)}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_negative_zero_survives_copy_and_scale(kernel: str, device: torch.device) -> None:
    x = torch.tensor([-0.0, 0.0, -0.0, 1.0], dtype=BF16, device=device)
    got = _run_one_param(kernel, x, FP32)
    assert_bits_equal(got, x.float(), f"{kernel} bf16 -> fp32 keeps -0.0")
    if kernel == "accumulate":
        layout = ShardLayout([(4,)], 1)
        out = torch.tensor([-0.0, -0.0, 0.0, 2.0], device=device)
        accumulate_shards([x, x], [out], layout, 0, scale=2.0, accumulate=True)
        assert_bits_equal(out, torch.tensor([-0.0, 0.0, 0.0, 6.0], device=device), "-0.0 sums")


# ---------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dst", [FP32, BF16], ids=_dn)
def test_accumulate_is_bit_reproducible(dst: torch.dtype, device: torch.device) -> None:
    # Random (non-integer) bf16 contributions: fp32 sums round, so only a fixed order gives
    # the same bits twice, and the same bits for any grid size.
    w, rank = 3, 1
    layout = ShardLayout([(3 * 257,), (7, 43), (2, 3, 5)], w)
    g = torch.Generator().manual_seed(5)
    srcs = [[torch.randn(s, generator=g).to(BF16).to(device) for s in layout.shapes] for _ in range(5)]
    old = [torch.randn(s, generator=g).to(dst).to(device) for s in layout.shard_shapes(rank, padded=True)]
    results = []
    for max_ctas in (None, None, 1, 3):
        shards = [t.clone() for t in old]
        accumulate_shards(srcs, shards, layout, rank, scale=1 / 3, accumulate=True, max_ctas=max_ctas)
        results.append(shards)
    ref = [t.clone() for t in old]
    accumulate_shards_ref(srcs, ref, layout, rank, scale=1 / 3, accumulate=True)
    for p in range(len(layout)):
        for i in range(1, len(results)):
            assert_bits_equal(results[i][p], results[0][p], f"shards[{p}] run {i} vs run 0")
        _assert_matches_ref(results[0][p], ref[p], f"shards[{p}] vs accumulate_shards_ref")


def test_scale_then_add_rounds_like_the_ref(device: torch.device) -> None:
    # old + scale * sum with an inexact product: the ref rounds the product to fp32, then
    # the sum.  -24 * fp32(1/3) = -8.0000002 rounds to -8.0, so adding 8 gives exactly 0.0;
    # a fused multiply-add keeps the product exact and gives -2.38e-07.  Each pair below
    # differs between the two.
    pairs = [(-24, 8), (-24, 5), (-23, 6), (-23, 8), (-22, 7)]
    layout = ShardLayout([(len(pairs),)], 1)
    src = torch.tensor([a for a, _ in pairs], dtype=BF16, device=device)
    out = torch.tensor([o for _, o in pairs], dtype=FP32, device=device)
    ref = out.clone()
    accumulate_shards([src], [out], layout, 0, scale=1 / 3, accumulate=True)
    accumulate_shards_ref([src], [ref], layout, 0, scale=1 / 3, accumulate=True)
    assert ref[0].item() == 0.0
    assert_bits_equal(out, ref, "old + (1/3) * sum, rounded as the ref rounds")


# ---------------------------------------------------------------------------------------
# Bindings
# ---------------------------------------------------------------------------------------
BIND_LAYOUT = ([(2 * 257 - 3,), (5, 7), (1, 3, 4)], 2)


def _bound(kernel: str, device: torch.device):
    """``bind()`` (binds ``kernel`` over BIND_LAYOUT to the tensors as they are now), the
    destinations and sources, a function computing the expected destinations with the
    ``_ref``, and a source to move."""
    layout = ShardLayout(*BIND_LAYOUT)
    g = torch.Generator().manual_seed(3)
    if kernel == "place":
        srcs = [int_tensor((layout.flat_shard_numel,), BF16, device, generator=g) for _ in range(2)]
        dsts = [torch.full(s, SENTINEL, dtype=FP32, device=device) for s in layout.shapes]

        def bind():
            return bind_place_shards(srcs, dsts, layout, max_ctas=2)

        def ref(out, **_):
            place_shards_ref(srcs, out, layout)
        moved_src = srcs[1]
    elif kernel == "pack":
        srcs = [int_tensor(s, BF16, device, generator=g) for s in layout.shapes]
        dsts = [torch.full((2 * layout.flat_shard_numel,), SENTINEL, dtype=FP32, device=device)]

        def bind():
            return bind_pack_shards(srcs, dsts[0], layout, [1, 0])

        def ref(out, **_):
            pack_shards_ref(srcs, out[0], layout, [1, 0])
        moved_src = srcs[2]
    else:
        srcs = [int_tensor((layout.flat_shard_numel,), BF16, device, generator=g) for _ in range(3)]
        dsts = [torch.full(s, SENTINEL, dtype=FP32, device=device) for s in layout.shard_shapes(1, padded=True)]

        def bind():
            return bind_accumulate_shards(srcs, dsts, layout, 1, max_ctas=1)

        def ref(out, scale=None, accumulate=False):
            accumulate_shards_ref(srcs, out, layout, 1, scale=scale, accumulate=accumulate)
        moved_src = srcs[0]
    return bind, dsts, srcs, ref, moved_src


@pytest.mark.parametrize("kernel", KERNELS)
def test_binding_launches_repeatedly(kernel: str, device: torch.device) -> None:
    bind, dsts, srcs, ref, _ = _bound(kernel, device)
    binding = bind()
    want = [t.clone() for t in dsts]
    kw = dict(scale=0.5, accumulate=True) if kernel == "accumulate" else {}
    for _ in range(2):  # accumulate: the second launch adds onto the first
        binding.launch(**kw)
        ref(want, **kw)
        for got, exp in zip(dsts, want):
            assert_bits_equal(got, exp, f"{kernel} binding")
    # Sources are read at launch: new contents in the same storage are picked up.
    for s in srcs:
        s.copy_(-s)
    binding.launch()
    ref(want)
    for got, exp in zip(dsts, want):
        assert_bits_equal(got, exp, f"{kernel} binding after sources changed")


def _move(t: torch.Tensor, how: str) -> None:
    """Give ``t`` new storage at another address, as FSDP2's resize_(0) / resize_(n) does."""
    before = t.data_ptr()
    if how == "resize":
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        blockers = []  # hold freed blocks so the allocator cannot hand the old one back
        for _ in range(16):
            storage.resize_(0)
            blockers.append(torch.empty(nbytes, dtype=torch.uint8, device=t.device))
            storage.resize_(nbytes)
            if t.data_ptr() != before:
                break
    else:
        t.set_(torch.zeros_like(t))
    assert t.data_ptr() != before, "test precondition: storage did not move"


@pytest.mark.parametrize("how", ["resize", "set_"])
@pytest.mark.parametrize("side", ["dst", "src"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_binding_refuses_moved_storage(kernel: str, side: str, how: str, device: torch.device) -> None:
    bind, dsts, _, ref, moved_src = _bound(kernel, device)
    binding = bind()
    moved = dsts[0] if side == "dst" else moved_src
    _move(moved, how)
    with pytest.raises(RuntimeError, match="moved"):
        binding.launch()
    with pytest.raises(RuntimeError, match="moved"):  # still refused: nothing was rebound
        binding.launch(scale=1.0) if kernel == "accumulate" else binding.launch()
    # Binding the same tensors again picks up the new storage (its contents are fresh).
    moved.fill_(SENTINEL if side == "dst" else 3.0)
    bind().launch()
    want = [torch.full_like(t, SENTINEL) for t in dsts]
    ref(want)
    for got, exp in zip(dsts, want):
        assert_bits_equal(got, exp, f"{kernel} rebound after {how}")


# ---------------------------------------------------------------------------------------
# Degenerate layouts
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("w", [1, 3])
def test_empty_layout(w: int, device: torch.device) -> None:
    layout = ShardLayout([], w)
    assert layout.flat_shard_numel == 0
    empty = [torch.empty(0, dtype=BF16, device=device) for _ in range(w)]
    place_shards(empty, [], layout)
    place_shards([[] for _ in range(w)], [], layout)
    bind_place_shards(empty, [], layout).launch()
    out = torch.full((5,), SENTINEL, device=device)
    pack_shards([], out, layout, list(range(w)))
    bind_pack_shards([], out, layout, 0).launch()
    assert bool((out == SENTINEL).all())
    accumulate_shards(empty[:1], [], layout, w - 1, scale=0.5, accumulate=True)
    accumulate_shards([[], []], [], layout, 0)
    bind_accumulate_shards(empty, [], layout, 0).launch(scale=2.0)


def test_rank_without_rows(device: torch.device) -> None:
    # W=3 over dim0 in {1, 2}: rank 2 holds no row of any parameter (FSDP2 gives it empty
    # shards), rank 1 holds rows of one only.
    shapes = [(1,), (1, 7), (1, 6, 13), (2, 3)]
    layout = ShardLayout(shapes, 3)
    assert layout.shard_numels(2) == (0, 0, 0, 0)
    g = torch.Generator().manual_seed(9)
    F = layout.flat_shard_numel
    full = [int_tensor(s, BF16, device, generator=g) for s in shapes]

    # place rank 2 alone (empty shards) touches nothing; all ranks with unpadded shards
    # (zero-size tensors for rank 2) match the ref.
    params = [torch.full(s, SENTINEL, device=device) for s in layout.padded_shapes]
    place_shards([[torch.empty((0, *s[1:]), dtype=BF16, device=device) for s in shapes]], params, layout, ranks=[2])
    place_shards([torch.zeros(F, dtype=BF16, device=device)], params, layout, ranks=2)
    assert all(bool((t == SENTINEL).all()) for t in params)
    srcs = []
    for r in range(3):
        srcs.append([])
        for x in full:
            c, rows = _rows(x.shape, 3, r)
            srcs[-1].append(x[r * c: r * c + rows].clone())
    place_shards(srcs, params, layout, max_ctas=1)
    ref = [torch.full(s, SENTINEL, device=device) for s in layout.padded_shapes]
    place_shards_ref(srcs, ref, layout)
    for p in range(len(shapes)):
        assert_bits_equal(params[p], ref[p], f"params[{p}]")
        assert_bits_equal(params[p][: shapes[p][0]], full[p].float(), f"params[{p}] rows")

    # pack ranks [2, 0]: block 0 stays poisoned.
    out = torch.full((2 * F,), SENTINEL, device=device)
    pack_shards(full, out, layout, [2, 0])
    ref_out = torch.full_like(out, SENTINEL)
    pack_shards_ref(full, ref_out, layout, [2, 0])
    assert_bits_equal(out, ref_out, "pack out")
    assert bool((out[:F] == SENTINEL).all())

    # accumulate into rank 2: padded shards keep the sentinel, unpadded ones are empty.
    for padded in (True, False):
        shards = [torch.full(s, SENTINEL, device=device) for s in layout.shard_shapes(2, padded=padded)]
        accumulate_shards([full, full], shards, layout, 2, scale=0.5, accumulate=True)
        bind_accumulate_shards([torch.zeros(F, dtype=BF16, device=device)], shards, layout, 2).launch()
        assert all(bool((t == SENTINEL).all()) for t in shards)


# ---------------------------------------------------------------------------------------
# Views into one flat buffer (FSDP2's parameters are views of one allocation)
# ---------------------------------------------------------------------------------------
def test_views_at_odd_offsets(device: torch.device) -> None:
    # Parameters and sources as views at odd element offsets of shared buffers: addresses
    # only 2-byte aligned, the case the kernels' alignment hints must not over-promise on.
    shapes = [(9, 13), (2 * 64 + 1,), (3, 5, 7)]
    w = 2
    layout = ShardLayout(shapes, w)
    g = torch.Generator().manual_seed(13)
    F = layout.flat_shard_numel
    big_src = int_tensor((w * (F + 3) + 1,), BF16, device, generator=g)
    srcs = [big_src[1 + r * (F + 3): 1 + r * (F + 3) + F] for r in range(w)]
    store = torch.full((sum(layout.numels) + 8,), SENTINEL, dtype=BF16, device=device)
    params, off = [], 1
    for s, n in zip(shapes, layout.numels):
        params.append(store[off: off + n].view(s))
        off += n + 1
    ref_store = store.clone()
    ref = [ref_store[t.storage_offset(): t.storage_offset() + t.numel()].view(t.shape) for t in params]
    place_shards(srcs, params, layout)
    place_shards_ref(srcs, ref, layout)
    assert_bits_equal(store, ref_store, "shared parameter storage")

    out_big = torch.full((w * F + 3,), SENTINEL, device=device)
    out = out_big[3:]
    pack_shards(params, out, layout, [1, 0], max_ctas=3)
    ref_out = torch.full_like(out_big, SENTINEL)
    pack_shards_ref(params, ref_out[3:], layout, [1, 0])
    assert_bits_equal(out_big, ref_out, "pack into a view")

    shards_store = torch.full((F + 5,), SENTINEL, device=device)
    shards = []
    off = 1
    for s in layout.shard_shapes(1):
        n = math.prod(s)
        shards.append(shards_store[off: off + n].view(s))
        off += n
    ref_store2 = shards_store.clone()
    ref_shards = [ref_store2[t.storage_offset(): t.storage_offset() + t.numel()].view(t.shape) for t in shards]
    accumulate_shards([out[:F], out[F:]], shards, layout, 1, scale=0.5)
    accumulate_shards_ref([out[:F], out[F:]], ref_shards, layout, 1, scale=0.5)
    assert_bits_equal(shards_store, ref_store2, "accumulate into views")


# ---------------------------------------------------------------------------------------
# Real model layers: FSDP2's reduce-scatter and all-gather, emulated with the three kernels
# ---------------------------------------------------------------------------------------
def _round_trip(layout: ShardLayout, device: torch.device, k: int) -> None:
    """K ranks' bf16 gradients: pack every rank's slices (reduce-scatter send side),
    accumulate each rank's K slots into fp32 shards with scale 1/W (AVG), then place all
    shards (fp32 -> bf16) into full parameters: equal to the bf16 cast of the average."""
    w = layout.world_size
    F = layout.flat_shard_numel
    g = torch.Generator().manual_seed(21) if device.type == "cpu" else None
    grads = [[int_tensor(s, BF16, device, generator=g) for s in layout.shapes] for _ in range(k)]
    packed = []
    for j in range(k):
        out = torch.full((w * F,), SENTINEL, dtype=BF16, device=device)
        pack_shards(grads[j], out, layout, list(range(w)))
        packed.append(out)
    shards_per_rank = []
    for r in range(w):
        shards = [torch.zeros(s, device=device) for s in layout.shard_shapes(r, padded=True)]
        accumulate_shards([buf[r * F:(r + 1) * F] for buf in packed], shards, layout, r, scale=1 / w)
        shards_per_rank.append(shards)
    params = [torch.full(s, SENTINEL, dtype=BF16, device=device) for s in layout.shapes]
    place_shards(shards_per_rank, params, layout)
    for p, s in enumerate(layout.shapes):
        acc = grads[0][p].float()
        for j in range(1, k):
            acc = acc + grads[j][p].float()
        want = (acc * (1 / w)).to(BF16)
        assert_bits_equal(params[p], want, f"param {p} {s}")


# Interpreter-sized layers (conftest's CPU_SCALE) with their 1-D/3-D, dim0 < W structure;
# Qwen3's 393 parameters cut to the first 24 (attention, router, 5 experts) on the CPU.
@pytest.mark.parametrize("model", ["llama-3.1-70b", "qwen3-30b-a3b", "wan2.2-14b"])
def test_scaled_workload_round_trip(model: str, device: torch.device) -> None:
    if device.type == "cuda" and not interpreting():
        layout = workload_layouts(8, factor=64)[model]
    else:
        layout = workload_layouts(8, max_params=24)[model]
    _round_trip(layout, device, k=2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or interpreting(), reason="real layer sizes need compiled Triton on a GPU")
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "llama-3.1-70b", "wan2.2-14b"])
def test_real_workload_round_trip(model: str) -> None:
    layout = workload_layouts(8, factor=1)[model]
    _round_trip(layout, torch.device("cuda"), k=2)
    torch.cuda.synchronize()


@pytest.mark.parametrize("offset", [0, 1])
def test_bindings_sharing_one_pointer_upload_match_their_own_tables(offset: int, device: torch.device) -> None:
    """Bindings over the same shards with their own sources, their address tables uploaded as
    one (``upload_pointer_tables``: the prepared reduce-scatter's chunks on new gradients),
    reduce exactly what each binding with a table of its own does, and assume the same
    alignment -- also for sources one element off 16 bytes (``offset``)."""
    from tide_triton.kernels.segments import Binding, upload_pointer_tables

    layout = ShardLayout([(6, 40), (5, 24), (64,)], 2)
    g = torch.Generator().manual_seed(21)
    shards = [torch.full(s, SENTINEL, dtype=FP32, device=device) for s in layout.shard_shapes(1, padded=True)]
    flat = layout.flat_shard_numel
    backing = [int_tensor((flat + offset,), BF16, device, generator=g) for _ in range(3)]
    srcs = [b[offset:] for b in backing]
    own = [bind_accumulate_shards(srcs, shards, layout, 1), bind_accumulate_shards(srcs[::-1], shards, layout, 1)]
    dst_ptrs = tuple(t.data_ptr() for t in shards)
    src_lists = [tuple(t.data_ptr() for t in b.srcs) for b in own]
    tables = upload_pointer_tables(device, dst_ptrs, src_lists)
    assert len(tables) == 2 and tables[0].event is tables[1].event
    shared = [Binding(b.program, b.dsts, b.srcs, b.k, b.max_ctas, known_ptrs=(dst_ptrs, p), shared=t)
              for b, p, t in zip(own, src_lists, tables)]
    for a, b in zip(own, shared):
        assert (a._static["SRC_ALIGN"], a._static["DST_ALIGN"]) == (b._static["SRC_ALIGN"], b._static["DST_ALIGN"])
        assert a._static["SRC_ALIGN"] == (2 if offset else 16)
        want = _launched(a, shards)
        got = _launched(b, shards)
        for g_, exp in zip(got, want):
            assert_bits_equal(g_, exp, "binding with shared tables")
    for g_, exp in zip(got, _halved_sums(srcs[::-1], shards, layout)):
        assert_bits_equal(g_, exp, "against the reference")
    with pytest.raises(ValueError, match="shared pointer tables need known_ptrs of the same lengths"):
        Binding(own[0].program, own[0].dsts, own[0].srcs, 3, None, known_ptrs=(dst_ptrs, src_lists[0][:-1]),
                shared=tables[0])


def test_a_binding_rebound_to_new_addresses_reduces_like_a_new_one(device: torch.device) -> None:
    """``Binding.rebound`` (a reduce-scatter's chunks on new gradient addresses every step): a
    copy with the new tables reduces exactly what a binding made anew on those addresses does,
    and shares the first one's compiled kernels and tile table -- unless the alignment its
    kernel is specialised on differs (sources one element off 16 bytes), where it is made anew
    (2-byte alignment assumed, never the first one's 16)."""
    from tide_triton.kernels.segments import Binding, upload_table_pairs

    layout = ShardLayout([(6, 40), (5, 24), (64,)], 2)
    g = torch.Generator().manual_seed(22)
    shards = [torch.full(s, SENTINEL, dtype=FP32, device=device) for s in layout.shard_shapes(1, padded=True)]
    flat = layout.flat_shard_numel
    dst_ptrs = tuple(t.data_ptr() for t in shards)

    def sources(offset: int) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        backing = [int_tensor((flat + offset,), BF16, device, generator=g) for _ in range(3)]
        srcs = [b[offset:] for b in backing]
        own = bind_accumulate_shards(srcs, shards, layout, 1)
        return srcs, own, tuple(t.data_ptr() for t in own.srcs)

    srcs0, own0, ptrs0 = sources(0)
    first = Binding(own0.program, own0.dsts, own0.srcs, own0.k, own0.max_ctas, known_ptrs=(dst_ptrs, ptrs0),
                    shared=upload_table_pairs(device, [(dst_ptrs, ptrs0)])[0])
    for offset, shares in ((0, True), (1, False)):
        srcs, own, ptrs = sources(offset)
        table, = upload_table_pairs(device, [(dst_ptrs, ptrs)])
        b = first.rebound((dst_ptrs, ptrs), table)
        assert b._tables[0] is first._tables[0]  # the program's tile table, either way
        assert (b._compiled is first._compiled) is shares, offset
        assert b.src_ptrs == ptrs and b._tables[2] is table.src
        assert b._static["SRC_ALIGN"] == (2 if offset else 16)
        want = _launched(own, shards)
        got = _launched(b, shards, check_addresses=False)  # its tensors are the first one's: bound by address
        for g_, exp in zip(got, want):
            assert_bits_equal(g_, exp, f"rebound binding, offset {offset}")
        for g_, exp in zip(got, _halved_sums(srcs, shards, layout)):
            assert_bits_equal(g_, exp, f"against the reference, offset {offset}")
    # the first binding still reduces its own sources
    for g_, exp in zip(_launched(first, shards), _halved_sums(srcs0, shards, layout)):
        assert_bits_equal(g_, exp, "the first binding after its copies")


def _launched(binding, shards, **kw) -> list[torch.Tensor]:
    """``binding``'s ``scale=0.5`` reduction into ``shards`` filled with SENTINEL first: the results."""
    for s in shards:
        s.fill_(SENTINEL)
    binding.launch(scale=0.5, **kw)
    return [s.clone() for s in shards]


def _halved_sums(srcs, shards, layout) -> list[torch.Tensor]:
    """The reference of :func:`_launched` for rank 1's shards of ``srcs``."""
    ref = [torch.full_like(s, SENTINEL) for s in shards]
    accumulate_shards_ref(srcs, ref, layout, 1, scale=0.5)
    return ref


class _FakeStream:
    """A CUDA stream for host-side tests of the launch's waits: records the events it waits on."""

    def __init__(self, name):
        self.name, self.waited, self.cuda_stream = name, [], 0

    def wait_event(self, ev):
        self.waited.append(ev)


class _FakeTable:
    """A device table: records the streams it is kept for; slices share their parent's record
    (one storage)."""

    def __init__(self, log=None):
        self.log = [] if log is None else log

    def __getitem__(self, s):
        return _FakeTable(self.log)

    def record_stream(self, s):
        self.log.append(s)

    def data_ptr(self):
        return 0


class _FakeKernel:
    """A compiled kernel as ``Binding.launch`` calls it directly: counts its launches."""

    function = packed_metadata = None

    def __init__(self):
        self.launches = 0

    def launch_metadata(self, *a):
        return None

    def run(self, *a):
        self.launches += 1


def test_a_launch_waits_for_a_tile_table_uploaded_on_another_stream() -> None:
    """A program's tile table goes up once, on the stream
    current at its first binding; a later binding of it (rebound to new gradients, or made by
    another group: programs are shared) uploads its pointer tables on another stream.  A launch
    on that pointer-upload stream skipped every wait, so the kernel could read tile rows not yet
    uploaded (a busy first stream): zero-length tiles, a silent wrong sum.  The launch must wait
    for the tile table's event; the kernel push's copy queue is not "ordered" by a fence from
    the pointer-upload stream alone; nothing waits where both went up on the launch stream.
    (Host-side fakes: the streams and the compiled kernel; the GPU test is in test_programs.)"""
    from tide_triton.kernels.segments import Binding
    from tide_triton.executors.prepare import KernelPush

    tiles_stream, ptr_stream = _FakeStream("tiles"), _FakeStream("pointers")
    kernel = _FakeKernel()

    def binding(tile_home):
        b = object.__new__(Binding)
        b.program = type("P", (), {"n_tiles": 4, "n_src": 1})()
        b.k, b._same_dtype, b._grid, b._n_iters = 1, True, (1,), 4
        b._cuda, b._torch, b._upload_stream, b._tile_upload = True, False, ptr_stream, ("tile-event", tile_home)
        b._tables, b._static = (_FakeTable(), _FakeTable(), _FakeTable()), {}
        b._streams_seen, b._streams_kept = set(), set()
        b._set_uploads("pointer-event")
        b._compiled = {b._variant(None, False): (kernel, ())}
        return b

    b = binding(tiles_stream)
    assert not b.uploaded_on(ptr_stream) and not b.uploaded_on(tiles_stream)
    b.launch(check_addresses=False, stream=ptr_stream)
    assert ptr_stream.waited == ["tile-event"], ptr_stream.waited
    b.launch(check_addresses=False, stream=ptr_stream)  # once per stream
    assert ptr_stream.waited == ["tile-event"]
    other = _FakeStream("other")
    b.launch(check_addresses=False, stream=other)
    assert other.waited == ["tile-event", "pointer-event"]
    same = binding(ptr_stream)  # both went up on the launch stream: no wait
    assert same.uploaded_on(ptr_stream)
    ptr_stream.waited.clear()
    same.launch(check_addresses=False, stream=ptr_stream)
    assert ptr_stream.waited == [] and kernel.launches == 4

    class Transport:  # the copy queue: a stream of its own, fenced from the run's stream
        def __init__(self):
            self.queue = _FakeStream("copy queue")

        def on_copy_queue(self, fn):
            fn(self.queue)

    t = Transport()
    KernelPush(binding(tiles_stream)).enqueue(t, ptr_stream)
    assert t.queue.waited == ["tile-event", "pointer-event"], t.queue.waited
    t = Transport()
    KernelPush(binding(ptr_stream)).enqueue(t, ptr_stream)  # ordered by the fence: no wait
    assert t.queue.waited == []


def test_a_pointer_table_cache_hit_keeps_the_stream_its_tables_went_up_on(monkeypatch) -> None:
    """The same class as the tile table's: a program's pointer
    tables are cached by address, and a binding made on a cache hit took the current stream for
    their home.  Bound on B (tile table up there), then on busy A for addresses X1 (X1's table
    goes up on A), then on B again for X1: the launch on B must wait for A's upload and keep
    X1's table for B (its memory is A's in the caching allocator).  Fails without the stream in
    the cache entry: B waits for nothing.  (Fake streams, uploads and kernel.)"""
    from tide_triton.kernels import segments
    from tide_triton.kernels.segments import Binding, SegmentProgram, Span

    class T:  # a stand-in CUDA tensor
        device, dtype = torch.device("cuda", 0), torch.bfloat16

        def element_size(self):
            return 2

    cur: dict = {}
    tables: dict = {}

    def fake_upload(host, device):
        what = "tiles" if host.dim() == 2 else tuple(host.tolist())
        tables[what] = _FakeTable()
        return tables[what], (what, cur["s"].name), cur["s"]

    monkeypatch.setattr(segments, "_upload", fake_upload)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cur["s"])
    prog = SegmentProgram((Span(0, 0, 0, 0, 100),), n_dst=1, n_src=1, tile_numel=64)
    A, B = _FakeStream("A"), _FakeStream("B")

    def bind(ptrs):
        b = Binding(prog, (T(),), (T(),), 1, None, known_ptrs=((ptrs[0],), (ptrs[1],)))
        b._compiled = {b._variant(None, False): (_FakeKernel(), ())}
        return b

    cur["s"] = B
    bind((0x1000, 0x2000)).launch(check_addresses=False, stream=B)
    cur["s"] = A
    bind((0x3000, 0x4000)).launch(check_addresses=False, stream=A)
    assert A.waited == [("tiles", "B")]
    cur["s"] = B
    again = bind((0x3000, 0x4000))  # a cache hit: X1's tables went up on A
    B.waited.clear()
    again.launch(check_addresses=False, stream=B)
    assert B.waited == [((0x3000, 0x4000), "A")], B.waited
    assert B in tables[(0x3000, 0x4000)].log
    assert not again.uploaded_on(B)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_program_first_bound_on_a_busy_stream_reduces_exactly_when_bound_again_on_another() -> None:
    """The GPU side of the test above: a fresh program's first binding made on a stream that
    sleeps ~200 ms (its tile table goes up behind the sleep); the binding rebound to new
    sources, and one made anew, with their pointer tables uploaded on a second stream and
    launched there at once.  Both reductions exact; without the wait for the tile table they
    read rows not yet uploaded."""
    from tide_triton.kernels.segments import Binding, SegmentProgram, upload_table_pairs

    dev = torch.device("cuda", torch.cuda.current_device())
    layout = ShardLayout([(96, 40), (5, 24), (640,), (33, 7)], 2)
    g = torch.Generator().manual_seed(23)
    shards = [torch.full(s, SENTINEL, dtype=FP32, device=dev) for s in layout.shard_shapes(1, padded=True)]
    dst_ptrs = tuple(t.data_ptr() for t in shards)
    flat = layout.flat_shard_numel

    def sources():
        srcs = [int_tensor((flat,), BF16, dev, generator=g) for _ in range(3)]
        own = bind_accumulate_shards(srcs, shards, layout, 1)
        return srcs, own, tuple(t.data_ptr() for t in own.srcs)

    srcs0, own0, ptrs0 = sources()
    p0 = own0.program
    busy, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def attempt() -> tuple:
        """A fresh program (no tile table yet) first bound behind the sleep, then bound again on
        ``other`` and launched there: (was ``busy`` still asleep after the launches, results)."""
        srcs1, own1, ptrs1 = sources()
        srcs2, own2, ptrs2 = sources()
        fresh = SegmentProgram(p0.runs, p0.n_dst, p0.n_src, tile_numel=p0.tile_numel)
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(busy):
            t0 = upload_table_pairs(dev, [(dst_ptrs, ptrs0)])[0]
            # Zeros where the tile table will lie (the block the allocator gives it next on this
            # stream): read before its upload, every tile has n = 0 and the shards keep SENTINEL.
            # (Without this the block held the first attempt's identical rows.)
            torch.zeros_like(fresh.tiles, device=dev)
            torch.cuda._sleep(400_000_000)
            first = Binding(fresh, own0.dsts, own0.srcs, own0.k, None, known_ptrs=(dst_ptrs, ptrs0), shared=t0)
        with torch.cuda.stream(other):
            t1, t2 = upload_table_pairs(dev, [(dst_ptrs, ptrs1), (dst_ptrs, ptrs2)])
            rebound = first.rebound((dst_ptrs, ptrs1), t1)
            anew = Binding(fresh, own2.dsts, own2.srcs, own2.k, None, known_ptrs=(dst_ptrs, ptrs2), shared=t2)
            assert rebound._tables[0] is anew._tables[0] is first._tables[0]
            got1 = _launched(rebound, shards, check_addresses=False)
            got2 = _launched(anew, shards, check_addresses=False)
        asleep = busy.query() is False
        torch.cuda.synchronize(dev)
        return asleep, ((got1, srcs1, "rebound"), (got2, srcs2, "made anew"))

    # The first attempt loads the kernel variants these tables' alignments need (a module load
    # settles the device: the sleep ends before the launches); the second loads nothing.
    for n in range(2):
        asleep, results = attempt()
        for got, srcs, what in results:
            for g_, exp in zip(got, _halved_sums(srcs, shards, layout)):
                assert_bits_equal(g_, exp, f"attempt {n}: binding {what} on another stream than its tile table's")
    assert asleep, "the first stream was expected to be still asleep at the second attempt's launches"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pointer_table_cached_from_a_busy_stream_is_waited_for_on_another() -> None:
    """The GPU side of the pointer-cache test: sources X1 bound and launched on one stream
    (the program's tile table goes up there); sources X2 bound on a stream that sleeps ~200 ms
    (X2's pointer table goes up behind the sleep, into a block that holds a copy of X1's table);
    X2 bound again on the first stream -- a cache hit -- and launched there at once.  Exact with
    the wait; without it the kernel reads X1's pointers: X1's sums, no error."""
    dev = torch.device("cuda", torch.cuda.current_device())
    layout = ShardLayout([(96, 40), (5, 24), (640,), (33, 7)], 2)
    g = torch.Generator().manual_seed(24)
    shards = [torch.full(s, SENTINEL, dtype=FP32, device=dev) for s in layout.shard_shapes(1, padded=True)]
    flat = layout.flat_shard_numel
    busy, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    for n in range(2):  # the first attempt loads what the second needs (a load settles the device)
        srcs1 = [int_tensor((flat,), BF16, dev, generator=g) for _ in range(3)]
        srcs2 = [int_tensor((flat,), BF16, dev, generator=g) for _ in range(3)]
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(other):
            own1 = bind_accumulate_shards(srcs1, shards, layout, 1)
            _launched(own1, shards)
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(busy):
            own1._tables[1]._base.clone()  # X1's table where X2's will lie (freed at once)
            torch.cuda._sleep(400_000_000)
            bind_accumulate_shards(srcs2, shards, layout, 1)  # X2's table up behind the sleep
        with torch.cuda.stream(other):
            own2 = bind_accumulate_shards(srcs2, shards, layout, 1)  # the cache hit
            got = _launched(own2, shards)
        asleep = busy.query() is False
        torch.cuda.synchronize(dev)
        for g_, exp in zip(got, _halved_sums(srcs2, shards, layout)):
            assert_bits_equal(g_, exp, f"attempt {n}: pointer table cached from a busy stream")
    assert asleep, "the busy stream was expected to be still asleep at the second attempt's launch"


def test_a_replay_keeps_the_tables_for_its_stream() -> None:
    """A graph that recorded a binding's launch may be replayed on another stream than the
    tables' upload (``async_op``: the group's side stream) and the binding dropped before
    that replay ran: the replay's stream is recorded on every table once (the caching
    allocator then keeps the blocks until that stream is past them), never the upload
    stream, and nothing on the host."""
    from tide_triton.kernels.segments import Binding

    class Table:
        def __init__(self):
            self.streams = []

        def record_stream(self, s):
            self.streams.append(s)

    b = object.__new__(Binding)
    b._cuda, b._upload_stream, b._streams_kept = True, "upload", set()
    b._tables = (Table(), Table(), Table())
    b._table_streams = ("upload",) * 3
    for s in ("side", "side", "upload", "other"):
        b.keep_tables_for(s)
    assert all(t.streams == ["side", "other"] for t in b._tables), [t.streams for t in b._tables]
    # the tile table went up with an earlier binding on another stream: kept for the upload stream too
    b._streams_kept, b._tables, b._table_streams = set(), (Table(), Table(), Table()), ("tiles", "upload", "upload")
    for s in ("side", "upload", "tiles"):
        b.keep_tables_for(s)
    assert [t.streams for t in b._tables] == [["side", "upload"], ["side", "tiles"], ["side", "tiles"]]
    host = object.__new__(Binding)
    host._cuda = False
    host.keep_tables_for("side")  # the host transport: nothing to keep
