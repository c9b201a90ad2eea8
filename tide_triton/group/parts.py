"""Parts a :class:`~tide_triton.group.core.Group` owns for its executors: the cache of prepared
collectives, the pacer of long collectives, the zero-filled buffer padding copies read, and
what must outlive the work queued on the group's streams."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..runtime import device_wide
from ..transport.driver import wait_with_deadline

QUEUED_OPS = 512
"""Operations a rank may have queued ahead of the GPU in one collective (see :class:`Pacer`):
a driver whose queue for a stream is full blocks the enqueuing thread, and a thread blocked
while its stream waits on a peer is a deadlock waiting to happen."""

PREPARED_KEEP = 512
"""Prepared collectives kept per group (least recently used first out).  A training step
uses every one of its combinations once -- the FSDP2 drop-in's one group serves every
module, about three entries per module and step (all-gather pulls, its staging, the
reduce-scatter) -- so the cache must hold a whole step (512: ~170 modules) or each entry is
evicted before its next use and every call prepares again (as with 8 entries).
An entry is copy plans on the host and kernel bindings whose pointer tables are device memory:
~50 KiB for a Qwen3-30B-A3B layer's reduce-scatter at W=8 (8 chunks x (393 + 8 x ~50)
addresses), so at most ~25 MiB if every entry were one of those."""

PAST_LEAKED_HEAPS: list[Any] = []
"""What closed groups kept (:class:`KeptUntilIdle`) where their close leaked a heap: never freed."""


class PreparedCache:
    """Prepared collectives (bindings, copy lists) by key, the least recently used evicted
    past ``keep`` entries; ``fills`` counts the entries put (flat in a training loop's steady
    state)."""

    def __init__(self, keep: int = PREPARED_KEEP) -> None:
        self.keep = keep
        self.fills = 0
        self._entries: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Any:
        """The entry for ``key``, or None."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
            return hit

    def put(self, key: tuple, value: Any) -> Any:
        """Keep ``value`` for ``key``; returns it."""
        with self._lock:
            self.fills += 1
            self._entries[key] = value
            while len(self._entries) > self.keep:
                self._entries.popitem(last=False)
        return value


class KeptUntilIdle:
    """Objects kept as long as a group's streams may run (device memory that queued work may
    still read): until the group closes, and past it -- for the rest of the process -- where
    close leaked a heap because its streams did not drain (freed then, the memory could be
    reused under a launch that runs late)."""

    def __init__(self) -> None:
        self._kept: list[Any] = []
        self._lock = threading.Lock()

    def add(self, obj: Any) -> None:
        with self._lock:
            self._kept.append(obj)

    def items(self) -> tuple:
        with self._lock:
            return tuple(self._kept)

    def release(self, leaked: bool, also: Any = ()) -> None:
        """At the group's close: drop what is kept, or, where a heap ``leaked`` (its streams
        may still run), keep it -- and ``also`` -- for the rest of the process."""
        with self._lock:
            if leaked:
                PAST_LEAKED_HEAPS.extend(self._kept)
                PAST_LEAKED_HEAPS.extend(also)
            self._kept.clear()


class ZeroBuffers:
    """A zero-filled buffer per device of at least the bytes asked for (grown, never shrunk).
    A grown-out buffer goes to ``kept`` (prepared copy lists, cached by address, may still
    read it from the copy queue, where torch's allocator would not see the use and could hand
    its memory out again).  Growing a CUDA buffer waits for the fill with ``timeout_s``; past
    it, the error of rank ``rank``'s transport for the device (``transport_of(device type)``)."""

    def __init__(self, kept: KeptUntilIdle, rank: int, timeout_s: float,
                 transport_of: Callable[[str], Any]) -> None:
        self._kept = kept
        self._rank = rank
        self._timeout_s = timeout_s
        self._transport_of = transport_of
        self._by_device: dict[tuple[str, int | None], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device, nbytes: int) -> torch.Tensor:
        key = (device.type, device.index)
        with self._lock:
            z = self._by_device.get(key)
            if z is not None and z.numel() < nbytes:
                self._kept.add(z)
            if z is None or z.numel() < nbytes:
                if z is None and device.type == "cuda":  # the fill kernel's first launch may load it
                    device_wide.before("the zero buffer's first fill (torch may load its kernel)",
                                       device.index if device.index is not None else torch.cuda.current_device())
                z = self._by_device[key] = torch.zeros(max(nbytes, 4096), dtype=torch.uint8, device=device)
                if device.type == "cuda":  # rare (growth only): other streams read it next
                    # with a deadline: the stream may hold waits on a peer that died
                    wait_with_deadline(torch.cuda.current_stream(device).synchronize, self._timeout_s,
                                       lambda: self._busy_error(device, "growing the zero buffer"))
        return z

    def _busy_error(self, device: torch.device, what: str) -> BaseException:
        """The error for a wait on ``device`` past the deadline: the transport's (which names
        a peer its pending stream waits wait for), else a ``TimeoutError``."""
        t = self._transport_of(device.type)
        inner = getattr(t, "inner", t)  # a node's view wraps its transport
        if hasattr(inner, "busy_error"):
            return inner.busy_error(what)
        return TimeoutError(f"rank {self._rank}: {what}: {device} still busy after {self._timeout_s:.1f} s")

    def buffers(self) -> list[torch.Tensor]:
        """The buffers in use (one per device)."""
        with self._lock:
            return list(self._by_device.values())


class Pacer:
    """Keeps the host at most ``depth`` chunks ahead of the GPU in a long collective.

    Every chunk enqueues flag waits on peers; a host that runs far ahead fills the driver's
    queues with work that cannot start, and where streams share hardware queues (the
    single-process mode: all ranks in one context) a full queue can stall a peer that would
    release it.  After chunk ``j`` an event is recorded; before chunk ``j`` the host waits
    (with the group's timeout, naming a short peer) for chunk ``j - depth``'s event."""

    def __init__(self, cuda: bool, depth: int) -> None:
        self.cuda = cuda
        self.max_depth = depth
        self.depth = depth
        self._events = [torch.cuda.Event() for _ in range(depth)] if cuda else []

    def start(self, ops_per_chunk: int) -> None:
        """Begin a collective whose chunks enqueue up to ``ops_per_chunk`` operations each
        (copy descriptors and flag operations): the depth shrinks so that at most about
        :data:`QUEUED_OPS` operations wait in the driver's queues at a time."""
        self.depth = max(1, min(self.max_depth, QUEUED_OPS // max(1, ops_per_chunk)))

    def before(self, j: int, transport: Any, timeout_s: float) -> None:
        if self.cuda and j >= self.depth:
            transport.host_wait_event(self._events[j % self.depth], timeout_s=timeout_s)

    def after(self, j: int, stream: Any) -> None:
        if self.cuda and stream is not None:
            self._events[j % self.depth].record(stream)
