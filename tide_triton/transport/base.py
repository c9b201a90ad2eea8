"""The interface every transport implements: a symmetric heap, copies, and flags.

A transport connects the ``local_size`` ranks of one node.  Each rank owns a *heap*: one
byte range that every peer can address (host shared memory, or a VMM allocation exported
as a POSIX file descriptor and mapped by every peer).  Collectives only ever name
``(rank, byte offset)`` pairs in the heap; the transport turns them into addresses.

* ``ensure_heap(nbytes)`` -- collective over the node: every heap holds at least
  ``nbytes`` (grown by whole segments; existing contents and addresses stay valid).
* ``heap_tensor(rank, offset, numel, dtype)`` -- a tensor view of ``rank``'s heap.
* ``copy(dsts, srcs, nbytes)`` -- byte copies (addresses), enqueued in order on the
  transport's copy queue (copy engines on a GPU, ``memmove`` on the host).
* ``signal(rank, slot, value)`` -- after every copy enqueued before it, write ``value`` into
  flag ``slot`` of ``rank``'s flag array.
* ``wait(slot, value, peer, timeout_s)`` -- later queue work waits until the local flag
  ``slot`` is ``>= value``; a wait that outlives ``timeout_s`` raises naming ``peer``.
* ``fence_from(stream)`` / ``fence_to(stream)`` -- order the copy queue after, or make a
  compute stream wait for, work already enqueued.
* ``close()`` -- idempotent; unmaps and frees everything.

Flags are 64-bit words in a separate small region of every heap, ``n_flags`` per rank;
values only grow (epochs), so no flag ever needs resetting.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..errors import PeerTimeoutError

__all__ = ["Transport", "PeerTimeoutError"]


class Transport(Protocol):
    rank: int
    local_size: int
    n_flags: int
    device: torch.device

    def ensure_heap(self, nbytes: int) -> None: ...

    def heap_nbytes(self) -> int: ...

    def heap_tensor(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def copy(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int]) -> None: ...

    def signal(self, rank: int, slot: int, value: int) -> None: ...

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float) -> None: ...

    def fence_from(self, stream: object) -> None: ...

    def fence_to(self, stream: object) -> None: ...

    def close(self) -> None: ...
