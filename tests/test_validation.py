"""Every argument check of the launchers: one ``pytest.raises(..., match=...)`` per branch,
the message naming the argument, what was expected and what came (STYLE.md).

Nothing here launches a kernel (every call fails validation first).  Tensors are made on
``DEV`` -- the CPU under the interpreter, the GPU otherwise -- and the "meta" device
stands in for a second device.

Layout used throughout: shapes (5, 3), (4,), (2, 3, 2) over W=2, so
  padded shapes (6, 3), (4,), (2, 3, 2); rows per rank 3, 2, 1;
  rank 1's shards (2, 3), (2,), (1, 3, 2) (padded (3, 3), (2,), (1, 3, 2));
  flat block F = 9 + 2 + 6 = 17 elements.
"""
from __future__ import annotations

import re

import pytest
import torch

try:  # pytest's default "prepend" import mode puts tests/ on sys.path
    from conftest import interpreting
except ImportError:  # pragma: no cover - importlib mode with the repo root on sys.path
    from tests.conftest import interpreting

from tide_triton import (
    ShardLayout,
    accumulate_shards,
    bind_accumulate_shards,
    bind_pack_shards,
    bind_place_shards,
    pack_shards,
    place_shards,
)

DEV = "cpu" if interpreting() else "cuda"
DEV_NAME = "cpu" if interpreting() else "cuda:0"

SHAPES = [(5, 3), (4,), (2, 3, 2)]
W = 2
F = 17
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _default_device():
    torch.set_default_device(DEV)
    yield
    torch.set_default_device(None)


@pytest.fixture
def layout() -> ShardLayout:
    lay = ShardLayout(SHAPES, W)
    assert lay.flat_shard_numel == F
    return lay


def _params(dtype=FP32):
    return [torch.zeros(s, dtype=dtype) for s in SHAPES]


def _flat(n: int = F, dtype=BF16):
    return torch.zeros(n, dtype=dtype)


def _shards(rank: int, padded: bool = False, dtype=FP32):
    return [torch.zeros(s, dtype=dtype) for s in ShardLayout(SHAPES, W).shard_shapes(rank, padded=padded)]


def _noncontig(shape, dtype=FP32):
    t = torch.zeros(tuple(reversed(shape)), dtype=dtype).t() if len(shape) == 2 else None
    if t is None:  # 1-D: every other element of a buffer twice as long
        t = torch.zeros(2 * shape[0], dtype=dtype)[::2]
    assert t.shape == tuple(shape) and not t.is_contiguous()
    return t


# Each launcher with valid arguments except the ones a test passes.
_DEFAULT = object()


def _place(layout, srcs=_DEFAULT, params=_DEFAULT, **kw):
    place_shards([_flat(), _flat()] if srcs is _DEFAULT else srcs,
                 _params() if params is _DEFAULT else params, layout, **kw)


def _pack(layout, grads=_DEFAULT, out=_DEFAULT, ranks=(0, 1), **kw):
    pack_shards(_params() if grads is _DEFAULT else grads,
                _flat(2 * F, FP32) if out is _DEFAULT else out, layout, ranks, **kw)


def _acc(layout, srcs=_DEFAULT, shards=_DEFAULT, rank=1, **kw):
    accumulate_shards([_flat(), _flat()] if srcs is _DEFAULT else srcs,
                      _shards(rank) if shards is _DEFAULT else shards, layout, rank, **kw)


LAUNCHERS = {"place": _place, "pack": _pack, "accumulate": _acc}


# ---------------------------------------------------------------------------------------
# Shared by all three launchers
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", list(LAUNCHERS))
def test_layout_must_be_a_shard_layout(kernel: str) -> None:
    with pytest.raises(TypeError, match=r"layout must be a ShardLayout, got list"):
        LAUNCHERS[kernel]([[5, 3], [4], [2, 3, 2]])


@pytest.mark.parametrize("bad", [0, -1])
@pytest.mark.parametrize("kernel", list(LAUNCHERS))
def test_max_ctas_must_be_positive(kernel: str, bad, layout) -> None:
    with pytest.raises(ValueError, match=rf"max_ctas must be None or an int >= 1, got {bad!r}"):
        LAUNCHERS[kernel](layout, max_ctas=bad)


@pytest.mark.parametrize("bad", [1.5, True, "2"])
@pytest.mark.parametrize("kernel", list(LAUNCHERS))
def test_max_ctas_must_be_an_int(kernel: str, bad, layout) -> None:
    with pytest.raises(TypeError, match=rf"max_ctas must be None or an int, got {type(bad).__name__}"):
        LAUNCHERS[kernel](layout, max_ctas=bad)


def test_valid_arguments_pass_validation(layout) -> None:
    # The baseline every test below breaks in one place: binding it raises nothing.
    bind_place_shards([_flat(), _flat()], _params(), layout)
    bind_pack_shards(_params(), _flat(2 * F, FP32), layout, [0, 1])
    bind_accumulate_shards([_flat(), _flat()], _shards(1), layout, 1)


# ---------------------------------------------------------------------------------------
# ranks (placement, packing)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [2, -1, 5])
def test_place_ranks_out_of_range(bad, layout) -> None:
    with pytest.raises(ValueError, match=rf"ranks must hold ints in \[0, 2\), got {bad}"):
        _place(layout, srcs=[_flat()], ranks=[bad])


@pytest.mark.parametrize("bad", [1.0, True, "1", None])
def test_place_ranks_must_be_ints(bad, layout) -> None:
    with pytest.raises(TypeError, match=rf"ranks must hold ints, got {type(bad).__name__}"):
        _place(layout, srcs=[_flat()], ranks=[bad])


def test_place_ranks_must_not_repeat(layout) -> None:
    with pytest.raises(ValueError, match=r"ranks must not repeat a rank, got \(1, 1\)"):
        _place(layout, ranks=[1, 1])


@pytest.mark.parametrize("bad", [2, -1])
def test_pack_rank_out_of_range(bad, layout) -> None:
    with pytest.raises(ValueError, match=rf"ranks must hold ints in \[0, 2\), got {bad}"):
        _pack(layout, ranks=bad)
    with pytest.raises(ValueError, match=rf"ranks must hold ints in \[0, 2\), got {bad}"):
        _pack(layout, ranks=[0, bad])


def test_pack_ranks_must_not_repeat(layout) -> None:
    with pytest.raises(ValueError, match=r"ranks must not repeat a rank, got \(0, 0\)"):
        _pack(layout, ranks=[0, 0])


# ---------------------------------------------------------------------------------------
# Per-parameter tensor lists: params, grads, shards
# ---------------------------------------------------------------------------------------
LIST_ARGS = {"params": "place", "grads": "pack", "shards": "accumulate"}


def _call_with_list(name: str, layout, value) -> None:
    kernel = LIST_ARGS[name]
    if kernel == "place":
        _place(layout, params=value)
    elif kernel == "pack":
        _pack(layout, grads=value)
    else:
        _acc(layout, shards=value)


def _good_list(name: str, dtype=FP32):
    return _shards(1, dtype=dtype) if name == "shards" else _params(dtype)


@pytest.mark.parametrize("name", list(LIST_ARGS))
def test_tensor_list_must_be_a_sequence(name: str, layout) -> None:
    with pytest.raises(TypeError, match=rf"{name} must be a sequence of tensors, got Tensor"):
        _call_with_list(name, layout, torch.zeros(3))
    with pytest.raises(TypeError, match=rf"{name} must be a sequence of tensors, got generator"):
        _call_with_list(name, layout, (t for t in _good_list(name)))


@pytest.mark.parametrize("name", list(LIST_ARGS))
def test_tensor_list_length_must_match_layout(name: str, layout) -> None:
    with pytest.raises(ValueError, match=rf"{name} must have 3 entries \(one per parameter\), got 2"):
        _call_with_list(name, layout, _good_list(name)[:2])
    with pytest.raises(ValueError, match=rf"{name} must have 3 entries \(one per parameter\), got 4"):
        _call_with_list(name, layout, _good_list(name) + [torch.zeros(1)])


@pytest.mark.parametrize("name", list(LIST_ARGS))
def test_tensor_list_entries_must_be_tensors(name: str, layout) -> None:
    value = _good_list(name)
    value[1] = [0.0, 0.0]
    with pytest.raises(TypeError, match=rf"{name}\[1\] must be a torch.Tensor, got list"):
        _call_with_list(name, layout, value)


def test_params_shape(layout) -> None:
    params = _params()
    params[0] = torch.zeros(5, 4)
    with pytest.raises(ValueError, match=r"params\[0\] must have shape \(5, 3\) or padded \(6, 3\), got \(5, 4\)"):
        _place(layout, params=params)
    # (4,) over W=2 needs no padding: the message offers one shape.
    params = _params()
    params[1] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"params\[1\] must have shape \(4,\), got \(5,\)"):
        _place(layout, params=params)
    params = _params()
    params[2] = torch.zeros(12)  # right numel, flattened
    with pytest.raises(ValueError, match=r"params\[2\] must have shape \(2, 3, 2\), got \(12,\)"):
        _place(layout, params=params)


def test_grads_shape(layout) -> None:
    grads = _params()
    grads[0] = torch.zeros(6, 2)
    with pytest.raises(ValueError, match=r"grads\[0\] must have shape \(5, 3\) or padded \(6, 3\), got \(6, 2\)"):
        _pack(layout, grads=grads)


def test_shards_shape(layout) -> None:
    shards = _shards(1)
    shards[0] = torch.zeros(5, 3)  # the full parameter, not rank 1's shard
    with pytest.raises(ValueError, match=r"shards\[0\] must have shape \(2, 3\) or padded \(3, 3\), got \(5, 3\)"):
        _acc(layout, shards=shards)
    shards = _shards(1)
    shards[2] = torch.zeros(2, 3, 2)
    with pytest.raises(ValueError, match=r"shards\[2\] must have shape \(1, 3, 2\), got \(2, 3, 2\)"):
        _acc(layout, shards=shards)


@pytest.mark.parametrize("name", list(LIST_ARGS))
@pytest.mark.parametrize("bad", [torch.int32, torch.float64, torch.int64])
def test_tensor_list_dtype_must_be_float(name: str, bad: torch.dtype, layout) -> None:
    value = _good_list(name, dtype=bad)
    bad_name = str(bad).replace("torch.", "")
    with pytest.raises(TypeError, match=rf"{name}\[0\] must be bfloat16 or float16 or float32, got {bad_name}"):
        _call_with_list(name, layout, value)


@pytest.mark.parametrize("name", list(LIST_ARGS))
def test_tensor_list_dtypes_must_agree(name: str, layout) -> None:
    value = _good_list(name)
    value[2] = value[2].to(BF16)
    with pytest.raises(TypeError, match=rf"{name}\[2\] must be float32 like {name}\[0\], got bfloat16"):
        _call_with_list(name, layout, value)


@pytest.mark.parametrize("name", list(LIST_ARGS))
def test_tensor_list_must_be_contiguous(name: str, layout) -> None:
    value = _good_list(name)
    value[0] = _noncontig(tuple(value[0].shape))
    with pytest.raises(ValueError, match=rf"{name}\[0\] must be contiguous, got strides \(1, \d+\)"):
        _call_with_list(name, layout, value)


@pytest.mark.parametrize("name", list(LIST_ARGS))
def test_tensor_list_one_device(name: str, layout) -> None:
    value = _good_list(name)
    value[1] = value[1].to("meta")
    with pytest.raises(ValueError, match=rf"{name}\[1\] must be on {DEV_NAME}, got meta"):
        _call_with_list(name, layout, value)


# ---------------------------------------------------------------------------------------
# srcs (placement: one entry per source rank; accumulation: one per contribution)
# ---------------------------------------------------------------------------------------
SRC_KERNELS = {"place": ("source rank", _place), "accumulate": ("contribution", _acc)}


def _entry(kernel: str, j: int, dtype=BF16):
    """A valid per-parameter entry srcs[j]: rank j's shards (place, ranks 0, 1) or the full
    gradients of contribution j (accumulate)."""
    if kernel == "place":
        return _shards(j, dtype=dtype)
    return _params(dtype)


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
@pytest.mark.parametrize("bad,got", [(torch.zeros(2, F), "Tensor"), (None, "NoneType"), (7, "int")])
def test_srcs_must_be_a_sequence(kernel: str, bad, got: str, layout) -> None:
    what, call = SRC_KERNELS[kernel]
    with pytest.raises(TypeError, match=rf"srcs must be a sequence \(one entry per {what}\), got {got}"):
        call(layout, srcs=bad)


def test_place_srcs_one_per_rank(layout) -> None:
    with pytest.raises(ValueError, match=r"srcs must have 2 entries \(one per source rank\), got 1"):
        _place(layout, srcs=[_flat()])
    with pytest.raises(ValueError, match=r"srcs must have 1 entry \(one per source rank\), got 2"):
        _place(layout, srcs=[_flat(), _flat()], ranks=[1])


def test_accumulate_srcs_not_empty(layout) -> None:
    with pytest.raises(ValueError, match=r"srcs must have at least one entry \(one per contribution\), got none"):
        _acc(layout, srcs=[])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_srcs_entries_one_kind(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(TypeError, match=r"srcs\[1\] must be a flat 1-D tensor like srcs\[0\], got list"):
        call(layout, srcs=[_flat(), _entry(kernel, 1)])
    with pytest.raises(TypeError, match=r"srcs\[1\] must be a sequence of per-parameter tensors like srcs\[0\], "
                                        r"got Tensor"):
        call(layout, srcs=[_entry(kernel, 0), _flat()])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_flat_srcs_must_be_1d(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(ValueError, match=r"srcs\[0\] must be a 1-D flat buffer, got shape \(17, 1\)"):
        call(layout, srcs=[torch.zeros(F, 1, dtype=BF16), _flat()])
    with pytest.raises(ValueError, match=r"srcs\[1\] must be a 1-D flat buffer, got shape \(\)"):
        call(layout, srcs=[_flat(), torch.zeros((), dtype=BF16)])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_flat_srcs_long_enough(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(ValueError, match=r"srcs\[1\] must hold at least 17 elements, got 16"):
        call(layout, srcs=[_flat(), _flat(F - 1)])
    # Longer is fine: slots may be padded further.
    if kernel == "place":
        bind_place_shards([_flat(F + 5), _flat()], _params(), layout)
    else:
        bind_accumulate_shards([_flat(F + 5), _flat()], _shards(1), layout, 1)


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_per_parameter_srcs_length(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(ValueError, match=r"srcs\[0\] must have 3 entries \(one per parameter\), got 2"):
        call(layout, srcs=[_entry(kernel, 0)[:2], _entry(kernel, 1)])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_per_parameter_srcs_entry_must_be_a_sequence(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(TypeError, match=r"srcs\[1\] must be a sequence of tensors, got int"):
        call(layout, srcs=[_entry(kernel, 0), 3])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_per_parameter_srcs_items_must_be_tensors(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    entry = _entry(kernel, 0)
    entry[2] = 1.5
    with pytest.raises(TypeError, match=r"srcs\[0\]\[2\] must be a torch.Tensor, got float"):
        call(layout, srcs=[entry, _entry(kernel, 1)])


def test_place_per_parameter_srcs_shape(layout) -> None:
    # srcs[j] is rank ranks[j]'s shards: rank 1 holds 2 real rows of (5, 3), padded to 3.
    entry = _shards(1, dtype=BF16)
    entry[0] = torch.zeros(3, 2, dtype=BF16)
    with pytest.raises(ValueError, match=r"srcs\[1\]\[0\] must have shape \(2, 3\) or padded \(3, 3\), got \(3, 2\)"):
        _place(layout, srcs=[_shards(0, dtype=BF16), entry])
    # Shapes are checked against the rank each entry stands for: with ranks=[1, 0],
    # srcs[0] must be rank 1's shards.
    with pytest.raises(ValueError, match=r"srcs\[0\]\[0\] must have shape \(2, 3\) or padded \(3, 3\), got \(5, 3\)"):
        _place(layout, srcs=[_params(BF16), _shards(0, dtype=BF16)], ranks=[1, 0])


def test_accumulate_per_parameter_srcs_shape(layout) -> None:
    entry = _params(BF16)
    entry[0] = torch.zeros(3, 3, dtype=BF16)  # rank 1's padded shard, not the full gradient
    with pytest.raises(ValueError, match=r"srcs\[1\]\[0\] must have shape \(5, 3\) or padded \(6, 3\), got \(3, 3\)"):
        _acc(layout, srcs=[_params(BF16), entry])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_flat_srcs_dtype(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(TypeError, match=r"srcs\[0\] must be bfloat16 or float16 or float32, got int64"):
        call(layout, srcs=[_flat(dtype=torch.int64), _flat(dtype=torch.int64)])
    with pytest.raises(TypeError, match=r"srcs\[1\] must be bfloat16 like srcs\[0\], got float32"):
        call(layout, srcs=[_flat(), _flat(dtype=FP32)])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_per_parameter_srcs_dtype(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(TypeError, match=r"srcs\[0\]\[0\] must be bfloat16 or float16 or float32, got float64"):
        call(layout, srcs=[_entry(kernel, 0, torch.float64), _entry(kernel, 1, torch.float64)])
    entry = _entry(kernel, 0)
    entry[1] = entry[1].to(FP16)
    with pytest.raises(TypeError, match=r"srcs\[0\]\[1\] must be bfloat16 like srcs\[0\]\[0\], got float16"):
        call(layout, srcs=[entry, _entry(kernel, 1)])
    # Across entries: the dtype of srcs[0] holds for all.
    with pytest.raises(TypeError, match=r"srcs\[1\]\[0\] must be bfloat16, got float32"):
        call(layout, srcs=[_entry(kernel, 0), _entry(kernel, 1, FP32)])
    entry = _entry(kernel, 1)
    entry[2] = entry[2].to(FP32)
    with pytest.raises(TypeError, match=r"srcs\[1\]\[2\] must be bfloat16 like srcs\[1\]\[0\], got float32"):
        call(layout, srcs=[_entry(kernel, 0), entry])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_srcs_must_be_contiguous(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(ValueError, match=r"srcs\[1\] must be contiguous, got strides \(2,\)"):
        call(layout, srcs=[_flat(), _noncontig((F,), BF16)])
    entry = _entry(kernel, 1)
    entry[0] = _noncontig(tuple(entry[0].shape), BF16)
    with pytest.raises(ValueError, match=r"srcs\[1\]\[0\] must be contiguous, got strides \(1, \d+\)"):
        call(layout, srcs=[_entry(kernel, 0), entry])


@pytest.mark.parametrize("kernel", list(SRC_KERNELS))
def test_srcs_on_the_destinations_device(kernel: str, layout) -> None:
    _, call = SRC_KERNELS[kernel]
    with pytest.raises(ValueError, match=rf"srcs\[1\] must be on {DEV_NAME}, got meta"):
        call(layout, srcs=[_flat(), _flat().to("meta")])
    entry = _entry(kernel, 1)
    entry[2] = entry[2].to("meta")
    with pytest.raises(ValueError, match=rf"srcs\[1\]\[2\] must be on {DEV_NAME}, got meta"):
        call(layout, srcs=[_entry(kernel, 0), entry])


def test_first_param_on_another_device(layout) -> None:
    # The first tensor sets the device, so the message names the next one: it says which
    # two disagree, not which one is "wrong".
    params = _params()
    params[0] = params[0].to("meta")
    with pytest.raises(ValueError, match=rf"params\[1\] must be on meta, got {DEV_NAME}"):
        _place(layout, params=params)
    # All params on meta: a device the kernels cannot run on, named as such.
    with pytest.raises(ValueError, match=r"params must be on a CUDA device or the CPU, got meta"):
        _place(layout, params=[p.to("meta") for p in _params()])


def test_all_meta_tensors_are_refused_by_validation(layout) -> None:
    if not interpreting():
        pytest.skip("compiled Triton would be handed null pointers: not tried on a GPU")
    with pytest.raises((TypeError, ValueError), match=r"must be on"):
        place_shards([_flat().to("meta")] * 2, [p.to("meta") for p in _params()], layout)


# ---------------------------------------------------------------------------------------
# pack's out
# ---------------------------------------------------------------------------------------
def test_pack_out_must_be_a_tensor(layout) -> None:
    with pytest.raises(TypeError, match=r"out must be a torch.Tensor, got list"):
        _pack(layout, out=[0.0] * (2 * F))


def test_pack_out_must_be_1d(layout) -> None:
    with pytest.raises(ValueError, match=r"out must be a 1-D buffer, got shape \(2, 17\)"):
        _pack(layout, out=torch.zeros(2, F))


def test_pack_out_long_enough(layout) -> None:
    with pytest.raises(ValueError, match=r"out must hold at least 34 elements, got 33"):
        _pack(layout, out=torch.zeros(2 * F - 1))
    with pytest.raises(ValueError, match=r"out must hold at least 17 elements, got 16"):
        _pack(layout, out=torch.zeros(F - 1), ranks=1)


def test_pack_out_dtype(layout) -> None:
    with pytest.raises(TypeError, match=r"out must be bfloat16, float16 or float32, got int32"):
        _pack(layout, out=torch.zeros(2 * F, dtype=torch.int32))


def test_pack_out_must_be_contiguous(layout) -> None:
    with pytest.raises(ValueError, match=r"out(\[0\])? must be contiguous, got strides \(2,\)"):
        _pack(layout, out=_noncontig((2 * F,)))


def test_pack_out_on_a_kernel_device(layout) -> None:
    with pytest.raises(ValueError, match=r"out must be on a CUDA device or the CPU, got meta"):
        _pack(layout, out=torch.zeros(2 * F, device="meta"))


def test_pack_grads_on_outs_device(layout) -> None:
    grads = _params()
    grads[2] = grads[2].to("meta")
    with pytest.raises(ValueError, match=rf"grads\[2\] must be on {DEV_NAME}, got meta"):
        _pack(layout, grads=grads)


# ---------------------------------------------------------------------------------------
# accumulate's rank and scale
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,got", [(1.0, "float"), (None, "NoneType"), (True, "bool"), ("1", "str")])
def test_accumulate_rank_must_be_an_int(bad, got: str, layout) -> None:
    with pytest.raises(TypeError, match=rf"rank must be an int, got {got}"):
        accumulate_shards([_flat()], _shards(1), layout, bad)


@pytest.mark.parametrize("bad", [2, -1])
def test_accumulate_rank_in_range(bad: int, layout) -> None:
    with pytest.raises(ValueError, match=rf"rank must be in \[0, 2\), got {bad}"):
        accumulate_shards([_flat()], _shards(1), layout, bad)


@pytest.mark.parametrize("bad,got", [("0.5", "str"), (True, "bool"), (1j, "complex"), (torch.tensor(0.5), "Tensor")])
def test_accumulate_scale_type(bad, got: str, layout) -> None:
    with pytest.raises(TypeError, match=rf"scale must be a float or None, got {got}"):
        _acc(layout, scale=bad)


# ---------------------------------------------------------------------------------------
# bind_* validate exactly like the launchers (the launchers go through them)
# ---------------------------------------------------------------------------------------
def test_bind_functions_validate(layout) -> None:
    with pytest.raises(TypeError, match=r"layout must be a ShardLayout"):
        bind_place_shards([_flat()], _params(), "layout")
    with pytest.raises(ValueError, match=r"max_ctas must be None or an int >= 1, got 0"):
        bind_pack_shards(_params(), _flat(2 * F, FP32), layout, [0, 1], max_ctas=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 3"):
        bind_accumulate_shards([_flat()], _shards(1), layout, 3)


def test_binding_tensor_counts() -> None:
    # Internal: a Binding checks it got one destination per slot and K x n_src sources.
    from tide_triton.kernels.segments import Binding, SegmentProgram, Span

    program = SegmentProgram((Span(0, 0, 0, 0, 4),), n_dst=1, n_src=1, tile_numel=256)
    with pytest.raises(ValueError, match=r"binding needs 1 destinations and 2 x 1 sources, got 1 and 1"):
        Binding(program, (torch.zeros(4),), (torch.zeros(4),), 2, None)


def test_tensors_on_another_gpu_than_the_groups_are_refused_naming_both() -> None:
    """One process per rank: a group's CUDA transport (heap, streams, context) is the GPU of
    its first CUDA call; a later call with tensors on another GPU reused it with no error
    naming the argument.  Stand-in transport: no GPU needed."""
    import types

    import tide_triton as tt

    (g,) = tt.local_groups(1)
    try:
        g._transports["cuda"] = types.SimpleNamespace(device=torch.device("cuda", 0))
        assert g.transport(torch.device("cuda", 0)) is g._transports["cuda"]
        with pytest.raises(ValueError, match=r"tensors on cuda:1, but rank 0 of this group drives cuda:0"):
            g.transport(torch.device("cuda", 1))
    finally:
        g._transports.pop("cuda", None)
        g.close()


@pytest.mark.parametrize("seed", range(10))
def test_check_apart_finds_exactly_the_overlaps_between_inputs_and_outputs(seed: int) -> None:
    """``_checks.check_apart`` (a reduce-scatter's shards against its gradients): one sorted
    sweep, raising iff some output shares a byte with some input -- overlaps within one list do
    not count -- checked against every pair, views of one buffer at random offsets."""
    import random

    from tide_triton.runtime.checks import check_apart

    rng = random.Random(seed)
    buf = torch.zeros(4096, dtype=torch.uint8)
    for _ in range(50):
        def views(n):
            out = []
            for _ in range(n):
                a = rng.randrange(0, 4000)
                out.append(buf[a:a + rng.randrange(0, 96)])
            return out
        ins, outs = views(rng.randrange(0, 6)), views(rng.randrange(0, 6))

        def span(t):
            return t.data_ptr(), t.data_ptr() + t.numel()
        overlap = any(t.numel() and u.numel() and span(t)[0] < span(u)[1] and span(u)[0] < span(t)[1]
                      for t in ins for u in outs)
        try:
            check_apart("grads", ins, "shards", outs, "why")
            raised = False
        except ValueError as e:
            raised = True
            m = re.match(r"shards\[(\d+)\] shares memory with grads\[(\d+)\]: why; pass shards", str(e))
            assert m, e
            u, t = outs[int(m.group(1))], ins[int(m.group(2))]  # the pair named does overlap
            assert span(t)[0] < span(u)[1] and span(u)[0] < span(t)[1], (e, span(t), span(u))
        assert raised == overlap, (seed, [span(t) for t in ins], [span(u) for u in outs])


@pytest.mark.parametrize("seed", range(5))
def test_check_disjoint_and_check_storage_against_every_tensor(seed: int) -> None:
    """``check_disjoint`` raises iff two non-empty tensors of one list share a byte, naming a
    pair that does; ``check_storage`` iff a non-empty tensor reaches past its storage (freed
    with ``resize_(0)``, or shrunk), naming the first such tensor."""
    import random

    from tide_triton.runtime.checks import check_disjoint, check_storage

    rng = random.Random(seed)
    for _ in range(50):
        buf = torch.zeros(4096, dtype=torch.uint8)
        ts = []
        for _ in range(rng.randrange(0, 8)):
            a = rng.randrange(0, 4000)
            ts.append(buf[a:a + rng.randrange(0, 96)])

        def span(t):
            return t.data_ptr(), t.data_ptr() + t.numel()
        overlap = any(t.numel() and u.numel() and span(t)[0] < span(u)[1] and span(u)[0] < span(t)[1]
                      for k, t in enumerate(ts) for u in ts[k + 1:])
        try:
            check_disjoint("params", ts)
            raised = False
        except ValueError as e:
            raised = True
            m = re.match(r"params\[(\d+)\] and params\[(\d+)\] overlap in memory", str(e))
            assert m and int(m.group(1)) < int(m.group(2)), e
            t, u = ts[int(m.group(1))], ts[int(m.group(2))]
            assert span(t)[0] < span(u)[1] and span(u)[0] < span(t)[1], (e, span(t), span(u))
        assert raised == overlap, (seed, [span(t) for t in ts])

        check_storage("params", ts)  # views inside their storage
        size = rng.randrange(0, 4096)
        buf.untyped_storage().resize_(size)  # freed (0) or shrunk: the views keep their shapes
        past = [k for k, t in enumerate(ts) if t.numel() and (size == 0 or t.storage_offset() + t.numel() > size)]
        if past:
            with pytest.raises(ValueError, match=rf"^params\[{past[0]}\] views \d+ bytes of a storage that holds "
                                                 rf"{size}: its storage was freed or resized"):
                check_storage("params", ts)
        else:
            check_storage("params", ts)


def test_a_stream_of_another_device_is_refused_naming_both() -> None:
    """``stream=`` on another device than the tensors: refused before anything moves (the
    CUDA transport's fences record and wait in the tensors' device's context, where another
    device's stream fails mid-call and breaks the group).  ``Group.check_own_stream`` is the
    check both the eager call and a prepared run make; a stand-in stream object here (no GPU)."""
    import types

    import tide_triton as tt

    (g,) = tt.local_groups(1)
    try:
        other = types.SimpleNamespace(device=torch.device("cuda", 1), cuda_stream=0x10)
        with pytest.raises(ValueError, match=r"^stream: a stream of cuda:1, but the tensors are on cuda:0; pass a "
                                             r"stream of cuda:0, or None"):
            g.check_own_stream(other, torch.device("cuda", 0))
        g.check_own_stream(types.SimpleNamespace(device=torch.device("cuda", 0), cuda_stream=0x10),
                           torch.device("cuda", 0))
        g.check_own_stream(None, torch.device("cuda", 0))
    finally:
        g.close()


def test_renamed_group_option_raises_naming_its_new_name():
    """``max_inflight_chunks`` is ``host_ahead_chunks`` now: the old name, passed to
    GroupOptions, init or local_groups, raises naming the new one (it read like
    ``inflight_chunks``, the inter-node knob); the new one reaches the group's pacer."""
    import tide_triton as tt

    want = r"'max_inflight_chunks' is now called 'host_ahead_chunks': pass host_ahead_chunks=3"
    with pytest.raises(TypeError, match=want):
        tt.GroupOptions(max_inflight_chunks=3)
    with pytest.raises(TypeError, match=want):
        tt.init(max_inflight_chunks=3)
    with pytest.raises(TypeError, match=want):
        tt.local_groups(2, max_inflight_chunks=3)
    with pytest.raises(ValueError, match="host_ahead_chunks must be an int >= 1, got 0"):
        tt.GroupOptions(host_ahead_chunks=0)
    (g,) = tt.local_groups(1, host_ahead_chunks=3)
    try:
        assert g.options.host_ahead_chunks == 3
        assert g.pacer(torch.device("cpu")).max_depth == 3
    finally:
        g.close()
