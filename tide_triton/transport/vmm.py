"""The VMM heap of one rank: reserved addresses, physical segments, peers' mappings.

A rank reserves ``va_bytes`` of virtual addresses once and maps physical segments
(``cuMemCreate``, POSIX-fd shareable, pinned on its device) into that range as the heap
grows, so addresses never move.  A multi-process transport also reserves one range per peer
and maps each peer's segments there (imported from the fd the peer exported, see
:mod:`tide_triton.transport.handles`).

Access: every mapping is made readable and writable (``cuMemSetAccess``) for every device
that touches it -- in a multi-process transport the rank's own device (its kernels and copy
engines read peers' heaps through its own mappings, over peer access when the peer's memory
sits on another GPU); in the single-process mode, where every rank addresses every other
rank's own range, the devices of all ranks (``access_devices``).

Release (Slot-Reuse between steps): whole segments can be unmapped and their handles released
on every rank (:meth:`VmmHeap.unmap_range`), own mapping and every peer's; the physical memory
is freed once every importer has let go.  The addresses stay reserved, so re-creating the
segments later at the same offsets (:meth:`VmmHeap.restore_segment`) keeps every view valid.

Every multi-step acquisition registers its undo on a :class:`~.driver.Transaction`, so a
failure part-way leaves nothing mapped.  Nothing here is collective: the transport
(:mod:`tide_triton.transport.cuda`) sequences these steps with its peers.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from ._once import round_up
from .driver import CtxGuard, Transaction, check

log = logging.getLogger("tide_triton")

VA_BYTES = 64 << 30
"""Virtual addresses reserved per rank: the most the heap can ever grow to."""
SEGMENT_BYTES = 2 << 20
"""Growth quantum: ``ensure_heap`` maps whole multiples of this (rounded to granularity).  The
allocation granularity of current GPUs: a heap maps no more than it uses (64 MiB before:
flags and a 4 MiB ring held a 64 MiB segment, and every region and the all-gather block were
rounded up to 64 MiB).  A growth is one segment whatever its size, so a small quantum adds no
handles."""


class VmmHeap:
    """The segments, mappings and address ranges of one rank (see the module notes)."""

    def __init__(self, cu: Any, guard: CtxGuard, *, rank: int, device_index: int,
                 access_devices: Sequence[int], segment_bytes: int, va_bytes: int,
                 tx: Transaction) -> None:
        self._cu = cu
        self._guard = guard
        self.rank = rank
        self.H = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        prop.requestedHandleTypes = self.H
        self._prop = prop
        self.access_devices = tuple(dict.fromkeys([device_index, *access_devices]))
        self._access = self._access_descs(self.access_devices)
        self.mapped = 0
        self.segments: list[tuple[int, int, Any]] = []  # own (offset, size, handle); handle None: released
        self.peer_segments: dict[int, list[tuple[int, int, Any]]] = {}
        self.peer_va: dict[int, int] = {}
        with guard:
            gran = check(cu.cuMemGetAllocationGranularity(
                prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity")
            self.gran = int(gran)
            self.segment_bytes = round_up(segment_bytes, self.gran)
            self.va_bytes = round_up(va_bytes, self.gran)
            self.own_va = self._reserve_va(f"rank={rank}")
            tx.on_rollback(self._free_va, self.own_va)

    def _access_descs(self, devices: Sequence[int]) -> list[Any]:
        cu = self._cu
        descs = []
        for d in devices:
            acc = cu.CUmemAccessDesc()
            acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            acc.location.id = d
            acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs.append(acc)
        return descs

    # ---- address ranges -----------------------------------------------------------------
    def _reserve_va(self, what: str) -> int:
        return int(check(self._cu.cuMemAddressReserve(self.va_bytes, self.gran, 0, 0),
                         f"cuMemAddressReserve({what}, {self.va_bytes} bytes)"))

    def _free_va(self, va: int) -> None:
        with self._guard:
            check(self._cu.cuMemAddressFree(va, self.va_bytes), f"cuMemAddressFree(rank={self.rank})")

    def reserve_peers(self, peers: Sequence[int], tx: Transaction) -> None:
        """One address range per peer, for mapping its segments."""
        with self._guard:
            for p in peers:
                va = self._reserve_va(f"rank={self.rank}, peer={p}")
                self.peer_va[p] = va
                self.peer_segments[p] = []
                tx.on_rollback(self._free_va, va)

    # ---- segments -------------------------------------------------------------------------
    def create_segment(self, offset: int, size: int, tx: Transaction) -> Any:
        """Create ``size`` bytes, map them at ``offset`` of the own range, grant access;
        returns the allocation handle (undone by ``tx``'s rollback)."""
        cu = self._cu
        with self._guard:
            handle = check(cu.cuMemCreate(size, self._prop, 0), f"cuMemCreate(rank={self.rank}, {size} bytes)")
            tx.on_rollback(self._release, handle)
            ptr = self.own_va + offset
            check(cu.cuMemMap(ptr, size, 0, handle, 0), f"cuMemMap(rank={self.rank})")
            tx.on_rollback(self._unmap, ptr, size)
            self._set_access(ptr, size, f"rank={self.rank}")
        return handle

    def _set_access(self, ptr: int, size: int, what: str) -> None:
        devs = ",".join(f"cuda:{d}" for d in self.access_devices)
        check(self._cu.cuMemSetAccess(ptr, size, self._access, len(self._access)),
              f"cuMemSetAccess({what}, devices {devs})")

    def export(self, handle: Any) -> int:
        """A POSIX fd of ``handle`` for the peers (the caller closes it)."""
        with self._guard:
            return int(check(self._cu.cuMemExportToShareableHandle(handle, self.H, 0),
                             f"cuMemExportToShareableHandle(rank={self.rank})"))

    def import_segment(self, peer: int, fd: int, offset: int, size: int, tx: Transaction) -> None:
        """Map ``peer``'s segment (from ``fd``) at ``offset`` of the range reserved for it."""
        cu = self._cu
        with self._guard:
            ph = check(cu.cuMemImportFromShareableHandle(fd, self.H),
                       f"cuMemImportFromShareableHandle(rank={self.rank}, peer={peer})")
            tx.on_rollback(self._release, ph)
            pptr = self.peer_va[peer] + offset
            check(cu.cuMemMap(pptr, size, 0, ph, 0), f"cuMemMap(rank={self.rank}, peer={peer})")
            tx.on_rollback(self._unmap, pptr, size)
            self._set_access(pptr, size, f"rank={self.rank}, peer={peer}")
            self.peer_segments[peer].append((offset, size, ph))
            tx.on_rollback(self.peer_segments[peer].pop)

    def commit_segment(self, offset: int, size: int, handle: Any) -> None:
        """Record a segment whose growth round succeeded everywhere."""
        self.segments.append((offset, size, handle))
        self.mapped = offset + size

    # ---- release and restore (whole segments) -----------------------------------------
    def spans_in(self, start: int, end: int) -> list[tuple[int, int, Any]]:
        """The own segments that tile ``[start, end)`` exactly (mapping offsets), in order;
        ValueError when the range cuts a segment or leaves the mapped heap."""
        if not 0 <= start < end <= self.mapped:
            raise ValueError(f"range [{start}, {end}) must lie in rank {self.rank}'s mapped heap "
                             f"[0, {self.mapped})")
        out = [s for s in self.segments if start <= s[0] and s[0] + s[1] <= end]
        covered = sum(s[1] for s in out)
        cut = [s for s in self.segments if s[0] < end and s[0] + s[1] > start and s not in out]
        if cut or covered != end - start:
            edges = sorted({o for o, _, _ in self.segments} | {self.mapped})
            raise ValueError(f"range [{start}, {end}) must start and end on segment boundaries of rank "
                             f"{self.rank}'s heap (boundaries near it: "
                             f"{[e for e in edges if start - self.segment_bytes <= e <= end + self.segment_bytes]}); "
                             "make the region end on a segment boundary (tide_triton.plan.heap)")
        return sorted(out, key=lambda s: s[0])

    def unmap_range(self, start: int, end: int) -> list[tuple[int, int]]:
        """Unmap and release the own segments tiling ``[start, end)`` and every peer's mapping
        of the same offsets (the caller made sure no work touches them).  Returns the
        ``(offset, size)`` released (segments released before are skipped).  Local."""
        spans = self.spans_in(start, end)
        done = []
        for p, segs in self.peer_segments.items():
            keep = []
            for off, size, h in segs:
                if start <= off and off + size <= end:
                    self._unmap(self.peer_va[p] + off, size)
                    self._release(h)
                else:
                    keep.append((off, size, h))
            segs[:] = keep
        for i, (off, size, h) in enumerate(self.segments):
            if h is not None and (off, size, h) in spans:
                self._unmap(self.own_va + off, size)
                self._release(h)
                self.segments[i] = (off, size, None)
                done.append((off, size))
        return done

    def released_in(self, start: int, end: int) -> list[tuple[int, int]]:
        """``(offset, size)`` of the released own segments tiling ``[start, end)``."""
        return [(o, s) for o, s, h in self.spans_in(start, end) if h is None]

    def restore_segment(self, offset: int, size: int, handle: Any) -> None:
        """Record the re-created segment at ``offset`` (mapped by :meth:`create_segment`)."""
        for i, (off, sz, h) in enumerate(self.segments):
            if off == offset and sz == size and h is None:
                self.segments[i] = (off, sz, handle)
                return
        raise ValueError(f"no released segment ({offset}, {size}) in rank {self.rank}'s heap")

    # ---- teardown -------------------------------------------------------------------------
    def _release(self, handle: Any) -> None:
        with self._guard:
            check(self._cu.cuMemRelease(handle), f"cuMemRelease(rank={self.rank})")

    def _unmap(self, ptr: int, size: int) -> None:
        with self._guard:
            check(self._cu.cuMemUnmap(ptr, size), f"cuMemUnmap(rank={self.rank})")

    def release_segments(self) -> None:
        """Unmap and release every segment (own and peers'); the ranges stay reserved."""
        for p, segs in self.peer_segments.items():
            while segs:
                off, size, h = segs.pop()
                quiet(self._unmap, self.peer_va[p] + off, size)
                quiet(self._release, h)
        while self.segments:
            off, size, h = self.segments.pop()
            if h is None:  # released (Slot-Reuse between steps): nothing mapped
                continue
            quiet(self._unmap, self.own_va + off, size)
            quiet(self._release, h)
        self.mapped = 0

    def free_ranges(self) -> None:
        """Give back every reserved range (after :meth:`release_segments`)."""
        for va in self.peer_va.values():
            quiet(self._free_va, va)
        self.peer_va.clear()
        quiet(self._free_va, self.own_va)


def quiet(fn: Callable[..., Any], *args: Any) -> None:
    """Run a teardown step; log (not raise) its failure so teardown goes on."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - teardown goes on
        log.warning("teardown step %s failed", getattr(fn, "__name__", fn), exc_info=True)
