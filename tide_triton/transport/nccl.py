"""NCCL host APIs for the inter-node hop: a typed ctypes table over ``libnccl.so.2``.

Why ctypes and not nccl4py: the NCCL that can run several ranks per GPU or one-sided RMA
(>= 2.29-2.30) is newer than the one torch's wheels pin (2.28.9 for torch 2.11 + cu130), so
it cannot be a pip dependency beside torch; users bring a library and point at it.  A
ctypes table binds *whatever library is loaded*, needs no compiled code and no extra
package, and lets every optional entry point be probed by symbol and version (nccl4py
targets one NCCL release and is not on the machines we run on).  The table follows
NCCL's ``nccl.h`` (2.27-2.32); ``ncclUniqueId`` is passed by value, communicators,
windows and streams as pointers.

Library discovery (first that exists): the ``path`` argument > ``$TIDE_TRITON_NCCL_LIBRARY``
> the ``nvidia-nccl-cu1x`` wheel's ``nvidia/nccl/lib/libnccl.so.2`` > the system's
``libnccl.so.2`` (the dynamic loader's search, which finds the copy torch loaded).

Features, by runtime version *and* exported symbol:

* ``one_sided`` (>= 2.29.2): ``ncclPutSignal`` / ``ncclWaitSignal`` into registered windows --
  the data path: copy engines inside an NVLink domain, NCCL's proxy on the network, no SMs.
* ``windows`` (>= 2.27): ``ncclCommWindowRegister`` (``NCCL_WIN_COLL_SYMMETRIC``).  A window
  must be ONE physical cuMem segment (NCCL 2.32 refuses VAs backed by several), so windows
  are registered per heap segment, not over the whole heap.
* ``rma_landing``: the above plus ``ncclSignal`` and ``ncclMemAlloc`` -- what the put/signal
  inter-node hop (:mod:`tide_triton.transport.rma_protocol`) needs.
* ``multi_rank_per_gpu`` (>= 2.30, with ``NCCL_MULTI_RANK_GPU_ENABLE=1``): several ranks on
  one GPU, how multi-node topologies are emulated on one H200.
* Otherwise the fallback is grouped ``ncclSend`` / ``ncclRecv``, whose kernels use SMs: that
  is logged once.

Communicators are created over a set of global ranks (a rail) from a unique id made by the
set's first member and exchanged through the caller's ``exchange`` (a torch.distributed
object all-gather), and destroyed by :meth:`NcclComm.close`.
"""
from __future__ import annotations

import ctypes as C
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..runtime import envs

log = logging.getLogger("tide_triton")

ENV_LIBRARY = envs.NCCL_LIBRARY
_SONAME = "libnccl.so.2"

CLOSE = "destroy"
"""Diagnostics: how a communicator ends -- ``"destroy"``, ``"abort"`` or ``"none"`` (left to
process exit)."""
_CLOSE_CHOICES = ("destroy", "abort", "none")

_P = C.c_void_p
_NCCL_UINT8 = 1
_WIN_COLL_SYMMETRIC = 0x01


class NcclUniqueId(C.Structure):
    _fields_ = [("internal", C.c_byte * 128)]


class NcclWaitSignalDesc(C.Structure):
    # Field order matters: nccl.h's ncclWaitSignalDesc_t.
    _fields_ = [("opCnt", C.c_int), ("peer", C.c_int), ("sigIdx", C.c_int), ("ctx", C.c_int)]


_REQUIRED: dict[str, list[Any]] = {
    "ncclGetVersion": [C.POINTER(C.c_int)],
    "ncclGetUniqueId": [C.POINTER(NcclUniqueId)],
    "ncclGetErrorString": [C.c_int],
    "ncclCommInitRank": [C.POINTER(_P), C.c_int, NcclUniqueId, C.c_int],
    "ncclCommDestroy": [_P],
    "ncclCommAbort": [_P],
    "ncclSend": [_P, C.c_size_t, C.c_int, C.c_int, _P, _P],
    "ncclRecv": [_P, C.c_size_t, C.c_int, C.c_int, _P, _P],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
}
_OPTIONAL: dict[str, list[Any]] = {
    "ncclCommWindowRegister": [_P, _P, C.c_size_t, C.POINTER(_P), C.c_int],
    "ncclCommWindowDeregister": [_P, _P],
    "ncclPutSignal": [_P, C.c_size_t, C.c_int, C.c_int, _P, C.c_size_t, C.c_int, C.c_int, C.c_uint, _P, _P],
    "ncclWaitSignal": [C.c_int, C.POINTER(NcclWaitSignalDesc), _P, _P],
    "ncclSignal": [C.c_int, C.c_int, C.c_int, C.c_uint, _P, _P],
    "ncclMemAlloc": [C.POINTER(_P), C.c_size_t],
    "ncclMemFree": [_P],
    "ncclGetLastError": [_P],
}


class NcclError(RuntimeError):
    """An NCCL call failed; ``code`` is its ``ncclResult_t``."""

    def __init__(self, what: str, code: int, message: str) -> None:
        super().__init__(f"{what} failed: {message} (ncclResult {code})")
        self.what = what
        self.code = code


def _wheel_library() -> Path | None:
    try:
        import nvidia.nccl as pkg  # type: ignore[import-not-found]
    except ImportError:
        return None
    for base in getattr(pkg, "__path__", []):
        cand = Path(base) / "lib" / _SONAME
        if cand.exists():
            return cand
    return None


def find_library(path: str | os.PathLike | None = None) -> tuple[str, str]:
    """``(path or soname, how it was found)``: the argument > ``$TIDE_TRITON_NCCL_LIBRARY`` >
    the nvidia-nccl wheel > the system loader.  An explicit path that does not exist is an
    error naming where it came from (never silently replaced by another library)."""
    for value, how in ((path, "path argument"), (envs.nccl_library(), f"${ENV_LIBRARY}")):
        if value:
            p = Path(value)
            if not p.is_file():
                raise FileNotFoundError(f"NCCL library from the {how} does not exist: {value}")
            return str(p), how
    wheel = _wheel_library()
    if wheel is not None:
        return str(wheel), "nvidia-nccl wheel"
    return _SONAME, "system loader"


def _version_tuple(code: int) -> tuple[int, int, int]:
    # NCCL >= 2.9 encodes major*10000 + minor*100 + patch; older major*1000 + minor*100 + patch.
    if code >= 10000:
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


@dataclass(frozen=True)
class Features:
    windows: bool
    one_sided: bool
    multi_rank_per_gpu: bool

    rma_landing: bool
    """Everything the put/signal inter-node hop uses: ``one_sided`` and ``windows``, plus
    ``ncclSignal`` and ``ncclMemAlloc`` / ``ncclMemFree`` (its landing ring's memory)."""


class NcclLibrary:
    """One loaded libnccl: its typed functions, runtime version and features."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        where, how = find_library(path)
        try:
            self._lib = C.CDLL(where)
        except OSError as exc:
            raise OSError(f"cannot load NCCL ({how}: {where}): {exc}") from exc
        self.path, self.found_by = where, how
        self._fn: dict[str, Any] = {}
        missing = []
        for name, argtypes in _REQUIRED.items():
            f = getattr(self._lib, name, None)
            if f is None:
                missing.append(name)
                continue
            f.restype, f.argtypes = C.c_int, argtypes
            self._fn[name] = f
        if missing:
            raise OSError(f"{where} ({how}) is not a usable NCCL: missing {', '.join(missing)}")
        self._fn["ncclGetErrorString"].restype = C.c_char_p
        for name, argtypes in _OPTIONAL.items():
            f = getattr(self._lib, name, None)
            if f is not None:
                f.restype, f.argtypes = C.c_int, argtypes
                self._fn[name] = f
        if "ncclGetLastError" in self._fn:
            self._fn["ncclGetLastError"].restype = C.c_char_p
        v = C.c_int()
        self.check(self._fn["ncclGetVersion"](C.byref(v)), "ncclGetVersion")
        self.version_code = int(v.value)
        self.version = _version_tuple(self.version_code)
        has = self._fn.__contains__
        windows = self.version >= (2, 27, 0) and has("ncclCommWindowRegister")
        one_sided = self.version >= (2, 29, 2) and has("ncclPutSignal") and has("ncclWaitSignal")
        self.features = Features(
            windows=windows, one_sided=one_sided, multi_rank_per_gpu=self.version >= (2, 30, 0),
            rma_landing=windows and one_sided and has("ncclSignal") and has("ncclMemAlloc") and has("ncclMemFree"))

    def __repr__(self) -> str:
        v = ".".join(map(str, self.version))
        return f"NcclLibrary({v}, {self.path!r} via {self.found_by}, {self.features})"

    def fn(self, name: str) -> Any:
        f = self._fn.get(name)
        if f is None:
            raise RuntimeError(f"this NCCL ({'.'.join(map(str, self.version))}, {self.path}) has no {name}")
        return f

    def check(self, code: int, what: str) -> None:
        if code != 0:
            msg = self._fn["ncclGetErrorString"](code)
            raise NcclError(what, int(code), msg.decode() if msg else "unknown error")

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self.fn("ncclGetUniqueId")(C.byref(uid)), "ncclGetUniqueId")
        return bytes(C.string_at(C.addressof(uid), C.sizeof(uid)))


_loaded: dict[str, NcclLibrary] = {}
_loaded_lock = threading.Lock()


def load(path: str | os.PathLike | None = None) -> NcclLibrary:
    """The :class:`NcclLibrary` for ``path`` (see :func:`find_library`), loaded once."""
    where, _ = find_library(path)
    with _loaded_lock:
        lib = _loaded.get(where)
        if lib is None:
            lib = _loaded[where] = NcclLibrary(where)
            log.info("NCCL %s", lib)
    return lib


_fallback_logged = False

MULTI_RANK_PER_GPU = (2, 30, 0)
"""The first NCCL that lets several ranks of one communicator share a GPU."""


def _device_key(device_index: int) -> str:
    """What tells GPUs apart across processes: the device UUID (ordinals differ under
    per-process ``CUDA_VISIBLE_DEVICES``), else the ordinal."""
    try:
        return f"uuid-{torch.cuda.get_device_properties(device_index).uuid}"
    except Exception:  # noqa: BLE001 - only used to tell devices apart
        return f"ordinal-{device_index}"


def check_placement(lib: "NcclLibrary", entries: Sequence[Any], rank: int) -> None:
    """Raise, on every rank alike, when a communicator of the group would put several of its
    ranks on one GPU and the loaded NCCL is older than 2.30.  ``entries[r]`` is rank ``r``'s
    ``(unique id or None, device key, members)`` from the exchange (None for a rank outside
    every communicator); the decision uses only ``entries``, so every rank reaches it."""
    if lib.version >= MULTI_RANK_PER_GPU:
        return
    shared = []
    seen: set[tuple[int, ...]] = set()
    for e in entries:
        if not e or tuple(e[2]) in seen:
            continue
        members = tuple(e[2])
        seen.add(members)
        by_dev: dict[str, list[int]] = {}
        for m in members:
            if 0 <= m < len(entries) and entries[m]:
                by_dev.setdefault(entries[m][1], []).append(m)
        shared += [ranks for ranks in by_dev.values() if len(ranks) > 1]
    if shared:
        v = ".".join(map(str, lib.version))
        raise RuntimeError(
            f"ranks {', '.join(map(str, shared))} share a GPU within one NCCL communicator, which "
            f"needs NCCL >= 2.30 (with NCCL_MULTI_RANK_GPU_ENABLE=1); the loaded NCCL is {v} from "
            f"{lib.path} (found by {lib.found_by}).  Point the project at a newer libnccl.so.2 with "
            f"${ENV_LIBRARY}=/path/to/libnccl.so.2 or GroupOptions(nccl_library=...), e.g. from "
            f"the nvidia-nccl-cu12/cu13 wheel >= 2.30, or place one rank per GPU (rank {rank})")


class NcclComm:
    """A communicator over ``members`` (global ranks, e.g. one rail), made collectively by
    every rank of the group: the first member's unique id travels through ``exchange`` (an
    all-gather of small objects over the whole group) with every rank's device, and
    :func:`check_placement` refuses, on every rank, members sharing a GPU under NCCL < 2.30
    (which fails inside ``ncclCommInitRank`` with "invalid usage")."""

    def __init__(self, lib: NcclLibrary, members: Sequence[int], rank: int,
                 exchange: Callable[[object], list], *, device_index: int) -> None:
        if rank not in members:
            raise ValueError(f"rank {rank} is not one of the communicator's members {list(members)}")
        if len(set(members)) != len(members):
            raise ValueError(f"members must be distinct ranks, got {list(members)}")
        self.lib = lib
        self.members = tuple(members)
        self.index = self.members.index(rank)
        self._comm = _P()
        self._closed = True
        self._windows: list[Any] = []
        self._memory: list[Any] = []
        uid_bytes = lib.unique_id() if self.index == 0 else None
        # Every rank sends its device with the id: the placement check below needs to know
        # which members share a GPU, and every rank decides it from the same list.
        got = exchange((uid_bytes, _device_key(device_index), self.members))
        check_placement(lib, got, rank)
        uid_bytes = got[self.members[0]][0]
        if not isinstance(uid_bytes, (bytes, bytearray)) or len(uid_bytes) != C.sizeof(NcclUniqueId):
            raise RuntimeError(f"rank {self.members[0]} sent no NCCL unique id for communicator {self.members}")
        uid = NcclUniqueId.from_buffer_copy(uid_bytes)
        self.device_index = device_index
        with torch.cuda.device(device_index):
            lib.check(lib.fn("ncclCommInitRank")(C.byref(self._comm), len(self.members), uid, self.index),
                      f"ncclCommInitRank(members={self.members}, index={self.index})")
        self._closed = False

    # ---- data movement ----------------------------------------------------------------
    def register_window(self, ptr: int, nbytes: int) -> Any:
        """Collective over the members: register ``nbytes`` at ``ptr`` (one cuMem segment)
        as a symmetric window; returns the handle (deregistered by :meth:`close`)."""
        win = _P()
        with torch.cuda.device(self.device_index):
            self.lib.check(self.lib.fn("ncclCommWindowRegister")(self._comm, _P(ptr), nbytes, C.byref(win),
                                                                  _WIN_COLL_SYMMETRIC),
                           f"ncclCommWindowRegister({nbytes} bytes)")
        self._windows.append(win)
        return win

    def mem_alloc(self, nbytes: int) -> int:
        """``nbytes`` of ``ncclMemAlloc`` memory (one physical cuMem segment, as a window
        needs; local, not collective).  Freed by :meth:`close`."""
        ptr = _P()
        with torch.cuda.device(self.device_index):
            self.lib.check(self.lib.fn("ncclMemAlloc")(C.byref(ptr), nbytes), f"ncclMemAlloc({nbytes})")
        self._memory.append(ptr)
        return int(ptr.value)

    def signal(self, peer: int, stream: int) -> None:
        """Raise this rank's signal counter at ``peer`` by one (enqueued on ``stream``,
        after everything before it there; no data)."""
        self.lib.check(self.lib.fn("ncclSignal")(peer, 0, 0, 0, self._comm, _P(stream)), f"ncclSignal(peer={peer})")

    def put_signal(self, src: int, nbytes: int, peer: int, window: Any, offset: int, stream: int) -> None:
        """One-sided: ``nbytes`` from ``src`` into ``peer``'s copy of ``window`` at ``offset``,
        then a signal to ``peer`` (enqueued on ``stream``; no SMs on NVLink or the network)."""
        self.lib.check(self.lib.fn("ncclPutSignal")(_P(src), nbytes, _NCCL_UINT8, peer, window, offset,
                                                     0, 0, 0, self._comm, _P(stream)),
                       f"ncclPutSignal(peer={peer}, {nbytes} bytes)")

    def wait_signals(self, counts: dict[int, int], stream: int) -> None:
        """``stream`` waits until each ``peer`` in ``counts`` has signalled ``counts[peer]``
        more times (the data of those puts is then visible here)."""
        descs = (NcclWaitSignalDesc * len(counts))(*[NcclWaitSignalDesc(n, p, 0, 0) for p, n in counts.items()])
        self.lib.check(self.lib.fn("ncclWaitSignal")(len(counts), descs, self._comm, _P(stream)),
                       f"ncclWaitSignal(peers={sorted(counts)})")

    def send_recv(self, sends: Sequence[tuple[int, int, int]], recvs: Sequence[tuple[int, int, int]],
                  stream: int) -> None:
        """Fallback data path: grouped ``ncclSend`` of ``(ptr, nbytes, peer)`` and ``ncclRecv``
        of ``(ptr, nbytes, peer)`` on ``stream`` (NCCL's kernels: uses SMs)."""
        global _fallback_logged
        if not _fallback_logged:
            _fallback_logged = True
            why = ("chosen by GroupOptions.inter_node, or the fallback of 'auto'" if self.lib.features.one_sided
                   else "one-sided put/signal needs NCCL >= 2.29.2")
            log.warning("NCCL %s: the inter-node hop uses ncclSend/ncclRecv, whose kernels take SMs (%s)",
                        ".".join(map(str, self.lib.version)), why)
        send, recv = self.lib.fn("ncclSend"), self.lib.fn("ncclRecv")
        self.lib.check(self.lib.fn("ncclGroupStart")(), "ncclGroupStart")
        try:
            for ptr, n, peer in sends:
                self.lib.check(send(_P(ptr), n, _NCCL_UINT8, peer, self._comm, _P(stream)), f"ncclSend(peer={peer})")
            for ptr, n, peer in recvs:
                self.lib.check(recv(_P(ptr), n, _NCCL_UINT8, peer, self._comm, _P(stream)), f"ncclRecv(peer={peer})")
        finally:
            self.lib.check(self.lib.fn("ncclGroupEnd")(), "ncclGroupEnd")

    # ---- lifetime ---------------------------------------------------------------------
    def close(self, deadline_s: float | None = None) -> None:
        """Deregister the windows and destroy the communicator (idempotent).  Both wait for
        the other members to do the same for this communicator (in the same order relative to
        their other communicators: :mod:`tide_triton.group.core` closes groups newest first), so
        they run on a helper thread with a deadline (``TIDE_TRITON_NCCL_CLOSE_DEADLINE_S``,
        default 60 s): past it, an error names this rank and the members, and the
        communicator is left to process exit instead of holding this process forever.  At
        interpreter exit (no thread may start there) it runs here, without the deadline."""
        if self._closed:
            return
        self._closed = True
        deadline_s = envs.nccl_close_deadline_s() if deadline_s is None else deadline_s
        worker = threading.Thread(target=self._teardown, name=f"tide-nccl-close-{self.members}", daemon=True)
        try:
            worker.start()
        except RuntimeError:  # Python >= 3.12 starts no thread in an atexit handler: close here, unbounded
            self._teardown()
            return
        worker.join(deadline_s)
        if worker.is_alive():
            rank = self.members[self.index]
            log.error("rank %d: closing the NCCL communicator of ranks %s did not end within %g s: a member "
                      "has not closed it (still running, or closing its groups in another order); it is left "
                      "to process exit", rank, list(self.members), deadline_s)

    def _teardown(self) -> None:
        dereg = self.lib._fn.get("ncclCommWindowDeregister")
        while self._windows:
            win = self._windows.pop()
            if dereg is not None:
                code = dereg(self._comm, win)
                if code:
                    log.warning("ncclCommWindowDeregister failed (ncclResult %d)", code)
        while self._memory:
            code = self.lib.fn("ncclMemFree")(self._memory.pop())
            if code:
                log.warning("ncclMemFree failed (ncclResult %d)", code)
        how = CLOSE
        if how not in _CLOSE_CHOICES:
            raise ValueError(f"tide_triton.transport.nccl.CLOSE must be one of {_CLOSE_CHOICES}, got {how!r}")
        if how == "none":
            log.warning("tide_triton.transport.nccl.CLOSE = 'none': the NCCL communicator is left to process exit")
            return
        code = self.lib.fn("ncclCommAbort" if how == "abort" else "ncclCommDestroy")(self._comm)
        if code and how != "abort":
            log.warning("ncclCommDestroy failed (ncclResult %d); aborting the communicator", code)
            self.lib.fn("ncclCommAbort")(self._comm)

    def abort(self) -> None:
        """``ncclCommAbort`` (local; idempotent): ends the communicator's stuck operations.
        Its windows and memory are left to process exit (deregistering them would wait on
        the aborted communicator)."""
        if self._closed:
            return
        self._closed = True
        code = self.lib.fn("ncclCommAbort")(self._comm)
        if code:
            log.warning("ncclCommAbort failed (ncclResult %d)", code)

    def __enter__(self) -> "NcclComm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
