"""Copy graphs: a prepared list of copies used again, captured once and replayed with one launch.

FSDP2's steady state enqueues the same addresses every step: such a list is captured into a
CUDA graph of its copies (one ``cuMemcpy2DAsync`` / ``3DAsync`` / ``cuMemcpyAsync`` per
descriptor, on the rank's own capture stream, relaxed mode) and replayed with one
``cuGraphLaunch``, so host time per call no longer grows with its descriptors
(``$TIDE_TRITON_COPY_GRAPHS``: ``off``, ``auto`` -- from the second use of a list of at least
:data:`GRAPH_MIN_DESCRIPTORS` -- or ``always``).  A graph lives as long as its list (destroyed
when the list is collected) or until close.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Sequence

from ..runtime.profiling import in_host_range
from ._once import log_once
from .copies import PreparedCopies, enqueue_each
from .driver import CtxGuard, CudaError, check
from .streams import RankStreams

GRAPH_MIN_DESCRIPTORS = 8
"""Under ``$TIDE_TRITON_COPY_GRAPHS=auto``, the smallest prepared list replayed as a graph:
below it the descriptors cost less host time than a graph launch saves."""


class CopyGraphs:
    """The copy graphs of one rank (see the module notes); ``mode`` is set with the copy path
    (:meth:`~tide_triton.transport.copies.Copies.choose_path`)."""

    def __init__(self, cu: Any, guard: CtxGuard, streams: RankStreams, *, rank: int) -> None:
        self._cu = cu
        self._guard = guard
        self._streams = streams
        self.rank = rank
        self.mode = "off"
        self._graphs: dict[int, Any] = {}  # id -> executable graph, destroyed with its list or at close

    def _replay_due(self, prepared: PreparedCopies, use: int) -> bool:
        """Whether the ``use``-th use of ``prepared`` (1 = first) replays it as a graph:
        from the second use of a list of >= :data:`GRAPH_MIN_DESCRIPTORS` (``auto``), from the
        first of any (``always``), never (``off``)."""
        if self.mode == "always":
            return True
        return self.mode == "auto" and use >= 2 and prepared.descriptors >= GRAPH_MIN_DESCRIPTORS

    def warm_replays(self, lists: Sequence[Any]) -> None:
        """Capture now the lists that :meth:`graph_of` will replay at their next use -- called
        by a collective before it enqueues any flag wait.  Instantiating a graph may allocate
        device memory, and in the single-process mode nothing that might synchronize the
        device may run while a peer's stream waits for this rank's flags."""
        for p in lists:
            if (p is not None and "graph" not in p.replay and (p.nbytes or p.strided)
                    and self._replay_due(p, p.replay.get("uses", 0) + 1)):
                self._make_graph(p)

    def graph_of(self, prepared: PreparedCopies) -> Any:
        """The executable graph replaying ``prepared`` if this use is due one (captured here
        unless :meth:`warm_replays` did); None: enqueue its descriptors."""
        r = prepared.replay
        if "graph" in r:
            return r["graph"]
        r["uses"] = use = r.get("uses", 0) + 1
        return self._make_graph(prepared) if self._replay_due(prepared, use) else None

    def _make_graph(self, prepared: PreparedCopies) -> Any:
        r = prepared.replay
        r["graph"] = graph = self._capture(prepared)
        if graph is not None:
            key = id(prepared)
            self._graphs[key] = graph
            weakref.finalize(prepared, self._drop_graph, key).atexit = False  # exit: close() does it
        return graph

    @in_host_range("tide_triton::copy_graph_capture")
    def _capture(self, prepared: PreparedCopies) -> Any:
        """Capture ``prepared``'s copies (``cuMemcpy2DAsync`` / ``cuMemcpyAsync``: the batch
        call cannot be captured) on the capture stream, relaxed mode (other threads' CUDA calls
        are not restricted meanwhile), into an executable graph; None, logged once, if the
        driver refuses -- the list is then enqueued as before."""
        cu = self._cu
        with self._guard:
            try:
                cs = self._streams.capture_stream()
                check(cu.cuStreamBeginCapture(cs, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                      "cuStreamBeginCapture(copies)")
                try:
                    enqueue_each(cu, self.rank, prepared, cs)
                finally:
                    graph = check(cu.cuStreamEndCapture(cs), "cuStreamEndCapture(copies)")
                try:
                    return check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate(copies)")
                finally:
                    check(cu.cuGraphDestroy(graph), "cuGraphDestroy(copies)")
            except CudaError as exc:
                log_once("copy-graph-refused", logging.WARNING,
                         "prepared copies are enqueued, not replayed as a CUDA graph: %s", exc)
                return None

    @in_host_range("tide_triton::copy_graph_destroy")
    def _drop_graph(self, key: int) -> None:
        """Its list is gone (a prepare-cache eviction): destroy the executable graph.  A
        launch still in flight completes first (the driver frees it asynchronously)."""
        graph = self._graphs.pop(key, None)
        if graph is not None:
            with self._guard:
                check(self._cu.cuGraphExecDestroy(graph), f"cuGraphExecDestroy(rank={self.rank})")

    def held(self) -> int:
        """Executable copy graphs held now (a test's view)."""
        return len(self._graphs)

    def close(self, quiet: Any) -> None:
        """Destroy every copy graph (``quiet`` runs each step)."""
        for key in list(self._graphs):
            quiet(self._drop_graph, key)
