"""The CUDA streams and events of one rank, and their lifetimes.

Its own streams, made by the driver at creation: the copy stream (``copy_stream``, also a
``torch.cuda`` stream object so events and the caching allocator work with it), where copies,
signals and waits go by default; the host stream, for reads of device words from the host
(into a pinned buffer) and for the transport's own writes; and, at the first capture, the
capture stream that copy graphs and recorded runs are captured on.  Fences between streams are
one ``cuEventRecord`` + ``cuStreamWaitEvent`` on an event lent to the calling thread.  The
progress words of the waits (:mod:`~tide_triton.transport.progress`) are allocated here too,
zeroed on the host stream.  Everything is destroyed at :meth:`RankStreams.close`, once the
streams are idle (:meth:`RankStreams.drain`).
"""
from __future__ import annotations

import ctypes
import threading
import time
import weakref
from typing import Any

import torch

from .driver import CtxGuard, Transaction, check
from .progress import ProgressWords

NOT_READY = 600
"""``CUDA_ERROR_NOT_READY``: what ``cuStreamQuery`` answers for a stream with work left."""


class _LentEvent:
    """A fence event lent to one thread (:meth:`RankStreams._thread_event`)."""

    __slots__ = ("event", "__weakref__")

    def __init__(self, event: Any) -> None:
        self.event = event


class RankStreams:
    """The streams, fence events, host reads and progress words of one rank (see the module
    notes).  ``stream_int`` turns a caller's stream into a handle and remembers it: a close
    drains every stream that got work (:meth:`busy_streams`)."""

    def __init__(self, cu: Any, guard: CtxGuard, *, rank: int, local_size: int, device: torch.device,
                 tx: Transaction) -> None:
        self._cu = cu
        self._guard = guard
        self.rank = rank
        self.device = device
        self._capture_handle: Any = None  # the rank's own stream for captures (capture_stream)
        self._record_stream: Any = None  # torch's handle of it (recording_stream)
        # Handles of the caller's streams that got waits/signals (drained at close).  Handles,
        # not weak references: torch <= 2.12's Stream/Event deallocs leave weak references
        # dangling (pytorch/pytorch#183403), which corrupts the heap and crashes the cyclic GC.
        self.streams_used: set[int] = set()
        self._tls = threading.local()
        self._events: list[Any] = []  # every fence event made (stream_waits_for), destroyed at close
        self._free_events: list[Any] = []  # those no live thread holds
        self._events_lock = threading.Lock()
        self._fence_what = (f"cuEventRecord(rank={rank}, fence)", f"cuStreamWaitEvent(rank={rank}, fence)")
        nb = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        with guard:
            self._copy_handle = check(cu.cuStreamCreate(nb), "cuStreamCreate(copy)")
            tx.on_rollback(self._destroy_stream, self._copy_handle)
            self.host_stream = check(cu.cuStreamCreate(nb), "cuStreamCreate(host reads)")
            tx.on_rollback(self._destroy_stream, self.host_stream)
            self._host_buf = int(check(cu.cuMemAllocHost(8 * max(2, local_size)), "cuMemAllocHost"))
            tx.on_rollback(self._free_host, self._host_buf)
            self.progress = ProgressWords(cu, guard, self.host_stream, rank)
            self.progress.grow()  # now, not at a first wait: peers may wait on this rank by then
            tx.on_rollback(self.progress.free_all)
        self.copy_stream_int = int(self._copy_handle)
        self.host_stream_int = int(self.host_stream)
        self.copy_stream = torch.cuda.ExternalStream(self.copy_stream_int, device=device)

    def stream_int(self, stream: Any) -> int:
        """The handle of ``stream`` (None: the copy stream), remembered for the close's drain."""
        if stream is None:
            return self.copy_stream_int
        if isinstance(stream, torch.cuda.Stream):
            h = int(stream.cuda_stream)
            self.streams_used.add(h)
            return h
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")

    # ---- captures ---------------------------------------------------------------------------
    def capture_stream(self) -> Any:
        """This rank's own stream for captures -- its copy lists' graphs
        (:class:`~tide_triton.transport.copy_graphs.CopyGraphs`) and its recorded runs
        (:meth:`recording_stream`), one at a time on the rank's thread (a run being recorded
        captures its copies one by one, never a copy graph) -- created at the first and
        destroyed at close.  The caller holds the context."""
        if self._capture_handle is None:
            self._capture_handle = check(self._cu.cuStreamCreate(int(self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                                         "cuStreamCreate(capture)")
        return self._capture_handle

    def recording_stream(self) -> Any:
        """The stream this rank records its prepared runs on (:mod:`tide_triton.executors.recorded`): the
        rank's own capture stream -- never one of torch's pooled streams, which torch hands out
        round-robin: in the single-process mode a pooled stream can be another rank's, and that
        rank's work would go into this rank's graph."""
        if self._record_stream is None:
            with self._guard:
                handle = self.capture_stream()
            self._record_stream = torch.cuda.ExternalStream(int(handle), device=self.device)
        return self._record_stream

    def launch_graph_exec(self, handle: int, stream: Any) -> None:
        """``cuGraphLaunch`` of an instantiated graph (``CUDAGraph.raw_cuda_graph_exec()``) on
        ``stream``: what ``CUDAGraph.replay()`` does, without its stream and device switches."""
        s = self.stream_int(stream)
        with self._guard:
            check(self._cu.cuGraphLaunch(self._cu.CUgraphExec(int(handle)), s),
                  f"cuGraphLaunch(rank={self.rank}, recorded run)")

    # ---- fences -----------------------------------------------------------------------------
    def stream_waits_for(self, waiter: int, source: int) -> None:
        """Stream ``waiter`` waits for the work enqueued on stream ``source`` so far: one
        ``cuEventRecord`` and one ``cuStreamWaitEvent`` on this thread's event
        (:meth:`_thread_event`) -- what torch's ``wait_stream`` does with a new event each
        time (a wait takes the event's latest record when it is enqueued, so re-recording it
        later changes no earlier wait; a replay's fences made two torch events per run)."""
        held = getattr(self._tls, "fence_event", None)
        if held is None:
            held = self._tls.fence_event = self._thread_event()
        cu, what = self._cu, self._fence_what
        with self._guard:
            check(cu.cuEventRecord(held.event, source), what[0])
            check(cu.cuStreamWaitEvent(waiter, held.event, 0), what[1])

    def fence_copy_from(self, stream: Any) -> None:
        """The copy stream waits for the work enqueued on ``stream`` so far (None: the current
        stream of this rank's device)."""
        src = torch.cuda.current_stream(self.device) if stream is None else stream
        self.stream_waits_for(self.copy_stream_int, self.stream_int(src))

    def fence_copy_to(self, stream: Any) -> None:
        """``stream`` (None: the current stream of this rank's device) waits for the work
        enqueued on the copy stream so far."""
        dst = torch.cuda.current_stream(self.device) if stream is None else stream
        self.stream_waits_for(self.stream_int(dst), self.copy_stream_int)

    def _thread_event(self) -> _LentEvent:
        """A driver event lent to the calling thread: from the free list, else made.  The
        thread's local holds it; when the thread ends, the holder dies and the event goes
        back to the free list (threads that make a stream per step do not add an event
        each).  Every event made is destroyed at :meth:`close`."""
        with self._events_lock:
            ev = self._free_events.pop() if self._free_events else None
        if ev is None:
            cu = self._cu
            with self._guard:
                ev = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)),
                           f"cuEventCreate(rank={self.rank}, fence)")
            with self._events_lock:
                self._events.append(ev)
        held = _LentEvent(ev)
        weakref.finalize(held, self._free_events.append, ev)
        return held

    # ---- host reads -------------------------------------------------------------------------
    def read_words(self, addr: int, n: int) -> list[int]:
        """``n`` int64 device words at ``addr``, read from the host on the host stream (never
        behind the copy stream)."""
        cu = self._cu
        with self._guard:
            check(cu.cuMemcpyDtoHAsync(self._host_buf, addr, 8 * n, self.host_stream),
                  f"cuMemcpyDtoHAsync(rank={self.rank}, flags)")
            check(cu.cuStreamSynchronize(self.host_stream), "cuStreamSynchronize(host reads)")
        return list((ctypes.c_int64 * n).from_address(self._host_buf))

    # ---- teardown ---------------------------------------------------------------------------
    def busy_streams(self) -> set[int]:
        """Handles of every stream that may still touch heaps: own ones and the caller's."""
        return {self.copy_stream_int, self.host_stream_int, *self.streams_used}

    def drain(self, handles: set[int], deadline: float) -> bool:
        """Poll until every stream of ``handles`` is idle (False at ``deadline``).  torch's
        streams come from its pool and are never destroyed, so their handles stay valid to
        query; a handle that errors is taken as idle."""
        with self._guard:
            for h in handles:
                while int(self._cu.cuStreamQuery(h)[0]) == NOT_READY:
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(1e-3)
        return True

    def _destroy_stream(self, s: Any) -> None:
        with self._guard:
            check(self._cu.cuStreamDestroy(s), f"cuStreamDestroy(rank={self.rank})")

    def _destroy_events(self, quiet: Any) -> None:
        """Destroy every fence event made, lent or not (at close: no thread fences after it)."""
        with self._events_lock:
            events, self._events = self._events, []
            self._free_events.clear()
        for ev in events:
            quiet(self._destroy_event, ev)

    def _destroy_event(self, ev: Any) -> None:
        with self._guard:
            check(self._cu.cuEventDestroy(ev), f"cuEventDestroy(rank={self.rank})")

    def _free_host(self, p: int) -> None:
        with self._guard:
            check(self._cu.cuMemFreeHost(p), f"cuMemFreeHost(rank={self.rank})")

    def close(self, quiet: Any) -> None:
        """Destroy the capture stream, the fence events, the progress words, the host stream
        and buffer and the copy stream (``quiet`` runs each step; the streams are idle)."""
        if self._capture_handle is not None:
            self._record_stream = None
            quiet(self._destroy_stream, self._capture_handle)
            self._capture_handle = None
        self._destroy_events(quiet)
        self.progress.free_all(quiet)
        quiet(self._destroy_stream, self.host_stream)
        quiet(self._free_host, self._host_buf)
        quiet(self._destroy_stream, self._copy_handle)
