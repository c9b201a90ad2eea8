"""The tensors a prepared collective holds (:class:`HeldList`) and the check a run makes that
each is still as prepared -- its address, shape, contiguity and dtype -- in one call of
torch's C++ tensor guard where it works here, else in Python."""
from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Sequence

import torch

from ..transport._once import log_once

_PTR, _SIZE = torch.Tensor.data_ptr, torch.Tensor.size
_CONTIGUOUS, _DTYPE = torch.Tensor.is_contiguous, operator.attrgetter("dtype")


class HeldList:
    """One list of tensors a prepared collective holds, as it was prepared: the tensors and
    what its layout depends on -- their addresses (storage and storage offset), shapes and
    dtypes, all contiguous (the preparation's checks refuse anything else)."""

    __slots__ = ("tensors", "ptrs", "shapes", "dtypes", "_guard")

    def __init__(self, tensors: Sequence[torch.Tensor], ptrs: tuple[int, ...]) -> None:
        self.tensors = ts = tuple(tensors)
        self.ptrs = ptrs
        self.shapes: tuple[torch.Size, ...] = tuple(map(_SIZE, ts))
        self.dtypes: tuple[torch.dtype, ...] = tuple(map(_DTYPE, ts))
        self._guard = _layout_guard(ts)

    def unchanged(self) -> bool:
        """Whether every tensor is as prepared.  The addresses in one C-level pass; shapes,
        strides and dtypes in one call of torch's C++ tensor guard where it works here
        (:func:`_layout_guard`), else in a pass per attribute (each streamed: no per-tensor
        object outlives its comparison).  A guard that refuses tensors the passes accept (its
        dispatch keys or ``requires_grad`` differ, e.g. under ``torch.inference_mode``) is
        made again from them."""
        ts = self.tensors
        if tuple(map(_PTR, ts)) != self.ptrs:
            return False
        guard = self._guard
        if guard is not None and guard.check(*ts):
            return True
        same = (all(map(operator.eq, map(_SIZE, ts), self.shapes)) and all(map(_CONTIGUOUS, ts))
                and all(map(operator.is_, map(_DTYPE, ts), self.dtypes)))
        if same and guard is not None:
            self._guard = _layout_guard(ts)
        return same

    def first_change(self, name: str) -> str:
        """What changed in the first tensor that is not as prepared (:meth:`unchanged` False)."""
        for i, (t, ptr, shape, dtype) in enumerate(zip(self.tensors, self.ptrs, self.shapes, self.dtypes)):
            if t.data_ptr() != ptr:
                return (f"{name}[{i}] moved (data_ptr {hex(ptr)} when prepared, {hex(t.data_ptr())} now; e.g. its "
                        "storage was resized or swapped)")
            was, now = [], []
            if t.shape != shape:
                was.append(f"shape {tuple(shape)}")
                now.append(f"shape {tuple(t.shape)}")
            if t.dtype is not dtype:
                was.append(f"dtype {dtype}")
                now.append(f"dtype {t.dtype}")
            if not t.is_contiguous():
                was.append("contiguous")
                now.append(f"strides {tuple(t.stride())}")
            if was:
                return (f"{name}[{i}] changed in place at its address (prepared: {', '.join(was)}; now: "
                        f"{', '.join(now)}; e.g. t_(), resize_(), set_() or an assignment to .data)")
        raise RuntimeError(f"internal error: {name} changed, yet every tensor is as prepared")


def _layout_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """torch's C++ check of these tensors' shapes, strides, dtypes and devices (dynamo's
    ``TensorGuards``; ``.check(*tensors)``), or None where it is missing or fails
    :func:`_guards_work`.  One call for a whole list: ~0.15 us a tensor, where Python
    passes per attribute cost ~0.5 us (the 256-expert layer's 1,542 held tensors on a loaded
    2-core x86, torch 2.13; docs/benchmarks.md, "Python per call on the CPU")."""
    if not _guards_work():
        return None
    from torch._C._dynamo.guards import TensorGuards  # torch's private API: imported only once _guards_work vouched

    return TensorGuards(*tensors, dynamic_dims_sizes=[list(map(int, t.size())) for t in tensors],
                        dynamic_dims_strides=[list(map(int, t.stride())) for t in tensors])


@functools.lru_cache(maxsize=1)
def _guards_work() -> bool:
    """Whether torch's ``TensorGuards`` exists here and refuses what a run must refuse (its
    API is torch's private one): another shape, strides, dtype; else the run checks in
    Python (logged once)."""
    try:  # torch's private API: a missing or changed one falls back to checks in Python
        from torch._C._dynamo.guards import TensorGuards

        a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.bfloat16)
        guard = TensorGuards(a, b, dynamic_dims_sizes=[[2, 3], [4]], dynamic_dims_strides=[[3, 1], [1]])
        changed = (a.t(), a[:1], a.as_strided((2, 3), (1, 2)), a.view(torch.int32), torch.zeros(3, 2))
        if guard.check(a, b) and not any(guard.check(x, b) for x in changed) and not guard.check(a, b[:2]):
            return True
        why = "it accepted a changed tensor"
    except Exception as e:  # noqa: BLE001 -- a private API: anything it does wrong means "not here"
        why = f"{type(e).__name__}: {e}"
    log_once("prepared-layout-guard", logging.INFO, "tide_triton: prepared runs check their tensors' shapes, "
             "strides and dtypes in Python (torch's TensorGuards is not usable here: %s)", why)
    return False
