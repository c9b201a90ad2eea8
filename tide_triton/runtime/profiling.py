"""Named ranges in a ``torch.profiler`` trace for the host work the profiler cannot see.

A driver call made through cuda-python (a copy graph's capture or destruction, a batched copy)
is not in a torch trace, and a host wait shows there only as a gap inside the caller's range
(on the H200: 250 ms of an FSDP2 reduce-scatter hook with no traced op inside).  The stretches
where the host may block or work long -- preparing a collective, pacing, waiting on an event or
a flag, capturing or destroying a copy graph -- open a ``record_function`` range named
``tide_triton::...`` while a profiler records; otherwise they cost one check
(``torch.autograd._profiler_enabled()``, ~30 ns) and nothing else."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, TypeVar

import torch

_NOTHING = contextlib.nullcontext()
F = TypeVar("F", bound=Callable[..., Any])


def host_range(name: str) -> ContextManager[Any]:
    """A ``torch.profiler.record_function(name)`` range while a profiler records, else a no-op."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NOTHING


def in_host_range(name: str) -> Callable[[F], F]:
    """Decorator: every call of the function runs inside :func:`host_range` ``(name)``."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def ranged(*args: Any, **kwargs: Any) -> Any:
            with host_range(name):
                return fn(*args, **kwargs)
        return ranged  # type: ignore[return-value]
    return wrap
