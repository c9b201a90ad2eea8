"""The CUDA transport: a symmetric VMM heap per rank, copy-engine copies, SM-free flags.

:class:`CudaTransport` implements :class:`~tide_triton.transport.base.DeviceTransport` for
one rank and holds its parts, each in its own module:

* :mod:`~tide_triton.transport.vmm` -- the heap: reserved addresses, physical segments,
  peers' mappings, access for every device that touches them, rollback, teardown;
  :mod:`~tide_triton.transport.heap_rounds` -- its growth as a collective round, with the
  segment fds passed by :mod:`~tide_triton.transport.handles`.
* :mod:`~tide_triton.transport.streams` -- the rank's streams, fence events, host reads.
* :mod:`~tide_triton.transport.copies` and :mod:`~tide_triton.transport.copy_graphs` --
  copies (``cuMemcpyBatchAsync`` or a ``cuMemcpyAsync`` loop) and their graph replays.
* :mod:`~tide_triton.transport.flags` and :mod:`~tide_triton.transport.waits` -- signals and
  stream waits (stream memory operations), the pending-wait ledger, host waits with deadlines.

This module owns the options (:class:`CudaOptions`), the wiring of the parts at creation
(whose exchange rounds are :mod:`~tide_triton.transport.cuda_setup`'s), the single-process mode
(:meth:`CudaTransport.create_local_group`), release and restore of heap ranges, and closing.

Heap offsets (``address``, ``heap_tensor``, ``ensure_heap``) count from the heap's start, as
in the host transport: ``[0, 8 * n_flags)`` are the flags (int64 words, zeroed at creation,
values only grow); the caller lays out its data after them.  A small hidden region below
offset 0 holds the transport's own words (:class:`~.flags.HiddenWords`).

Devices: peers may share a GPU or sit on different GPUs of the node, in any mix.  Between
distinct GPUs the creation checks ``cuDeviceCanAccessPeer`` both ways and every rank raises
the same error, naming both ranks and devices, when two cannot reach each other.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..runtime import device_wide
from ..errors import PeerTimeoutError
from . import driver
from ._once import describe, round_up
from .copies import COPY_MODES, Copies, PreparedCopies
from .copy_graphs import CopyGraphs
from .cuda_setup import (access_problems, as_device, check_int, choose_signal_path, device_uuid,
                         LocalGroup, local_placement, placement, probe_local_signals, rendezvous,
                         reserve_peers)
from .driver import CtxGuard, Transaction, check
from .flags import SIGNAL_MODES, Flags, HiddenWords
from .handles import FD_PASSING, FdChannel
from .heap_rounds import HeapRounds
from .streams import RankStreams
from .views import heap_view
from .vmm import SEGMENT_BYTES, VA_BYTES, VmmHeap, quiet
from .waits import Pending, WaitLedger

log = logging.getLogger("tide_triton")

_DRAIN_TIMEOUT_S = 30.0
AUTO_COPY_MODE = "auto"
"""Diagnostics: what ``copy_mode="auto"`` resolves to (``"batch"`` or ``"loop"`` pin the copy
path of every transport made without an explicit ``copy_mode``)."""
_RELEASE_DRAIN_S = 5.0
"""How long a close waits for streams released from their stuck flag waits (see
:meth:`~tide_triton.transport.waits.WaitLedger.release_at_close`)."""


@dataclass(frozen=True, kw_only=True)
class CudaOptions:
    """How a :class:`CudaTransport` is built; every rank of a group must pass equal options."""

    n_flags: int = 1024
    """int64 flag words per rank (heap offsets ``[0, 8 * n_flags)``)."""
    segment_bytes: int = SEGMENT_BYTES
    """The heap grows by multiples of this (rounded up to the allocation granularity)."""
    va_bytes: int = VA_BYTES
    """Addresses reserved per rank: the most the heap can grow to."""
    signal_mode: str = "auto"
    """``"auto"`` (probe at creation), ``"direct"`` (stream writes into peers' flags) or
    ``"copy"`` (a scratch word + an 8-byte copy-engine copy)."""
    copy_mode: str = "auto"
    """``"auto"`` (:data:`AUTO_COPY_MODE`, else probe), ``"batch"``
    (``cuMemcpyBatchAsync``) or ``"loop"`` (``cuMemcpyAsync`` per piece)."""
    fd_passing: str = "auto"
    """``"auto"`` (Unix socket, then ``pidfd_getfd`` for what did not arrive), ``"socket"``
    or ``"pidfd"``."""
    timeout_s: float = 120.0
    """Bound of every rendezvous step (seconds)."""

    def __post_init__(self) -> None:
        check_int("n_flags", self.n_flags, 1)
        check_int("segment_bytes", self.segment_bytes, 1)
        check_int("va_bytes", self.va_bytes, 1)
        for name, value, allowed in (("signal_mode", self.signal_mode, SIGNAL_MODES),
                                     ("copy_mode", self.copy_mode, COPY_MODES),
                                     ("fd_passing", self.fd_passing, FD_PASSING)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    def resolved(self) -> "CudaOptions":
        """With ``copy_mode="auto"`` replaced by :data:`AUTO_COPY_MODE`."""
        if self.copy_mode != "auto":
            return self
        if AUTO_COPY_MODE not in COPY_MODES:
            raise ValueError(f"tide_triton.transport.cuda.AUTO_COPY_MODE must be one of {COPY_MODES}, "
                             f"got {AUTO_COPY_MODE!r}")
        return dataclasses.replace(self, copy_mode=AUTO_COPY_MODE)


def _options(options: CudaOptions | None, **given: Any) -> CudaOptions:
    """``options`` with the keywords that were given (not None) applied on top."""
    if options is not None and not isinstance(options, CudaOptions):
        raise TypeError(f"options must be a CudaOptions, got {type(options).__name__}")
    given = {k: v for k, v in given.items() if v is not None}
    base = options or CudaOptions()
    return dataclasses.replace(base, **given) if given else base




class CudaTransport:
    """The :class:`~tide_triton.transport.base.DeviceTransport` of one rank over CUDA.

    ``exchange(obj) -> list`` is an all-gather of small picklable objects among the
    node's ``local_size`` ranks (e.g. ``dist.all_gather_object`` on a gloo group); the
    constructor and :meth:`ensure_heap` are collective through it, and every rank's error
    is shared so a failure raises on every rank (and rolls back everywhere).

    ``device`` is this rank's GPU (peers may share it or use other GPUs of the node).
    ``options`` (:class:`CudaOptions`) sets the rest; the keywords ``n_flags`` ...
    ``timeout_s`` are kept for existing callers and override fields of ``options``.

    ``close()`` also runs on ``with`` exit and (errors swallowed) in ``__del__``.  Methods
    documented in :mod:`~tide_triton.transport.base` say here only what is CUDA's.
    """

    leaked: bool = False
    """Set by a close that left the heap mapped because the streams did not drain."""
    strided_copies = True  # cuMemcpy2DAsync, or 3DAsync of sub-rows (transport.copies.sub_row_bytes)

    def __init__(self, rank: int, local_size: int, exchange: Callable[[Any], Sequence[Any]] | None, *,
                 device: torch.device | str | int, options: CudaOptions | None = None, n_flags: int | None = None,
                 segment_bytes: int | None = None, va_bytes: int | None = None, signal_mode: str | None = None,
                 copy_mode: str | None = None, fd_passing: str | None = None, timeout_s: float | None = None,
                 _local_group: bool = False, _access_devices: Sequence[int] = ()) -> None:
        self._closed = True  # until the heap exists: close() and __del__ do nothing
        check_int("rank", rank, 0)
        check_int("local_size", local_size, 1)
        if not rank < local_size:
            raise ValueError(f"rank must be in [0, {local_size}), got {rank}")
        opts = _options(options, n_flags=n_flags, segment_bytes=segment_bytes, va_bytes=va_bytes,
                        signal_mode=signal_mode, copy_mode=copy_mode, fd_passing=fd_passing,
                        timeout_s=timeout_s).resolved()
        if not _local_group and not callable(exchange):
            raise TypeError(f"exchange must be callable, got {type(exchange).__name__}")
        self.rank, self.local_size, self.n_flags = rank, local_size, opts.n_flags
        self.options, self.device = opts, as_device(device)
        self._exchange, self._local = exchange, _local_group
        self._peers: LocalGroup | None = None  # the members of a single-process group
        self._channel: FdChannel | None = None
        self._words = HiddenWords.of(local_size, opts.n_flags)
        self._cu = driver.init()
        with Transaction() as tx:
            err: str | None = None
            try:
                self._setup_local(tx, _access_devices)
            except Exception as exc:  # noqa: BLE001 - shared with the peers below
                if self._local:
                    raise
                err = describe(exc)
            if not self._local:
                infos = rendezvous(self._allgather, self._channel, rank=rank, local_size=local_size, options=opts,
                                   err=err, uuid=getattr(self, "_uuid", b""), device=self.device)
                reserve_peers(self._allgather, self._heap, tx, lambda: access_problems(
                    self._cu, self._cudev, self._uuid, rank=rank, device=self.device, infos=infos),
                    rank=rank, local_size=local_size)
            self._bases = [self._heap.peer_va.get(p, 0) for p in range(local_size)]
            self._flags.bases = self._bases
            self._bases[rank] = self._heap.own_va
            tx.on_rollback(self._heap.release_segments)
            self._rounds.grow(round_up(self._words.user_off + 8 * self.n_flags, self._heap.gran))
            own = self._heap.own_va
            self._copies.choose_path(opts.copy_mode, probe_src=own + self._words.probe_off,
                                     probe_dst=own + self._words.scratch_off,
                                     ranks_in_process=self.local_size if self._local else 1)
            self._flags.signal_path = choose_signal_path(self._allgather, self._flags, mode=opts.signal_mode,
                                                         rank=rank, local_size=local_size, local=self._local)
            self._flags.choose_memop_path()
            self._closed = False
        if not self._local or self.local_size == 1:  # one rank in this process: see device_wide
            device_wide.register(self)

    def _setup_local(self, tx: Transaction, access_devices: Sequence[int]) -> None:
        """This rank's parts: context, heap, streams, wait ledger, flags, copies, fd channel."""
        cu, rank = self._cu, self.rank
        self._cudev, self._ctx = driver.device_context(self.device)
        tx.on_rollback(cu.cuDevicePrimaryCtxRelease, self._cudev)
        guard = self._guard = CtxGuard(self._ctx)
        heap = self._heap = VmmHeap(cu, guard, rank=rank, device_index=self.device.index,
                                    access_devices=access_devices, segment_bytes=self.options.segment_bytes,
                                    va_bytes=self.options.va_bytes, tx=tx)
        streams = self._streams = RankStreams(cu, guard, rank=rank, local_size=self.local_size,
                                              device=self.device, tx=tx)
        self._waits = WaitLedger(cu, guard, streams, rank=rank, own_flags=heap.own_va + self._words.user_off)
        self._flags = Flags(cu, guard, streams, self._waits, rank=rank, local_size=self.local_size,
                            n_flags=self.n_flags, own_va=heap.own_va, words=self._words)
        self._copy_graphs = CopyGraphs(cu, guard, streams, rank=rank)
        self._copies = Copies(cu, guard, streams, self._copy_graphs, rank=rank, device=self.device)
        self._uuid = device_uuid(cu, self._cudev, self.device.index)
        if not self._local:
            self._channel = FdChannel(rank, self.local_size, fd_passing=self.options.fd_passing,
                                      timeout_s=self.options.timeout_s, tx=tx)
        flag_words = self._words.user_off + 8 * self.n_flags
        self._rounds = HeapRounds(heap, self._channel, None if self._local else self._allgather, rank=rank,
                                  local_size=self.local_size, user_off=self._words.user_off,
                                  zero_words=lambda: self._flags.zero_words(flag_words))

    def _allgather(self, obj: Any) -> list[Any]:
        out = list(self._exchange(obj))  # type: ignore[misc]
        if len(out) != self.local_size:
            raise RuntimeError(f"exchange must return local_size={self.local_size} items, got {len(out)}")
        return out

    @classmethod
    def create_local_group(cls, local_size: int, *, device: torch.device | str | int | None = None,
                           devices: Sequence[torch.device | str | int] | None = None,
                           options: CudaOptions | None = None, n_flags: int | None = None,
                           segment_bytes: int | None = None, va_bytes: int | None = None,
                           signal_mode: str | None = None, copy_mode: str | None = None) -> list["CudaTransport"]:
        """``local_size`` transports driven from this one process, placed by
        :func:`~tide_triton.transport.cuda_setup.placement`.  Each rank has its own heap and copy
        stream; a peer's heap is addressed through the peer's own mapping (no fd exchange), which
        grants access to every device of the group (distinct GPUs must have peer access: checked).
        ``ensure_heap`` is then called once per rank.  Close every member (or :meth:`close_group`)."""
        devs = placement(local_size, device, devices)
        opts = _options(options, n_flags=n_flags, segment_bytes=segment_bytes, va_bytes=va_bytes,
                        signal_mode=signal_mode, copy_mode=copy_mode)
        distinct = local_placement(devs)
        group: list[CudaTransport] = []
        with Transaction() as tx:
            for r in range(local_size):
                t = cls(r, local_size, None, device=devs[r], options=opts, _local_group=True,
                        _access_devices=distinct)
                tx.on_rollback(t.close)
                group.append(t)
            bases = [t._heap.own_va for t in group]
            members = LocalGroup(group)
            for t in group:
                t._peers = members
                t._bases = t._flags.bases = list(bases)
            if len(distinct) > 1 and opts.signal_mode == "auto" and local_size > 1:
                probe_local_signals([t._flags for t in group])
        return group

    @staticmethod
    def close_group(group: Sequence["CudaTransport"]) -> None:
        """Close every transport of a local group (each drains all copy streams first)."""
        for t in group:
            t.close()

    # ---- the heap ---------------------------------------------------------------------------
    def ensure_heap(self, nbytes: int) -> None:
        """Collective: :mod:`~tide_triton.transport.heap_rounds`."""
        self._check_open()
        self._rounds.ensure(nbytes)

    def heap_nbytes(self) -> int:
        return self._rounds.nbytes()

    def _mapped_of(self, rank: int) -> int:
        return self._heap.mapped if self._peers is None else self._peers.member(rank)._heap.mapped

    def busy_error(self, what: str) -> BaseException:
        peers = self._waits.stuck_peers()
        if peers:
            return PeerTimeoutError(min(peers), f"{what}: this rank's streams wait for ranks {sorted(peers)}",
                                    self.options.timeout_s)
        return TimeoutError(f"rank {self.rank}: {what} after {self.options.timeout_s:.1f} s")

    def settle_device_wide(self, what: str) -> None:
        if self._closed:
            return
        if not self._drain(self.options.timeout_s):
            raise self.busy_error(f"before {what}, which waits for every stream of this process")

    def release_range(self, offset: int, nbytes: int) -> None:
        """Blocks until every stream that may touch the heaps is idle (the devices too) first."""
        self._check_open()
        start, end = self._rounds.user_range(offset, nbytes)
        self._rounds.release(start, end, settle=self._settle_for_release)

    def _settle_for_release(self) -> None:
        """Every stream that may touch the heaps idle, and the devices (the members' too in the
        single-process mode), within the deadline -- else the error naming the peer waited for."""
        devs = {self.device, *(t.device for t in (self._peers.open_members() if self._peers else ()))}
        for d in devs:  # with a deadline: a stream stuck on a dead peer's flag never ends
            driver.wait_with_deadline(lambda d=d: torch.cuda.synchronize(d), self.options.timeout_s,
                                      lambda d=d: self.busy_error(f"release_range: {d} still busy"))
        if not self._drain(self.options.timeout_s):
            raise self.busy_error("release_range: streams still busy")

    def restore_range(self, offset: int, nbytes: int) -> None:
        self._check_open()
        start, end = self._rounds.user_range(offset, nbytes)
        self._rounds.restore(start, end, f"restore_range({offset}, {nbytes})")

    # ---- addresses and views ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CudaTransport(rank={self.rank}) is closed")

    @property
    def rank_offset(self) -> int:
        """Added to rank numbers in errors and timeouts: a node-local transport of a
        several-node group names global ranks (set by the owner after creation)."""
        return self._waits.rank_offset if hasattr(self, "_waits") else 0

    @rank_offset.setter
    def rank_offset(self, value: int) -> None:
        self._waits.rank_offset = value

    def address(self, rank: int, offset: int) -> int:
        self._flags.check_rank("rank", rank)
        return self._bases[rank] + self._words.user_off + offset

    def heap_tensor(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """On this rank's device also where ``rank``'s heap sits on another GPU (peer access)."""
        self._check_open()
        self._flags.check_rank("rank", rank)
        return heap_view(rank, offset, numel, dtype, self.device,
                         heap_size=lambda: self._mapped_of(rank) - self._words.user_off,
                         address=lambda: self.address(rank, offset))

    # ---- copies -----------------------------------------------------------------------------
    @property
    def copy_stream(self) -> torch.cuda.Stream:
        return self._streams.copy_stream

    def on_copy_queue(self, fn: Callable[[Any], None]) -> None:  # the caller holds the device current
        fn(self._streams.copy_stream)

    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
                       strided: Sequence[Any] = ()) -> PreparedCopies:
        """Converting addresses to driver objects costs ~10x the enqueue itself.  ``strided``:
        runs ``(dst, src, nbytes, rows, dst_pitch, src_pitch)`` of equal rows
        (:class:`tide_triton.executors.copy_plan.Strided`), one ``cuMemcpy2DAsync`` / ``cuMemcpy3DAsync`` each."""
        return self._copies.prepare_copies(dsts, srcs, nbytes, strided=strided)

    def copy_prepared(self, prepared: PreparedCopies, *, stream: torch.cuda.Stream | None = None,
                      capturable: bool = False) -> None:
        self._check_open()
        self._copies.copy_prepared(prepared, stream=stream, capturable=capturable)

    def warm_replays(self, lists: Sequence[Any]) -> None:
        self._check_open()
        self._copy_graphs.warm_replays(lists)

    def replays(self, prepared: PreparedCopies) -> bool:
        """From a list's second or third use on (``$TIDE_TRITON_COPY_GRAPHS``)."""
        return prepared.replay.get("graph") is not None

    def copy(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
             stream: torch.cuda.Stream | None = None) -> None:
        """Each piece must lie inside one allocation on either side (a tensor's bytes: the
        driver refuses a copy across two); :meth:`prepare_copies` cuts lists that may not."""
        self._check_open()
        # raw pieces, each inside one tensor: no allocation cut (nor its driver queries) per call
        self._copies.copy_prepared(self._copies.prepare_copies(dsts, srcs, nbytes, cut=False), stream=stream)

    # ---- flags ------------------------------------------------------------------------------
    def signal(self, rank: int, slot: int, value: int, *, stream: torch.cuda.Stream | None = None) -> None:
        self._check_open()
        self._flags.signal(rank, slot, value, stream=stream)

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: torch.cuda.Stream | None = None) -> None:
        self._check_open()
        self._flags.signal_all(ranks, slots, values, stream=stream)

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float,
             stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """The stream cannot time out by itself: :meth:`synchronize` (or :meth:`host_wait_flag`)
        raises ``PeerTimeoutError(peer)`` once ``timeout_s`` has passed."""
        self._check_open()
        self._flags.wait(slot, value, peer=peer, timeout_s=timeout_s, stream=stream, what=what)

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """One ``cuStreamBatchMemOp`` (one ``cuStreamWaitValue64`` each where batches are refused)."""
        self._check_open()
        self._flags.wait_all(slots, values, peers=peers, timeout_s=timeout_s, stream=stream, what=what)

    def wait_all_equal(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                       timeout_s: float, stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """``CU_STREAM_WAIT_VALUE_EQ``: a peer's later call identity must not satisfy it."""
        self._check_open()
        self._flags.wait_all(slots, values, peers=peers, timeout_s=timeout_s, stream=stream, what=what, equal=True)

    def read_flag(self, slot: int, rank: int | None = None) -> int:
        """Of ``rank`` (default: this rank), read on a private stream (never waits for the copy stream)."""
        self._check_open()
        return self._flags.read_flag(slot, rank)

    def host_wait_flag(self, slot: int, value: int, peer: int, timeout_s: float, what: str = "") -> int:
        return self._flags.host_wait_flag(slot, value, peer, timeout_s, what)

    # ---- recorded runs ----------------------------------------------------------------------
    def recording_waits(self) -> ContextManager[dict[int, Pending]]:
        return self._waits.recording_waits()

    def recording_started(self, stream: torch.cuda.Stream) -> None:
        self._check_open()
        self._flags.recording_started(stream)

    def recording_stream(self) -> torch.cuda.Stream:
        return self._streams.recording_stream()

    def launch_graph_exec(self, handle: int, stream: torch.cuda.Stream) -> None:
        self._check_open()
        self._streams.launch_graph_exec(handle, stream)

    def stream_capturing(self, stream: torch.cuda.Stream | None) -> bool:
        """One driver call, where torch's query costs several."""
        return self._waits.stream_capturing(stream if stream is not None else torch.cuda.current_stream(self.device))

    def user_capture_ended(self) -> None:
        self._waits.user_capture_ended()

    def note_waits(self, waits: dict[int, Pending], stream: torch.cuda.Stream) -> None:
        self._waits.note_waits(waits, stream)

    # ---- streams and host waits -------------------------------------------------------------
    def fence_from(self, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` defaults to the current stream of this device."""
        self._check_open()
        self._streams.fence_copy_from(stream)

    def fence_to(self, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` defaults to the current stream of this device."""
        self._check_open()
        self._streams.fence_copy_to(stream)

    def mark(self) -> torch.cuda.Event:
        self._check_open()
        return self._streams.copy_stream.record_event()

    def wait_mark(self, mark: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        if mark is not None:
            (torch.cuda.current_stream(self.device) if stream is None else stream).wait_event(mark)

    def session(self) -> CtxGuard:  # each enqueue inside skips its own context push/pop
        return self._guard

    def host_wait_event(self, event: Any, *, timeout_s: float) -> None:
        self._waits.host_wait_event(event, timeout_s=timeout_s)

    def synchronize(self, *, timeout_s: float, stream: torch.cuda.Stream | None = None,
                    poll: Callable[[], None] | None = None) -> None:
        """``poll`` runs every 50 ms of the wait."""
        self._check_open()
        self._waits.synchronize(timeout_s=timeout_s, stream=stream, poll=poll)

    # ---- teardown ---------------------------------------------------------------------------
    def _drain(self, timeout_s: float) -> bool:
        """Wait (polling, bounded) until every stream that may touch the heaps is idle --
        in the single-process mode also every open member's (queried in its own context,
        which may be another GPU's)."""
        deadline = time.monotonic() + timeout_s
        members = [self, *(t for t in (self._peers.open_members() if self._peers else ()) if t is not self)]
        return all(t._streams.drain(t._streams.busy_streams(), deadline) for t in members)

    def close(self, *, drain_timeout_s: float = _DRAIN_TIMEOUT_S,
              may_release: Callable[[set[int]], bool] | None = None) -> None:
        """Waits up to ``drain_timeout_s`` for the streams; if they do not drain, a broken
        group's close (``may_release``) releases this rank's own stuck waits
        (:meth:`~tide_triton.transport.waits.WaitLedger.release_at_close`); if they still do
        not, the memory is leaked instead of unmapped under running copies."""
        if self._closed:
            return
        self._closed = True
        device_wide.unregister(self)
        if not self._drain(drain_timeout_s) and not (may_release is not None and self._waits.release_at_close(
                may_release, self._drain, _RELEASE_DRAIN_S)):
            log.error("rank %d: streams still busy after %.0f s at close; "
                      "leaking the heap rather than unmapping it under running work",
                      self.rank, drain_timeout_s)
            self.leaked = True
            return
        self._heap.release_segments()
        self._heap.free_ranges()
        self._copy_graphs.close(quiet)
        self._waits.close()
        self._streams.close(quiet)
        quiet(self._release_ctx)
        if self._channel is not None:
            self._channel.close()

    def _release_ctx(self) -> None:
        check(self._cu.cuDevicePrimaryCtxRelease(self._cudev), "cuDevicePrimaryCtxRelease")

    def __enter__(self) -> "CudaTransport":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        if not hasattr(self, "_copies"):
            return f"CudaTransport(rank={self.rank}, local_size={self.local_size}, not created)"
        state = "closed" if self._closed else f"heap={self.heap_nbytes()}"
        return (f"CudaTransport(rank={self.rank}, local_size={self.local_size}, "
                f"device={self.device}, {state}, copy={self._copies.copy_path}, "
                f"signal={self._flags.signal_path})")
