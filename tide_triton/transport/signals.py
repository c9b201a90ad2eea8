"""Copies and signals of the CUDA transport: copy engines, stream memory operations, host waits.

Copies
    On a dedicated stream (``copy_stream``, a ``torch.cuda`` stream object so events and the
    caching allocator work with it): one ``cuMemcpyBatchAsync`` per call where the driver
    has it (CUDA >= 12.8), otherwise one ``cuMemcpyAsync`` per piece; the path is chosen at
    creation and logged once.  A stream being captured into a CUDA graph gets the loop
    (``cuMemcpyBatchAsync`` cannot be captured).  Strided runs (equal rows at constant
    pitches, :class:`tide_triton.executor.Strided`) are one ``cuMemcpy2DAsync`` each, or on
    one GPU with wide rows one ``cuMemcpy3DAsync`` of sub-rows (:func:`sub_row_bytes`).
    A prepared list used again (FSDP2's steady state: the same addresses every step) is
    captured once into a CUDA graph of its copies and replayed with one ``cuGraphLaunch``:
    host time per call no longer grows with its descriptors (``$TIDE_TRITON_COPY_GRAPHS``).
    Addresses may lie on another GPU (a peer's heap mapped with peer access): the copy
    engines of this rank's device move the bytes.  No copy or strided run spans two
    allocations: the driver refuses that, so prepared lists are cut where one ends
    (:mod:`tide_triton.transport.allocations`).

Signals
    ``signal`` writes a flag of a peer with ``cuStreamWriteValue64`` -- straight to the
    peer's mapped address where a probe at creation shows that works (also across devices),
    otherwise into a local scratch word followed by an 8-byte copy-engine copy (NCCL's
    CE-collective recipe).  ``wait`` is ``cuStreamWaitValue64(GEQ)`` on the local flag.
    Several of either go in one ``cuStreamBatchMemOp`` where the driver accepts it.  Neither
    uses an SM.

Host waits
    Stream-side waits cannot time out; ``host_wait_flag``, ``host_wait_event`` and
    ``synchronize`` wait from the host with a deadline and raise
    :class:`~tide_triton.errors.PeerTimeoutError` naming the peer of a pending wait whose
    flag is still short -- of the waits that have not passed, the earliest of the stuck stream:
    each wait batch ends with a write of its sequence number into a progress word of its
    stream, which tells a passed wait from a stuck one (:mod:`tide_triton.transport.progress`;
    a token word its reader reset reads short either way).

Why ~1,100 lines: one class owns a rank's streams, and copies, signals and host waits all
enqueue on them and share its pending-wait ledger (which a timeout and a close read); the
copy-graph replay, the path probes and the progress words are the parts that grew it.

Layout of the words this module uses (:class:`HiddenWords`): below heap offset 0 of every
rank, ``local_size`` probe words then ``local_size * n_flags`` scratch words; the flags
are the first ``n_flags`` words at offset 0.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from .. import envs
from .._checks import is_int
from ..errors import PeerTimeoutError
from ..ranges import host_range, in_host_range
from ._once import log_once, round_up
from .allocations import AllocationRanges, split_copies, split_strided
from .driver import CtxGuard, CudaError, Transaction, check, driver_version
from .progress import ProgressWords

log = logging.getLogger("tide_triton")

__all__ = ["CopyEngine", "HiddenWords", "PreparedCopies", "Stuck", "SIGNAL_MODES", "COPY_MODES", "RECORDING_WORDS"]

SIGNAL_MODES = ("auto", "direct", "copy")
COPY_MODES = ("auto", "batch", "loop")

PROBE_MAGIC = 0x7469_6465_0000_0000  # "tide" in the high half, the writer's rank below
_CUDA_ERROR_NOT_READY = 600
_BATCH_MIN_DRIVER = 12080
_DATA_ALIGN = 4096
_MEMOPS_PER_CALL = 255
GRAPH_MIN_DESCRIPTORS = 8
"""Under ``$TIDE_TRITON_COPY_GRAPHS=auto``, the smallest prepared list replayed as a graph:
below it the descriptors cost less host time than a graph launch saves."""
POLL_S = 0.05
"""How often a host wait on a stream runs its ``poll`` (a look for peers' published aborts)."""
SUPERSEDED_KEPT = 1024
"""Pending waits kept after a later wait on the same slot with another progress word replaced
them in the ledger (:meth:`CopyEngine._note_pending`), the most recent."""
RECORDING_WORDS = 4
"""Progress words a recording can take during its capture (its streams: the recording stream
and the copy stream; more get none), set aside before the capture begins."""


SUB_ROWS_MIN_ROW_BYTES = 128 << 10
SUB_ROWS_BYTES = (64 << 10, 512 << 10)
"""A strided run whose both ends lie on this rank's GPU and whose rows span at least
:data:`SUB_ROWS_MIN_ROW_BYTES` goes as a ``cuMemcpy3DAsync`` with each row cut into equal
sub-rows (the largest power of two in :data:`SUB_ROWS_BYTES` dividing the row and both
pitches, at most half a row): the driver runs a same-GPU ``cuMemcpy2DAsync`` of wide rows as a
kernel at ~41% of a contiguous copy's bandwidth, the 3-D form at 59% (64 KiB sub-rows) to 73%
(512 KiB) -- measured on the H200 for the MoE layers' expert rows
(docs/constraints.md#strided-copies-of-wide-rows).  Across GPUs (copy engines over NVLink)
the 2-D form stays: the 3-D one is unmeasured there."""


def memcpy2d_struct(cu: Any, dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int) -> Any:
    """``CUDA_MEMCPY2D`` of ``rows`` device rows of ``nbytes``, at the given pitches."""
    m = cu.CUDA_MEMCPY2D()
    dev = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcMemoryType, m.srcDevice, m.srcPitch = dev, cu.CUdeviceptr(int(src)), int(src_pitch)
    m.dstMemoryType, m.dstDevice, m.dstPitch = dev, cu.CUdeviceptr(int(dst)), int(dst_pitch)
    m.srcXInBytes = m.srcY = m.dstXInBytes = m.dstY = 0
    m.WidthInBytes, m.Height = int(nbytes), int(rows)
    return m


def memcpy3d_struct(cu: Any, dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int,
                    sub: int) -> Any:
    """The same rows as a ``CUDA_MEMCPY3D`` with each row cut into sub-rows of ``sub`` bytes
    (``sub`` divides ``nbytes`` and both pitches): width ``sub``, height ``nbytes // sub``,
    depth ``rows``; a row starts every pitch bytes (pitch ``sub`` x height ``pitch // sub``)."""
    m = cu.CUDA_MEMCPY3D()
    dev = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcMemoryType, m.srcDevice, m.srcPitch, m.srcHeight = dev, cu.CUdeviceptr(int(src)), sub, int(src_pitch) // sub
    m.dstMemoryType, m.dstDevice, m.dstPitch, m.dstHeight = dev, cu.CUdeviceptr(int(dst)), sub, int(dst_pitch) // sub
    m.srcXInBytes = m.srcY = m.srcZ = m.srcLOD = m.dstXInBytes = m.dstY = m.dstZ = m.dstLOD = 0
    m.WidthInBytes, m.Height, m.Depth = sub, int(nbytes) // sub, int(rows)
    return m


def sub_row_bytes(nbytes: int, dst_pitch: int, src_pitch: int) -> int | None:
    """The sub-row size a same-GPU strided run of ``nbytes``-byte rows is cut into for
    ``cuMemcpy3DAsync`` (see :data:`SUB_ROWS_BYTES`), or None where it stays 2-D."""
    if nbytes < SUB_ROWS_MIN_ROW_BYTES:
        return None
    lo, hi = SUB_ROWS_BYTES
    sub = hi
    while sub >= lo:
        if 2 * sub <= nbytes and nbytes % sub == 0 and dst_pitch % sub == 0 and src_pitch % sub == 0:
            return sub
        sub //= 2
    return None


@dataclass(frozen=True)
class HiddenWords:
    """Byte offsets, from the start of a rank's mapping, of the transport's own words."""

    probe_off: int
    scratch_off: int
    user_off: int
    """Where heap offset 0 (flag 0) starts."""

    @classmethod
    def of(cls, local_size: int, n_flags: int) -> "HiddenWords":
        scratch = 8 * local_size
        return cls(0, scratch, round_up(scratch + 8 * local_size * n_flags, _DATA_ALIGN))


class _Track:
    """The progress word of one stream -- or of one stream of a recording -- and the sequence
    number of the last wait batch enqueued there (:mod:`tide_triton.transport.progress`).
    ``reset``: the word was not written to 0 at the recording's start (a stream that joined it
    later): its first batch writes 0 first.  ``word`` 0: none (those waits keep the old rule)."""

    __slots__ = ("word", "seq", "reset")

    def __init__(self, word: int, reset: bool = False) -> None:
        self.word, self.seq, self.reset = word, 0, reset


class Stuck(NamedTuple):
    """A pending wait that has not passed and whose flag is short (:meth:`CopyEngine._short_waits`)."""

    slot: int
    value: int
    peer: int
    """The global rank that was to write the flag."""
    stream: int
    tier: int
    """0: in the batch its stream is at (the one after the last that passed: what the stream is
    blocked on, or reaches next); 1: no progress word tells (waits enqueued under a user's
    capture); 2: further on -- behind that batch, whose own entries may have been replaced by
    later waits on their slots (the ledger keeps one wait per slot and progress word)."""
    what: str = ""
    """What the wait was for, as its collective said (empty: the flag and value are named)."""


class _LentEvent:
    """A fence event lent to one thread (:meth:`CopyEngine._thread_event`)."""

    __slots__ = ("event", "__weakref__")

    def __init__(self, event: Any) -> None:
        self.event = event


@dataclass(frozen=True)
class PreparedCopies:
    """Copies checked and converted once (:meth:`CopyEngine.prepare_copies`)."""

    dsts: list[int]
    srcs: list[int]
    nbytes: list[int]
    dst_ptrs: list[Any]
    src_ptrs: list[Any]
    strided: tuple[Any, ...] = ()
    """``CUDA_MEMCPY2D`` structs (one ``cuMemcpy2DAsync`` each) and ``CUDA_MEMCPY3D`` ones
    (same-GPU runs cut into sub-rows, :func:`sub_row_bytes`; one ``cuMemcpy3DAsync`` each)."""
    replay: dict = field(default_factory=dict, compare=False, repr=False)
    """The graph replay's state (:meth:`CopyEngine.copy_prepared`): ``uses`` so far, and
    ``graph`` -- the executable graph of these copies, or None where capturing failed."""

    @property
    def descriptors(self) -> int:
        """Copy descriptors one enqueue hands the driver (a strided run counts one)."""
        return len(self.nbytes) + len(self.strided)


def _check_value(value: Any, name: str = "value") -> None:
    if not is_int(value) or not 0 <= value < 1 << 63:
        raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")


class CopyEngine:
    """The streams, copies, flags and host waits of one rank (see the module notes).

    ``bases[r]`` is the address, in this process, of rank ``r``'s mapping (set by the
    owner once the peers' ranges are known); ``rank_offset`` is added to rank numbers in
    timeouts (a node-local transport of a several-node group names global ranks)."""

    def __init__(self, cu: Any, guard: CtxGuard, *, rank: int, local_size: int, n_flags: int,
                 device: torch.device, words: HiddenWords, tx: Transaction) -> None:
        self._cu = cu
        self._guard = guard
        self.rank = rank
        self.local_size = local_size
        self.n_flags = n_flags
        self.device = device
        self.words = words
        self.rank_offset = 0
        self.own_va = 0
        self.bases: list[int] = []
        self.copy_path = "loop"
        self.copy_graphs = "off"  # choose_copy_path sets it
        self._graphs: dict[int, Any] = {}  # id -> executable graph, destroyed with its list or at close
        self._capture_handle: Any = None  # the rank's own stream for captures (_capture_stream)
        self._record_stream: Any = None  # torch's handle of it (recording_stream)
        self.signal_path = "direct"
        self.memop_batch = False
        self._attrs: list[Any] = []
        # slot -> (value, peer, stream, what, progress word, seq): the wait has passed iff the
        # word reads >= seq (word 0: unknown; see the progress module)
        self._pending: dict[int, tuple[int, int, int, str, int, int]] = {}
        self._waits_into: dict[int, tuple[int, int, int, str, int, int]] | None = None  # see recording_waits
        self._tracks: dict[int, _Track] = {}  # stream handle -> its progress word (eager batches)
        # (slot, progress word) -> a pending wait a later one on its slot replaced (_note_pending)
        self._superseded: OrderedDict[tuple[int, int], tuple[int, int, int, str, int, int]] = OrderedDict()
        self._rec_tracks: dict[int, _Track] | None = None  # the same for a recording's streams
        # Handles of the caller's streams that got waits/signals (drained at close).  Handles,
        # not weak references: torch <= 2.12's Stream/Event deallocs leave weak references
        # dangling (pytorch/pytorch#183403), which corrupted the heap and crashed the cyclic
        # GC later (the segfaults seen on torch 2.11).
        self.streams_used: set[int] = set()
        self._tls = threading.local()
        self._events: list[Any] = []  # every fence event made (stream_waits_for), destroyed at close
        self._free_events: list[Any] = []  # those no live thread holds
        self._events_lock = threading.Lock()
        self._fence_what = (f"cuEventRecord(rank={rank}, fence)", f"cuStreamWaitEvent(rank={rank}, fence)")
        self.WRITE = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        self.GEQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self.EQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
        self._equal: set[int] = set()  # pending slots waited for with EQ (call identities)
        self._WAIT_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
        self._WRITE_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
        nb = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        with guard:
            self._copy_handle = check(cu.cuStreamCreate(nb), "cuStreamCreate(copy)")
            tx.on_rollback(self._destroy_stream, self._copy_handle)
            self._host_stream = check(cu.cuStreamCreate(nb), "cuStreamCreate(host reads)")
            tx.on_rollback(self._destroy_stream, self._host_stream)
            self._host_buf = int(check(cu.cuMemAllocHost(8 * max(2, local_size)), "cuMemAllocHost"))
            tx.on_rollback(self._free_host, self._host_buf)
            self._progress = ProgressWords(cu, guard, self._host_stream, rank)
            self._progress.grow()  # now, not at a first wait: peers may wait on this rank by then
            tx.on_rollback(self._progress.free_all)
        self.copy_stream_int = int(self._copy_handle)
        self.host_stream_int = int(self._host_stream)
        self.copy_stream = torch.cuda.ExternalStream(self.copy_stream_int, device=device)

    # ---- checks ---------------------------------------------------------------------------
    def check_rank(self, name: str, rank: Any) -> None:
        if not is_int(rank) or not 0 <= rank < self.local_size:
            raise ValueError(f"{name} must be an int in [0, {self.local_size}), got {rank!r}")

    def check_slot(self, slot: Any) -> None:
        if not is_int(slot) or not 0 <= slot < self.n_flags:
            raise ValueError(f"slot must be an int in [0, {self.n_flags}), got {slot!r}")

    def flag_addr(self, rank: int, slot: int) -> int:
        return self.bases[rank] + self.words.user_off + 8 * slot

    def stream_int(self, stream: Any) -> int:
        if stream is None:
            return self.copy_stream_int
        if isinstance(stream, torch.cuda.Stream):
            h = int(stream.cuda_stream)
            self.streams_used.add(h)
            return h
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")

    # ---- path probes ----------------------------------------------------------------------
    def choose_copy_path(self, copy_mode: str, ranks_in_process: int = 1) -> None:
        """``batch`` where ``cuMemcpyBatchAsync`` copies a probe word, else ``loop``
        (``copy_mode`` pins one; ``batch`` that cannot work raises); and the copy-graph mode
        (``ranks_in_process`` > 1 in the single-process mode: :func:`tide_triton.envs.graphs_in_process`)."""
        cu = self._cu
        why = ""
        path = "loop"
        if copy_mode == "loop":
            why = "copy_mode='loop'"
        elif not hasattr(cu, "cuMemcpyBatchAsync"):
            why = "this cuda-python has no cuMemcpyBatchAsync"
        elif driver_version() < _BATCH_MIN_DRIVER:
            why = f"driver {driver_version()} < {_BATCH_MIN_DRIVER} (CUDA 12.8)"
        else:
            a = cu.CUmemcpyAttributes()
            a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            a.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
            self._attrs = [a]
            try:  # 8 bytes from a probe word to a scratch word of our own heap
                base = self.own_va
                dp = cu.CUdeviceptr
                with self._guard:
                    check(cu.cuMemcpyBatchAsync([dp(base + self.words.scratch_off)],
                                                [dp(base + self.words.probe_off)],
                                                [8], 1, self._attrs, [0], 1, self.copy_stream_int),
                          f"cuMemcpyBatchAsync(rank={self.rank}, probe)")
                    check(cu.cuStreamSynchronize(self.copy_stream_int), "cuStreamSynchronize(copy)")
                path, why = "batch", "cuMemcpyBatchAsync works"
            except Exception as exc:  # noqa: BLE001
                if copy_mode == "batch":
                    raise
                why = f"cuMemcpyBatchAsync failed: {exc}"
        if copy_mode == "batch" and path != "batch":
            raise RuntimeError(f"copy_mode='batch' but {why}")
        self.copy_path = path
        self.copy_graphs = envs.copy_graphs(ranks_in_process=ranks_in_process)
        level = logging.INFO if path == "batch" else logging.WARNING
        log_once(f"copy-{path}", level, "copies use %s (%s)",
                 "cuMemcpyBatchAsync" if path == "batch" else "a cuMemcpyAsync loop", why)

    def probe_write(self, peers: Sequence[int]) -> str | None:
        """First half of the signal-path probe: write this rank's probe word into every
        peer's mapping with a stream write; returns the error, if any."""
        cu = self._cu
        try:
            with self._guard:
                own_probe = self.own_va + self.words.probe_off + 8 * self.rank
                check(cu.cuStreamWaitValue64(self._host_stream, own_probe, 0, self.GEQ),
                      "cuStreamWaitValue64(probe)")
                for p in peers:
                    check(cu.cuStreamWriteValue64(self._host_stream,
                                                  self.bases[p] + self.words.probe_off + 8 * self.rank,
                                                  PROBE_MAGIC + self.rank, self.WRITE),
                          f"cuStreamWriteValue64(rank={self.rank} -> peer={p})")
                check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize(probe)")
        except CudaError as exc:
            return str(exc)
        return None

    def probe_read(self, peers: Sequence[int], err: str | None) -> tuple[bool, str]:
        """Second half, once every peer's writes are done: ``(ok, why not)``."""
        words = self.read_words(self.own_va + self.words.probe_off, self.local_size)
        wrong = [p for p in peers if words[p] != PROBE_MAGIC + p]
        why = err or (f"probe words from rank(s) {wrong} did not arrive" if wrong else "")
        return err is None and not wrong, why

    def choose_memop_path(self) -> None:
        """Probe ``cuStreamBatchMemOp`` (a wait that is already satisfied and a write, on
        this rank's own scratch word); fall back to one call per flag if refused."""
        cu = self._cu
        self.memop_batch = False
        if not hasattr(cu, "cuStreamBatchMemOp") or not envs.memop_batch():
            return
        word = self.own_va + self.words.scratch_off
        try:
            self._memops(self.host_stream_int, [(self._WRITE_OP, word, 7, self.WRITE),
                                                (self._WAIT_OP, word, 7, self.GEQ),
                                                (self._WRITE_OP, word, 0, self.WRITE)], "probe")
            with self._guard:
                check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize(memop probe)")
            self.memop_batch = True
        except CudaError as exc:
            log_once("memop-loop", logging.INFO,
                     "flag waits and signals use one call each (cuStreamBatchMemOp: %s)", exc)

    def zero_words(self, nbytes: int) -> None:
        """Zero the first ``nbytes`` of the own mapping (probe, scratch and flag words)."""
        cu = self._cu
        with self._guard:
            check(cu.cuMemsetD8Async(self.own_va, 0, nbytes, self._host_stream), "cuMemsetD8Async(flags)")
            check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize")

    # ---- copies ---------------------------------------------------------------------------
    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
                       strided: Sequence[Any] = (), cut: bool = True) -> PreparedCopies:
        """``strided``: ``(dst, src, nbytes, rows, dst_pitch, src_pitch)`` runs
        (:class:`tide_triton.executor.Strided`), pitches >= nbytes.  ``cut``: cut copies and
        runs where an allocation ends (a list made once and kept, whose pieces the planner may
        have merged across tensors); ``False`` for a raw per-call list of pieces that each lie
        inside one tensor (:meth:`CudaTransport.copy`: no driver queries on that path)."""
        n = len(nbytes)
        if len(dsts) != n or len(srcs) != n:
            raise ValueError(f"dsts, srcs and nbytes must have one entry per copy, got "
                             f"{len(dsts)}, {len(srcs)} and {n}")
        if any(b < 0 for b in nbytes):
            raise ValueError(f"nbytes must be >= 0, got {min(nbytes)}")
        keep = [i for i in range(n) if nbytes[i]]
        d = [int(dsts[i]) for i in keep]
        x = [int(srcs[i]) for i in keep]
        b = [int(nbytes[i]) for i in keep]
        for run in strided:
            self._check_run(*run)
        # no copy may span two allocations (the driver refuses it): cut where one ends; the
        # context held once for all the queries (one driver call each, not three)
        runs = [tuple(map(int, run)) for run in strided]
        if cut:
            ends = AllocationRanges(self._address_range)
            with self._guard:
                runs, rows = split_strided(runs, ends.end_of)
                d, x, b = split_copies(d + [r[0] for r in rows], x + [r[1] for r in rows],
                                       b + [r[2] for r in rows], ends)
        dp = self._cu.CUdeviceptr
        return PreparedCopies(d, x, b, [dp(v) for v in d], [dp(v) for v in x],
                              tuple(self._strided_struct(*run) for run in runs))

    def _address_range(self, address: int) -> tuple[int, int] | None:
        """``(base, size)`` of the allocation holding ``address`` (None where the driver
        does not know it: host memory)."""
        with self._guard:
            err, base, size = self._cu.cuMemGetAddressRange(self._cu.CUdeviceptr(address))
        return (int(base), int(size)) if int(err) == 0 else None

    @staticmethod
    def _check_run(dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int) -> None:
        if not (nbytes > 0 and rows > 0 and nbytes <= dst_pitch and nbytes <= src_pitch):
            raise ValueError(f"strided copy must have nbytes > 0, rows > 0 and pitches >= nbytes, got "
                             f"nbytes={nbytes}, rows={rows}, dst_pitch={dst_pitch}, src_pitch={src_pitch}")

    def _strided_struct(self, dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int) -> Any:
        """The driver struct of one strided run: :func:`memcpy3d_struct` of sub-rows where both
        ends are on this GPU and :func:`sub_row_bytes` finds a size, else :func:`memcpy2d_struct`."""
        sub = sub_row_bytes(nbytes, dst_pitch, src_pitch)
        if sub is not None and self._on_this_gpu(dst) and self._on_this_gpu(src):
            return memcpy3d_struct(self._cu, dst, src, nbytes, rows, dst_pitch, src_pitch, sub)
        return memcpy2d_struct(self._cu, dst, src, nbytes, rows, dst_pitch, src_pitch)

    def _on_this_gpu(self, address: int) -> bool:
        """Whether ``address``'s memory resides on this rank's GPU (the driver's pointer
        attribute; False where the driver cannot tell)."""
        cu = self._cu
        if self.device.index is None:
            return False
        try:
            with self._guard:
                err, ordinal = cu.cuPointerGetAttribute(
                    cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cu.CUdeviceptr(int(address)))
        except Exception:  # noqa: BLE001 - an unknown answer keeps the 2-D form
            return False
        return err == cu.CUresult.CUDA_SUCCESS and int(ordinal) == self.device.index

    def copy_prepared(self, prepared: PreparedCopies, *, stream: Any = None, capturable: bool = False) -> None:
        if not prepared.nbytes and not prepared.strided:
            return
        s = self.stream_int(stream)
        cu = self._cu
        if capturable:  # inside a capture: neither cuMemcpyBatchAsync nor cuGraphLaunch (docs/design.md)
            with self._guard:
                self._one_by_one(prepared, s)
            return
        if self.copy_graphs != "off":
            graph = self._graph_of(prepared)
            if graph is not None:
                with self._guard:
                    check(cu.cuGraphLaunch(graph, s),
                          f"cuGraphLaunch(rank={self.rank}, {prepared.descriptors} copies)")
                return
        with self._guard:
            # Graph capture never reaches here: the eager collectives refuse it before any
            # transport call (collectives._refuse_capture), and a captured prepared run asks
            # for capturable copies -- so no per-call capture query on this path.
            if prepared.nbytes and self.copy_path == "batch" and s not in (0, 1, 2):
                self._one_by_one(prepared, s, plain=False)
                check(cu.cuMemcpyBatchAsync(prepared.dst_ptrs, prepared.src_ptrs, prepared.nbytes,
                                            len(prepared.nbytes), self._attrs, [0], 1, s),
                      f"cuMemcpyBatchAsync(rank={self.rank}, {len(prepared.nbytes)} copies)")
                return
            if prepared.nbytes and self.copy_path == "batch":
                log_once("copy-legacy", logging.INFO, "copies on a default stream use a cuMemcpyAsync "
                         "loop (cuMemcpyBatchAsync refuses it)")
            self._one_by_one(prepared, s)

    def _one_by_one(self, prepared: PreparedCopies, s: int, *, plain: bool = True) -> None:
        """``prepared`` on stream ``s`` as one ``cuMemcpy2DAsync`` / ``cuMemcpy3DAsync`` per strided run and (``plain``)
        one ``cuMemcpyAsync`` per piece -- the loop path, and what a stream capture records
        (the batch call cannot be captured).  The caller holds the context."""
        cu = self._cu
        for m in prepared.strided:
            if isinstance(m, cu.CUDA_MEMCPY3D):
                check(cu.cuMemcpy3DAsync(m, s), f"cuMemcpy3DAsync(rank={self.rank}, {m.Depth} rows)")
            else:
                check(cu.cuMemcpy2DAsync(m, s), f"cuMemcpy2DAsync(rank={self.rank}, {m.Height} rows)")
        if plain:
            for d, x, b in zip(prepared.dsts, prepared.srcs, prepared.nbytes):
                check(cu.cuMemcpyAsync(d, x, b, s), f"cuMemcpyAsync(rank={self.rank})")

    def _replay_due(self, prepared: PreparedCopies, use: int) -> bool:
        """Whether the ``use``-th use of ``prepared`` (1 = first) replays it as a graph:
        from the second use of a list of >= :data:`GRAPH_MIN_DESCRIPTORS` (``auto``), from the
        first of any (``always``), never (``off``)."""
        if self.copy_graphs == "always":
            return True
        return self.copy_graphs == "auto" and use >= 2 and prepared.descriptors >= GRAPH_MIN_DESCRIPTORS

    def warm_replays(self, lists: Sequence[Any]) -> None:
        """Capture now the lists that :meth:`copy_prepared` will replay as graphs at their next
        use -- called by a collective before it enqueues any flag wait.  Instantiating a graph
        may allocate device memory, and in the single-process mode nothing that might
        synchronize the device may run while a peer's stream waits for this rank's flags."""
        for p in lists:
            if (p is not None and "graph" not in p.replay and (p.nbytes or p.strided)
                    and self._replay_due(p, p.replay.get("uses", 0) + 1)):
                self._make_graph(p)

    def _graph_of(self, prepared: PreparedCopies) -> Any:
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
        call cannot be captured) on a private stream, relaxed mode (other threads' CUDA calls
        are not restricted meanwhile), into an executable graph; None, logged once, if the
        driver refuses -- the list is then enqueued as before."""
        cu = self._cu
        with self._guard:
            try:
                cs = self._capture_stream()
                check(cu.cuStreamBeginCapture(cs, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
                      "cuStreamBeginCapture(copies)")
                try:
                    self._one_by_one(prepared, cs)
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

    def _capture_stream(self) -> Any:
        """This rank's own stream for captures -- its copy lists' graphs (:meth:`_capture`) and
        its recorded runs (:meth:`recording_stream`), one at a time on the rank's thread (a run
        being recorded captures its copies one by one, never a copy graph) -- created at the
        first and destroyed at close.  The caller holds the context."""
        if self._capture_handle is None:
            self._capture_handle = check(self._cu.cuStreamCreate(int(self._cu.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                                         "cuStreamCreate(capture)")
        return self._capture_handle

    def recording_stream(self) -> Any:
        """The stream this rank records its prepared runs on (:mod:`tide_triton.run_graph`): the
        rank's own capture stream -- never one of torch's pooled streams, which torch hands out
        round-robin: in the single-process mode a pooled stream can be another rank's, and that
        rank's work would go into this rank's graph."""
        if self._record_stream is None:
            with self._guard:
                handle = self._capture_stream()
            self._record_stream = torch.cuda.ExternalStream(int(handle), device=self.device)
        return self._record_stream

    @in_host_range("tide_triton::copy_graph_destroy")
    def _drop_graph(self, key: int) -> None:
        """Its list is gone (a prepare-cache eviction): destroy the executable graph.  A
        launch still in flight completes first (the driver frees it asynchronously)."""
        graph = self._graphs.pop(key, None)
        if graph is not None:
            with self._guard:
                check(self._cu.cuGraphExecDestroy(graph), f"cuGraphExecDestroy(rank={self.rank})")

    def graphs(self) -> int:
        """Executable copy graphs held now (a test's view)."""
        return len(self._graphs)

    # ---- signals and stream waits ---------------------------------------------------------
    def signal(self, rank: int, slot: int, value: int, *, stream: Any = None) -> None:
        self.check_rank("rank", rank)
        self.check_slot(slot)
        _check_value(value)
        s = self.stream_int(stream)
        cu = self._cu
        addr = self.flag_addr(rank, slot)
        with self._guard:
            if rank == self.rank or self.signal_path == "direct":
                check(cu.cuStreamWriteValue64(s, addr, value, self.WRITE),
                      f"cuStreamWriteValue64(rank={self.rank} -> {rank}, slot={slot})")
                return
            scratch = self.own_va + self.words.scratch_off + 8 * (rank * self.n_flags + slot)
            check(cu.cuStreamWriteValue64(s, scratch, value, self.WRITE),
                  f"cuStreamWriteValue64(rank={self.rank}, scratch for {rank}/{slot})")
            check(cu.cuMemcpyAsync(addr, scratch, 8, s),
                  f"cuMemcpyAsync(rank={self.rank} -> {rank}, flag {slot})")

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: Any = None) -> None:
        n = len(ranks)
        if len(slots) != n or len(values) != n:
            raise ValueError(f"ranks, slots and values must have one entry per signal, got "
                             f"{n}, {len(slots)} and {len(values)}")
        if n == 0:
            return
        if n == 1 or not self.memop_batch or self.signal_path != "direct":
            for r, sl, v in zip(ranks, slots, values):
                self.signal(r, sl, v, stream=stream)
            return
        for r, sl, v in zip(ranks, slots, values):
            self.check_rank("rank", r)
            self.check_slot(sl)
            _check_value(v)
        s = self.stream_int(stream)
        self._memops(s, [(self._WRITE_OP, self.flag_addr(r, sl), v, self.WRITE)
                         for r, sl, v in zip(ranks, slots, values)], "write")

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float, stream: Any = None,
             what: str = "", equal: bool = False) -> None:
        self.check_slot(slot)
        self.check_rank("peer", peer)
        _check_value(value)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._enqueue_waits(self.stream_int(stream), (slot,), (value,), (peer,), (what,), equal)

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: Any = None, what: str = "", equal: bool = False) -> None:
        """Waits until each flag is >= its value (``equal``: exactly its value -- a call
        identity, which a later call's must not satisfy): one wait batch (see
        :meth:`_enqueue_waits`)."""
        n = len(slots)
        if len(values) != n or len(peers) != n:
            raise ValueError(f"slots, values and peers must have one entry per wait, got "
                             f"{n}, {len(values)} and {len(peers)}")
        if n == 0:
            return
        for sl, p in zip(slots, peers):
            self.check_slot(sl)
            self.check_rank("peer", p)
        if n == 1 or not self.memop_batch:  # the checks of wait(), as when this path called it
            for v in values:
                _check_value(v)
            if not timeout_s > 0:
                raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        off = self.rank_offset
        self._enqueue_waits(self.stream_int(stream), slots, values, peers,
                            [what.format(peer=p + off) for p in peers], equal)

    def _enqueue_waits(self, s: int, slots: Sequence[int], values: Sequence[int], peers: Sequence[int],
                       whats: Sequence[str], equal: bool) -> None:
        """One wait batch on stream ``s``: its waits, then the write of its sequence number
        into the stream's progress word (:meth:`_track`; none under a user's capture) -- one
        ``cuStreamBatchMemOp`` where batches work (a lone wait without a word: one
        ``cuStreamWaitValue64``), else one call per wait plus one ``cuStreamWriteValue64`` --
        and their pending entries (or the recording's)."""
        mode = self.EQ if equal else self.GEQ
        own = self.rank
        ops = [(self._WAIT_OP, self.flag_addr(own, sl), v, mode) for sl, v in zip(slots, values)]
        track = self._track(s)
        word = seq = 0
        writes: list[tuple[Any, int, int, int]] = []  # the progress word's: (0 first,) seq after
        if track is not None:
            word = track.word
            if track.reset:  # a recording's stream that joined after its start: 0 first
                writes.append((self._WRITE_OP, word, 0, self.WRITE))
                track.reset = False
            track.seq = seq = track.seq + 1
            writes.append((self._WRITE_OP, word, seq, self.WRITE))
        if self.memop_batch and len(ops) + len(writes) > 1:
            self._memops(s, [*writes[:-1], *ops, *writes[-1:]], "wait")
        else:
            cu = self._cu
            with self._guard:
                for _op, addr, v, flags in writes[:-1]:
                    check(cu.cuStreamWriteValue64(s, addr, v, flags),
                          f"cuStreamWriteValue64(rank={own}, progress reset)")
                for (_op, addr, v, flags), sl, p in zip(ops, slots, peers):
                    check(cu.cuStreamWaitValue64(s, addr, v, flags),
                          f"cuStreamWaitValue64(rank={own}, slot={sl}, peer={p})")
                for _op, addr, v, flags in writes[-1:]:
                    check(cu.cuStreamWriteValue64(s, addr, v, flags), f"cuStreamWriteValue64(rank={own}, progress)")
        pending = self._waits()
        note = self._note_pending if pending is self._pending else pending.__setitem__
        off = self.rank_offset
        eq = self._eq_slots()
        for sl, v, p, w in zip(slots, values, peers, whats):
            note(sl, (v, p + off, s, w, word, seq))
            (eq.add if equal else eq.discard)(sl)

    def _note_pending(self, slot: int, entry: tuple[int, int, int, str, int, int]) -> None:
        """``entry`` becomes slot ``slot``'s pending wait.  The wait it replaces is kept aside
        (``_superseded``) when it has a progress word other than the new one's: a
        replay of another recording noted behind a stuck run (FSDP2's backward enqueues the
        next layer's replay without waiting), whose own word still reads its last replay's
        count until its first node runs -- without it the stuck run's wait left the ledger and
        a timeout named nobody."""
        old = self._pending.get(slot)
        if old is not None and old[4] and old[4] != entry[4]:
            kept = self._superseded
            kept[(slot, old[4])] = old
            kept.move_to_end((slot, old[4]))
            while len(kept) > SUPERSEDED_KEPT:
                kept.popitem(last=False)
        self._pending[slot] = entry

    def _track(self, s: int) -> _Track | None:
        """Stream ``s``'s progress word for the batch being enqueued: a recording's own
        (:meth:`recording_waits`), none while this thread's last capture query said its
        stream is captured (:meth:`stream_capturing`: a user's graph), else the stream's
        eager word, taken at its first batch."""
        rec = self._rec_tracks
        if rec is not None:
            track = rec.get(s)
            if track is None:  # a stream that joined the recording later: from the reserve
                track = rec[s] = _Track(self._progress.take(grow=False), reset=True)
            return track if track.word else None
        if getattr(self._tls, "user_capture", False):
            return None
        track = self._tracks.get(s)
        if track is None:
            try:
                word = self._progress.take(grow=True)
            except CudaError as exc:  # the waits go without one (the old rule), never fail
                log_once("progress-words", logging.WARNING,
                         "rank %d: no progress word for a stream (%s): its timeouts may name a peer "
                         "whose token wait passed", self.rank, exc)
                word = 0
            track = self._tracks[s] = _Track(word)
        return track if track.word else None

    def _waits(self) -> dict[int, tuple[int, int, int, str, int, int]]:
        """Where a wait being enqueued is noted: the pending waits, or a recording's."""
        return self._pending if self._waits_into is None else self._waits_into

    @contextmanager
    def recording_waits(self) -> Iterator[dict[int, tuple[int, int, int, str, int, int]]]:
        """While a run is recorded into a graph (nothing runs), its waits go into the dict
        yielded instead of the pending waits -- :meth:`note_waits` notes them at each replay
        -- with progress words of the recording's own, one per stream
        (:data:`RECORDING_WORDS` set aside now, before the capture:
        :meth:`recording_started` and the waits take them)."""
        if self._waits_into is not None:
            raise RuntimeError("internal error: this transport records waits already")
        try:
            self._progress.reserve(RECORDING_WORDS)
        except CudaError as exc:  # the recording's waits go without (the old rule)
            log_once("progress-words", logging.WARNING,
                     "rank %d: no progress words for a recording (%s): its timeouts may name a peer "
                     "whose token wait passed", self.rank, exc)
        self._waits_into = into = {}
        self._rec_tracks = {}
        try:
            yield into
        finally:
            self._waits_into = None
            self._rec_tracks = None

    def recording_started(self, stream: Any) -> None:
        """The first operation of a recording, right after its capture began on ``stream``:
        the progress words of the recording's streams -- ``stream`` and the copy stream, which
        joins the capture through a fence from ``stream``, after this -- are written to 0, so
        each replay starts from 0 before any of its waits (replays of one graph run one after
        another).  One memop node of the graph; no driver call at a replay."""
        rec = self._rec_tracks
        if rec is None:
            raise RuntimeError("internal error: recording_started outside recording_waits")
        s = self.stream_int(stream)
        ops = []
        for h in (s, self.copy_stream_int):
            if h not in rec:
                rec[h] = _Track(self._progress.take(grow=False))
                if rec[h].word:
                    ops.append((self._WRITE_OP, rec[h].word, 0, self.WRITE))
        if self.memop_batch and len(ops) > 1:
            self._memops(s, ops, "write")
            return
        with self._guard:
            for _op, addr, v, flags in ops:
                check(self._cu.cuStreamWriteValue64(s, addr, v, flags),
                      f"cuStreamWriteValue64(rank={self.rank}, progress reset)")

    def launch_graph_exec(self, handle: int, stream: Any) -> None:
        """``cuGraphLaunch`` of an instantiated graph (``CUDAGraph.raw_cuda_graph_exec()``) on
        ``stream``: what ``CUDAGraph.replay()`` does, without its stream and device switches."""
        s = self.stream_int(stream)
        with self._guard:
            check(self._cu.cuGraphLaunch(self._cu.CUgraphExec(int(handle)), s),
                  f"cuGraphLaunch(rank={self.rank}, recorded run)")

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

    def _thread_event(self) -> "_LentEvent":
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

    def stream_capturing(self, stream: Any) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (one driver call) -- a
        prepared run asks before each run, and the only waits a capture can hold are a
        prepared run's.  The answer is kept for this thread: while it is True, wait batches
        get no progress word (the user's graph would write its fixed sequence numbers into an
        eager stream's word at every replay); the next run's query ends it."""
        with self._guard:
            err, status = self._cu.cuStreamIsCapturing(self.stream_int(stream))
        check((err,), f"cuStreamIsCapturing(rank={self.rank})")
        captured = status != self._cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        self._tls.user_capture = captured
        return captured

    def user_capture_ended(self) -> None:
        """This thread's prepared run inside a user's capture is enqueued whole: its next
        waits (outside a capture -- an eager collective refuses one -- or in another run,
        which asks again) get progress words again.  Without it the answer stayed until this
        thread's next prepared run asked, and eager timeouts in between named peers by the
        old rule."""
        self._tls.user_capture = False

    def note_waits(self, waits: dict[int, tuple[int, int, int, str, int, int]], stream: Any) -> None:
        """A replayed graph's waits (:meth:`recording_waits`), pending on ``stream`` (with the
        recording's progress words: the graph wrote them to 0 first)."""
        s = self.stream_int(stream)
        note = self._note_pending
        for slot, (value, peer, _s, what, word, seq) in waits.items():
            note(slot, (value, peer, s, what, word, seq))

    def _eq_slots(self) -> set[int]:
        return self.__dict__.setdefault("_equal", set())

    def _memops(self, s: int, ops: Sequence[tuple[Any, int, int, int]], kind: str) -> None:
        """Enqueue ``(op, address, value, flags)`` stream memory operations, <= 255 a call."""
        cu = self._cu
        for i in range(0, len(ops), _MEMOPS_PER_CALL):
            part = ops[i:i + _MEMOPS_PER_CALL]
            params = self._memop_params(len(part))
            for p, (op, addr, value, flags) in zip(params, part):
                p.operation = op
                u = p.waitValue if op == self._WAIT_OP else p.writeValue
                u.operation = op
                u.address = addr
                u.value64 = value
                u.flags = flags
            with self._guard:
                check(cu.cuStreamBatchMemOp(s, len(part), params[:len(part)], 0),
                      f"cuStreamBatchMemOp(rank={self.rank}, {len(part)} {kind}s)")

    def _memop_params(self, n: int) -> list[Any]:
        # Kept for reuse (setting fields is cheaper than building the structs per call);
        # one list per thread, since ranks of the single-process mode enqueue concurrently.
        tls = self._tls
        params = getattr(tls, "memops", None)
        if params is None or len(params) < n:
            params = tls.memops = [self._cu.CUstreamBatchMemOpParams() for _ in range(max(n, 8))]
        return params

    # ---- host-side reads and waits --------------------------------------------------------
    def read_words(self, addr: int, n: int) -> list[int]:
        cu = self._cu
        with self._guard:
            check(cu.cuMemcpyDtoHAsync(self._host_buf, addr, 8 * n, self._host_stream),
                  f"cuMemcpyDtoHAsync(rank={self.rank}, flags)")
            check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize(host reads)")
        return list((ctypes.c_int64 * n).from_address(self._host_buf))

    def read_flag(self, slot: int, rank: int | None = None) -> int:
        self.check_slot(slot)
        r = self.rank if rank is None else rank
        self.check_rank("rank", r)
        return self.read_words(self.flag_addr(r, slot), 1)[0]

    @in_host_range("tide_triton::host_wait_flag")
    def host_wait_flag(self, slot: int, value: int, peer: int, timeout_s: float, what: str = "") -> int:
        self.check_slot(slot)
        self.check_rank("peer", peer)
        deadline = time.monotonic() + timeout_s
        nap = 20e-6
        while True:
            cur = self.read_flag(slot)
            if cur >= value:
                return cur
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    peer, what or f"flag {slot} of rank {self.rank} to reach {value}, last "
                    f"read {cur}", timeout_s)
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)

    def host_wait_event(self, event: Any, *, timeout_s: float) -> None:
        if event.query():
            return
        deadline = time.monotonic() + timeout_s
        nap = 5e-6
        with host_range("tide_triton::pace"):  # the pacer's wait (group._Pacer), its only use
            while not event.query():
                if time.monotonic() >= deadline:
                    self.raise_stuck(timeout_s, None)
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)

    @in_host_range("tide_triton::synchronize")
    def synchronize(self, *, timeout_s: float, stream: Any = None,
                    poll: Callable[[], None] | None = None) -> None:
        """Block until stream ``s`` (default: the copy stream) is idle; ``poll`` runs every
        :data:`POLL_S` while it is not (it may raise: a peer that gave up)."""
        s = self.stream_int(stream)
        start = time.monotonic()
        deadline, next_poll = start + timeout_s, start + POLL_S
        nap = 20e-6
        while True:
            res = self._cu.cuStreamQuery(s)
            code = int(res[0])
            if code == 0:
                self._pending = {k: v for k, v in self._pending.items() if v[2] != s}
                kept = self._superseded
                for k in [k for k, v in kept.items() if v[2] == s]:
                    del kept[k]
                return
            if code != _CUDA_ERROR_NOT_READY:
                check(res, f"cuStreamQuery(rank={self.rank})")
            now = time.monotonic()
            if now >= deadline:
                break
            if poll is not None and now >= next_poll:
                poll()
                next_poll = now + POLL_S
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)
        self.raise_stuck(timeout_s, s)

    def raise_stuck(self, timeout_s: float, s: int | None) -> None:
        """Raise ``PeerTimeoutError`` for a pending wait that has not passed and whose flag is
        still short, else ``TimeoutError``.  Which one (:meth:`_short_waits`): a wait of the
        batch stream ``s`` is at -- what it is blocked on -- then of the batch another stream is
        at (a stream can be stuck behind another's wait: the copy queue fenced behind a replay
        on the caller's stream), then waits without a progress word (the old rule: a short
        token word may be a finished wait's, reset by its reader), then waits further on; on
        stream ``s`` first, counters before tokens and the lowest slot within each.  A finished
        token wait whose reader reset its word is never named: its progress word says it
        passed."""
        short = self._short_waits()
        if short:
            eq = self._eq_slots()
            w = min(short, key=lambda w: (w.tier == 2, w.stream != s, w.tier, w.slot in eq, w.slot))
            raise PeerTimeoutError(
                w.peer, w.what or f"flag {w.slot} of rank {self.rank + self.rank_offset} to reach "
                f"{w.value}, last read {self.read_flag(w.slot)}", timeout_s)
        raise TimeoutError(f"rank {self.rank + self.rank_offset}: GPU work still busy after {timeout_s:.1f} s "
                           "(no pending flag wait is short)")

    # ---- teardown -------------------------------------------------------------------------
    def release_own_waits(self, deadline: float) -> int:
        """Last resort of a close whose streams did not drain (a peer that will never signal:
        a broken group's): write into this rank's own flag words the value each pending
        stream wait that has not passed expects -- never lowering a counter, never a wait that
        passed (its token word was reset by its reader: writing the token again would leave
        it there) -- so the stuck streams run to their end.  Without it they wait forever, the
        heap cannot be unmapped, and every later device-wide synchronize of the process
        (``torch.cuda.synchronize``) hangs.  What the released work then computes was already
        reported as an error; its copies land in mappings this rank still holds (unmapped only
        after the streams are idle).  An earlier wait on a word for another value than its
        latest (two calls' identities on one parity word) cannot be released: the close then
        leaks as before.  Returns the words written."""
        # one value per word: a slot short for two waits (a replay noted behind a stuck run)
        # gets the one of the batch its stream is at -- a later write would hide it from an
        # exact-value wait
        chosen: dict[int, Stuck] = {}
        for w in self._short_waits():
            if w.slot not in chosen or w.tier < chosen[w.slot].tier:
                chosen[w.slot] = w
        writes = [(w.slot, w.value) for w in chosen.values()]
        if not writes:
            return 0
        cu = self._cu
        with self._guard:
            for slot, value in writes:
                check(cu.cuStreamWriteValue64(self._host_stream, self.flag_addr(self.rank, slot), value,
                                              self.WRITE), f"cuStreamWriteValue64(rank={self.rank}, release {slot})")
        if not self.drain({self.host_stream_int}, deadline):
            log.error("rank %d: releasing its own stuck flag waits did not complete", self.rank)
        return len(writes)

    def _short_waits(self) -> list[Stuck]:
        """The pending waits that have not passed and whose flag is still short of their
        value.  Passed: on a stream that is idle, or -- read from its progress word, before
        its flag -- in a batch whose sequence number the word has reached (a token word is
        reset by its reader once its wait passed: it reads short, but the wait is done).  Each
        wait's :attr:`Stuck.tier` says whether its batch is the one its stream is at.  Reads
        words from the host (error paths only)."""
        idle: dict[int, bool] = {}
        progress: dict[int, int] = {}  # word -> what it reads
        out = []
        eq = self._eq_slots()
        waits = sorted(self._pending.items()) + [(k[0], v) for k, v in self._superseded.items()]
        for slot, (value, peer, sh, what, word, seq) in waits:
            if sh not in idle:
                with self._guard:
                    idle[sh] = int(self._cu.cuStreamQuery(sh)[0]) != _CUDA_ERROR_NOT_READY
            if idle[sh]:
                continue
            tier = 1
            if word:
                done = progress.get(word)
                if done is None:
                    done = progress[word] = self.read_words(word, 1)[0]
                if done >= seq:
                    continue
                tier = 0 if seq == done + 1 else 2
            cur = self.read_flag(slot)
            if (cur != value) if slot in eq else (cur < value):
                out.append(Stuck(slot, value, peer, sh, tier, what))
        return out

    def stuck_peers(self) -> set[int]:
        """Global ranks that pending stream waits of this rank still wait for."""
        return {w.peer for w in self._short_waits()}

    def busy_streams(self) -> set[int]:
        """Handles of every stream that may still touch heaps: own ones and the caller's."""
        return {self.copy_stream_int, self.host_stream_int, *self.streams_used}

    def drain(self, handles: set[int], deadline: float) -> bool:
        """Poll until every stream of ``handles`` is idle (False at ``deadline``).  torch's
        streams come from its pool and are never destroyed, so their handles stay valid to
        query; a handle that errors is taken as idle."""
        with self._guard:
            for h in handles:
                while int(self._cu.cuStreamQuery(h)[0]) == _CUDA_ERROR_NOT_READY:
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
        """Destroy the copy graphs and streams, free the progress words and the host buffer
        (``quiet`` runs each step)."""
        for key in list(self._graphs):
            quiet(self._drop_graph, key)
        if self._capture_handle is not None:
            self._record_stream = None
            quiet(self._destroy_stream, self._capture_handle)
            self._capture_handle = None
        self._destroy_events(quiet)
        self._progress.free_all(quiet)
        self._tracks.clear()
        quiet(self._destroy_stream, self._host_stream)
        quiet(self._free_host, self._host_buf)
        quiet(self._destroy_stream, self._copy_handle)
