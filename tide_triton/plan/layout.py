"""Which bytes go where: FSDP2's dim-0 padded sharding for a list of parameter shapes.

FSDP2 (``fully_shard`` with the default ``Shard(0)`` placement) gives every rank
``c = ceil(dim0 / W)`` rows of every parameter.  Rank ``r`` holds rows
``[r*c, r*c + rows_r)`` with ``rows_r = clamp(dim0 - r*c, 0, c)``: trailing ranks may
hold fewer rows, or none.  Each rank's shard is padded to ``c`` rows, so the padded shard
numel ``S_p = c * prod(shape[1:])`` is the same on every rank, and rank ``r``'s segment of
parameter ``p`` starts at element ``r * S_p`` of ``p``'s padded unsharded storage.

:class:`DimShards` gives FSDP2's ``Shard(dim)`` placements of any dim as such a layout of
contiguous slices.

This module imports nothing from CUDA: schedules and simulators use it anywhere.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Any, Callable, Iterable, Sequence

def _rows_per_rank(sizes: Iterable[int], world_size: int) -> tuple[int, ...]:
    """FSDP2's rule for the sharded dim of each size: ``c = ceil(size / W)`` entries per rank, padded."""
    return tuple(-(-d // world_size) for d in sizes)


def _shard_rows(sizes: Iterable[int], rows_per_rank: Iterable[int], rank: int) -> tuple[int, ...]:
    """Real entries rank ``rank`` holds of each sharded dim: ``clamp(size - rank * c, 0, c)``."""
    return tuple(max(0, min(d - rank * c, c)) for d, c in zip(sizes, rows_per_rank))


def _starts(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each of ``sizes`` starts when they are laid back to back (exclusive prefix sums)."""
    return tuple(accumulate(sizes[:-1], initial=0)) if sizes else ()


def _check_rank(rank: int, world_size: int) -> int:
    if isinstance(rank, bool) or not hasattr(rank, "__index__"):
        raise TypeError(f"rank must be an int, got {type(rank).__name__}")
    rank = rank.__index__()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank


def _as_shape(shape: object, index: int) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        raise TypeError(f"shapes[{index}] must be a sequence of ints, got {type(shape).__name__}")
    dims = tuple(shape)
    if len(dims) == 0:
        raise ValueError(f"shapes[{index}] must have at least one dimension, got a 0-d shape ()")
    for d in dims:
        if isinstance(d, bool):
            raise TypeError(f"shapes[{index}] must hold ints, got {dims!r}")
        if not isinstance(d, int):
            # torch.Size holds ints; numpy integers are accepted through __index__.
            try:
                d = d.__index__()  # type: ignore[union-attr]
            except AttributeError:
                raise TypeError(f"shapes[{index}] must hold ints, got {dims!r}") from None
        if d < 0:
            raise ValueError(f"shapes[{index}] must have non-negative dims, got {dims!r}")
    return tuple(int(d) for d in dims)


@dataclass(frozen=True)
class ShardLayout:
    """FSDP2's dim-0 sharding of ``shapes`` over ``world_size`` ranks.

    Immutable and hashable: build it once per parameter group and use it as a cache key
    for everything derived from it (segment tables, plans).
    """

    shapes: tuple[tuple[int, ...], ...]
    """Unsharded parameter shapes, each with at least one dimension."""
    world_size: int
    """Number of ranks sharing every parameter (the shard group size), >= 1."""
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __init__(self, shapes: Sequence[Sequence[int]], world_size: int) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Iterable):
            raise TypeError(f"shapes must be a sequence of shapes, got {type(shapes).__name__}")
        object.__setattr__(self, "shapes", tuple(_as_shape(s, i) for i, s in enumerate(shapes)))
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "_derived", {})

    # ---- per-parameter sizes -------------------------------------------------------
    def __len__(self) -> int:
        return len(self.shapes)

    @cached_property
    def row_numels(self) -> tuple[int, ...]:
        """Elements per dim-0 row: ``prod(shape[1:])`` (1 for 1-D parameters)."""
        return tuple(math.prod(s[1:]) for s in self.shapes)

    @cached_property
    def numels(self) -> tuple[int, ...]:
        """Unsharded (unpadded) numel of each parameter."""
        return tuple(math.prod(s) for s in self.shapes)

    @cached_property
    def rows_per_rank(self) -> tuple[int, ...]:
        """``ceil(dim0 / world_size)``: the padded number of rows every rank holds."""
        return _rows_per_rank((s[0] for s in self.shapes), self.world_size)

    @cached_property
    def padded_shard_numels(self) -> tuple[int, ...]:
        """``rows_per_rank * prod(shape[1:])``: numel of each rank's padded shard."""
        return tuple(c * n for c, n in zip(self.rows_per_rank, self.row_numels))

    @cached_property
    def padded_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of the padded unsharded storage: ``(W * rows_per_rank, *shape[1:])``."""
        w = self.world_size
        return tuple((w * c, *s[1:]) for c, s in zip(self.rows_per_rank, self.shapes))

    @cached_property
    def padded_numels(self) -> tuple[int, ...]:
        """Numel of each parameter's padded unsharded storage: ``W * S_p``."""
        return tuple(self.world_size * s for s in self.padded_shard_numels)

    @cached_property
    def flat_offsets(self) -> tuple[int, ...]:
        """Start of each padded shard in one rank's flat block (padded shards back to back,
        in parameter order: FSDP2's all-gather input and its reduce-scatter output)."""
        return _starts(self.padded_shard_numels)

    @cached_property
    def flat_shard_numel(self) -> int:
        """Numel of one rank's flat block: ``sum(padded_shard_numels)``."""
        return sum(self.padded_shard_numels)

    # ---- per-rank views ------------------------------------------------------------
    def _check_rank(self, rank: int) -> int:
        return _check_rank(rank, self.world_size)

    def derived(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``key`` for this layout and kept as long as the layout:
        what other modules derive from the layout alone (e.g. the collectives' copy
        templates, ``tide_triton.executors.prepare``).  Keys are tuples led by the deriving
        module's name for the value.  Two threads asking at once may both make it (the same
        value); the layout's own derived sizes work the same way."""
        hit = self._derived.get(key)
        if hit is None:
            hit = self._derived[key] = make()
        return hit

    def shard_rows(self, rank: int) -> tuple[int, ...]:
        """Real rows rank ``rank`` holds of each parameter:
        ``clamp(dim0 - rank * rows_per_rank, 0, rows_per_rank)``."""
        key = ("rows", self._check_rank(rank))
        hit = self._derived.get(key)
        if hit is None:
            hit = _shard_rows((s[0] for s in self.shapes), self.rows_per_rank, rank)
            self._derived[key] = hit
        return hit

    def shard_numels(self, rank: int) -> tuple[int, ...]:
        """Real (unpadded) numel of rank ``rank``'s shard of each parameter."""
        key = ("numels", self._check_rank(rank))
        hit = self._derived.get(key)
        if hit is None:
            hit = tuple(r * n for r, n in zip(self.shard_rows(rank), self.row_numels))
            self._derived[key] = hit
        return hit

    def shard_offsets(self, rank: int) -> tuple[int, ...]:
        """Element offset of rank ``rank``'s segment in each padded unsharded storage:
        ``rank * padded_shard_numels``."""
        self._check_rank(rank)
        return tuple(rank * s for s in self.padded_shard_numels)

    def shard_rule(self, i: int, rank: int) -> str:
        """Why rank ``rank``'s shard of parameter ``i`` has the rows it has (for error messages)."""
        d0, w = self.shapes[i][0], self.world_size
        c, n = self.rows_per_rank[i], self.shard_rows(rank)[i]
        return (f"parameter {i} has dim 0 = {d0}; FSDP2 gives each of the {w} ranks ceil({d0} / {w}) = {c} rows, "
                f"and rank {rank} holds rows [{rank * c}, {rank * c + c}) of which {n} are real "
                f"(unpadded shard: {n} rows; padded: {c}); shapes come from ShardLayout(...).shard_shapes({rank})")

    def shard_shapes(self, rank: int, *, padded: bool = False) -> tuple[tuple[int, ...], ...]:
        """Shape of rank ``rank``'s shard of each parameter, ``(rows, *shape[1:])``; with
        ``padded=True`` every shard has ``rows_per_rank`` rows."""
        key = ("shapes", self._check_rank(rank), bool(padded))
        hit = self._derived.get(key)
        if hit is None:
            rows = self.rows_per_rank if padded else self.shard_rows(rank)
            hit = tuple((r, *s[1:]) for r, s in zip(rows, self.shapes))
            self._derived[key] = hit
        return hit

    def select(self, indices: Iterable[int]) -> "ShardLayout":
        """The layout of a subset of the parameters (in the given order), same world size."""
        idx = list(indices)
        n = len(self.shapes)
        for i in idx:
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"indices must hold ints, got {type(i).__name__}")
            if not -n <= i < n:
                raise ValueError(f"indices must be in [-{n}, {n}), got {i}")
        return ShardLayout([self.shapes[i] for i in idx], self.world_size)

    def __repr__(self) -> str:
        return f"ShardLayout({len(self.shapes)} params, world_size={self.world_size})"


def _as_dims(shard_dims: object, shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """``shard_dims`` (None: dim 0 everywhere; one int for every parameter; or one per
    parameter, negative counting from the end as FSDP2's ``Shard(-1)``) as non-negative dims."""
    n = len(shapes)
    if shard_dims is None:
        return (0,) * n
    if isinstance(shard_dims, bool):
        raise TypeError(f"shard_dims must be None, an int or a sequence of ints, got {shard_dims!r}")
    one = hasattr(shard_dims, "__index__")
    if one:
        given: list[object] = [shard_dims] * n
    elif isinstance(shard_dims, (str, bytes)) or not isinstance(shard_dims, Iterable):
        raise TypeError(f"shard_dims must be None, an int or a sequence of ints, got {type(shard_dims).__name__}")
    else:
        given = list(shard_dims)
        if len(given) != n:
            raise ValueError(f"shard_dims must have one entry per parameter ({n}), got {len(given)}")
    out = []
    for i, (k, s) in enumerate(zip(given, shapes)):
        if isinstance(k, bool) or not hasattr(k, "__index__"):
            raise TypeError(f"shard_dims[{i}] must be an int, got {type(k).__name__}")
        k = k.__index__()  # type: ignore[union-attr]
        kk = k + len(s) if k < 0 else k
        if not 0 <= kk < len(s):
            what = f"shard_dims = {k} (every parameter's dim)" if one else f"shard_dims[{i}] = {k}"
            raise ValueError(f"{what} is not a dim of parameter {i}'s shape {s} (valid: {-len(s)}..{len(s) - 1})")
        out.append(kk)
    return tuple(out)


@dataclass(frozen=True)
class DimShards:
    """FSDP2's ``Shard(dim)`` placements of ``shapes`` over ``world_size`` ranks, as the dim-0
    layout the collectives move.

    Parameter ``i`` of shape ``(*outer, d, *inner)`` sharded on dim ``k = len(outer)`` gives
    every rank ``c = ceil(d / W)`` entries of dim ``k``: rank ``r`` holds ``[r*c, r*c + n_r)``,
    ``n_r = clamp(d - r*c, 0, c)``, in a shard of shape ``(*outer, n_r, *inner)`` (padded:
    ``c``).  Slice ``o`` of the flattened outer dims is contiguous in the full tensor
    (``(d, *inner)``) and in every shard (``(n_r, *inner)``), and rank ``r``'s entries of it
    are that slice's rows ``[r*c, r*c + n_r)``: FSDP2's dim-0 rule.  So the parameter is, to
    the collectives, ``prod(outer)`` parameters of shape ``(d, *inner)`` sharded on dim 0
    (:attr:`layout`), and every rank's piece lands in place -- runs of ``c * prod(inner)``
    elements at a pitch of ``d * prod(inner)`` in the full tensor, back to back in the shard:
    no transposing copy on either side.  A parameter with no outer elements (an outer dim of
    size 0) is one empty part ``(0, *inner)``; ``k = 0`` is the parameter itself.
    """

    shapes: tuple[tuple[int, ...], ...]
    """Unsharded parameter shapes."""
    dims: tuple[int, ...]
    """Sharded dim of each parameter, non-negative."""
    world_size: int

    def __init__(self, shapes: Sequence[Sequence[int]], shard_dims: object, world_size: int) -> None:
        base = ShardLayout(shapes, world_size)  # checks shapes and world_size
        object.__setattr__(self, "shapes", base.shapes)
        object.__setattr__(self, "dims", _as_dims(shard_dims, base.shapes))
        object.__setattr__(self, "world_size", world_size)

    @cached_property
    def trivial(self) -> bool:
        """Every parameter sharded on dim 0 (the layout is :class:`ShardLayout` of the shapes)."""
        return not any(self.dims)

    @cached_property
    def outer(self) -> tuple[int, ...]:
        """``prod(shape[:dim])``: slices of each parameter (1 for dim 0)."""
        return tuple(math.prod(s[:k]) for s, k in zip(self.shapes, self.dims))

    @cached_property
    def parts(self) -> tuple[int, ...]:
        """Dim-0 parameters each parameter becomes: its slices, at least one."""
        return tuple(max(o, 1) for o in self.outer)

    @cached_property
    def part_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Shape of each parameter's parts, ``(d, *inner)`` (``(0, *inner)`` when empty)."""
        return tuple((s[k] if o else 0, *s[k + 1:]) for s, k, o in zip(self.shapes, self.dims, self.outer))

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Index of each parameter's first part in :attr:`layout`."""
        return _starts(self.parts)

    @cached_property
    def layout(self) -> ShardLayout:
        """The dim-0 layout of the parts, parameter by parameter, slice by slice."""
        return ShardLayout([sh for sh, n in zip(self.part_shapes, self.parts) for _ in range(n)], self.world_size)

    @cached_property
    def rows_per_rank(self) -> tuple[int, ...]:
        """``ceil(shape[dim] / W)``: entries of the sharded dim every rank holds, padded."""
        return _rows_per_rank((s[k] for s, k in zip(self.shapes, self.dims)), self.world_size)

    def shard_rows(self, rank: int) -> tuple[int, ...]:
        """Real entries of the sharded dim rank ``rank`` holds of each parameter."""
        rank = _check_rank(rank, self.world_size)
        return _shard_rows((s[k] for s, k in zip(self.shapes, self.dims)), self.rows_per_rank, rank)

    def shard_shapes(self, rank: int, *, padded: bool = False) -> tuple[tuple[int, ...], ...]:
        """Shape of rank ``rank``'s shard of each parameter: the sharded dim holds its real
        entries (``padded``: ``rows_per_rank``)."""
        rows = self.rows_per_rank if padded else self.shard_rows(rank)
        return tuple((*s[:k], n, *s[k + 1:]) for s, k, n in zip(self.shapes, self.dims, rows))

    def shard_rule(self, i: int, rank: int) -> str:
        """Why rank ``rank``'s shard of parameter ``i`` has the shape it has (for error messages)."""
        s, k, w = self.shapes[i], self.dims[i], self.world_size
        c, n = self.rows_per_rank[i], self.shard_rows(rank)[i]
        return (f"parameter {i} of shape {s} is sharded on dim {k} = {s[k]}; each of the {w} ranks holds "
                f"ceil({s[k]} / {w}) = {c} entries of it, and rank {rank} holds [{rank * c}, {rank * c + c}) of which "
                f"{n} are real (unpadded shard {self.shard_shapes(rank)[i]}; padded "
                f"{self.shard_shapes(rank, padded=True)[i]})")

    def __repr__(self) -> str:
        return f"DimShards({len(self.shapes)} params, dims={self.dims}, world_size={self.world_size})"
