"""The device tables the segmented kernel reads: small host tables uploaded without a host
sync, and address tables uploaded once for several bindings (:class:`SharedPointers`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

def upload(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object, object]:
    """Copy a small host table to ``device`` without a host sync: pinned memory, a
    non-blocking copy on the current stream, an event that other streams wait on before
    their first use, and that stream (the table's memory is its, in torch's caching
    allocator; see :meth:`~tide_triton.kernels.segments.Binding.launch`)."""
    if device.type != "cuda":
        return host, None, None
    stream = torch.cuda.current_stream(device)
    table = host.pin_memory().to(device, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return table, event, stream


def alignment(values: Sequence[int], cap: int = 16) -> int:
    """Largest power of two <= cap dividing every value (bytes)."""
    g = math.gcd(*values)
    if g == 0:
        return cap
    a = 1
    while a < cap and g % (a * 2) == 0:
        a *= 2
    return a


@dataclass(frozen=True, eq=False)
class SharedPointers:
    """One binding's address tables, cut from a table uploaded for several bindings at once
    (:func:`upload_pointer_tables`), with the gcd of its addresses (0: none) for the
    alignment the kernel may assume, and the event of the one upload."""

    dst: torch.Tensor
    src: torch.Tensor
    dst_gcd: int
    src_gcd: int
    event: object
    stream: object
    """The stream the upload went on (CUDA; None on the host): the tables' home."""


def upload_pointer_tables(device: torch.device, dst_ptrs: Sequence[int],
                          src_lists: Sequence[Sequence[int]]) -> list[SharedPointers]:
    """Address tables for bindings that share their destinations (``dst_ptrs``), each with
    its own sources (``src_lists``), uploaded as one table: one pinned buffer, one
    non-blocking copy and one event where a table per binding costs one of each per binding
    (a reduce-scatter's chunks bound on new gradients every call: FSDP2's)."""
    return upload_table_pairs(device, [(dst_ptrs, s) for s in src_lists])


def upload_table_pairs(device: torch.device,
                       pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[SharedPointers]:
    """:func:`upload_pointer_tables` for bindings that each have their own ``(dst_ptrs,
    src_ptrs)``: every distinct sequence (by identity: pass the same object where bindings
    share one) uploaded once, all in one table, one copy and one event."""
    if not pairs:
        return []
    at: dict[int, int] = {}  # id of a sequence -> its index in parts
    parts: list[np.ndarray] = []
    for seq in (x for pair in pairs for x in pair):
        if id(seq) not in at:
            at[id(seq)] = len(parts)
            parts.append(np.asarray(seq, dtype=np.int64))
    table, event, up = upload(torch.from_numpy(np.concatenate(parts)), device)
    starts = np.cumsum([0] + [len(p) for p in parts]).tolist()
    slices = [table[starts[i]:starts[i + 1]] for i in range(len(parts))]
    gcds = [int(np.gcd.reduce(p)) if len(p) else 0 for p in parts]
    return [SharedPointers(slices[at[id(d)]], slices[at[id(x)]], gcds[at[id(d)]], gcds[at[id(x)]], event, up)
            for d, x in pairs]


