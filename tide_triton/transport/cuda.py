"""The CUDA transport: a symmetric VMM heap per rank, copy-engine copies, SM-free flags.

Heap
    Every rank owns one range of ``va_bytes`` virtual addresses (64 GiB by default),
    reserved once, and maps physical segments (``cuMemCreate``, POSIX-fd shareable) into
    it as the heap grows, so addresses never move.  In a multi-process group each rank
    exports every new segment as a file descriptor, passes it to every peer over a Unix
    socket (SCM_RIGHTS; ``pidfd_getfd`` as the fallback) and every peer maps it into a
    range it reserved for that rank.  Peers may share one GPU.  In a single-process group
    (:meth:`CudaTransport.create_local_group`) a peer's heap is simply its own range.

    Heap offsets (``address``, ``heap_tensor``, ``ensure_heap``) count from the heap's
    start, as in the host transport: ``[0, 8 * n_flags)`` are the flags (int64 words,
    zeroed at creation, values only grow); the caller lays out its data after them.  A
    small hidden region below offset 0 (4 KiB aligned) holds the transport's own words:
    ``local_size`` probe words (the signal-path test at creation) and
    ``local_size * n_flags`` scratch words (scratch+copy signals).

Copies
    On a dedicated stream (:attr:`CudaTransport.copy_stream`, a ``torch.cuda`` stream
    object so events and the caching allocator work with it): one ``cuMemcpyBatchAsync``
    per :meth:`~CudaTransport.copy` where the driver has it (CUDA >= 12.8), otherwise one
    ``cuMemcpyAsync`` per piece; the path is chosen at creation and logged once.

Signals
    ``signal`` writes a flag of a peer with ``cuStreamWriteValue64`` -- straight to the
    peer's mapped address where a probe at creation shows that works, otherwise into a
    local scratch word followed by an 8-byte copy-engine copy (NCCL's CE-collective
    recipe).  ``wait`` is ``cuStreamWaitValue64(GEQ)`` on the local flag.  Neither uses an
    SM.  Stream-side waits cannot time out; :meth:`~CudaTransport.host_wait_flag` and
    :meth:`~CudaTransport.synchronize` wait from the host with a deadline and raise
    :class:`~tide_triton.transport.base.PeerTimeoutError` naming the peer.
"""
from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from . import driver
from .base import PeerTimeoutError
from .driver import CtxGuard, CudaError, Transaction, check

__all__ = ["CudaTransport"]

log = logging.getLogger("tide_triton")

_VA_BYTES = 64 << 30
"""Virtual addresses reserved per rank: the most the heap can ever grow to."""
_SEGMENT_BYTES = 64 << 20
"""Growth quantum: ``ensure_heap`` maps whole multiples of this (rounded to granularity)."""
_DATA_ALIGN = 4096
_PROBE_MAGIC = 0x7469_6465_0000_0000  # "tide" in the high half, the writer's rank below
_HEADER = struct.Struct("<qqq")  # magic, sender rank, generation
_FD_MAGIC = 0x7469_6465_6664  # "tidefd"
_SYS_PIDFD_GETFD = 438  # same number on every Linux architecture (generic syscall table)
_CUDA_ERROR_NOT_READY = 600
_DRAIN_TIMEOUT_S = 30.0
_BATCH_MIN_DRIVER = 12080

_SIGNAL_MODES = ("auto", "direct", "copy")
_COPY_MODES = ("auto", "batch", "loop")
_FD_PASSING = ("auto", "socket", "pidfd")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_once(key: str, level: int, msg: str, *args: Any) -> None:
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, msg, *args)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class PreparedCopies:
    """Copies checked and converted once (:meth:`CudaTransport.prepare_copies`)."""

    dsts: list[int]
    srcs: list[int]
    nbytes: list[int]
    dst_ptrs: list[Any]
    src_ptrs: list[Any]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _raise_if_failed(infos: Sequence[dict], what: str) -> None:
    errs = {r: i.get("err") for r, i in enumerate(infos) if i.get("err")}
    if errs:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errs.items()))
        raise RuntimeError(f"{what} failed on rank(s) {sorted(errs)}: {detail}")


def _close_fds(fds: Any) -> None:
    for fd in list(fds):
        try:
            os.close(fd)
        except OSError:
            pass


def _pidfd_getfd(pid: int, remote_fd: int) -> int:
    """A duplicate of ``remote_fd`` of process ``pid`` (Linux >= 5.6, needs ptrace rights)."""
    if not hasattr(os, "pidfd_open"):
        raise RuntimeError("pidfd_getfd fallback needs os.pidfd_open (Linux, Python >= 3.9)")
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(
            ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(remote_fd),
            ctypes.c_uint(0),
        )
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid={pid}, fd={remote_fd}): {os.strerror(err)}")
        return int(fd)
    finally:
        os.close(pidfd)


# DLPack through ctypes: the fallback where torch has no non-owning storage constructor.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
        ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DLDeleter),
]
_dl_keep: dict[int, Any] = {}  # address of the DLManagedTensor -> the ctypes objects behind it


@_DLDeleter
def _dl_delete(addr: int) -> None:
    _dl_keep.pop(addr, None)


def _dlpack_wrap(ptr: int, nbytes: int, device_index: int) -> torch.Tensor:
    shape = (ctypes.c_int64 * 1)(nbytes)
    m = _DLManagedTensor()
    m.dl_tensor.data = ctypes.c_void_p(ptr)
    m.dl_tensor.device = _DLDevice(2, device_index)  # kDLCUDA
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(1, 8, 1)  # uint8
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.deleter = _dl_delete
    _dl_keep[ctypes.addressof(m)] = (m, shape)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return torch.from_dlpack(new(ctypes.addressof(m), b"dltensor", None))


class CudaTransport:
    """The :class:`~tide_triton.transport.base.Transport` of one rank over CUDA.

    ``exchange(obj) -> list`` is an all-gather of small picklable objects among the
    node's ``local_size`` ranks (e.g. ``dist.all_gather_object`` on a gloo group); the
    constructor and :meth:`ensure_heap` are collective through it, and every rank's error
    is shared so a failure raises on every rank (and rolls back everywhere).

    ``device`` is this rank's GPU (peers may share it).  ``n_flags`` int64 flag words per
    rank.  The heap grows by multiples of ``segment_bytes`` inside ``va_bytes`` of
    reserved addresses.  ``signal_mode``: ``"auto"`` (probe at creation), ``"direct"``
    (write peers' flags with a stream write) or ``"copy"`` (scratch word + 8-byte copy).
    ``copy_mode``: ``"auto"``, ``"batch"`` (``cuMemcpyBatchAsync``) or ``"loop"``
    (``cuMemcpyAsync`` per piece).  ``fd_passing``: ``"auto"`` (Unix socket, then
    ``pidfd_getfd`` for what did not arrive), ``"socket"`` or ``"pidfd"``.  ``timeout_s``
    bounds every rendezvous step.

    ``close()`` is local (no collective), idempotent, and also runs on ``with`` exit and
    (errors swallowed) in ``__del__``.  Tensors from :meth:`heap_tensor` dangle after it.
    """

    rank_offset = 0  # see __init__

    rank: int
    local_size: int
    n_flags: int
    device: torch.device
    copy_path: str
    """``"batch"`` or ``"loop"``: how :meth:`copy` enqueues (decided at creation)."""
    signal_path: str
    """``"direct"`` or ``"copy"``: how :meth:`signal` reaches a peer's flag."""

    def __init__(
        self,
        rank: int,
        local_size: int,
        exchange: Callable[[Any], Sequence[Any]] | None,
        *,
        device: torch.device | str | int,
        n_flags: int = 1024,
        segment_bytes: int = _SEGMENT_BYTES,
        va_bytes: int = _VA_BYTES,
        signal_mode: str = "auto",
        copy_mode: str = "auto",
        fd_passing: str = "auto",
        timeout_s: float = 120.0,
        _local_group: bool = False,
    ) -> None:
        self._closed = True  # until the heap exists: close() and __del__ do nothing
        for name, value in (("rank", rank), ("local_size", local_size), ("n_flags", n_flags),
                            ("segment_bytes", segment_bytes), ("va_bytes", va_bytes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if local_size < 1:
            raise ValueError(f"local_size must be >= 1, got {local_size}")
        if not 0 <= rank < local_size:
            raise ValueError(f"rank must be in [0, {local_size}), got {rank}")
        if n_flags < 1:
            raise ValueError(f"n_flags must be >= 1, got {n_flags}")
        if segment_bytes < 1 or va_bytes < 1:
            raise ValueError(
                f"segment_bytes and va_bytes must be > 0, got {segment_bytes} and {va_bytes}"
            )
        # Diagnostics: the environment can pin the paths "auto" would choose.
        if copy_mode == "auto":
            copy_mode = os.environ.get("TIDE_TRITON_COPY_MODE", "auto")
        for name, value, allowed in (("signal_mode", signal_mode, _SIGNAL_MODES),
                                     ("copy_mode", copy_mode, _COPY_MODES),
                                     ("fd_passing", fd_passing, _FD_PASSING)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not _local_group and not callable(exchange):
            raise TypeError(f"exchange must be callable, got {type(exchange).__name__}")
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a cuda device, got {dev}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())

        self.rank = rank
        self.local_size = local_size
        self.n_flags = n_flags
        self.rank_offset = 0
        """Added to rank numbers in errors and timeouts: a node-local transport of a
        several-node group names global ranks (set by the owner after creation)."""
        self.device = dev
        self._exchange = exchange
        self._local = _local_group
        self._timeout_s = float(timeout_s)
        self._fd_passing = fd_passing
        self._copy_mode = copy_mode
        self._signal_mode = signal_mode
        self.copy_path = "loop"
        self.signal_path = "direct"
        self._pending: dict[int, tuple[int, int, int, str]] = {}  # slot -> value, peer, stream, what
        # Handles of the caller's streams that got waits/signals (drained at close).  Handles,
        # not weak references: torch <= 2.12's Stream/Event deallocs leave weak references
        # dangling (pytorch/pytorch#183403), which corrupted the heap and crashed the cyclic
        # GC later (the segfaults seen on torch 2.11).
        self._streams_used: set[int] = set()
        self._generation = 0
        self._mapped = 0
        self._segments: list[tuple[int, int, Any]] = []  # own (offset, size, handle)
        self._peer_segments: dict[int, list[tuple[int, int, Any]]] = {}
        self._peer_va: dict[int, int] = {}
        self._peers: list[Any] | None = None  # local group: weak references to every member
        self._listener: socket.socket | None = None
        self._sock_names: list[bytes] = []
        self._pids: list[int] = []
        self._own_va = 0
        self._host_stream = None
        self._host_buf = 0
        self._copy_stream_handle = None
        self._ctx = None
        self._cudev = None
        self._tls = threading.local()
        self._memop_batch = False

        # Hidden region below heap offset 0: probe words, then scratch words.
        self._probe_off = 0
        self._scratch_off = 8 * local_size
        self._user_off = _round_up(self._scratch_off + 8 * local_size * n_flags, _DATA_ALIGN)
        self._va_bytes = va_bytes

        cu = driver.init()
        self._cu = cu
        self._H = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._WRITE = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        self._GEQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)

        with Transaction() as tx:
            err: str | None = None
            try:
                self._setup_local(tx, segment_bytes)
            except Exception as exc:  # noqa: BLE001 - shared with the peers below
                if self._local:
                    raise
                err = _describe(exc)
            if not self._local:
                self._rendezvous(err, segment_bytes)
                self._peer_va_reserve(tx)
            self._peers_bases_init()
            tx.on_rollback(self._release_heap)
            self._grow(_round_up(self._user_off + 8 * n_flags, self._gran))
            self._choose_copy_path()
            self._choose_signal_path()
            self._choose_memop_path()
            self._closed = False

    # ------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------
    def _setup_local(self, tx: Transaction, segment_bytes: int) -> None:
        cu = self._cu
        self._cudev, self._ctx = driver.device_context(self.device)
        tx.on_rollback(cu.cuDevicePrimaryCtxRelease, self._cudev)
        self._guard = CtxGuard(self._ctx)
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        prop.requestedHandleTypes = self._H
        self._prop = prop
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = self.device.index
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [acc]
        with self._guard:
            gran = check(
                cu.cuMemGetAllocationGranularity(
                    prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                ),
                "cuMemGetAllocationGranularity",
            )
            self._gran = int(gran)
            self._segment_bytes = _round_up(segment_bytes, self._gran)
            self._va_bytes = _round_up(self._va_bytes, self._gran)
            self._own_va = self._reserve_va(f"rank={self.rank}")
            tx.on_rollback(self._free_va, self._own_va)
            nb = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._copy_stream_handle = check(cu.cuStreamCreate(nb), "cuStreamCreate(copy)")
            tx.on_rollback(self._destroy_stream, self._copy_stream_handle)
            self._host_stream = check(cu.cuStreamCreate(nb), "cuStreamCreate(host reads)")
            tx.on_rollback(self._destroy_stream, self._host_stream)
            nbuf = 8 * max(2, self.local_size)
            self._host_buf = int(check(cu.cuMemAllocHost(nbuf), "cuMemAllocHost"))
            tx.on_rollback(self._free_host, self._host_buf)
        self._copy_stream_int = int(self._copy_stream_handle)
        self._host_stream_int = int(self._host_stream)
        self._copy_stream = torch.cuda.ExternalStream(self._copy_stream_int, device=self.device)
        self._uuid = self._device_uuid(self._cudev)
        if not self._local:
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            tx.on_rollback(lst.close)
            name = f"\0tide_triton.{os.getpid()}.{self.rank}.{uuid.uuid4().hex}".encode()
            lst.bind(name)
            lst.listen(max(64, 2 * self.local_size))
            self._listener = lst
            self._my_sock_name = name

    def _device_uuid(self, cudev: Any) -> bytes:
        try:
            u = check(self._cu.cuDeviceGetUuid(cudev), "cuDeviceGetUuid")
            return bytes(u.bytes)
        except Exception:  # noqa: BLE001 - only used to tell devices apart
            return f"ordinal-{self.device.index}".encode()

    def _allgather(self, obj: Any) -> list[Any]:
        out = list(self._exchange(obj))  # type: ignore[misc]
        if len(out) != self.local_size:
            raise RuntimeError(
                f"exchange must return local_size={self.local_size} items, got {len(out)}"
            )
        return out

    def _rendezvous(self, err: str | None, segment_bytes: int) -> None:
        args = (self.local_size, self.n_flags, segment_bytes, self._va_bytes, self._signal_mode,
                self._copy_mode, self._fd_passing)
        infos = self._allgather({
            "err": err, "rank": self.rank, "args": args, "pid": os.getpid(),
            "sock": getattr(self, "_my_sock_name", b""),
            "uuid": getattr(self, "_uuid", b""),
        })
        _raise_if_failed(infos, "CudaTransport setup")
        for r, info in enumerate(infos):
            if info["rank"] != r:
                raise RuntimeError(f"exchange returned rank {info['rank']}'s entry at index {r}")
            if info["args"] != args:
                raise ValueError(
                    f"CudaTransport arguments differ: rank {r} has (local_size, n_flags, "
                    f"segment_bytes, va_bytes, signal_mode, copy_mode, fd_passing)="
                    f"{info['args']}, rank {self.rank} has {args}"
                )
        self._sock_names = [i["sock"] for i in infos]
        self._pids = [i["pid"] for i in infos]
        # Peers on other GPUs need peer access; peers on this GPU need nothing.
        cu = self._cu
        n = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        by_uuid = {}
        for i in range(n):
            d = check(cu.cuDeviceGet(i), f"cuDeviceGet({i})")
            by_uuid[self._device_uuid(d)] = d
        for r, info in enumerate(infos):
            if info["uuid"] == self._uuid:
                continue
            peer_dev = by_uuid.get(info["uuid"])
            if peer_dev is None:
                _log_once("peer-dev-invisible", logging.WARNING,
                          "rank %d's GPU is not visible to rank %d; mapping its "
                          "heap relies on the driver's peer access", r, self.rank)
                continue
            ok = check(cu.cuDeviceCanAccessPeer(self._cudev, peer_dev),
                       f"cuDeviceCanAccessPeer(rank={self.rank}, peer={r})")
            if not ok:
                raise RuntimeError(
                    f"rank {self.rank} ({self.device}) cannot access rank {r}'s GPU "
                    "(cuDeviceCanAccessPeer is 0)"
                )

    def _peer_va_reserve(self, tx: Transaction) -> None:
        err = None
        try:
            with self._guard:
                for p in range(self.local_size):
                    if p == self.rank:
                        continue
                    va = self._reserve_va(f"rank={self.rank}, peer={p}")
                    self._peer_va[p] = va
                    self._peer_segments[p] = []
                    tx.on_rollback(self._free_va, va)
        except Exception as exc:  # noqa: BLE001
            err = _describe(exc)
        _raise_if_failed(self._allgather({"err": err}), "CudaTransport peer address reservation")

    def _peers_bases_init(self) -> None:
        self._bases = [self._peer_va.get(p, 0) for p in range(self.local_size)]
        self._bases[self.rank] = self._own_va

    @classmethod
    def create_local_group(
        cls,
        local_size: int,
        *,
        device: torch.device | str | int,
        n_flags: int = 1024,
        segment_bytes: int = _SEGMENT_BYTES,
        va_bytes: int = _VA_BYTES,
        signal_mode: str = "auto",
        copy_mode: str = "auto",
    ) -> list["CudaTransport"]:
        """``local_size`` transports driven from this one process on one device.

        Each rank has its own heap and copy stream; a peer's heap is addressed through the
        peer's own mapping (no fd exchange).  ``ensure_heap`` is then called once per rank
        (each grows its own heap).  Close every member (or use :meth:`close_group`)."""
        if isinstance(local_size, bool) or not isinstance(local_size, int):
            raise TypeError(f"local_size must be an int, got {type(local_size).__name__}")
        if local_size < 1:
            raise ValueError(f"local_size must be >= 1, got {local_size}")
        group: list[CudaTransport] = []
        with Transaction() as tx:
            for r in range(local_size):
                t = cls(r, local_size, None, device=device, n_flags=n_flags,
                        segment_bytes=segment_bytes, va_bytes=va_bytes, signal_mode=signal_mode,
                        copy_mode=copy_mode, _local_group=True)
                tx.on_rollback(t.close)
                group.append(t)
        bases = [t._own_va for t in group]
        for t in group:
            t._peers = [weakref.ref(m) for m in group]  # no reference cycle among members
            t._bases = list(bases)
        return group

    @staticmethod
    def close_group(group: Sequence["CudaTransport"]) -> None:
        """Close every transport of a local group (each drains all copy streams first)."""
        for t in group:
            t.close()

    # ------------------------------------------------------------------------------------
    # heap growth (collective)
    # ------------------------------------------------------------------------------------
    def ensure_heap(self, nbytes: int) -> None:
        """Collective: every heap holds at least ``nbytes`` bytes (flags included).

        Grows by whole segments (``segment_bytes`` multiples); addresses and contents stay.
        A no-op (no communication) when the heap is large enough already -- every rank
        calls it with the same ``nbytes``, so every rank makes the same decision."""
        self._check_open()
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        need = self._user_off + nbytes
        if need <= self._mapped:
            return
        new_mapped = self._mapped + _round_up(need - self._mapped, self._segment_bytes)
        if new_mapped > self._va_bytes:
            raise ValueError(
                f"nbytes={nbytes} needs {new_mapped} bytes of heap, more than the "
                f"va_bytes={self._va_bytes} reserved per rank"
            )
        self._grow(new_mapped)

    def heap_nbytes(self) -> int:
        """Bytes in this rank's heap, flags included (offsets go up to this)."""
        return max(0, self._mapped - self._user_off)

    def _mapped_of(self, rank: int) -> int:
        if self._peers is None:
            return self._mapped
        peer = self._peers[rank]()
        if peer is None:
            raise RuntimeError(f"rank {rank} of this local group no longer exists")
        return peer._mapped

    def _grow(self, new_mapped: int) -> None:
        cu = self._cu
        offset = self._mapped
        size = new_mapped - offset
        self._generation += 1
        gen = self._generation
        tx = Transaction()
        own_fd = -1
        err = None
        handle = None
        peers = [p for p in range(self.local_size) if p != self.rank] if not self._local else []
        sent: list[int] = []
        try:
            with self._guard:
                handle = check(cu.cuMemCreate(size, self._prop, 0),
                               f"cuMemCreate(rank={self.rank}, {size} bytes)")
                tx.on_rollback(self._release, handle)
                ptr = self._own_va + offset
                check(cu.cuMemMap(ptr, size, 0, handle, 0), f"cuMemMap(rank={self.rank})")
                tx.on_rollback(self._unmap, ptr, size)
                check(cu.cuMemSetAccess(ptr, size, self._access, 1),
                      f"cuMemSetAccess(rank={self.rank})")
                if offset == 0:  # probe, scratch and flag words start at zero
                    check(cu.cuMemsetD8Async(ptr, 0, self._user_off + 8 * self.n_flags,
                                             self._host_stream),
                          "cuMemsetD8Async(flags)")
                    check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize")
                if peers:
                    own_fd = int(check(cu.cuMemExportToShareableHandle(handle, self._H, 0),
                                       f"cuMemExportToShareableHandle(rank={self.rank})"))
            if peers and self._fd_passing != "pidfd":
                sent = self._send_fds(own_fd, gen, peers)
        except Exception as exc:  # noqa: BLE001 - shared with the peers
            if self._local:
                tx.rollback()
                raise
            err = _describe(exc)

        if self._local:
            tx.commit()
            self._segments.append((offset, size, handle))
            self._mapped = new_mapped
            return

        try:
            infos = self._allgather({"err": err, "fd": own_fd, "size": size, "offset": offset,
                                     "gen": gen, "sent": sent})
            expected = {p for p in peers if self.rank in infos[p]["sent"]}
            bad = [r for r, i in enumerate(infos) if (i["size"], i["offset"], i["gen"])
                   != (size, offset, gen)]
            failed = bad or any(i["err"] for i in infos)
            fds: dict[int, int] = {}
            err2 = None
            try:
                fds = self._recv_fds(expected, gen)
                if failed:
                    _raise_if_failed(infos, "CudaTransport heap growth")
                    raise ValueError(
                        "ensure_heap disagrees across ranks: (size, offset, generation) = "
                        + ", ".join(f"rank {r}: {(infos[r]['size'], infos[r]['offset'], infos[r]['gen'])}"
                                    for r in bad)
                    )
                missing = [p for p in peers if p not in fds]
                if missing and self._fd_passing == "socket":
                    raise RuntimeError(f"no heap fd from rank(s) {missing} over the Unix socket "
                                       f"within {self._timeout_s} s")
                for p in missing:
                    if self._fd_passing == "auto":
                        _log_once("pidfd", logging.WARNING,
                                  "heap fd of rank %d did not come over the Unix "
                                  "socket; using pidfd_getfd", p)
                    fds[p] = _pidfd_getfd(self._pids[p], infos[p]["fd"])
                with self._guard:
                    for p in peers:
                        ph = check(cu.cuMemImportFromShareableHandle(fds[p], self._H),
                                   f"cuMemImportFromShareableHandle(rank={self.rank}, peer={p})")
                        tx.on_rollback(self._release, ph)
                        pptr = self._peer_va[p] + offset
                        check(cu.cuMemMap(pptr, size, 0, ph, 0),
                              f"cuMemMap(rank={self.rank}, peer={p})")
                        tx.on_rollback(self._unmap, pptr, size)
                        check(cu.cuMemSetAccess(pptr, size, self._access, 1),
                              f"cuMemSetAccess(rank={self.rank}, peer={p})")
                        self._peer_segments[p].append((offset, size, ph))
                        tx.on_rollback(self._peer_segments[p].pop)
            except Exception as exc:  # noqa: BLE001
                if failed:
                    raise
                err2 = _describe(exc)
            finally:
                _close_fds(fds.values())
            # Second round: every rank has imported (or failed); the exporter's fd may go.
            _raise_if_failed(self._allgather({"err": err2}), "CudaTransport heap import")
        except BaseException:
            tx.rollback()
            raise
        finally:
            if own_fd >= 0:
                os.close(own_fd)
        tx.commit()
        self._segments.append((offset, size, handle))
        self._mapped = new_mapped

    def _send_fds(self, fd: int, gen: int, peers: Sequence[int]) -> list[int]:
        """Send ``fd`` to every peer's socket; returns the peers it reached."""
        header = _HEADER.pack(_FD_MAGIC, self.rank, gen)
        sent = []
        for p in peers:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(self._timeout_s)
                    s.connect(self._sock_names[p])
                    socket.send_fds(s, [header], [fd])
                sent.append(p)
            except OSError as exc:
                _log_once(f"send-{type(exc).__name__}", logging.WARNING,
                          "sending a heap fd from rank %d to rank %d over a Unix "
                          "socket failed (%s)", self.rank, p, exc)
        return sent

    def _recv_fds(self, expected: set[int], gen: int) -> dict[int, int]:
        """Accept fds from ``expected`` senders of generation ``gen``; stale ones are closed."""
        got: dict[int, int] = {}
        if not expected:
            return got
        deadline = time.monotonic() + self._timeout_s
        lst = self._listener
        try:
            while expected - got.keys():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                lst.settimeout(remaining)
                try:
                    conn, _ = lst.accept()
                except (socket.timeout, TimeoutError):
                    break
                with conn:
                    conn.settimeout(max(1.0, remaining))
                    msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 4)
                ok = len(msg) == _HEADER.size and len(fds) == 1
                if ok:
                    magic, sender, g = _HEADER.unpack(msg)
                    ok = magic == _FD_MAGIC and g == gen and sender in expected and sender not in got
                if ok:
                    got[sender] = fds[0]
                else:
                    _close_fds(fds)  # a stale message from a failed earlier round
        except BaseException:
            _close_fds(got.values())
            raise
        return got

    # ------------------------------------------------------------------------------------
    # path probes
    # ------------------------------------------------------------------------------------
    def _choose_copy_path(self) -> None:
        cu = self._cu
        why = ""
        path = "loop"
        if self._copy_mode == "loop":
            why = "copy_mode='loop'"
        elif not hasattr(cu, "cuMemcpyBatchAsync"):
            why = "this cuda-python has no cuMemcpyBatchAsync"
        elif driver.driver_version() < _BATCH_MIN_DRIVER:
            why = f"driver {driver.driver_version()} < {_BATCH_MIN_DRIVER} (CUDA 12.8)"
        else:
            a = cu.CUmemcpyAttributes()
            a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            a.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
            self._attrs = [a]
            try:  # 8 bytes from a probe word to a scratch word of our own heap
                base = self._own_va
                dp = cu.CUdeviceptr
                with self._guard:
                    check(cu.cuMemcpyBatchAsync([dp(base + self._scratch_off)], [dp(base + self._probe_off)],
                                                [8], 1, self._attrs, [0], 1, self._copy_stream_int),
                          f"cuMemcpyBatchAsync(rank={self.rank}, probe)")
                    check(cu.cuStreamSynchronize(self._copy_stream_int), "cuStreamSynchronize(copy)")
                path, why = "batch", "cuMemcpyBatchAsync works"
            except Exception as exc:  # noqa: BLE001
                if self._copy_mode == "batch":
                    raise
                why = f"cuMemcpyBatchAsync failed: {exc}"
        if self._copy_mode == "batch" and path != "batch":
            raise RuntimeError(f"copy_mode='batch' but {why}")
        self.copy_path = path
        level = logging.INFO if path == "batch" else logging.WARNING
        _log_once(f"copy-{path}", level, "copies use %s (%s)",
                  "cuMemcpyBatchAsync" if path == "batch" else "a cuMemcpyAsync loop", why)

    def _choose_signal_path(self) -> None:
        """Probe, collectively, whether a stream write lands in a peer's mapped flag."""
        cu = self._cu
        if self._signal_mode != "auto" or self._local or self.local_size == 1:
            self.signal_path = "copy" if self._signal_mode == "copy" else "direct"
            return
        peers = [p for p in range(self.local_size) if p != self.rank]
        err = None
        try:
            with self._guard:
                own_probe = self._own_va + self._probe_off + 8 * self.rank
                check(cu.cuStreamWaitValue64(self._host_stream, own_probe, 0, self._GEQ),
                      "cuStreamWaitValue64(probe)")
                for p in peers:
                    check(cu.cuStreamWriteValue64(self._host_stream,
                                                  self._bases[p] + self._probe_off + 8 * self.rank,
                                                  _PROBE_MAGIC + self.rank, self._WRITE),
                          f"cuStreamWriteValue64(peer={p})")
                check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize(probe)")
        except CudaError as exc:
            err = str(exc)
        self._allgather(None)  # every rank's probe writes are done
        words = self._read_words(self._own_va + self._probe_off, self.local_size)
        wrong = [p for p in peers if words[p] != _PROBE_MAGIC + p]
        ok = err is None and not wrong
        why = err or (f"probe words from rank(s) {wrong} did not arrive" if wrong else "")
        infos = self._allgather({"ok": ok, "why": why})
        if all(i["ok"] for i in infos):
            self.signal_path = "direct"
            _log_once("signal-direct", logging.INFO,
                      "signals write peers' flags directly (cuStreamWriteValue64 "
                      "to the peer mapping works)")
        else:
            self.signal_path = "copy"
            whys = "; ".join(f"rank {r}: {i['why']}" for r, i in enumerate(infos) if not i["ok"])
            _log_once("signal-copy", logging.WARNING,
                      "signals use a scratch word + 8-byte copy (%s)", whys)

    # ------------------------------------------------------------------------------------
    # addresses and views
    # ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CudaTransport(rank={self.rank}) is closed")

    def _check_rank(self, name: str, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.local_size:
            raise ValueError(f"{name} must be an int in [0, {self.local_size}), got {rank!r}")

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.n_flags:
            raise ValueError(f"slot must be an int in [0, {self.n_flags}), got {slot!r}")

    def address(self, rank: int, offset: int) -> int:
        """Address, in this process, of byte ``offset`` of ``rank``'s heap (0 = flag 0)."""
        self._check_rank("rank", rank)
        return self._bases[rank] + self._user_off + offset

    def heap_ptr(self, rank: int, offset: int = 0) -> int:
        """Same as :meth:`address`."""
        return self.address(rank, offset)

    def flag_ptr(self, rank: int, slot: int) -> int:
        """Address, in this process, of flag word ``slot`` of ``rank``."""
        self._check_rank("rank", rank)
        self._check_slot(slot)
        return self._bases[rank] + self._user_off + 8 * slot

    def heap_tensor(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` tensor viewing ``numel`` elements of ``rank``'s heap at byte
        ``offset`` (no copy; valid until :meth:`close`)."""
        self._check_open()
        self._check_rank("rank", rank)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        item = dtype.itemsize
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % item:
            raise ValueError(f"offset must be a non-negative multiple of {item} (the size of "
                             f"{dtype}), got {offset!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        nbytes = numel * item
        size = self._mapped_of(rank) - self._user_off
        if offset + nbytes > size:
            raise ValueError(f"offset + numel * {item} = {offset + nbytes} exceeds rank {rank}'s "
                             f"heap of {size} bytes (call ensure_heap first)")
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        ptr = self.heap_ptr(rank, offset)
        return self._wrap(ptr, nbytes).view(dtype)

    def _wrap(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over ``nbytes`` of heap at ``ptr`` that does not own the memory.

        torch's non-owning storage constructor (the one its CUDA-graph trees use) involves no
        Python object's reference count.  ``__cuda_array_interface__`` is not used: with torch
        2.11 on the H200, processes that wrapped heap memory that way crashed later inside
        the cyclic garbage collector, the signature of a Python object freed while still
        referenced.  DLPack through ctypes is the fallback for a torch without the
        constructor."""
        make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
        if make is not None:
            storage = make(ptr, self.device, nbytes)
            t = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        else:
            _log_once("dlpack", logging.INFO, "heap views through DLPack (this torch has no "
                      "_construct_storage_from_data_pointer)")
            t = _dlpack_wrap(ptr, nbytes, self.device.index)
        if t.data_ptr() != ptr or t.numel() != nbytes:
            raise RuntimeError(f"wrapping heap address {ptr:#x} gave a tensor at {t.data_ptr():#x} "
                               f"of {t.numel()} bytes")
        return t

    # ------------------------------------------------------------------------------------
    # streams, copies, flags
    # ------------------------------------------------------------------------------------
    @property
    def copy_stream(self) -> torch.cuda.Stream:
        """The stream every copy (and, by default, every signal and wait) goes on."""
        return self._copy_stream

    def _stream_int(self, stream: Any) -> int:
        if stream is None:
            return self._copy_stream_int
        if isinstance(stream, torch.cuda.Stream):
            h = int(stream.cuda_stream)
            self._streams_used.add(h)
            return h
        raise TypeError(f"stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")

    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int]) -> "PreparedCopies":
        """Check and convert a list of copies once, for :meth:`copy_prepared` to enqueue many
        times (converting addresses to driver objects costs ~10x the enqueue itself)."""
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
        dp = self._cu.CUdeviceptr
        return PreparedCopies(d, x, b, [dp(v) for v in d], [dp(v) for v in x])

    def copy_prepared(self, prepared: "PreparedCopies", *, stream: torch.cuda.Stream | None = None) -> None:
        """:meth:`copy` of a :meth:`prepare_copies` result."""
        self._check_open()
        if not prepared.nbytes:
            return
        s = self._stream_int(stream)
        cu = self._cu
        with self._guard:
            if self.copy_path == "batch" and s not in (0, 1, 2):  # legacy / per-thread default
                check(cu.cuMemcpyBatchAsync(prepared.dst_ptrs, prepared.src_ptrs, prepared.nbytes,
                                            len(prepared.nbytes), self._attrs, [0], 1, s),
                      f"cuMemcpyBatchAsync(rank={self.rank}, {len(prepared.nbytes)} copies)")
                return
            if self.copy_path == "batch":
                _log_once("copy-legacy", logging.INFO, "copies on a default "
                          "stream use a cuMemcpyAsync loop (cuMemcpyBatchAsync refuses it)")
            for d, x, b in zip(prepared.dsts, prepared.srcs, prepared.nbytes):
                check(cu.cuMemcpyAsync(d, x, b, s), f"cuMemcpyAsync(rank={self.rank})")

    def copy(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
             stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue byte copies ``srcs[i] -> dsts[i]`` (addresses) on the copy stream (or
        ``stream``), after everything already on it.  Pieces of one call may run in any
        order relative to each other.  Producers of the sources must be ordered before
        (:meth:`fence_from`); consumers wait with :meth:`fence_to` or a flag."""
        self._check_open()
        self.copy_prepared(self.prepare_copies(dsts, srcs, nbytes), stream=stream)

    def signal(self, rank: int, slot: int, value: int, *,
               stream: torch.cuda.Stream | None = None) -> None:
        """After everything enqueued before it on the copy stream (or ``stream``), write
        ``value`` into flag ``slot`` of ``rank``.  Values of one flag must only grow."""
        self._check_open()
        self._check_rank("rank", rank)
        self._check_slot(slot)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
            raise ValueError(f"value must be an int in [0, 2**63), got {value!r}")
        s = self._stream_int(stream)
        cu = self._cu
        addr = self._bases[rank] + self._user_off + 8 * slot
        with self._guard:
            if rank == self.rank or self.signal_path == "direct":
                check(cu.cuStreamWriteValue64(s, addr, value, self._WRITE),
                      f"cuStreamWriteValue64(rank={self.rank} -> {rank}, slot={slot})")
                return
            scratch = self._own_va + self._scratch_off + 8 * (rank * self.n_flags + slot)
            check(cu.cuStreamWriteValue64(s, scratch, value, self._WRITE),
                  f"cuStreamWriteValue64(rank={self.rank}, scratch for {rank}/{slot})")
            check(cu.cuMemcpyAsync(addr, scratch, 8, s),
                  f"cuMemcpyAsync(rank={self.rank} -> {rank}, flag {slot})")

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float,
             stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """Work enqueued later on the copy stream (or ``stream``) waits until local flag
        ``slot`` is >= ``value`` (set by ``peer``).  The stream cannot time out by itself:
        :meth:`synchronize` (or :meth:`host_wait_flag`) raises ``PeerTimeoutError(peer)``
        once ``timeout_s`` has passed."""
        self._check_open()
        self._check_slot(slot)
        self._check_rank("peer", peer)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
            raise ValueError(f"value must be an int in [0, 2**63), got {value!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        s = self._stream_int(stream)
        with self._guard:
            check(self._cu.cuStreamWaitValue64(s, self._own_va + self._user_off + 8 * slot,
                                               value, self._GEQ),
                  f"cuStreamWaitValue64(rank={self.rank}, slot={slot}, peer={peer})")
        self._pending[slot] = (value, peer + self.rank_offset, s, what)

    def fence_from(self, stream: torch.cuda.Stream | None = None) -> None:
        """The copy stream waits for work already enqueued on ``stream`` (default: the
        current stream of this device)."""
        self._check_open()
        src = torch.cuda.current_stream(self.device) if stream is None else stream
        self._copy_stream.wait_stream(src)

    def fence_to(self, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` (default: the current stream of this device) waits for work already
        enqueued on the copy stream."""
        self._check_open()
        dst = torch.cuda.current_stream(self.device) if stream is None else stream
        dst.wait_stream(self._copy_stream)

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """:meth:`wait` on several local flags in one driver call (``cuStreamBatchMemOp``;
        one ``cuStreamWaitValue64`` each where batches are refused).  ``what`` may hold
        ``{peer}``."""
        n = len(slots)
        if len(values) != n or len(peers) != n:
            raise ValueError(f"slots, values and peers must have one entry per wait, got "
                             f"{n}, {len(values)} and {len(peers)}")
        if n == 0:
            return
        if n == 1 or not self._memop_batch:
            for sl, v, p in zip(slots, values, peers):
                self.wait(sl, v, peer=p, timeout_s=timeout_s, stream=stream,
                          what=what.format(peer=p + self.rank_offset))
            return
        self._check_open()
        for sl, p in zip(slots, peers):
            self._check_slot(sl)
            self._check_rank("peer", p)
        s = self._stream_int(stream)
        base = self._own_va + self._user_off
        self._memops(s, [(self._WAIT_OP, base + 8 * sl, v, self._GEQ) for sl, v in zip(slots, values)],
                     "wait")
        for sl, v, p in zip(slots, values, peers):
            self._pending[sl] = (v, p + self.rank_offset, s, what.format(peer=p + self.rank_offset))

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: torch.cuda.Stream | None = None) -> None:
        """:meth:`signal` to several flags (of several ranks) in one driver call."""
        n = len(ranks)
        if len(slots) != n or len(values) != n:
            raise ValueError(f"ranks, slots and values must have one entry per signal, got "
                             f"{n}, {len(slots)} and {len(values)}")
        if n == 0:
            return
        if n == 1 or not self._memop_batch or self.signal_path != "direct":
            for r, sl, v in zip(ranks, slots, values):
                self.signal(r, sl, v, stream=stream)
            return
        self._check_open()
        for r, sl, v in zip(ranks, slots, values):
            self._check_rank("rank", r)
            self._check_slot(sl)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
                raise ValueError(f"value must be an int in [0, 2**63), got {v!r}")
        s = self._stream_int(stream)
        self._memops(s, [(self._WRITE_OP, self._bases[r] + self._user_off + 8 * sl, v, self._WRITE)
                         for r, sl, v in zip(ranks, slots, values)], "write")

    def _memops(self, s: int, ops: Sequence[tuple[Any, int, int, int]], kind: str) -> None:
        """Enqueue ``(op, address, value, flags)`` stream memory operations, <= 255 a call."""
        cu = self._cu
        for i in range(0, len(ops), 255):
            part = ops[i:i + 255]
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

    def _choose_memop_path(self) -> None:
        """Probe ``cuStreamBatchMemOp`` (a wait that is already satisfied and a write, on
        this rank's own scratch word); fall back to one call per flag if refused."""
        cu = self._cu
        self._WAIT_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
        self._WRITE_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
        self._memop_batch = False
        if not hasattr(cu, "cuStreamBatchMemOp") or os.environ.get("TIDE_TRITON_MEMOP_BATCH", "1") == "0":
            return
        word = self._own_va + self._scratch_off
        try:
            self._memops(self._host_stream_int, [(self._WRITE_OP, word, 7, self._WRITE),
                                                 (self._WAIT_OP, word, 7, self._GEQ),
                                                 (self._WRITE_OP, word, 0, self._WRITE)], "probe")
            with self._guard:
                check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize(memop probe)")
            self._memop_batch = True
        except CudaError as exc:
            _log_once("memop-loop", logging.INFO,
                      "flag waits and signals use one call each (cuStreamBatchMemOp: %s)", exc)

    def session(self) -> CtxGuard:
        """``with t.session():`` -- hold this transport's context current across many
        enqueues (each one then skips its own push/pop)."""
        return self._guard

    def host_wait_event(self, event: Any, *, timeout_s: float) -> None:
        """Block the host until ``event`` (a ``torch.cuda.Event``) has completed -- the
        pacing of a long collective, so the host never runs more than a few chunks ahead
        of the GPU.  After ``timeout_s``, raises ``PeerTimeoutError`` naming the peer of a
        pending flag wait that is still short."""
        if event.query():
            return
        deadline = time.monotonic() + timeout_s
        nap = 5e-6
        while not event.query():
            if time.monotonic() >= deadline:
                self._raise_stuck(timeout_s, None)
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def _raise_stuck(self, timeout_s: float, s: int | None) -> None:
        """Raise ``PeerTimeoutError`` for a pending wait (on stream ``s``, or any) whose
        flag is still short, else ``TimeoutError``."""
        for slot, (value, peer, sh, what) in sorted(self._pending.items()):
            if s is not None and sh != s:
                continue
            cur = self.read_flag(slot)
            if cur < value:
                raise PeerTimeoutError(
                    peer, what or f"flag {slot} of rank {self.rank + self.rank_offset} to reach {value}, "
                    f"last read {cur}", timeout_s)
        raise TimeoutError(f"rank {self.rank + self.rank_offset}: GPU work still busy after {timeout_s:.1f} s "
                           "(no pending flag wait is short)")

    # ------------------------------------------------------------------------------------
    # host-side waits
    # ------------------------------------------------------------------------------------
    def _read_words(self, addr: int, n: int) -> list[int]:
        cu = self._cu
        with self._guard:
            check(cu.cuMemcpyDtoHAsync(self._host_buf, addr, 8 * n, self._host_stream),
                  f"cuMemcpyDtoHAsync(rank={self.rank}, flags)")
            check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize(host reads)")
        return list((ctypes.c_int64 * n).from_address(self._host_buf))

    def read_flag(self, slot: int, rank: int | None = None) -> int:
        """Current value of flag ``slot`` of ``rank`` (default: this rank), read from the
        host on a private stream (never waits for the copy stream)."""
        self._check_open()
        self._check_slot(slot)
        r = self.rank if rank is None else rank
        self._check_rank("rank", r)
        return self._read_words(self._bases[r] + self._user_off + 8 * slot, 1)[0]

    def host_wait_flag(self, slot: int, value: int, peer: int, timeout_s: float,
                       what: str = "") -> int:
        """Block the host until local flag ``slot`` >= ``value``; returns the value read.
        Raises ``PeerTimeoutError(peer)`` after ``timeout_s`` (``what`` says what for)."""
        self._check_slot(slot)
        self._check_rank("peer", peer)
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

    def synchronize(self, *, timeout_s: float, stream: torch.cuda.Stream | None = None) -> None:
        """Block the host until the copy stream (or ``stream``) is idle.  After
        ``timeout_s``, raises ``PeerTimeoutError`` naming the peer of a pending
        :meth:`wait` whose flag is still short, else ``TimeoutError``."""
        self._check_open()
        s = self._stream_int(stream)
        deadline = time.monotonic() + timeout_s
        nap = 20e-6
        while True:
            res = self._cu.cuStreamQuery(s)
            code = int(res[0])
            if code == 0:
                self._pending = {k: v for k, v in self._pending.items() if v[2] != s}
                return
            if code != _CUDA_ERROR_NOT_READY:
                check(res, f"cuStreamQuery(rank={self.rank})")
            if time.monotonic() >= deadline:
                break
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)
        self._raise_stuck(timeout_s, s)

    # ------------------------------------------------------------------------------------
    # teardown
    # ------------------------------------------------------------------------------------
    def _release(self, handle: Any) -> None:
        with self._guard:
            check(self._cu.cuMemRelease(handle), f"cuMemRelease(rank={self.rank})")

    def _unmap(self, ptr: int, size: int) -> None:
        with self._guard:
            check(self._cu.cuMemUnmap(ptr, size), f"cuMemUnmap(rank={self.rank})")

    def _reserve_va(self, what: str) -> int:
        return int(check(self._cu.cuMemAddressReserve(self._va_bytes, self._gran, 0, 0),
                         f"cuMemAddressReserve({what}, {self._va_bytes} bytes)"))

    def _free_va(self, va: int) -> None:
        with self._guard:
            check(self._cu.cuMemAddressFree(va, self._va_bytes), f"cuMemAddressFree(rank={self.rank})")

    def _destroy_stream(self, s: Any) -> None:
        with self._guard:
            check(self._cu.cuStreamDestroy(s), f"cuStreamDestroy(rank={self.rank})")

    def _free_host(self, p: int) -> None:
        with self._guard:
            check(self._cu.cuMemFreeHost(p), f"cuMemFreeHost(rank={self.rank})")

    def _release_ctx(self) -> None:
        check(self._cu.cuDevicePrimaryCtxRelease(self._cudev), "cuDevicePrimaryCtxRelease")

    def _release_heap(self) -> None:
        """Unmap and release every segment (own and peers'); the VA ranges stay reserved."""
        for p, segs in self._peer_segments.items():
            while segs:
                off, size, h = segs.pop()
                self._quiet(self._unmap, self._peer_va[p] + off, size)
                self._quiet(self._release, h)
        while self._segments:
            off, size, h = self._segments.pop()
            self._quiet(self._unmap, self._own_va + off, size)
            self._quiet(self._release, h)
        self._mapped = 0

    @staticmethod
    def _quiet(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - teardown goes on
            log.warning("teardown step %s failed", fn.__name__, exc_info=True)

    def _drain(self, timeout_s: float) -> bool:
        """Wait (polling, bounded) until every stream that may touch the heaps is idle."""
        # torch's streams come from its pool and are never destroyed, so their handles stay
        # valid to query; a handle that errors is taken as idle.
        handles = {self._copy_stream_int, self._host_stream_int, *self._streams_used}
        if self._peers is not None:
            for ref in self._peers:
                t = ref()
                if t is None:
                    continue
                if not t._closed:
                    handles.add(t._copy_stream_int)
                    handles.update(t._streams_used)
        deadline = time.monotonic() + timeout_s
        with self._guard:
            for h in handles:
                while int(self._cu.cuStreamQuery(h)[0]) == _CUDA_ERROR_NOT_READY:
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(1e-3)
        return True

    def close(self) -> None:
        """Unmap and free everything this rank holds (local; idempotent).  Waits up to
        30 s for the copy streams; if they never drain (a flag wait that no peer will
        release), the memory is leaked instead of unmapped under running copies."""
        if self._closed:
            return
        self._closed = True
        if not self._drain(_DRAIN_TIMEOUT_S):
            log.error("rank %d: streams still busy after %.0f s at close; "
                      "leaking the heap rather than unmapping it under running work",
                      self.rank, _DRAIN_TIMEOUT_S)
            return
        self._release_heap()
        for va in self._peer_va.values():
            self._quiet(self._free_va, va)
        self._peer_va.clear()
        self._quiet(self._free_va, self._own_va)
        self._quiet(self._destroy_stream, self._host_stream)
        self._quiet(self._free_host, self._host_buf)
        self._quiet(self._destroy_stream, self._copy_stream_handle)
        self._quiet(self._release_ctx)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

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
        state = "closed" if self._closed else f"heap={self.heap_nbytes()}"
        return (f"CudaTransport(rank={self.rank}, local_size={self.local_size}, "
                f"device={self.device}, {state}, copy={self.copy_path}, "
                f"signal={self.signal_path})")
