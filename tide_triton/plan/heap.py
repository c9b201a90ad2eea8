"""Every rank's heap byte layout, in one place.

The heap is one symmetric byte range per rank (same offsets on every rank); the transports
map it, the executors address into it.  Node-local groups lay it out as

    ``[flags | reduce-scatter ring | named regions... | all-gather block]``

and groups of several nodes as

    ``[flags (+ cross-node flags) | wire ring | reduce-scatter ring | named regions... | all-gather block]``

Named regions (Slot-Reuse, :mod:`tide_triton.group.regions`) are placed past everything fixed and
past whatever the heap holds when they are made; the all-gather block moves past them.
Areas start at multiples of :data:`ALIGN`.  Nothing here knows a group or a transport: the
functions take the numbers they need.
"""
from __future__ import annotations

from dataclasses import dataclass

from .schedule import peer_slot, ring_slots

ALIGN = 4096
"""Every heap area starts at a multiple of this."""

WIRE_HEADER = 24
"""Bytes of one wire-ring slot header (host inter-node hop): (dst << 40 | channel sequence),
global sequence, nbytes."""


def round_up(n: int, m: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


def flags_bytes(n_flags: int) -> int:
    """The flag area (8-byte flags) at heap offset 0, rounded up to :data:`ALIGN`."""
    return round_up(n_flags * 8)


# --------------------------------------------------------------------------- node-local
@dataclass(frozen=True)
class Ring:
    """The node-local reduce-scatter receive ring and where the all-gather block starts."""

    ring_off: int
    slot_bytes: int
    slots: int
    ag_off: int

    def slot(self, stage: int, src: int, dest: int) -> int:
        """Byte offset, in ``dest``'s heap, of the slot contributor ``src`` fills."""
        return self.ring_off + (stage * self.slots + peer_slot(src, dest)) * self.slot_bytes


def _slot_bytes(ring_bytes: int, stages: int, slots: int) -> int:
    return (ring_bytes // (stages * slots)) // 16 * 16


def ring(n_flags: int, world_size: int, ring_bytes: int, stages: int, regions_end: int) -> Ring:
    """The group's ring right after the flags; the all-gather block past it and past the
    named regions (which end at ``regions_end``)."""
    flags = flags_bytes(n_flags)
    n = ring_slots(world_size)
    slot_bytes = _slot_bytes(ring_bytes, stages, n)
    return Ring(flags, slot_bytes, n, max(flags + round_up(stages * n * slot_bytes), regions_end))


def staging_ring(offset: int, nbytes: int, world_size: int, stages: int, ag_off: int) -> Ring:
    """The receive slots of a reduce-scatter that stages in a named region: a ring of
    ``nbytes`` at the region's ``offset`` (the same on every rank)."""
    n = ring_slots(world_size)
    return Ring(offset, _slot_bytes(nbytes, stages, n), n, ag_off)


# --------------------------------------------------------------------------- cross-node
def extra_flags(world_size: int, inflight_chunks: int) -> int:
    """Flags the cross-node executor needs after the group's :class:`FlagMap`: one ready
    flag per sending rank and one free flag per slot of this rank's wire ring."""
    return world_size + inflight_chunks


def wire_ring_bytes(chunk_bytes: int, n_slots: int) -> int:
    """The host inter-node hop's wire ring: ``n_slots`` headers, then ``n_slots`` data slots."""
    return round_up(n_slots * WIRE_HEADER, 64) + n_slots * round_up(chunk_bytes, 64)


@dataclass(frozen=True)
class CrossNode:
    """The cross-node path's areas: wire ring, reduce-scatter ring (its fixed areas end at
    ``end``), all-gather block."""

    net_off: int
    rs_off: int
    end: int
    ag_off: int


def cross_node_fixed_end(n_flags: int, ring_bytes: int, chunk_bytes: int, inflight_chunks: int) -> int:
    """Where the cross-node path's fixed areas (flags, wire ring, reduce-scatter ring) end."""
    net_off = flags_bytes(n_flags)
    rs_off = net_off + round_up(wire_ring_bytes(chunk_bytes, inflight_chunks))
    return rs_off + round_up(ring_bytes)


def cross_node(n_flags: int, ring_bytes: int, chunk_bytes: int, inflight_chunks: int,
               regions_end: int) -> CrossNode:
    """The cross-node layout; the all-gather block past the fixed areas and the named regions."""
    end = cross_node_fixed_end(n_flags, ring_bytes, chunk_bytes, inflight_chunks)
    return CrossNode(flags_bytes(n_flags), end - round_up(ring_bytes), end, max(end, round_up(regions_end)))


# --------------------------------------------------------------------------- regions, all-gather block
def regions_floor(fixed_ends: list[int], regions_end: int, heap_nbytes: int) -> int:
    """Lowest offset this rank would place a new named region at: past the fixed areas of
    every path the group may take, past every region, past whatever the heap holds now (an
    all-gather block a peer may still read).  The ranks take the maximum of their floors."""
    return max(*fixed_ends, regions_end, heap_nbytes)


def region_end(data_end: int, heap_nbytes: int) -> int:
    """Where a named region whose data ends at ``data_end`` ends in the layout: at the end of
    the heap segment its growth mapped (``heap_nbytes`` right after), so no other area shares
    a segment with it and releasing the region (:meth:`~tide_triton.group.regions.HeapRegion.release`)
    frees nothing else."""
    return max(round_up(data_end), heap_nbytes)


def ag_block_end(ag_off: int, block_bytes: int) -> int:
    """Heap bytes needed for an all-gather block of ``block_bytes`` at ``ag_off``."""
    return ag_off + round_up(block_bytes, 16)
