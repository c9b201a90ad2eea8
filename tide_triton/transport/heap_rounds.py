"""Heap growth of the CUDA transport as a collective round over the node.

Mapping ``size`` more bytes at a mapping offset is one round on every rank: create and export
a segment, pass its fd to every peer (:mod:`~tide_triton.transport.handles`), import the
peers' (:mod:`~tide_triton.transport.vmm`); two exchange rounds, and everything of the round
undone on every rank if any rank fails.  The same round maps new memory at segments released
between steps (:meth:`HeapRounds.release`, :meth:`HeapRounds.restore`: Slot-Reuse).  In the
single-process mode a rank maps its own segment only: the peers address it through its own
mapping.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from ..runtime.checks import is_int
from ._once import describe, raise_if_failed, round_up
from .cuda_setup import check_int
from .driver import Transaction
from .handles import FdChannel, close_fds
from .vmm import VmmHeap

class HeapRounds:
    """The collective growth of one rank's heap (see the module notes).  ``user_off``: where
    heap offset 0 lies in the mapping; ``zero_words()`` zeroes the transport's own words and
    the flags, once the first segment is mapped; ``allgather`` is None in the single-process
    mode."""

    def __init__(self, heap: VmmHeap, channel: FdChannel | None, allgather: Callable[[Any], list] | None, *,
                 rank: int, local_size: int, user_off: int, zero_words: Callable[[], None]) -> None:
        self.heap = heap
        self._channel = channel
        self._allgather = allgather
        self.rank = rank
        self.local_size = local_size
        self.user_off = user_off
        self._zero_words = zero_words
        self._generation = 0

    def nbytes(self) -> int:
        """Bytes in this rank's heap, flags included (offsets go up to this)."""
        return max(0, self.heap.mapped - self.user_off)

    def user_range(self, offset: int, nbytes: int) -> tuple[int, int]:
        """Mapping bytes ``[start, end)`` of heap bytes ``[offset, offset + nbytes)`` (checked)."""
        for name, v, low in (("offset", offset, 0), ("nbytes", nbytes, 1)):
            check_int(name, v, low)
        start = self.user_off + offset
        return start, start + nbytes

    def ensure(self, nbytes: int) -> None:
        """Grow (collectively) by whole segments until the heap holds ``nbytes``; no round
        where it does already."""
        if not is_int(nbytes):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        heap = self.heap
        need = self.user_off + nbytes
        if need <= heap.mapped:
            return
        new_mapped = heap.mapped + round_up(need - heap.mapped, heap.segment_bytes)
        if new_mapped > heap.va_bytes:
            raise ValueError(
                f"nbytes={nbytes} needs {new_mapped} bytes of heap, more than the "
                f"va_bytes={heap.va_bytes} reserved per rank"
            )
        self.grow(new_mapped)

    def grow(self, new_mapped: int) -> None:
        """Map ``[mapped, new_mapped)`` on every rank (:meth:`_map_round`) and record it."""
        offset = self.heap.mapped
        size = new_mapped - offset
        handle = self._map_round(offset, size)
        self.heap.commit_segment(offset, size, handle)

    def release(self, start: int, end: int, settle: Callable[[], None]) -> None:
        """Unmap mapping bytes ``[start, end)`` (whole segments, else ValueError on every rank)
        on every rank, once ``settle()`` saw this rank's streams idle and every rank did."""
        local = self._allgather is None
        err = None
        try:
            self.heap.spans_in(start, end)
            settle()
        except Exception as exc:  # noqa: BLE001 - shared with the peers
            if local:
                raise
            err = describe(exc)
        if not local:  # every rank is idle before anyone unmaps
            raise_if_failed(self._allgather({"err": err}), "CudaTransport release_range")  # type: ignore[misc]
        self.heap.unmap_range(start, end)

    def restore(self, start: int, end: int, call: str) -> None:
        """Map new memory at the released segments of mapping bytes ``[start, end)`` on every
        rank; every rank must have released the same ones (``call`` names the call in the error)."""
        spans = self.heap.released_in(start, end)
        if self._allgather is not None:
            infos = self._allgather({"spans": spans})
            bad = [r for r, i in enumerate(infos) if i["spans"] != spans]
            if bad:
                raise RuntimeError(f"{call}: ranks {bad} released other segments "
                                   f"than rank {self.rank} ({spans}); release and restore on every rank alike")
        for off, size in spans:
            self.heap.restore_segment(off, size, self._map_round(off, size))

    def _map_round(self, offset: int, size: int) -> Any:
        """Map ``size`` bytes at mapping offset ``offset`` on every rank: create + export, pass
        the fds, import; two exchange rounds, and everything of this round undone on every
        rank if any fails.  Returns the own allocation handle (the caller records it)."""
        heap = self.heap
        local = self._allgather is None
        self._generation += 1
        gen = self._generation
        tx = Transaction()
        own_fd = -1
        err = None
        handle = None
        peers = [p for p in range(self.local_size) if p != self.rank] if not local else []
        sent: list[int] = []
        try:
            handle = heap.create_segment(offset, size, tx)
            if offset == 0:  # probe, scratch and flag words start at zero
                self._zero_words()
            if peers:
                own_fd = heap.export(handle)
                sent = self._channel.send(own_fd, gen, peers)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - shared with the peers
            if local:
                tx.rollback()
                raise
            err = describe(exc)

        if local:
            tx.commit()
            return handle

        try:
            self._import_round(tx, offset, size, gen, peers, err, own_fd, sent)
        except BaseException:
            tx.rollback()
            raise
        finally:
            if own_fd >= 0:
                os.close(own_fd)
        tx.commit()
        return handle

    def _import_round(self, tx: Transaction, offset: int, size: int, gen: int, peers: list[int],
                      err: str | None, own_fd: int, sent: list[int]) -> None:
        """The exchange rounds of :meth:`_map_round`: every rank's result and fd, the peers'
        segments imported, then every rank's import result (the exporter's fd may go after)."""
        allgather, channel = self._allgather, self._channel
        infos = allgather({"err": err, "fd": own_fd, "size": size, "offset": offset,  # type: ignore[misc]
                           "gen": gen, "sent": sent})
        expected = {p for p in peers if self.rank in infos[p]["sent"]}
        bad = [r for r, i in enumerate(infos) if (i["size"], i["offset"], i["gen"])
               != (size, offset, gen)]
        failed = bad or any(i["err"] for i in infos)
        fds: dict[int, int] = {}
        err2 = None
        try:
            fds = channel.recv(expected, gen)  # type: ignore[union-attr]
            if failed:
                raise_if_failed(infos, "CudaTransport heap growth")
                raise ValueError(
                    "ensure_heap disagrees across ranks: (size, offset, generation) = "
                    + ", ".join(f"rank {r}: {(infos[r]['size'], infos[r]['offset'], infos[r]['gen'])}"
                                for r in bad)
                )
            channel.fill_missing(fds, peers, [i["fd"] for i in infos])  # type: ignore[union-attr]
            for p in peers:
                self.heap.import_segment(p, fds[p], offset, size, tx)
        except Exception as exc:  # noqa: BLE001
            if failed:
                raise
            err2 = describe(exc)
        finally:
            close_fds(fds.values())
        # Second round: every rank has imported (or failed); the exporter's fd may go.
        raise_if_failed(allgather({"err": err2}), "CudaTransport heap import")  # type: ignore[misc]
