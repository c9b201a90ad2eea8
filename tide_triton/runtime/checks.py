"""Argument checks shared by the kernels' launchers and the collectives.

Every failure names the argument, what was expected and what came.  Nothing here touches
device memory or synchronises a device.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from itertools import repeat
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


def is_int(x: object) -> bool:
    """``x`` is an ``int`` and not a ``bool`` (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape_str(shape: Iterable[int]) -> str:
    s = tuple(shape)
    return "(" + ", ".join(map(str, s)) + ("," if len(s) == 1 else "") + ")"


def check_tensor_list(name: str, value: object, length: int | None = None) -> list[torch.Tensor]:
    """``value`` must be a sequence of tensors (of ``length`` items if given)."""
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of tensors, got {type(value).__name__}")
    items = list(value)
    if all(map(isinstance, items, repeat(torch.Tensor))) and (length is None or len(items) == length):
        return items  # fast path
    if length is not None and len(items) != length:
        raise ValueError(
            f"{name} must have {length} {'entry' if length == 1 else 'entries'} (one per parameter), got {len(items)}"
        )
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return items


def check_uniform(
    name: str,
    tensors: Sequence[torch.Tensor],
    *,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
) -> tuple[torch.dtype, torch.device]:
    """Same dtype (one of ``dtypes``), same device, contiguous; returns (dtype, device)."""
    first = tensors[0]
    dtype = first.dtype
    dev = first.device if device is None else device
    # Fast path (hundreds of tensors per call): C-level maps, details only on failure.
    if (
        dtype in dtypes
        and all(map(operator.is_, map(_DTYPE, tensors), repeat(dtype)))
        and all(map(operator.eq, map(_DEVICE, tensors), repeat(dev)))
        and all(map(torch.Tensor.is_contiguous, tensors))
    ):
        return dtype, dev
    allowed = " or ".join(dtype_name(d) for d in dtypes)
    for i, t in enumerate(tensors):
        if t.dtype is not dtype or dtype not in dtypes:
            want = allowed if dtype not in dtypes else f"{dtype_name(dtype)} like {name}[0]"
            raise TypeError(f"{name}[{i}] must be {want}, got {dtype_name(t.dtype)}")
        if t.device != dev:
            raise ValueError(f"{name}[{i}] must be on {dev}, got {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}[{i}] must be contiguous, got strides {tuple(t.stride())} for shape "
                             f"{tuple(t.shape)}: pass {name}[{i}].contiguous() (a copy), or a tensor that owns "
                             "its storage in row-major order")
    return dtype, dev


_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel
_ESIZE, _OFFSET, _STORAGE = torch.Tensor.element_size, torch.Tensor.storage_offset, torch.Tensor.untyped_storage
_STORAGE_BYTES = torch.UntypedStorage.nbytes

Spans = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A list's :func:`spans_of`: first bytes, byte counts, element sizes."""


def _ints(fn: Callable[[torch.Tensor], int], tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter(map(fn, tensors), np.int64, len(tensors))


def spans_of(tensors: Sequence[torch.Tensor], esize: int | None = None) -> Spans:
    """Each tensor's first byte, byte count and element size, as arrays (one C-level pass
    per attribute: these checks run on every new set of addresses -- FSDP2's reduce-scatter
    on autograd's gradients, every step -- over hundreds of tensors; below a few dozen
    tensors numpy's fixed cost makes them slower than a Python loop, ~35 us in all).
    ``esize``: the element size of every tensor, where their dtype is known to be uniform
    (saves a pass)."""
    if esize is None:
        sizes = _ints(_ESIZE, tensors)
    else:
        sizes = np.full(len(tensors), esize, np.int64)
    return _ints(_PTR, tensors), _ints(_NUMEL, tensors) * sizes, sizes


def spans_at(ptrs: Sequence[int], layout: Any, esize: int) -> Spans:
    """:func:`spans_of` of the full tensors of ``layout`` (a ``ShardLayout``: their shapes
    checked against it) at ``ptrs`` (their addresses, read just before): no attribute read per
    tensor; the sizes as an array are kept by the layout."""
    numels = layout.derived(("_checks.numels",), lambda: np.asarray(layout.numels, dtype=np.int64))
    n = len(ptrs)
    return np.fromiter(ptrs, np.int64, n), numels * esize, np.full(n, esize, np.int64)


def check_storage(name: str, tensors: Sequence[torch.Tensor], spans: Spans | None = None) -> None:
    """Each non-empty tensor's bytes lie inside its storage.  A storage resized to 0 (FSDP2
    frees unsharded parameters so: ``untyped_storage().resize_(0)``) or shrunk keeps the
    tensor's shape, dtype and contiguity -- the other checks pass -- while its address is 0 or
    its bytes belong to something else: a copy there writes into memory it does not own.
    Run where a set of addresses is prepared (a cache miss), not per call: a freed storage
    has address 0, which no prepared set holds.  ``spans``: :func:`spans_of` of ``tensors``."""
    if not tensors:
        return
    ptr, nbytes, esize = spans_of(tensors) if spans is None else spans
    need = _ints(_OFFSET, tensors) * esize + nbytes
    have = np.fromiter(map(_STORAGE_BYTES, map(_STORAGE, tensors)), np.int64, len(tensors))
    bad = np.flatnonzero((nbytes > 0) & ((have < need) | (ptr == 0)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{name}[{i}] views {int(need[i])} bytes of a storage that holds {int(have[i])}: its storage was freed "
            f"or resized (FSDP2 frees unsharded parameters with untyped_storage().resize_(0)); pass tensors "
            f"whose storage is allocated")


def _sorted_spans(spans: Spans) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The non-empty spans' (start, end, index), sorted by start, then end, then index."""
    start, nbytes, _ = spans
    idx = np.flatnonzero(nbytes > 0)
    start, end = start[idx], start[idx] + nbytes[idx]
    order = np.lexsort((idx, end, start))
    return start[order], end[order], idx[order]


def check_disjoint(name: str, tensors: Sequence[torch.Tensor],
                   spans: Spans | None = None) -> None:
    """No two non-empty outputs share a byte (a collective writes each as if it were alone:
    two views of one buffer would receive each other's rows).  Run where a set of addresses
    is prepared, like :func:`check_storage`; sorting by address, O(n log n): sorted by start,
    any overlap shows between neighbours."""
    start, end, idx = _sorted_spans(spans_of(tensors) if spans is None else spans)
    hit = np.flatnonzero(start[1:] < end[:-1])
    if hit.size:
        k = int(hit[0])
        i, j = sorted((int(idx[k]), int(idx[k + 1])))
        raise ValueError(f"{name}[{i}] and {name}[{j}] overlap in memory: the collective writes each of "
                         f"them whole, so each needs bytes of its own (pass separate tensors, or "
                         f"non-overlapping views of one buffer)")


def check_apart(in_name: str, inputs: Sequence[torch.Tensor], out_name: str,
                outputs: Sequence[torch.Tensor], why: str,
                spans: tuple[Spans, Spans] | None = None) -> None:
    """No output shares a byte with an input (``why``: what would go wrong).  One sweep over
    both lists' spans sorted by start, O(n log n): a span overlaps the other list exactly when
    it starts before the furthest end of the other list's spans sorted before it."""
    in_spans, out_spans = (spans_of(inputs), spans_of(outputs)) if spans is None else spans
    s0, e0, i0 = _sorted_spans(in_spans)
    s1, e1, i1 = _sorted_spans(out_spans)
    start, end = np.concatenate((s0, s1)), np.concatenate((e0, e1))
    kind = np.concatenate((np.zeros(len(s0), np.int64), np.ones(len(s1), np.int64)))
    index = np.concatenate((i0, i1))
    order = np.lexsort((index, kind, end, start))
    start, end, kind, index = start[order], end[order], kind[order], index[order]
    reach = [np.concatenate(([-1], np.maximum.accumulate(np.where(kind == k, end, -1))[:-1])) for k in (0, 1)]
    other = np.where(kind == 0, reach[1], reach[0])  # furthest end of the other list's earlier spans
    hit = np.flatnonzero(start < other)
    if hit.size:
        p = int(hit[0])
        k = 1 - int(kind[p])
        o = int(np.argmax(np.where(kind[:p] == k, end[:p], -1)))  # the earlier span reaching furthest
        i, j = (int(index[o]), int(index[p])) if k == 0 else (int(index[p]), int(index[o]))
        raise ValueError(f"{out_name}[{j}] shares memory with {in_name}[{i}]: {why}; pass {out_name} that "
                         f"share no bytes with {in_name}")


def check_bound(in_name: str, inputs: Sequence[torch.Tensor], out_name: str,
                outputs: Sequence[torch.Tensor], *, apart: str | None = None,
                spans: tuple[Spans | None, Spans | None] = (None, None),
                outputs_checked: bool = False) -> tuple[Spans, Spans]:
    """The checks of a new set of addresses, before it is bound: every tensor's storage is
    allocated (:func:`check_storage`), no two outputs share a byte (:func:`check_disjoint`)
    and, where ``apart`` says why, no output shares a byte with an input (:func:`check_apart`).
    Each list's addresses and sizes are read once.  ``spans``: a list's :func:`spans_of` where
    the caller has them.  ``outputs_checked``: the outputs passed their own checks (storage,
    disjointness) at these very addresses and sizes before (:class:`CheckedLists`): only their
    pairing with the inputs is checked.  Returns both lists' spans."""
    in_spans = spans_of(inputs) if spans[0] is None else spans[0]
    out_spans = spans_of(outputs) if spans[1] is None else spans[1]
    check_storage(in_name, inputs, in_spans)
    if not outputs_checked:
        check_storage(out_name, outputs, out_spans)
        check_disjoint(out_name, outputs, out_spans)
    if apart is not None:
        check_apart(in_name, inputs, out_name, outputs, apart, (in_spans, out_spans))
    return in_spans, out_spans


class CheckedLists:
    """Output lists that passed their own checks of a new set of addresses (storage,
    disjointness) -- by a key of their addresses, sizes and dtype, with their spans, the
    ``kept`` most recent.  A trusted caller's outputs that recur beside new inputs (FSDP2's
    reduce-scatter shards beside autograd's new gradients, every step on MoE layers) are then
    only paired with the new inputs: the trust a set of addresses seen before already has,
    given per list.  Shapes, dtypes and layout are the caller's to check every time."""

    def __init__(self, kept: int = 8) -> None:
        self._spans: OrderedDict[tuple, Spans] = OrderedDict()
        self.kept = kept

    def __len__(self) -> int:
        return len(self._spans)

    def check_bound(self, in_name: str, inputs: Sequence[torch.Tensor], out_name: str,
                    outputs: Sequence[torch.Tensor], key: tuple, esizes: tuple[int, int], *,
                    apart: str | None = None, in_spans: Spans | None = None) -> None:
        """:func:`check_bound` of ``inputs`` (new) beside ``outputs`` (``key``: their addresses,
        sizes and dtype; ``esizes``: both lists' element sizes, their dtypes checked uniform),
        the outputs' own checks skipped where they passed at ``key`` before; remembers them.
        ``in_spans``: the inputs' :func:`spans_at`, where the caller has their addresses."""
        known = self._spans.get(key)
        spans = (spans_of(inputs, esizes[0]) if in_spans is None else in_spans,
                 known if known is not None else spans_of(outputs, esizes[1]))
        check_bound(in_name, inputs, out_name, outputs, apart=apart, spans=spans, outputs_checked=known is not None)
        self._spans[key] = spans[1]
        self._spans.move_to_end(key)
        while len(self._spans) > self.kept:
            self._spans.popitem(last=False)


RS_APART = ("the reduce-scatter reads every rank's rows of the gradients -- pushing the peers' rows, "
            "copy by copy, while it writes the sums -- so a shard over gradient bytes sends a peer sums "
            "instead of gradients, or sums its own partial sums")
"""Why a reduce-scatter's shards may not share memory with its gradients (:func:`check_apart`)."""


def same_shapes(tensors: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether ``tensors[i]`` has shape ``shapes[i]`` for every i (and the counts match).
    Streams the comparison: each tensor's shape object dies before the next is made, where a
    list of them (one per parameter, alive at once) would start garbage-collector passes in
    proportion to the parameter count."""
    return len(tensors) == len(shapes) and all(map(operator.eq, map(torch.Tensor.size, tensors), shapes))


def check_shapes(
    name: str,
    tensors: Sequence[torch.Tensor],
    expected: Sequence[tuple[int, ...]],
    alternative: Sequence[tuple[int, ...]] | None = None,
    *,
    what: str = "",
    alt_what: str = "padded",
    why: "Callable[[int], str] | None" = None,
) -> list[bool]:
    """Each tensor has ``expected[i]`` or ``alternative[i]``; returns per tensor whether it
    matched the alternative."""
    if same_shapes(tensors, expected):  # fast paths
        return [False] * len(tensors)
    if alternative is not None and same_shapes(tensors, alternative):
        return [True] * len(tensors)
    out = []
    for i, (t, e) in enumerate(zip(tensors, expected)):
        shape = tuple(t.shape)
        if shape == e:
            out.append(False)
        elif alternative is not None and shape == alternative[i]:
            out.append(True)
        else:
            want = f"{what + ' ' if what else ''}{_shape_str(e)}"
            if alternative is not None and alternative[i] != e:
                want += f" or {alt_what} {_shape_str(alternative[i])}"
            rule = f" ({why(i)})" if why is not None else ""
            raise ValueError(f"{name}[{i}] must have shape {want}, got {_shape_str(shape)}{rule}")
    return out


def check_flat(name: str, t: torch.Tensor, min_numel: int) -> None:
    """A 1-D (or any contiguous) buffer holding at least ``min_numel`` elements."""
    if t.numel() < min_numel:
        raise ValueError(f"{name} must hold at least {min_numel} elements, got {t.numel()}")


def check_sources(
    name: str,
    value: object,
    *,
    count_name: str,
    count: int | None,
    flat_numel: int,
    n_params: int,
) -> tuple[list[list[torch.Tensor]], bool]:
    """Sources given per rank / per contribution: each entry is either one flat 1-D buffer
    (padded shards back to back, ``flat_numel`` elements at least) or a sequence of
    ``n_params`` per-parameter tensors; all entries of one kind.  Returns the entries as
    lists of tensors (one tensor each when flat) and whether they are flat.  Shapes of
    per-parameter entries are the caller's to check."""
    if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
        raise TypeError(
            f"{name} must be a sequence (one entry per {count_name}), got {type(value).__name__}"
        )
    entries = list(value)
    if count is not None and len(entries) != count:
        raise ValueError(
            f"{name} must have {count} {'entry' if count == 1 else 'entries'} (one per {count_name}), "
            f"got {len(entries)}"
        )
    if not entries:
        raise ValueError(f"{name} must have at least one entry (one per {count_name}), got none")
    flat = isinstance(entries[0], torch.Tensor)
    out: list[list[torch.Tensor]] = []
    for j, e in enumerate(entries):
        if isinstance(e, torch.Tensor) != flat:
            kind = "a flat 1-D tensor" if flat else "a sequence of per-parameter tensors"
            raise TypeError(f"{name}[{j}] must be {kind} like {name}[0], got {type(e).__name__}")
        if flat:
            if e.dim() != 1:
                raise ValueError(f"{name}[{j}] must be a 1-D flat buffer, got shape {_shape_str(e.shape)}")
            check_flat(f"{name}[{j}]", e, flat_numel)
            out.append([e])
        else:
            out.append(check_tensor_list(f"{name}[{j}]", e, n_params))
    return out, flat


def check_entries_uniform(
    name: str,
    entries: Sequence[Sequence[torch.Tensor]],
    flat: bool,
    *,
    dtypes: Sequence[torch.dtype],
    device: torch.device,
) -> torch.dtype:
    """One dtype (of ``dtypes``) and ``device`` across all entries of a source list."""
    if flat:
        dtype, _ = check_uniform(name, [e[0] for e in entries], dtypes=dtypes, device=device)
        return dtype
    dtype, _ = check_uniform(f"{name}[0]", entries[0], dtypes=dtypes, device=device)
    for j, e in enumerate(entries[1:], start=1):
        check_uniform(f"{name}[{j}]", e, dtypes=(dtype,), device=device)
    return dtype


def check_gather_shards(shards: Sequence[torch.Tensor], layout: Any, rank: int) -> None:
    """An all-gather's shards against ``layout`` (a :class:`tide_triton.plan.layout.ShardLayout`):
    shard ``i`` is ``(rows, *rest)`` with rows = ``c`` (padded) or this rank's real rows.
    A parameter passed padded (``W*c`` rows) hides its true dim 0, so there any row count
    up to ``c`` is a valid unpadded shard: the rows it lacks arrive as zero padding."""
    if same_shapes(shards, layout.shard_shapes(rank)) or same_shapes(shards, layout.shard_shapes(rank, padded=True)):
        return  # fast path: all unpadded or all padded
    real = layout.shard_rows(rank)
    for i, (x, shape, c) in enumerate(zip(shards, layout.shapes, layout.rows_per_rank)):
        got = tuple(x.shape)
        ok = len(got) == len(shape) and got[1:] == shape[1:] and (
            got[0] in (c, real[i]) or (shape[0] == layout.world_size * c and 0 <= got[0] <= c))
        if not ok:
            want = (real[i], *shape[1:])
            alt = "" if real[i] == c else f" or padded {(c, *shape[1:])}"
            raise ValueError(f"shards[{i}] must have shape {want}{alt}, got {got} ({layout.shard_rule(i, rank)})")
