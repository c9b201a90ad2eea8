"""A prepared collective's run recorded once and replayed by one launch: how an
eager-launched prepared run's host work stops growing with its rounds, copies and flags.

A prepared run on a set of addresses it has run on before (FSDP2's steady state, or
``PreparedAllGather.run()`` in a loop) is recorded the first time it repeats -- into a CUDA
graph on a GPU (the same captured path a user's ``torch.cuda.graph`` takes,
``programs._Prepared._run(..., captured=True)``), into a
:class:`~tide_triton.runtime.host_capture.HostGraph` on the host transport -- and every later run on
those addresses replays it: one ``cudaGraphLaunch`` instead of its flag operations, copies and
kernel launches one by one (on the H200, ~1-2 ms of host per Qwen3-30B-A3B reduce-scatter at
W=2).  Which collectives: ``$TIDE_TRITON_RUN_GRAPHS`` -- both kinds by default, all-gathers only
with ``all-gathers``, none with ``off`` (docs/constraints.md#same-gpu-copies-run-on-sms: on one GPU every form
of a same-GPU copy, eager or recorded, runs on SMs, so recording changes no copy's engine there).

The capture runs in ``thread_local`` mode on a stream of the rank's own (the transport's
``recording_stream``, never a pooled one: ranks of the single-process mode capture while their
peers enqueue, and torch hands its pooled streams out round-robin) and never synchronizes the device
(``torch.cuda.graph`` would: a peer's stream may be waiting for this rank's next flags).  A
capture the driver refuses leaves nothing behind: the run is made eagerly, and that set of
addresses is never recorded again (logged once).

Deadlines: a replay's flag waits are noted as the rank's pending waits on the stream it
replays on, at every replay (not at capture: nothing waited then), so
:func:`tide_triton.synchronize` names a peer that never signals, as it does for eager runs.
Their progress words (:mod:`tide_triton.transport.progress`: which waits passed) are the
recording's own, one per stream it captured, numbered 1..k in the graph and written to 0 by the
graph's first node (``recording_started``, right after the capture begins).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..runtime import host_capture
from ..transport._once import log_once

class RunGraph:
    """A recorded run: ``graph`` (``torch.cuda.CUDAGraph``, or a ``HostGraph`` on the host
    transport) and, on CUDA, the flag waits it holds (slot -> the transport's pending-wait
    entry -- value, peer, stream, what, progress word, sequence number -- noted again at each
    replay)."""

    __slots__ = ("graph", "waits", "exec_handle")

    def __init__(self, graph: Any, waits: dict) -> None:
        self.graph, self.waits = graph, waits
        raw = getattr(graph, "raw_cuda_graph_exec", None)  # torch >= 2.8
        self.exec_handle = raw() if raw is not None and not isinstance(graph, host_capture.HostGraph) else None

    def replay(self, t: Any, stream: Any) -> None:
        """Launch the recorded run on ``stream`` (CUDA: after the work already there): one
        ``cuGraphLaunch`` through the transport where it has one (``CUDAGraph.replay`` adds
        stream and device switches around the same launch; the recordings hold no RNG state
        for it to advance)."""
        if isinstance(self.graph, host_capture.HostGraph):
            self.graph.replay()
            return
        if self.exec_handle is not None and hasattr(t, "launch_graph_exec"):
            t.launch_graph_exec(self.exec_handle, stream)
        else:
            with torch.cuda.stream(stream):
                self.graph.replay()
        t.note_waits(self.waits, stream)


def record(t: Any, device: torch.device, run: Callable[[Any], None]) -> RunGraph | None:
    """``run(stream)`` -- a prepared run's captured path on ``stream`` -- recorded without
    running it; None where the driver refuses the capture (logged once per reason)."""
    if device.type != "cuda":
        graph = host_capture.HostGraph()
        with host_capture.capture(graph):
            run(None)
        return RunGraph(graph, {})
    side = t.recording_stream()  # the rank's own: a pooled stream may be another rank's (single-process mode)
    side.wait_stream(torch.cuda.current_stream(device))  # nothing runs in a capture: only its order
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), torch.cuda.stream(side), t.recording_waits() as waits:
        try:
            graph.capture_begin(capture_error_mode="thread_local")
        except RuntimeError as e:
            _log_refused(e)
            return None
        try:
            t.recording_started(side)  # the graph's first node: its progress words back to 0
            run(side)
        except RuntimeError as e:  # e.g. an operation the capture refuses: the run goes eager
            _end_quietly(graph)
            _log_refused(e)
            return None
        except BaseException:  # never leave the stream capturing
            _end_quietly(graph)
            raise
        try:
            graph.capture_end()
        except RuntimeError as e:
            _log_refused(e)
            return None
    return RunGraph(graph, dict(waits))


def _end_quietly(graph: Any) -> None:
    try:
        graph.capture_end()
    except RuntimeError:
        pass  # the capture was invalidated already: nothing was recorded


def _log_refused(e: BaseException) -> None:
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    log_once(f"run-graph-refused:{why}", logging.WARNING, "tide_triton: a prepared run could not be recorded as a "
             "CUDA graph (%s); runs on those addresses stay eager", why)
