"""Slot-Reuse: the heap slots that hold the enabled groups' unsharded parameters.

Every group's unsharded storage (FSDP2's ``FSDPParam.all_gather_outputs``) is a view of a heap
region of its tide_triton group (:meth:`tide_triton.Group.heap_region`): ``pool`` slots shared
round-robin by the groups that reshard after forward, a private slot for the outermost module
(FSDP2 keeps the root unsharded after forward) and for any group without a reshard after
forward.  FSDP2's ``free_storage`` / ``alloc_storage`` (``resize_``) pass through except for
these views, where they do nothing (a free records a CUDA event: the next writer waits for it).

On one node the all-gather reads the peers' rows straight from their slots
(``all_gather(..., params_region=slot)``): no all-gather block is mapped for the slotted
groups (one that other groups' all-gathers made past the slots is released with them; one
made before the slots lies below them and stays mapped: :mod:`tide_triton.group.regions`).

What the slots cost: their bytes are mapped while a step uses them.  With ``release`` (the
default) every slot whose groups are all resharded is released once backward is over
(:func:`release_idle`, run by an autograd callback queued after FSDP2's final one: the step's
reduce-scatters are done), so the optimizer step -- where stock FSDP2 holds no unsharded
parameters either -- runs without them; the first all-gather into a released slot restores it
(:func:`restore`; collective, and every rank all-gathers in the same order).  A release blocks
the host until the GPU is idle (the memory is unmapped on every rank; nothing may touch it).
The pool is as small as FSDP2's default prefetching allows: two slots.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from . import _state
from ..executors.ag_block import release_all_gather_block
from ._torch_adapter import all_sharded, param_groups

SLOT_REUSE_RING = 4 << 20
"""Receive ring of a tide_triton group created for Slot-Reuse (only reduce-scatters that
cannot stage in their slot, e.g. without a reshard after backward, use it)."""

_ALIGN = 64
_HEAP_STORAGES: dict[tuple[str, int], Slot] = {}  # (device type, storage data_ptr) -> slot
_SLOTS: list[weakref.ref[Slot]] = []
"""Every slot made, in creation order (the same on every rank: releases go in this order)."""
_ENABLES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
"""tide_triton Group -> how many Slot-Reuse enables made regions in it (their key prefix)."""
ORIG_STORAGE: list = []
"""FSDP2's ``(alloc_storage, free_storage)`` while ours stand in for them (set by install)."""


class Slot:
    """A heap region holding the unsharded parameters of one or more parameter groups
    (never two at once: checked at every all-gather and reduce-scatter)."""

    def __init__(self, region: Any, private: bool, pool: int, release: bool = True) -> None:
        self.region = region
        self.private = private
        self.release = release
        """Released between steps (:func:`release_idle`)."""
        self.pool = pool
        """The SLOT_POOL it was made under (named by the error of an overfull pool)."""
        self.members: weakref.WeakSet[Any] = weakref.WeakSet()   # FSDPParamGroups
        self.freed: list = []  # CUDA events: a member's reshard (its compute is done with it)

    def live_others(self, pg: Any) -> list:
        """Members other than ``pg`` whose parameters are in the slot now: unsharded, or with
        an all-gather issued and not yet waited for (``unshard(async_op=True)``, explicit
        forward prefetch -- FSDP2 marks them unsharded only at the wait, while the slot
        already holds, or is about to receive, their rows)."""
        return [m for m in self.members if m is not pg
                and (not all_sharded(m.fsdp_params) or getattr(m, "_all_gather_result", None) is not None)]


def release_idle() -> list[str]:
    """Collective: release every slot made with ``release`` whose groups are all resharded
    (in creation order; every rank holds the same slots in the same state), then the
    all-gather block of each tide_triton group that released a slot.  Returns the keys of the
    regions released (and ``"all-gather block of <device type>"``)."""
    done: list[str] = []
    blocks: list[tuple[Any, torch.device]] = []
    for ref in list(_SLOTS):
        slot = ref()
        if slot is None:
            _SLOTS.remove(ref)
            continue
        members = list(slot.members)
        if (not slot.release or slot.region.released or not members or slot.region.group.closed
                or not all(all_sharded(m.fsdp_params) for m in members)):
            continue
        slot.region.release()  # waits for the GPU: the frees' events are done
        slot.freed.clear()
        done.append(slot.region.key)
        if (slot.region.group, slot.region.device) not in blocks:
            blocks.append((slot.region.group, slot.region.device))
    # An all-gather block (each rank's staged shards, 1/W of the largest layer; one node:
    # only from all-gathers made without a params region) is idle too until the next
    # all-gather that stages in it, which maps it again.
    for group, device in blocks:
        if release_all_gather_block(group, device):
            done.append(f"all-gather block of {device.type}")
    return done


def restore(slot: Slot) -> None:
    """Collective: memory behind a released slot again (the first all-gather into it)."""
    if slot.region.released:
        slot.region.restore()


def released_bytes(group: Any, device_type: str) -> int:
    """Heap bytes of ``group``'s released slots on ``device_type`` (mapped nowhere now)."""
    out = 0
    for ref in _SLOTS:
        slot = ref()
        if slot is not None and slot.region.group is group and slot.region.device.type == device_type \
                and slot.region.released:
            out += slot.region.end - slot.region.offset
    return out


def group_layout(pg: Any, W: int) -> tuple[torch.dtype, list[tuple[int, int]], int]:
    """Unsharded storage of a group in one heap slot: (dtype, [(byte offset, numel)], bytes)."""
    dt = None
    out, off = [], 0
    for fp in pg.fsdp_params:
        dt = pg.mp_policy.param_dtype or fp.sharded_param.dtype  # what FSDP2 all-gathers into
        n = W * fp.padded_sharded_param_size.numel()
        off = -(-off // _ALIGN) * _ALIGN
        out.append((off, n))
        off += n * dt.itemsize
    return dt, out, off


def assign_slots(mods: list[tuple[str, nn.Module]], pool: int, release: bool = True) -> None:
    """Heap slots for the enabled groups' unsharded parameters (collective: every rank walks
    the same modules in the same order).  Groups that may stay unsharded across other groups'
    work (the outermost FSDP module -- FSDP2 keeps the root unsharded after forward -- and any
    group without a reshard after forward) get a private slot; the others share ``pool``
    slots round-robin."""
    names = [n for n, _ in mods]
    pools: dict[int, list] = {}  # id(tide group) -> [(pg, st)]
    private: list = []
    seen: set[int] = set()  # a group several modules share (fully_shard([norm, head])): one slot
    for name, m in mods:
        outer = name == "<root>" or not any(o == "<root>" or name.startswith(o + ".") for o in names if o != name)
        for pg in param_groups(m):
            st = _state.GROUPS.get(pg)
            if st is None or id(pg) in seen:
                continue
            seen.add(id(pg))
            if outer or pg.post_forward_mesh_info is None:
                private.append((pg, st))
            else:
                pools.setdefault(id(st.group), []).append((pg, st))
    tag: dict[int, str] = {}
    for _, st in private + [x for v in pools.values() for x in v]:
        g = st.group
        if id(g) not in tag:
            _ENABLES[g] = _ENABLES.get(g, 0) + 1
            tag[id(g)] = f"fsdp{_ENABLES[g]}"

    def floor(g: Any) -> int:  # a staged reduce-scatter needs >= 16 bytes per slot and peer
        return 16 * g.options.stages * max(1, g.world_size - 1)

    # Every region this needs fits, or nothing is made (each rank decides the same)
    need: dict[int, list] = {}
    for _, st in private:
        need.setdefault(id(st.group), [st.group, 0, 0])[1] += 1
    for members in pools.values():
        need.setdefault(id(members[0][1].group), [members[0][1].group, 0, 0])[2] += min(pool, len(members))
    for g, n_private, n_pool in need.values():
        room = g.regions.room()
        if n_private + n_pool > room:
            raise ValueError(
                f"enable(slot_reuse=True) needs {n_private + n_pool} heap regions in one tide_triton group -- "
                f"{n_private} private slots (the root and every group without a reshard after forward) and "
                f"{n_pool} shared ones -- but the group has room for {room} (of {g.flags.regions}); reshard "
                "more groups after forward, or enable Slot-Reuse on part of the model")

    made: list[Slot] = []
    try:
        for pg, st in private:
            g = st.group
            nbytes = max(group_layout(pg, g.world_size)[2], floor(g))
            made.append(_new_slot(g.heap_region(f"{tag[id(g)]}:{st.fqn}", nbytes, pg.device), True, pool, release))
            _bind(pg, st, made[-1])
        for members in pools.values():
            g = members[0][1].group
            need = max(max(group_layout(pg, g.world_size)[2] for pg, _ in members), floor(g))
            slots = []
            for k in range(min(pool, len(members))):
                slots.append(_new_slot(g.heap_region(f"{tag[id(g)]}:slot{k}", need, members[0][0].device), False,
                                       pool, release))
                made.append(slots[-1])
            for i, (pg, st) in enumerate(members):
                _bind(pg, st, slots[i % len(slots)])
    except Exception:  # a region failed on every rank (agreed): the ones made give their memory back
        for slot in made:
            if not slot.region.released and not slot.region.group.closed:
                slot.region.release()
        raise


def release_emptied(ids: set[int]) -> None:
    """Collective (``disable``): release every slot of ``ids`` (``id(slot)``) that no group
    holds any more, in creation order (the same on every rank).  An eval forward after the
    last backward maps a released slot again; without this, ``disable`` left it mapped until
    the group closed (``heap_bytes`` said 0)."""
    for ref in list(_SLOTS):
        slot = ref()
        if (slot is None or id(slot) not in ids or len(slot.members) or slot.region.released
                or slot.region.group.closed):
            continue
        slot.region.release()
        slot.freed.clear()


def _new_slot(region: Any, private: bool, pool: int, release: bool) -> Slot:
    slot = Slot(region, private, pool, release)
    _SLOTS.append(weakref.ref(slot))
    return slot


def _bind(pg: Any, st: _state.GroupState, slot: Slot) -> None:
    """The group's unsharded parameters become views of ``slot`` (FSDP2's
    ``all_gather_outputs``; its ``init_all_gather_outputs`` keeps existing ones)."""
    dt, offs, _ = group_layout(pg, st.group.world_size)
    for fp, (off, n) in zip(pg.fsdp_params, offs):
        view = slot.region.tensor(dt, n, off)
        if n:  # an empty view is no heap storage (address 0: FSDP2's freed storages have it too)
            _HEAP_STORAGES[_storage_key(view)] = slot
        fp.all_gather_outputs = [view]  # torch's attribute: FSDP2 all-gathers into it
        if hasattr(fp, "_unsharded_param"):  # a stock-allocated one from before: made anew
            del fp._unsharded_param
    slot.members.add(pg)
    st.slot = slot


def unbind(pg: Any, st: _state.GroupState) -> None:
    """Stock FSDP2 allocates the group's unsharded storage itself again."""
    if st.slot is None:
        return
    st.slot.members.discard(pg)
    # the slot's other groups may view the same addresses (a shared slot, alike layouts)
    kept = {_storage_key(v) for m in st.slot.members for fp in m.fsdp_params for v in fp.all_gather_outputs}
    for fp in pg.fsdp_params:
        for view in fp.all_gather_outputs:  # its address may hold a stock storage later
            key = _storage_key(view)
            if _HEAP_STORAGES.get(key) is st.slot and key not in kept:
                del _HEAP_STORAGES[key]
        fp.all_gather_outputs = []
        if hasattr(fp, "_unsharded_param"):
            del fp._unsharded_param


def heap_slot(tensor: torch.Tensor) -> Slot | None:
    """The slot whose heap storage ``tensor`` views, or None."""
    if not _HEAP_STORAGES:
        return None
    return _HEAP_STORAGES.get(_storage_key(tensor))


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """``_HEAP_STORAGES``' key of the storage ``tensor`` views."""
    return tensor.device.type, tensor.untyped_storage().data_ptr()


def free_storage(tensor: torch.Tensor) -> None:
    """FSDP2's reshard frees unsharded storage with ``resize_(0)``; a heap slot stays (it is
    not resizable): the compute that used it is recorded so the next writer waits for it."""
    slot = heap_slot(tensor)
    if slot is None:
        return ORIG_STORAGE[1](tensor)
    if tensor.device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(tensor.device))
        slot.freed.append(ev)
    return None


def alloc_storage(tensor: torch.Tensor) -> None:
    """FSDP2's ``alloc_storage``, except for heap slots (always allocated)."""
    if heap_slot(tensor) is None:
        return ORIG_STORAGE[0](tensor)
    return None


free_storage._tide_wrapper = True  # type: ignore[attr-defined]
alloc_storage._tide_wrapper = True  # type: ignore[attr-defined]
