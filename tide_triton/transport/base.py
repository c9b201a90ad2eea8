"""The interface the executors call on a transport: a symmetric heap, copies, and flags.

A transport connects the ``local_size`` ranks of one node.  Each rank owns a *heap*: one
byte range that every peer can address (host shared memory, or a VMM allocation exported
as a POSIX file descriptor and mapped by every peer).  Collectives only ever name
``(rank, byte offset)`` pairs in the heap; the transport turns them into addresses.

Flags are 64-bit words at the start of every heap (offsets ``[0, 8 * n_flags)``); values
only grow (epochs), so no flag ever needs resetting.

:class:`Transport` is what every transport implements (:class:`~.host.HostTransport`,
:class:`~.cuda.CudaTransport`, :class:`~.node_view.GlobalRanks` around either);
:class:`DeviceTransport` adds what only the GPU transports have (a copy stream, host waits
on it, strided copies, recorded runs).  ``tests/test_transport_protocol.py`` checks the three classes against both
structurally, so the interface stays current: a method the executors start calling goes
here first.
"""
from __future__ import annotations

from typing import Any, ContextManager, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Transport(Protocol):
    """One rank's end of a node-local transport (see the module notes)."""

    rank: int
    """This rank's number (global for :class:`~.node_view.GlobalRanks`)."""
    local_size: int
    """Ranks the transport connects."""
    n_flags: int
    """Flag words per rank."""
    device: torch.device
    """Where this rank's heap views and streams live."""
    rank_offset: int
    """Added to rank numbers in errors and timeouts: a node-local transport of a several-node
    group names global ranks (:class:`~.node_view.GlobalRanks` sets it)."""

    def ensure_heap(self, nbytes: int) -> None:
        """Collective over the node: every heap holds at least ``nbytes`` bytes (flags
        included), grown by whole segments; existing contents and addresses stay valid.
        No communication when every heap is large enough already."""

    def heap_nbytes(self) -> int:
        """Bytes in this rank's heap, flags included."""

    def release_range(self, offset: int, nbytes: int) -> None:
        """Collective over the node: unmap heap bytes ``[offset, offset + nbytes)`` (whole
        segments, else ValueError on every rank) on every rank -- its own mapping and its
        mappings of every peer's -- and release their memory, once every queue that may touch
        the heaps is idle.  The addresses stay reserved: :meth:`restore_range` maps new memory
        there (contents are not kept).  In the single-process mode each rank's call releases
        its own range; the caller orders the ranks (no rank may still address a peer's range)."""

    def restore_range(self, offset: int, nbytes: int) -> None:
        """Collective over the node: map new memory at the released segments of ``[offset,
        offset + nbytes)`` on every rank and every peer's mapping of them (the same addresses,
        so existing views stay valid; the contents are undefined).  A no-op for segments that
        are mapped; every rank must have released the same ones."""

    def address(self, rank: int, offset: int) -> int:
        """Address, in this process, of byte ``offset`` of ``rank``'s heap (0 = flag 0)."""

    def heap_tensor(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` view of ``numel`` elements of ``rank``'s heap at byte ``offset``
        (no copy; valid until :meth:`close`)."""

    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int]) -> Any:
        """Check and convert byte copies ``srcs[i] -> dsts[i]`` (addresses) once, for
        :meth:`copy_prepared` to enqueue many times."""

    def copy_prepared(self, prepared: Any, *, stream: Any = None, capturable: bool = False) -> None:
        """Enqueue a :meth:`prepare_copies` result on the copy queue (or ``stream``), after
        everything already there; pieces may run in any order among themselves.
        ``capturable``: only operations a CUDA graph capture records (no batch call, no
        nested graph launch) -- the copy queue is being captured."""

    def on_copy_queue(self, fn: Any) -> None:
        """Call ``fn(stream)`` -- SM-side work, a kernel launch on ``stream`` (the copy queue's
        ``torch.cuda`` stream; None on the host) -- so that what it enqueues runs in the copy
        queue's order (after the waits and copies enqueued there before, before those enqueued
        after)."""

    def warm_replays(self, lists: Sequence[Any]) -> None:
        """Before a collective enqueues flag waits: capture the prepared ``lists`` that
        :meth:`copy_prepared` will replay as graphs at their next use (nothing that might
        synchronize the device may run once a peer waits on this rank)."""

    def replays(self, prepared: Any) -> bool:
        """Whether :meth:`copy_prepared` enqueues ``prepared`` as one replayed graph (one
        queue entry, nothing for the host to pace) rather than descriptor by descriptor."""

    def copy(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
             stream: Any = None) -> None:
        """:meth:`prepare_copies` then :meth:`copy_prepared`, for one-off copies."""

    def signal(self, rank: int, slot: int, value: int, *, stream: Any = None) -> None:
        """After everything enqueued before it on the copy queue (or ``stream``), write
        ``value`` into flag ``slot`` of ``rank``."""

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: Any = None) -> None:
        """:meth:`signal` to several flags of several ranks (one driver call where it can)."""

    def wait_all_equal(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                       timeout_s: float, stream: Any = None, what: str = "") -> None:
        """Wait until each local flag ``slots[i]`` holds exactly ``values[i]`` (a token or a
        call identity, which no other value satisfies); on the copy queue (or ``stream``)."""

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float, stream: Any = None,
             what: str = "") -> None:
        """Later queue work waits until local flag ``slot`` is ``>= value`` (set by
        ``peer``); a wait that outlives ``timeout_s`` raises
        :class:`~tide_triton.errors.PeerTimeoutError` naming ``peer`` (at once on the host,
        at the next host wait on a GPU)."""

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: Any = None, what: str = "") -> None:
        """:meth:`wait` on several local flags; ``what`` may hold ``{peer}``."""

    def read_flag(self, slot: int) -> int:
        """The current value of this rank's flag ``slot``, read from the host."""

    def host_wait_event(self, event: Any, *, timeout_s: float) -> None:
        """Block the host until ``event`` completed (pacing); after ``timeout_s`` raise
        ``PeerTimeoutError`` naming the peer of a pending wait still short."""

    def fence_from(self, stream: Any) -> None:
        """The copy queue waits for work already enqueued on ``stream``."""

    def fence_to(self, stream: Any) -> None:
        """``stream`` waits for work already enqueued on the copy queue."""

    def mark(self) -> Any:
        """A point on the copy queue, now (an event on a GPU); for :meth:`wait_mark`."""

    def wait_mark(self, mark: Any, stream: Any = None) -> None:
        """``stream`` waits until the copy queue has passed ``mark`` (None: nothing to wait for)."""

    def session(self) -> ContextManager[Any]:
        """A context that keeps the transport ready for many enqueues in a row (the CUDA
        context held current); a no-op where there is nothing to hold."""

    def close(self) -> None:
        """Unmap and free everything this rank holds; local (no collective), idempotent."""


@runtime_checkable
class DeviceTransport(Transport, Protocol):
    """A :class:`Transport` whose copy queue is a GPU stream."""

    strided_copies: bool
    """:meth:`prepare_copies` takes ``strided=`` runs ``(dst, src, nbytes, rows, dst_pitch,
    src_pitch)`` of equal rows (:class:`tide_triton.executors.copy_plan.Strided`), one descriptor each."""

    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
                       strided: Sequence[Any] = ()) -> Any:
        """:meth:`Transport.prepare_copies`, with strided runs (:attr:`strided_copies`)."""

    def busy_error(self, what: str) -> BaseException:
        """The error for a device wait past its deadline: ``PeerTimeoutError`` naming a peer
        that this rank's pending stream waits wait for, else ``TimeoutError``."""

    def settle_device_wide(self, what: str) -> None:
        """Before ``what``, a driver call that waits for every stream of this process
        (:mod:`tide_triton.runtime.device_wide`): wait, with the deadline, until this rank's streams are
        idle -- what that call would wait for anyway, but ending in ``PeerTimeoutError`` naming
        the peer they wait for, not in a thread stopped inside the driver."""

    def stream_capturing(self, stream: Any) -> bool:
        """Whether ``stream`` (None: the device's current stream) is being captured into a CUDA
        graph.  The answer holds for this thread's wait batches until its next query: under a
        capture they write no progress word (a prepared run asks before each run)."""

    def user_capture_ended(self) -> None:
        """A prepared run inside a user's capture is enqueued whole: this thread's waits get
        progress words again (see :meth:`stream_capturing`)."""

    def recording_stream(self) -> Any:
        """This rank's own stream for recording prepared runs into graphs (never a pooled one)."""

    def recording_waits(self) -> ContextManager[dict]:
        """``with t.recording_waits() as waits:`` the flag waits enqueued meanwhile -- a run
        being recorded into a graph -- go into ``waits``, not into this rank's pending waits
        (nothing waits until a replay: :meth:`note_waits`); their progress words are the
        recording's own (entered before the capture begins: it sets them aside)."""

    def recording_started(self, stream: Any) -> None:
        """Right after a recording's capture began on ``stream``, before anything else is
        recorded: the graph's first node writes the recording's progress words to 0, so each
        replay's waits count as not passed until they do."""

    def launch_graph_exec(self, handle: int, stream: Any) -> None:
        """Launch an instantiated CUDA graph (its ``cudaGraphExec_t``) on ``stream``."""

    def note_waits(self, waits: dict, stream: Any) -> None:
        """A replay of a graph holding ``waits`` (:meth:`recording_waits`) was launched on
        ``stream``: its waits are pending there (what :meth:`synchronize` names when stuck)."""

    @property
    def copy_stream(self) -> Any:
        """The ``torch.cuda`` stream every copy (and by default every signal and wait) goes on."""

    def synchronize(self, *, timeout_s: float, stream: Any = None, poll: Any = None) -> None:
        """Block the host until the copy stream (or ``stream``) is idle; after ``timeout_s``
        raise ``PeerTimeoutError`` naming the peer of a pending wait still short, else
        ``TimeoutError``.  ``poll()``, where given, runs now and then during the wait and
        may raise (a peer's published abort)."""

    def host_wait_flag(self, slot: int, value: int, peer: int, timeout_s: float, what: str = "") -> int:
        """Block the host until local flag ``slot`` >= ``value``; returns the value read;
        ``PeerTimeoutError(peer)`` after ``timeout_s``."""
