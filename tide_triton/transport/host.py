"""Host transport: the transport interface over CPU shared memory, for tests without a GPU.

Each rank's heap is a file in ``/dev/shm`` mapped into a virtual range reserved once
(``mmap`` with ``MAP_FIXED`` into a ``PROT_NONE`` reservation), so the heap grows by whole
segments without moving: addresses handed out earlier stay valid, as with the VMM heap.
Peers open each other's files by name (exchanged through the group), keep the descriptors
for growth, and the files are unlinked as soon as every peer has opened them -- nothing is
left in ``/dev/shm`` even if a process dies.  Copies are ``memmove``; flags are 64-bit
words at the start of every heap, written after the copies they announce (x86 stores are
ordered, and every copy here completes before the call returns).

The copy queue as a stream (tests): with :data:`COPY_QUEUE` ``= "async"`` the copies,
signals and waits a collective puts on the copy queue (``stream=None``) run later, in order,
on a worker thread of this rank (:data:`COPY_QUEUE_JITTER_S`: each waits a random
time up to that first), while the compute stream's work (``stream=``
:data:`HOST_COMPUTE`, the kernels, the host itself) runs at once -- the ordering a GPU has,
where the copy queue lags the caller's stream.  :meth:`fence_to` blocks until the queue has
reached it; :meth:`mark` / :meth:`wait_mark` do that for a point recorded earlier.  A wait
on the queue that times out stops the queue; its error is raised by the next call that
touches the queue (on a GPU: the next ``synchronize``).  :attr:`queue_delay`, when set, is
called before each queued operation (a test's way of making one rank's queue slow).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import queue
import random
import threading
import time
import uuid
from typing import Any, Callable, Sequence

import torch

from ..runtime import host_capture
from ..plan.heap import round_up
from ..errors import PeerTimeoutError

class _HostCompute:
    """The compute stream of a collective on the host transport: the calling thread."""

    def __repr__(self) -> str:
        return "HOST_COMPUTE"


HOST_COMPUTE = _HostCompute()

COPY_QUEUE = "sync"
"""Tests: ``"async"`` runs a host transport's copy queue behind the caller, on a worker thread
per rank, as a GPU's copy stream runs behind the caller's stream (``"sync"``: every operation
at once).  Read when a host transport is made."""
COPY_QUEUE_JITTER_S = 0.0
"""Tests, with ``"async"``: each queued operation first waits a random time up to this many
seconds, so runs explore other orders."""


def _copy_queue() -> str:
    """:data:`COPY_QUEUE`, checked."""
    if COPY_QUEUE not in ("sync", "async"):
        raise ValueError(f"tide_triton.transport.host.COPY_QUEUE must be 'sync' or 'async', got {COPY_QUEUE!r}")
    if not COPY_QUEUE_JITTER_S >= 0:
        raise ValueError(f"tide_triton.transport.host.COPY_QUEUE_JITTER_S must be >= 0 seconds, "
                         f"got {COPY_QUEUE_JITTER_S!r}")
    return COPY_QUEUE
"""``stream=`` value for work on a host collective's compute stream (runs at once, in the
caller's order) -- as opposed to ``None``, the copy queue."""


class _CopyQueue:
    """A rank's copy queue as a worker thread running operations in order (see the module
    docstring).  ``error``: the first operation that raised; the queue drops the rest."""

    def __init__(self, rank: int) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.delay: Callable[[int, str], None] | None = None
        jitter = COPY_QUEUE_JITTER_S
        if jitter > 0:  # each queued operation waits up to this long first (orders shaken)
            rng = random.Random(rank * 7919 + os.getpid())
            self.delay = lambda _rank, _name: time.sleep(rng.random() * jitter)
        self._rank = rank
        self._worker = threading.Thread(target=self._run, name=f"tide-host-copy-queue-{rank}", daemon=True)
        self._worker.start()

    def _run(self) -> None:
        while True:
            op = self._q.get()
            if op is None:
                return
            fn, name = op
            if self.error is not None:
                if isinstance(fn, threading.Event):
                    fn.set()
                continue
            try:
                if isinstance(fn, threading.Event):
                    fn.set()
                    continue
                if self.delay is not None:
                    self.delay(self._rank, name)
                fn()
            except BaseException as e:  # noqa: BLE001 -- raised again on the caller's thread
                self.error = e

    def put(self, fn: Callable[[], None], name: str) -> None:
        self.raise_error()
        self._q.put((fn, name))

    def mark(self) -> threading.Event:
        ev = threading.Event()
        self._q.put((ev, "mark"))
        return ev

    def wait(self, ev: threading.Event, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ev.wait(0.01):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the host copy queue of rank {self._rank} did not reach its mark in {timeout_s} s")
        self.raise_error()

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self, timeout_s: float = 60.0) -> None:
        ev = self.mark()
        ev.wait(timeout_s)
        self._q.put(None)
        self._worker.join(timeout_s)


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
        self._queue = _CopyQueue(rank) if _copy_queue() == "async" else None
        self.host_compute = HOST_COMPUTE if self._queue is not None else None
        """The compute stream a collective passes with its compute-stream work: None when the
        copy queue is synchronous (every operation runs at once anyway)."""
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
    @property
    def queue_delay(self) -> Callable[[int, str], None] | None:
        return None if self._queue is None else self._queue.delay

    @queue_delay.setter
    def queue_delay(self, fn: Callable[[int, str], None] | None) -> None:
        if self._queue is None:
            raise RuntimeError("queue_delay needs tide_triton.transport.host.COPY_QUEUE = 'async'")
        self._queue.delay = fn

    def _on(self, stream: object, name: str, fn: Callable[..., None], *args: Any, **kw: Any) -> None:
        """Run ``fn`` now (a synchronous queue, or the compute stream), or queue it -- or, while
        this thread captures (:mod:`tide_triton.runtime.host_capture`), record where it would go."""
        now = self._queue is None or stream is not None
        graph = host_capture.recording()
        if graph is not None:
            op = functools.partial(fn, *args, **kw)
            graph.record(op, None if now else functools.partial(self._queue.put, name=name))
        elif now:
            fn(*args, **kw)
        else:
            self._queue.put(functools.partial(fn, *args, **kw), name)

    def copy(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *, stream: object = None) -> None:
        self._on(stream, "copy", self._copy_now, dsts, srcs, nbytes)

    @staticmethod
    def _copy_now(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int]) -> None:
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
        self.copy(*prepared, stream=stream)

    def on_copy_queue(self, fn: Callable[[Any], None]) -> None:
        """Run ``fn(None)`` (SM-side work: a kernel launch; no stream on the host) in the copy
        queue's order: now on a synchronous queue, else queued behind what is there (recorded
        so under a host capture)."""
        self._on(None, "kernel", fn, None)

    def _flag(self, rank: int, slot: int) -> ctypes.c_int64:
        if not 0 <= slot < self.n_flags:
            raise ValueError(f"flag slot must be in [0, {self.n_flags}), got {slot}")
        return ctypes.c_int64.from_address(self._bases[rank] + 8 * slot)

    def signal(self, rank: int, slot: int, value: int, *, stream: object = None) -> None:
        flag = self._flag(rank, slot)
        self._on(stream, "signal", setattr, flag, "value", value)

    def read_flag(self, slot: int) -> int:
        return self._flag(self.rank, slot).value

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float, stream: object = None,
             what: str = "") -> None:
        self._wait_on(stream, slot, value.__le__, peer, timeout_s, what or f"flag {slot} >= {value}")

    def _wait_on(self, stream: object, slot: int, done: Callable[[int], bool], peer: int, timeout_s: float,
                 what: str) -> None:
        """:meth:`_poll` where ``stream`` says (:meth:`_on`); a bad slot raises at once, on the
        caller's thread, and only the caller's thread watches for aborts."""
        self._flag(self.rank, slot)
        self._on(stream, "wait", self._poll, slot, done, peer, timeout_s, what,
                 watch=stream is not None or self._queue is None)

    def host_wait_flag(self, slot: int, value: int, peer: int, timeout_s: float, what: str = "") -> int:
        """Block the calling thread until local flag ``slot`` >= ``value`` (never queued);
        returns the value read."""
        self._poll(slot, value.__le__, peer, timeout_s, what or f"flag {slot} >= {value}")
        return self._flag(self.rank, slot).value

    def _poll(self, slot: int, done: Callable[[int], bool], peer: int, timeout_s: float, what: str, *,
              watch: bool = True) -> None:
        """Until ``done(flag value)``, with backoff; a peer's abort (``watch``, on the caller's
        thread only: the queue's worker has no call to abandon) or the deadline raises, the
        deadline as :class:`PeerTimeoutError` naming ``peer``."""
        flag = self._flag(self.rank, slot)
        if done(flag.value):
            return
        deadline = time.monotonic() + timeout_s
        pause = 1e-6
        while not done(flag.value):
            if watch and self.watch is not None:
                self.watch(peer)
            if time.monotonic() > deadline:
                raise PeerTimeoutError(peer + self.rank_offset, f"{what}, saw {flag.value}", timeout_s)
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: object = None, what: str = "") -> None:
        """:meth:`wait` on each flag in turn (``what`` may hold ``{peer}``)."""
        for sl, v, p in zip(slots, values, peers, strict=True):
            self.wait(sl, v, peer=p, timeout_s=timeout_s, stream=stream, what=what.format(peer=p + self.rank_offset))

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: object = None) -> None:
        for r, sl, v in zip(ranks, slots, values, strict=True):
            self.signal(r, sl, v, stream=stream)

    def wait_all_equal(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                       timeout_s: float, stream: object = None, what: str = "") -> None:
        """:meth:`wait_all` for exactly each value (a token, which neither a smaller nor a
        larger value satisfies)."""
        for sl, v, p in zip(slots, values, peers, strict=True):
            self._wait_on(stream, sl, v.__eq__, p, timeout_s,
                          what.format(peer=p + self.rank_offset) or f"flag {sl} == {v}")

    def session(self):
        return contextlib.nullcontext()

    def host_wait_event(self, event: object, *, timeout_s: float) -> None:
        return None  # the pacer's events: none on the host (its queue needs no pacing)

    def fence_from(self, stream: object) -> None:
        return None  # the compute stream is the calling thread: its work is done already

    def fence_to(self, stream: object) -> None:
        """The compute stream (the calling thread) waits for what is on the copy queue."""
        if self._queue is None:
            return
        graph = host_capture.recording()
        if graph is not None:
            graph.record(functools.partial(self.fence_to, stream))
            return
        self._queue.wait(self._queue.mark())

    def mark(self) -> threading.Event | None:
        """A point on the copy queue, now (None: a synchronous queue is always there)."""
        if self._queue is not None and host_capture.recording() is not None:
            raise RuntimeError("internal error: a copy-queue mark while capturing (a graph cannot hold one)")
        return None if self._queue is None else self._queue.mark()

    def wait_mark(self, mark: threading.Event | None, stream: object = None) -> None:
        """The compute stream waits until the copy queue has passed ``mark``."""
        if mark is not None and self._queue is not None:
            self._queue.wait(mark)

    # ---- lifetime -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this transport is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._queue is not None:  # what is queued still runs (a peer may wait for it)
            self._queue.stop()
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
