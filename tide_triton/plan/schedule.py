"""In what order: pure-Python schedules for the node-local collectives (no CUDA imports).

Reduce-scatter moves rank ``d``'s segment of every gradient from every *other* contributor
into ``d``'s receive ring, chunk by chunk (``d`` reads its own contribution in place, from
its gradients).  The ring has ``stages`` stages of ``local_size - 1`` slots (one per peer);
a slot holds ``chunk_elems`` elements, chosen so the ring is a fixed number of bytes
whatever the world size or the layout: more ranks, smaller chunks, same staging.
Chunk ``j`` of destination ``d`` is a list of :class:`Piece` -- contiguous runs of ``d``'s real
shard elements, packed back to back in the slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .layout import ShardLayout

@dataclass(frozen=True)
class Piece:
    """``numel`` elements of parameter ``param`` starting at element ``start`` of the
    destination's shard, at element ``slot_off`` of the slot."""

    param: int
    start: int
    numel: int
    slot_off: int


@dataclass(frozen=True)
class RingPlan:
    layout: ShardLayout
    stages: int
    chunk_elems: int
    chunks: tuple[tuple[tuple[Piece, ...], ...], ...]
    """``chunks[d][j]``: the pieces of destination ``d``'s chunk ``j``."""

    @property
    def rounds(self) -> int:
        """Lock-step iterations: the most chunks any destination has."""
        return max((len(c) for c in self.chunks), default=0)

    @property
    def slots_per_stage(self) -> int:
        return ring_slots(self.layout.world_size)

    def staging_elems(self) -> int:
        """Receive staging per rank, in elements: stages x peers x chunk."""
        return self.stages * self.slots_per_stage * self.chunk_elems


def ring_slots(world_size: int) -> int:
    """Slots per ring stage: one per peer (at least one, so a lone rank's plan still chunks)."""
    return max(1, world_size - 1)


def peer_slot(src: int, dest: int) -> int:
    """Index, in ``dest``'s ring stage, of the slot that contributor ``src != dest`` fills."""
    return src if src < dest else src - 1


def _split(layout: ShardLayout, dest: int, chunk_elems: int) -> tuple[tuple[Piece, ...], ...]:
    chunks: list[tuple[Piece, ...]] = []
    cur: list[Piece] = []
    used = 0
    for p, n in enumerate(layout.shard_numels(dest)):
        start = 0
        while start < n:
            take = min(n - start, chunk_elems - used)
            cur.append(Piece(p, start, take, used))
            start += take
            used += take
            if used == chunk_elems:
                chunks.append(tuple(cur))
                cur, used = [], 0
    if cur:
        chunks.append(tuple(cur))
    return tuple(chunks)


@lru_cache(maxsize=64)
def ring_plan(layout: ShardLayout, ring_bytes: int, elem_bytes: int, stages: int = 2) -> RingPlan:
    """Chunks for a ring of ``ring_bytes`` per rank (``stages`` x :func:`ring_slots` slots).

    Slots are rounded down to 16-byte multiples so every slot starts aligned."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    per_slot = ring_bytes // (stages * ring_slots(layout.world_size))
    chunk_elems = (per_slot // 16 * 16) // elem_bytes
    if chunk_elems < 1:
        raise ValueError(
            f"ring_bytes={ring_bytes} is too small for {stages} stages x {ring_slots(layout.world_size)} peers "
            f"of {elem_bytes}-byte elements"
        )
    chunks = tuple(_split(layout, d, chunk_elems) for d in range(layout.world_size))
    return RingPlan(layout, stages, chunk_elems, chunks)


@dataclass(frozen=True)
class FlagMap:
    """Where each flag lives in every heap's flag array (64-bit words)."""

    local_size: int
    stages: int = 2
    regions: int = 64
    """Named heap regions (:meth:`tide_triton.group.core.Group.heap_region`) a group can hold:
    each has one "vacated" flag per owner in every heap."""

    def ag_ready(self, src: int) -> int:
        """On a reader: rank ``src``'s all-gather block holds this epoch's shards."""
        return src

    def ag_done(self, reader: int) -> int:
        """On an owner: ``reader`` has finished reading the owner's all-gather block."""
        return self.local_size + reader

    def rs_ready(self, stage: int, src: int) -> int:
        """On a destination: contributor ``src`` filled its slot of ring ``stage``."""
        return 2 * self.local_size + stage * self.local_size + src

    def rs_free(self, stage: int, dest: int) -> int:
        """On a contributor: destination ``dest`` has consumed this contributor's slot."""
        return (2 + self.stages) * self.local_size + stage * self.local_size + dest

    def vacated(self, region: int, owner: int) -> int:
        """On a writer: ``owner`` has handed over its copy of heap region ``region`` (the
        value is the number of hand-overs so far: an epoch)."""
        if not 0 <= region < self.regions:
            raise ValueError(f"region must be in [0, {self.regions}), got {region}")
        return (2 + 2 * self.stages) * self.local_size + region * self.local_size + owner

    def _after_regions(self) -> int:
        return (2 + 2 * self.stages + self.regions) * self.local_size

    def call(self, parity: int, src: int) -> int:
        """On every peer: the identity of ``src``'s current collective call, ``(call number
        << 32) | signature fingerprint`` (two words, by call-number parity, so a peer already
        in the next call does not overwrite the one being checked)."""
        return self._after_regions() + (parity % 2) * self.local_size + src

    def abort(self, src: int) -> int:
        """On every peer: the number of the last call ``src`` abandoned (0: none)."""
        return self._after_regions() + 2 * self.local_size + src

    def _after_calls(self) -> int:
        return self._after_regions() + 3 * self.local_size

    # Prepared collectives (tide_triton.executors.prepared): token words, each with one writer and one
    # reader, who sets it back to 0 once seen -- so a run leaves them all 0.
    def program_rs_ready(self, stage: int, src: int) -> int:
        """On a destination: contributor ``src``'s token once its slot of the prepared ring's
        ``stage`` is filled (0 again once the destination saw it)."""
        return self._after_calls() + stage * self.local_size + src

    def program_rs_free(self, stage: int, dest: int) -> int:
        """On a contributor: ``dest``'s token once it has reduced this contributor's slot of
        ``stage`` (0 again once the contributor saw it)."""
        return self._after_calls() + (self.stages + stage) * self.local_size + dest

    def program_ag_ready(self, src: int) -> int:
        """On a reader: ``src``'s token once its prepared all-gather block holds its rows."""
        return self._after_calls() + 2 * self.stages * self.local_size + src

    def program_ag_done(self, reader: int) -> int:
        """On an owner: ``reader``'s token once it has read the owner's prepared block."""
        return self._after_calls() + (2 * self.stages + 1) * self.local_size + reader

    @property
    def n_flags(self) -> int:
        return self._after_calls() + (2 * self.stages + 2) * self.local_size
