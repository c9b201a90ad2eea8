"""Placement: every rank's shard straight into per-parameter storage (FSDP2's copy-out).

Replaces ``torch.split_with_sizes_copy`` of a flat rank-major all-gather buffer: each
rank's real rows of each parameter go to element ``r * S_p`` of that parameter's (padded
or unpadded) storage, in one launch for the whole group, with an optional fused cast
(fp32 -> bf16 rounds to nearest even).  Padding rows of a padded destination are not
written.
"""
from __future__ import annotations

import operator
from functools import lru_cache
from typing import Sequence, Union

import torch

from ..runtime.checks import (
    FLOAT_DTYPES,
    check_entries_uniform,
    check_shapes,
    check_sources,
    check_tensor_list,
    check_uniform,
)
from ..plan.layout import ShardLayout
from .segments import Binding, SegmentProgram, Span, check_device

Sources = Sequence[Union[torch.Tensor, Sequence[torch.Tensor]]]
"""Per rank (or per contribution): one flat 1-D buffer holding that rank's padded shards
back to back (``layout.flat_offsets``), or a sequence of per-parameter tensors."""


def check_layout(layout: object) -> ShardLayout:
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
    return layout


def _as_int(what: str, value: object) -> int:
    """``value`` as an int (numpy integers too; bools refused); ``what`` words the error."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what}, got {type(value).__name__}")
    return operator.index(value)


def check_ranks(layout: ShardLayout, ranks: object) -> tuple[int, ...]:
    """None (all ranks), one rank, or a sequence of distinct ranks of ``layout``."""
    if ranks is None:
        return tuple(range(layout.world_size))
    if isinstance(ranks, Sequence) and not isinstance(ranks, (str, bytes)):
        out = tuple(_as_int("ranks must hold ints", r) for r in ranks)
    else:
        out = (_as_int("ranks must be None, an int or a sequence of ints", ranks),)
    for r in out:
        if not 0 <= r < layout.world_size:
            raise ValueError(f"ranks must hold ints in [0, {layout.world_size}), got {r}")
    if len(set(out)) != len(out):
        raise ValueError(f"ranks must not repeat a rank, got {out}")
    return out


def check_max_ctas(max_ctas: object) -> int | None:
    if max_ctas is None:
        return None
    n = _as_int("max_ctas must be None or an int", max_ctas)
    if n < 1:
        raise ValueError(f"max_ctas must be None or an int >= 1, got {n}")
    return n


@lru_cache(maxsize=64)
def _program(layout: ShardLayout, ranks: tuple[int, ...], flat_src: bool) -> SegmentProgram:
    P = len(layout)
    S = layout.padded_shard_numels
    runs = []
    for p in range(P):
        for i, r in enumerate(ranks):
            n = layout.shard_numels(r)[p]
            if flat_src:
                runs.append(Span(p, r * S[p], i, layout.flat_offsets[p], n))
            else:
                runs.append(Span(p, r * S[p], i * P + p, 0, n))
    n_src = len(ranks) * (1 if flat_src else P)
    return SegmentProgram(tuple(runs), n_dst=P, n_src=n_src)


def bind_place_shards(
    srcs: Sources,
    params: Sequence[torch.Tensor],
    layout: ShardLayout,
    *,
    ranks: Sequence[int] | None = None,
    max_ctas: int | None = None,
) -> Binding:
    """Check the arguments of :func:`place_shards` once and return a binding whose
    ``launch()`` costs one kernel launch (it re-checks the tensors' addresses)."""
    check_layout(layout)
    rank_list = check_ranks(layout, ranks)
    max_ctas = check_max_ctas(max_ctas)
    P = len(layout)
    params_l = check_tensor_list("params", params, P)
    entries, flat = check_sources(
        "srcs", srcs, count_name="source rank", count=len(rank_list),
        flat_numel=layout.flat_shard_numel, n_params=P,
    )
    check_shapes("params", params_l, layout.shapes, layout.padded_shapes)
    if not flat:
        for j, r in enumerate(rank_list):
            check_shapes(f"srcs[{j}]", entries[j], layout.shard_shapes(r), layout.shard_shapes(r, padded=True))
    src_tensors = [t for e in entries for t in e]
    if P == 0:
        return Binding(_program(layout, rank_list, flat), (), (), 1, max_ctas)
    _, device = check_uniform("params", params_l, dtypes=FLOAT_DTYPES)
    check_device("params", device)
    check_entries_uniform("srcs", entries, flat, dtypes=FLOAT_DTYPES, device=device)
    program = _program(layout, rank_list, flat)
    return Binding(program, tuple(params_l), tuple(src_tensors), 1, max_ctas)


def place_shards(
    srcs: Sources,
    params: Sequence[torch.Tensor],
    layout: ShardLayout,
    *,
    ranks: Sequence[int] | None = None,
    max_ctas: int | None = None,
) -> None:
    """Copy every listed rank's real rows of every parameter into ``params``.

    ``srcs[j]`` holds rank ``ranks[j]``'s shards (default ranks: all, in order): a flat
    1-D buffer with its padded shards back to back, or a list of per-parameter shards
    (padded ``(c, *rest)`` or unpadded ``(rows_r, *rest)``).  ``params[p]`` is parameter
    ``p``'s storage, full ``layout.shapes[p]`` or padded ``layout.padded_shapes[p]``.
    Dtypes may differ between the two sides (one each); the cast is fused.  One launch on
    the current stream of the parameters' device; ``max_ctas`` bounds its grid.
    """
    bind_place_shards(srcs, params, layout, ranks=ranks, max_ctas=max_ctas).launch(check_addresses=False)


def place_shards_ref(
    srcs: Sources,
    params: Sequence[torch.Tensor],
    layout: ShardLayout,
    *,
    ranks: Sequence[int] | None = None,
) -> None:
    """Plain-torch reference of :func:`place_shards` (same arguments)."""
    rank_list = check_ranks(layout, ranks)
    S = layout.padded_shard_numels
    for j, r in enumerate(rank_list):
        numels = layout.shard_numels(r)
        for p, dst in enumerate(params):
            n = numels[p]
            if n == 0:
                continue
            if isinstance(srcs[j], torch.Tensor):
                off = layout.flat_offsets[p]
                piece = srcs[j][off:off + n]
            else:
                piece = srcs[j][p].reshape(-1)[:n]
            dst.view(-1)[r * S[p]:r * S[p] + n].copy_(piece)
