"""Capture on the host transport: what a CUDA graph is to a GPU run, for the CPU tests of
captured prepared collectives.

Inside ``with capture(graph):`` (this thread only) a prepared collective's run is recorded
instead of run -- the host transport's copies, signals, waits and fences
(:class:`tide_triton.transport.host.HostTransport`) and the kernels' launches
(:meth:`tide_triton.kernels.Binding.launch`), in program order, each with where it goes (the
caller's thread, or the rank's copy queue when that runs behind it) -- and
:meth:`HostGraph.replay` runs the same operations again, on the tensors' current values, as
``torch.cuda.CUDAGraph.replay`` does.  The package's code takes the same captured path on the
host as on a GPU (``programs._Prepared._is_captured``), so the CPU suite checks what replays
do: exact results, runs between replays, tokens that every replay finds reset.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

_local = threading.local()


class HostGraph:
    """Operations recorded by :func:`capture`, replayed in order by :meth:`replay`."""

    def __init__(self) -> None:
        self._ops: list[tuple[Callable[[], None], Callable[[Callable[[], None]], None] | None]] = []

    def record(self, op: Callable[[], None], enqueue: Callable[[Callable[[], None]], None] | None = None) -> None:
        """``op`` runs on the replaying thread, or -- ``enqueue`` given -- is handed to it (a
        copy queue that runs behind the caller)."""
        self._ops.append((op, enqueue))

    def __len__(self) -> int:
        return len(self._ops)

    def replay(self) -> None:
        if recording() is not None:
            raise RuntimeError("a HostGraph cannot be replayed while this thread captures")
        for op, enqueue in self._ops:
            if enqueue is None:
                op()
            else:
                enqueue(op)


def recording() -> HostGraph | None:
    """The graph this thread is capturing into, or None."""
    return getattr(_local, "graph", None)


@contextmanager
def capture(graph: HostGraph) -> Iterator[HostGraph]:
    """Record into ``graph`` what this thread enqueues until the block ends."""
    if recording() is not None:
        raise RuntimeError("this thread is capturing already")
    _local.graph = graph
    try:
        yield graph
    finally:
        _local.graph = None
