"""The all-gather block between steps: each rank's staged shards (1/W of the largest layer
all-gathered) are held only while an all-gather runs, so the block's physical memory can be
given back in between (:func:`release_all_gather_block`, collective) and is mapped again, at
the same addresses, by the next all-gather that stages in it (:func:`restore_block`).  Heap
layout: :mod:`tide_triton.plan.heap` (the block is the last area, past the named regions).
"""
from __future__ import annotations

import torch

from . import state
from ..group.core import Group

def release_all_gather_block(group: Group, device: object) -> int:
    """Collective over ``group``: give the physical memory of its all-gather block on
    ``device`` back on every rank until the next all-gather, which maps new memory at the same
    addresses first (collective as well: every rank all-gathers in the same order).  The block
    holds each rank's staged shards only while an all-gather runs; between training steps it
    is 1/W of the largest all-gathered layer held for nothing (the FSDP2 drop-in's Slot-Reuse
    releases it after backward, with the slots, where one exists: its own all-gathers read
    from the slots and map none).  Blocks the host until the GPU work that may
    touch the heaps is done.

    Returns the bytes released on this rank; 0, releasing nothing, when there is no block
    (no all-gather yet), when it is released already, for a group over several nodes, or
    when the block does not start on a heap segment boundary (without named regions it
    shares the ring's segment)."""
    if not isinstance(group, Group):
        raise TypeError(f"group must be a tide_triton Group, got {type(group).__name__}")
    dev = torch.device(device)
    t = group.existing_transport(dev.type)
    released = state.of(group).released_blocks.setdefault(dev.type, {})
    start = group.ring_layout().ag_off
    end = t.heap_nbytes() if t is not None else 0
    ok = (t is not None and group.nodes == 1 and not released and group.heap_regions_end > 0
          and start == group.heap_regions_end and end > start)
    # the same decision on every rank (same heap layout), checked: a rank that differs raises
    group.agree(("release_all_gather_block", dev.type, ok, start if ok else 0, end if ok else 0), None)
    if not ok:
        return 0
    group.heap_barrier()  # single process: every rank's last read of a peer's block is enqueued
    t.release_range(start, end - start)
    released.update(offset=start, nbytes=end - start)
    return end - start


def released_block_bytes(group: Group, device_type: str) -> int:
    """Heap bytes of ``group``'s all-gather block on ``device_type`` released now
    (:func:`release_all_gather_block`), mapped nowhere until the next all-gather."""
    st = state.existing(group)
    released = st.released_blocks.get(device_type) if st is not None else None
    return released.get("nbytes", 0) if released else 0


def restore_block(g: Group, t, device: torch.device) -> None:
    """New memory behind a released all-gather block (collective: inside the all-gather)."""
    released = state.of(g).released_blocks.get(device.type)
    if released:
        t.restore_range(released["offset"], released["nbytes"])
        g.heap_barrier()  # single process: nobody addresses a peer's block before it is mapped
        released.clear()
