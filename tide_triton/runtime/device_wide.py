"""Driver calls that wait for every stream of the process, and the one rule around them.

Measured on the H200 (driver 580, CUDA 13.0;
docs/constraints.md#driver-calls-that-wait-for-a-stream-waiting-on-a-flag): while a stream of
the process's context waits for a flag,

* ``cuModuleLoadData`` -- every Triton kernel variant's first load --, ``cuModuleUnload``,
  ``cuMemFree`` and ``cuMemFreeHost`` do not return until that stream has passed its wait;
* and while one thread is inside such a call, **every other thread's driver calls of the
  process stop too** (stream writes, device-to-host copies, event records, launches; only
  ``cuStreamQuery`` answered).

Graph capture, instantiation and launch, ``cuMemAlloc``, pinned allocations and VMM mapping
did not wait.  So a kernel variant loaded while this rank's stream waits for a peer that has
died never returns, and nothing of the process -- no deadline, no flag read -- gets another
driver call through.  The rule: before such a call the library settles.  Every transport
registered here (one per group whose process holds one rank of it: how users run) waits, with
its group's deadline, until its streams are idle -- what the driver call would wait for anyway
-- and past the deadline raises ``PeerTimeoutError`` naming the peer its streams wait for,
before any thread enters the driver.  The cost falls only on those rare calls (a kernel
variant's first load in the process).

Ranks of one process (the single-process mode) do not register: a rank thread settling its
own streams would still load while a peer thread's stream waits for this thread's next flags,
and wait for it forever inside the driver.  There every kernel variant must be loaded before
any rank enqueues a wait on another (``Binding.prepare`` at preparation; module loading
``EAGER`` for torch's kernels: ``tide_triton.group.core``).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

class Settles(Protocol):
    device: Any  # a torch.device: the GPU whose context the owner's streams live in

    def settle_device_wide(self, what: str) -> None:
        """Return once this owner's streams are idle; raise naming the peer they wait for
        past the owner's deadline."""


_lock = threading.Lock()
_owners: "weakref.WeakSet[Settles]" = weakref.WeakSet()


def register(owner: Settles) -> None:
    """``owner`` settles before every device-wide driver call of this process (held weakly:
    a transport that is garbage no longer counts)."""
    with _lock:
        _owners.add(owner)


def unregister(owner: Settles) -> None:
    with _lock:
        _owners.discard(owner)


def registered() -> int:
    """How many owners settle now."""
    with _lock:
        return len(_owners)


def before(what: str, device_index: int | None) -> None:
    """Call before a driver call on GPU ``device_index`` that waits for every stream of its
    context in this process (``what`` names it in an error): each owner registered on that
    GPU settles in turn; the first error propagates.  Owners on other GPUs do not (their
    streams live in other contexts)."""
    with _lock:
        owners = [o for o in _owners if getattr(o.device, "index", None) == device_index]
    for owner in owners:
        owner.settle_device_wide(what)
