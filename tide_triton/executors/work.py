"""What every executor shares: the :class:`Work` handle, the stream policy (:class:`Streams`,
and :func:`bound`: a transport with every operation on one stream), the zeroing of padding
rows, the wait for a staging region's hand-over and the paced enqueue of copy batches.

The executors -- node-local (:mod:`tide_triton.executors.ring`, :mod:`tide_triton.executors.prepared`) and across
nodes (:mod:`tide_triton.executors.across_nodes`) -- run a collective the API has already validated
and agreed; they address the heap through :mod:`tide_triton.plan.heap` and move bytes through the
group's transport.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

import torch

from .copy_plan import plan_copies, prepare_planned

class Work:
    """Handle of a collective.  ``wait()`` makes the current stream wait for it (a no-op
    for the host transport, whose work is complete when the call returns)."""

    def __init__(self, event: object = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()


class Bound:
    """Transport ``t`` with every copy, signal and wait on ``stream`` (:func:`bound`): the
    operations the across-nodes executor and a call's check-in use, each pinned to the stream;
    anything else is not reachable through it (no delegation by name)."""

    __slots__ = ("t", "stream")

    def __init__(self, t: Any, stream: Any) -> None:
        self.t, self.stream = t, stream

    @property
    def device(self) -> Any:
        return self.t.device

    @property
    def host_compute(self) -> Any:
        return getattr(self.t, "host_compute", None)

    @property
    def watch(self) -> Any:
        """The transport's own abort watch (its host waits read it there): set through this
        view by a call's check-in, it must reach the transport, not stay on the view."""
        return self.t.watch

    @watch.setter
    def watch(self, fn: Any) -> None:
        self.t.watch = fn

    def _on(self, k: dict) -> dict:
        """``k`` with this stream: a caller's own ``stream=`` may only be None or name it (the
        host's check_in passes its compute stream, which is this one)."""
        s = k.pop("stream", None)
        if s is not None and s is not self.stream:
            raise RuntimeError(f"internal error: an operation on {s!r} through a transport bound to {self.stream!r}")
        k["stream"] = self.stream
        return k

    def read_flag(self, slot: int) -> int:
        return self.t.read_flag(slot)

    def copy(self, *a: Any, **k: Any) -> None:
        self.t.copy(*a, **self._on(k))

    def on_copy_queue(self, fn: Any) -> None:
        """Kernels meant for the copy queue go on this stream too (on the host: the caller's
        thread, now)."""
        fn(self.stream if isinstance(self.stream, torch.cuda.Stream) else None)

    def copy_prepared(self, *a: Any, **k: Any) -> None:
        self.t.copy_prepared(*a, **self._on(k))

    def signal(self, *a: Any, **k: Any) -> None:
        self.t.signal(*a, **self._on(k))

    def signal_all(self, *a: Any, **k: Any) -> None:
        self.t.signal_all(*a, **self._on(k))

    def wait(self, *a: Any, **k: Any) -> None:
        self.t.wait(*a, **self._on(k))

    def wait_all(self, *a: Any, **k: Any) -> None:
        self.t.wait_all(*a, **self._on(k))

    def wait_all_equal(self, *a: Any, **k: Any) -> None:
        # the call-identity check (Group.check_in) must precede this stream's data movement
        self.t.wait_all_equal(*a, **self._on(k))


def bound(t: Any, stream: Any) -> Bound:
    """``t`` with every copy, signal and wait on ``stream``."""
    return Bound(t, stream)


class Streams:
    """Where a collective's work goes.  Host: everything is synchronous, in program order.

    CUDA: SM work (the Triton sums and casts, under :meth:`kernels`) runs on ``compute``:
    the caller's ``stream`` (default: the current stream), or -- with ``async_op`` or
    ``whole_on_side`` -- the group's side stream (:meth:`Group.side_stream`), after the work
    already on the caller's stream.  Copies and flags go on the transport's copy-engine
    stream (node-local executor), or, with ``whole_on_side`` (cross-node executor: node-local
    copies, flags, sums and NCCL groups in one program order), on ``compute`` as well:
    :attr:`t` is then the transport bound to it.  Not the transport's own copy stream for
    everything: torch work on it (allocations, kernel tables) would be recorded against a
    stream the transport destroys at close, and torch's allocator then fails freeing those
    blocks (seen on the H200 as ``cudaErrorContextIsDestroyed`` after ``Group.close()``).

    :meth:`finish`: with ``async_op`` the returned :class:`Work` carries an event on
    ``compute`` (the caller keeps the tensors alive until ``wait()``); otherwise the caller's
    stream waits for ``compute`` when they differ."""

    def __init__(self, g: Any, t: Any, device: torch.device, stream: object, async_op: bool, *,
                 whole_on_side: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.async_op = async_op
        self.t = t
        self.user = None
        # the host transport's compute stream: the calling thread (None unless its copy queue
        # runs behind it, transport.host.COPY_QUEUE = "async")
        self.compute = getattr(t, "host_compute", None)
        if self.cuda:
            self.user = stream if stream is not None else torch.cuda.current_stream(device)
            if async_op or whole_on_side:
                self.compute = g.side_stream(device)
                self.compute.wait_stream(self.user)
            else:
                self.compute = self.user
        if whole_on_side and self.compute is not None:
            self.t = bound(t, self.compute)

    def kernels(self):
        """Context for SM work: on ``compute`` (GPU)."""
        return torch.cuda.stream(self.compute) if self.cuda else nullcontext()

    def finish(self) -> Work:
        if not self.cuda:
            return Work()
        if self.async_op:
            ev = torch.cuda.Event()
            ev.record(self.compute)
            return Work(ev)
        if self.compute is not self.user:
            self.user.wait_stream(self.compute)
        return Work()


def capturing(stream: object = None, device: object = None) -> bool:
    """Whether ``stream`` (default: the current stream of ``device``, default the current
    device) is being captured into a CUDA graph; False while CUDA is not initialised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    s = stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream(device)
    with torch.cuda.stream(s):
        return torch.cuda.is_current_stream_capturing()


def prepare_padding_zeros(g: Any, t: Any, shard_ptrs: Sequence[int], shard_numels: Sequence[int],
                          real_numels: Sequence[int], elem_bytes: int, device: torch.device) -> Any:
    """The zero-fill of padded shards' padding (the elements past each shard's real ones) as
    copies from the group's zero buffer, prepared once per set of addresses: one transport
    call per collective, not a view and a kernel per padded shard every call (771 at the
    256-expert layer with W=3).  Returns ``(prepared
    copies, the zero buffer -- kept alive with them)``, or None when no shard is padded."""
    pads = [(p, n) for p, n in enumerate(real_numels) if shard_numels[p] > n]
    if not pads:
        return None
    es = elem_bytes
    zeros = g.zeros(device, max(shard_numels[p] - n for p, n in pads) * es)
    z = zeros.data_ptr()
    plan = plan_copies([shard_ptrs[p] + n * es for p, n in pads], [z] * len(pads),
                       [(shard_numels[p] - n) * es for p, n in pads])
    return prepare_planned(t, plan), zeros


def wait_vacated(t: Any, flags: Any, staging: Any, peers: Sequence[int], timeout_s: float) -> None:
    """Slot-Reuse: count a new use of ``staging`` and wait until every rank of ``peers`` has
    vacated its copy that many times -- nobody writes into a peer's region before the peer
    handed it over (:meth:`HeapRegion.vacate`)."""
    e = staging._begin_staging()
    peers = list(peers)
    t.wait_all([flags.vacated(staging.index, d) for d in peers], [e] * len(peers), peers=peers,
               timeout_s=timeout_s, what=f"rank {{peer}} to vacate staging region {staging.key!r} "
               f"(use {e}: its staging.vacate())")


def copy_batches_paced(g: Any, t: Any, device: torch.device, batches: Sequence[Any], ops_per_batch: int,
                       timeout_s: float, *, capturing: bool = False) -> None:
    """Enqueue prepared copy ``batches`` on the copy queue, the host at most a few batches
    ahead of the copy engines (:meth:`Group.pacer`): thousands of descriptors queued behind
    flag waits would fill the driver's queue and block the thread inside the driver.  A batch
    the transport replays as one graph (:meth:`replays`) is one queue entry: not paced.
    ``capturing``: the copy queue is being captured into a CUDA graph -- capturable copies,
    no pacing (nothing reaches the driver's queues until a replay, and a capture cannot wait
    on the host)."""
    if capturing:
        for batch in batches:
            t.copy_prepared(batch, capturable=True)
        return
    pace = g.pacer(device)
    pace.start(ops_per_batch)
    cuda = device.type == "cuda"
    for b, batch in enumerate(batches):
        if not t.replays(batch):
            pace.before(b, t, timeout_s)
        t.copy_prepared(batch)
        if cuda:
            pace.after(b, t.copy_stream)
