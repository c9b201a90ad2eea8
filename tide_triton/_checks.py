"""Argument checks shared by the kernels' launchers and the collectives.

Every failure names the argument, what was expected and what came.  Nothing here touches
device memory or synchronises a device.
"""
from __future__ import annotations

import operator
from itertools import repeat
from typing import Any, Callable, Iterable, Sequence

import torch

__all__ = [
    "FLOAT_DTYPES",
    "check_tensor_list",
    "check_uniform",
    "check_shapes",
    "check_gather_shards",
    "same_shapes",
    "check_flat",
    "dtype_name",
    "is_int",
]

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


def check_storage(name: str, tensors: Sequence[torch.Tensor]) -> None:
    """Each non-empty tensor's bytes lie inside its storage.  A storage resized to 0 (FSDP2
    frees unsharded parameters so: ``untyped_storage().resize_(0)``) or shrunk keeps the
    tensor's shape, dtype and contiguity -- the other checks pass -- while its address is 0 or
    its bytes belong to something else: a copy there writes into memory it does not own.
    Run where a set of addresses is prepared (a cache miss), not per call: a freed storage
    has address 0, which no prepared set holds."""
    for i, t in enumerate(tensors):
        n = t.numel()
        if n == 0:
            continue
        need = (t.storage_offset() + n) * t.element_size()
        have = t.untyped_storage().nbytes()
        if have < need or t.data_ptr() == 0:
            raise ValueError(
                f"{name}[{i}] views {need} bytes of a storage that holds {have}: its storage was freed or "
                f"resized (FSDP2 frees unsharded parameters with untyped_storage().resize_(0)); pass tensors "
                f"whose storage is allocated")


def check_disjoint(name: str, tensors: Sequence[torch.Tensor]) -> None:
    """No two non-empty outputs share a byte (a collective writes each as if it were alone:
    two views of one buffer would receive each other's rows).  Run where a set of addresses
    is prepared, like :func:`check_storage`; sorting by address, O(n log n)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i)
                   for i, t in enumerate(tensors) if t.numel())
    for (_a0, a1, i), (b0, _b1, j) in zip(spans, spans[1:]):
        if b0 < a1:  # sorted by start: any overlap shows between neighbours
            i, j = min(i, j), max(i, j)
            raise ValueError(f"{name}[{i}] and {name}[{j}] overlap in memory: the collective writes each of "
                             f"them whole, so each needs bytes of its own (pass separate tensors, or "
                             f"non-overlapping views of one buffer)")


def check_apart(in_name: str, inputs: Sequence[torch.Tensor], out_name: str,
                outputs: Sequence[torch.Tensor], why: str) -> None:
    """No output shares a byte with an input (``why``: what would go wrong).  One sweep over
    both lists' spans sorted by start, O(n log n)."""
    spans = sorted([(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), 0, i)
                    for i, t in enumerate(inputs) if t.numel()]
                   + [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), 1, j)
                      for j, t in enumerate(outputs) if t.numel()])
    reach = [(0, -1), (0, -1)]  # per kind: the furthest end seen so far, and whose
    for start, end, kind, k in spans:
        other_end, o = reach[1 - kind]
        if start < other_end:  # sorted by start: it begins inside a span of the other list
            i, j = (o, k) if kind else (k, o)
            raise ValueError(f"{out_name}[{j}] shares memory with {in_name}[{i}]: {why}; pass {out_name} that "
                             f"share no bytes with {in_name}")
        if end > reach[kind][0]:
            reach[kind] = (end, k)


def check_bound(in_name: str, inputs: Sequence[torch.Tensor], out_name: str,
                outputs: Sequence[torch.Tensor], *, apart: str | None = None) -> None:
    """The checks of a new set of addresses, before it is bound: every tensor's storage is
    allocated (:func:`check_storage`), no two outputs share a byte (:func:`check_disjoint`)
    and, where ``apart`` says why, no output shares a byte with an input (:func:`check_apart`)."""
    check_storage(in_name, inputs)
    check_storage(out_name, outputs)
    check_disjoint(out_name, outputs)
    if apart is not None:
        check_apart(in_name, inputs, out_name, outputs, apart)


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
    """An all-gather's shards against ``layout`` (a :class:`tide_triton.layout.ShardLayout`):
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
