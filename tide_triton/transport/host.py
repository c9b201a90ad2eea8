"""Host transport: the transport interface over CPU shared memory, for tests without a GPU.

Each rank's heap is a file in ``/dev/shm`` mapped into a virtual range reserved once
(``mmap`` with ``MAP_FIXED`` into a ``PROT_NONE`` reservation), so the heap grows by whole
segments without moving: addresses handed out earlier stay valid, as with the VMM heap.
Peers open each other's files by name (exchanged through the group), keep the descriptors
for growth, and the files are unlinked as soon as every peer has opened them -- nothing is
left in ``/dev/shm`` even if a process dies.  Copies are ``memmove``; flags are 64-bit
words at the start of every heap, written after the copies they announce (x86 stores are
ordered, and every copy here completes before the call returns).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import time
import uuid
from typing import Callable, Sequence

import torch

from ..heap import round_up
from .base import PeerTimeoutError

__all__ = ["HostTransport", "remove_stale_files"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_PROT_NONE = 0
_MAP_NORESERVE = 0x4000
_RESERVE_BYTES = 1 << 36  # 64 GiB of address space per heap; only mapped pages cost memory
_PAGE = mmap.PAGESIZE
_SEGMENT = 1 << 22  # heaps grow by whole 4 MiB segments



def _mmap(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    out = _libc.mmap(addr, length, prot, flags, fd, offset)
    if out in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({length} bytes) failed: {os.strerror(err)}")
    return out


_SHM_DIR = "/dev/shm"
_SHM_PREFIX = "tide_triton."


def remove_stale_files(directory: str = _SHM_DIR) -> list[str]:
    """Remove heap files (``tide_triton.<pid>.<hex>.<rank>``) whose creating process is gone:
    a process killed between creating its file and every peer opening it (where it is
    unlinked) leaves one behind.  Returns the paths removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for n in names:
        if not n.startswith(_SHM_PREFIX):
            continue
        parts = n[len(_SHM_PREFIX):].split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        pid = int(parts[0])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): keep
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, n))
            removed.append(os.path.join(directory, n))
        except OSError:
            pass
    return removed


class HostTransport:
    """Shared-memory heaps for ``local_size`` processes on one host.

    ``exchange(obj) -> list`` gathers one small picklable object from every local rank (in
    rank order); the group provides it over its torch.distributed process group.
    """

    def __init__(self, rank: int, local_size: int, exchange: Callable[[object], list], *,
                 n_flags: int = 1024) -> None:
        self.rank = rank
        self.local_size = local_size
        self.rank_offset = 0
        """Added to rank numbers in timeouts (a node-local transport of a several-node group)."""
        self.n_flags = n_flags
        self.device = torch.device("cpu")
        self.watch: Callable[[int], None] | None = None
        """Called with the peer's rank while a wait on it polls (the group's abort check: it
        raises when the peer has abandoned the call)."""
        self._exchange = exchange
        self._closed = False
        self._bases: list[int] = []
        self._mapped: list[int] = [0] * local_size
        self._fds: list[int] = []
        self._size = 0
        remove_stale_files()
        name = f"{_SHM_DIR}/{_SHM_PREFIX}{os.getpid()}.{uuid.uuid4().hex[:12]}.{rank}"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            names = exchange(name)
            self._fds = [fd if r == rank else os.open(n, os.O_RDWR) for r, n in enumerate(names)]
            exchange(None)  # every rank holds every file open: the names can go
        finally:
            os.unlink(name)
        for _ in range(local_size):
            self._bases.append(_mmap(None, _RESERVE_BYTES, _PROT_NONE,
                                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0))
        self.ensure_heap(n_flags * 8)

    # ---- heap -------------------------------------------------------------------------
    def ensure_heap(self, nbytes: int) -> None:
        """Collective: every heap holds at least ``nbytes`` (whole segments); addresses stay.
        A no-op (no communication) when the heap is large enough already: heaps grow
        together and every rank asks for the same ``nbytes``, so all make the same decision."""
        self._check_open()
        if 0 < nbytes <= self._size:
            return
        want = round_up(max(nbytes, 1), _SEGMENT)
        sizes = self._exchange(max(want, self._size))
        new = max(sizes)
        if new > _RESERVE_BYTES:
            raise ValueError(f"heap of {new} bytes exceeds the {_RESERVE_BYTES}-byte reservation")
        if new > self._size:
            os.ftruncate(self._fds[self.rank], new)
        self._exchange(None)  # every file is long enough before anyone maps it
        for r in range(self.local_size):
            old = self._mapped[r]
            if new > old:
                _mmap(self._bases[r] + old, new - old, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_SHARED | _MAP_FIXED, self._fds[r], old)
                self._mapped[r] = new
        self._size = new

    def heap_nbytes(self) -> int:
        return self._size

    def _segment_range(self, what: str, offset: int, nbytes: int) -> None:
        for name, v, low in (("offset", offset, 0), ("nbytes", nbytes, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{what}: {name} must be an int >= {low}, got {v!r}")
        if offset % _SEGMENT or (offset + nbytes) % _SEGMENT or offset + nbytes > self._size:
            raise ValueError(f"{what}: [{offset}, {offset + nbytes}) must be whole {_SEGMENT}-byte segments "
                             f"of the {self._size}-byte heap; make the region end on a segment boundary")

    def release_range(self, offset: int, nbytes: int) -> None:
        """Collective: give back the pages of heap bytes ``[offset, offset + nbytes)`` (whole
        segments) on every rank -- a hole punched into each rank's file, which frees them for
        every process mapping it.  The addresses stay mapped; they read as zeros until written."""
        self._check_open()
        self._segment_range("release_range", offset, nbytes)
        self._exchange(None)  # every rank is done with the range (host work is synchronous)
        if _libc.fallocate(self._fds[self.rank], _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, nbytes):
            err = ctypes.get_errno()
            raise OSError(err, f"fallocate(PUNCH_HOLE, {offset}, {nbytes}) on rank {self.rank}'s heap failed: "
                               f"{os.strerror(err)}")

    def restore_range(self, offset: int, nbytes: int) -> None:
        """Collective: the range is usable again (pages come back, zeroed, when touched)."""
        self._check_open()
        self._segment_range("restore_range", offset, nbytes)
        self._exchange(None)

    def address(self, rank: int, offset: int) -> int:
        return self._bases[rank] + offset

    def heap_tensor(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self._check_open()
        nbytes = numel * dtype.itemsize
        if offset < 0 or offset + nbytes > self._size:
            raise ValueError(f"heap range [{offset}, {offset + nbytes}) outside rank {rank}'s heap of "
                             f"{self._size} bytes")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        buf = (ctypes.c_char * nbytes).from_address(self._bases[rank] + offset)
        return torch.frombuffer(buf, dtype=dtype, count=numel)

    # ---- data and flags ---------------------------------------------------------------
    def copy(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *, stream: object = None) -> None:
        for d, s, n in zip(dsts, srcs, nbytes):
            if n:
                ctypes.memmove(d, s, n)

    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int]):
        """The copies as a tuple of lists (nothing to convert on the host)."""
        if not len(dsts) == len(srcs) == len(nbytes):
            raise ValueError(f"dsts, srcs and nbytes must have one entry per copy, got "
                             f"{len(dsts)}, {len(srcs)} and {len(nbytes)}")
        return list(dsts), list(srcs), list(nbytes)

    def warm_replays(self, lists) -> None:
        """Nothing to capture: the host copies each piece itself."""

    def replays(self, prepared) -> bool:
        """Never: the host copies each piece itself."""
        return False

    def copy_prepared(self, prepared, *, stream: object = None, capturable: bool = False) -> None:
        self.copy(*prepared)

    def _flag(self, rank: int, slot: int) -> ctypes.c_int64:
        if not 0 <= slot < self.n_flags:
            raise ValueError(f"flag slot must be in [0, {self.n_flags}), got {slot}")
        return ctypes.c_int64.from_address(self._bases[rank] + 8 * slot)

    def signal(self, rank: int, slot: int, value: int, *, stream: object = None) -> None:
        self._flag(rank, slot).value = value

    def read_flag(self, slot: int) -> int:
        return self._flag(self.rank, slot).value

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float, stream: object = None,
             what: str = "") -> None:
        self._poll(slot, value.__le__, peer, timeout_s, what or f"flag {slot} >= {value}")

    def _poll(self, slot: int, done: Callable[[int], bool], peer: int, timeout_s: float, what: str) -> None:
        """Until ``done(flag value)``, with backoff; a peer's abort (``watch``) or the deadline
        raises, the deadline as :class:`PeerTimeoutError` naming ``peer``."""
        flag = self._flag(self.rank, slot)
        if done(flag.value):
            return
        deadline = time.monotonic() + timeout_s
        pause = 1e-6
        while not done(flag.value):
            if self.watch is not None:
                self.watch(peer)
            if time.monotonic() > deadline:
                raise PeerTimeoutError(peer + self.rank_offset, f"{what}, saw {flag.value}", timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    host_wait_flag = wait

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: object = None, what: str = "") -> None:
        """:meth:`wait` on each flag in turn (``what`` may hold ``{peer}``)."""
        for sl, v, p in zip(slots, values, peers, strict=True):
            self.wait(sl, v, peer=p, timeout_s=timeout_s, what=what.format(peer=p + self.rank_offset))

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: object = None) -> None:
        for r, sl, v in zip(ranks, slots, values, strict=True):
            self.signal(r, sl, v)

    def wait_all_equal(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                       timeout_s: float, stream: object = None, what: str = "") -> None:
        """:meth:`wait_all` for exactly each value (a token, which neither a smaller nor a
        larger value satisfies)."""
        for sl, v, p in zip(slots, values, peers, strict=True):
            self._poll(sl, v.__eq__, p, timeout_s, what.format(peer=p + self.rank_offset) or f"flag {sl} == {v}")

    def session(self):
        return contextlib.nullcontext()

    def host_wait_event(self, event: object, *, timeout_s: float) -> None:
        return None  # host work is complete when it returns: there is never a backlog

    def fence_from(self, stream: object) -> None:
        return None  # host work is synchronous

    def fence_to(self, stream: object) -> None:
        return None

    # ---- lifetime -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this transport is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for base in self._bases:
            _libc.munmap(base, _RESERVE_BYTES)
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._bases, self._fds = [], []

    def __enter__(self) -> "HostTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # no collective work here: only local unmapping
        try:
            self.close()
        except Exception:
            pass
