"""Switching parameter groups between stock FSDP2 and tide_triton: :func:`enable`,
:func:`disable`, and the patching behind them.

FSDP2's ``_fsdp_param_group`` module calls ``foreach_all_gather``,
``foreach_all_gather_copy_out`` and ``foreach_reduce`` by name, and ``_fsdp_param`` calls
``alloc_storage`` / ``free_storage``.  The first :func:`enable` that enables a group puts
:mod:`.wrappers`' functions (and :mod:`.slots`' storage functions) into those modules; when no
group is enabled any more, :func:`disable` puts FSDP2's own back.  These module attributes are
the only writes onto torch's objects besides FSDP2's ``FSDPParam.all_gather_outputs`` (Slot-Reuse
points them at heap slots; FSDP2 all-gathers into them) and deleting a stale
``FSDPParam._unsharded_param`` (FSDP2 rebuilds it from ``all_gather_outputs``).  What
tide_triton knows about a group is in :mod:`._state`, keyed by it.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.checks import is_int
from ..executors.ag_block import released_block_bytes
from ..group.core import Group, existing, init
from ..group.options import GroupOptions
from ..group.process_groups import exchange_once
from ..group.signatures import check_same
from . import _state, slots, wrappers
from ._state import GroupState
from ._torch_adapter import (
    TorchApi,
    all_sharded,
    fsdp_modules,
    load_api,
    param_groups,
    why_stock,
)

log = logging.getLogger("tide_triton")


# --------------------------------------------------------------------------- patching
def _install(api: TorchApi) -> None:
    fpg = api.fpg
    if getattr(fpg.foreach_reduce, "_tide_wrapper", False):
        return
    _state.set_active(api)
    from torch.distributed.fsdp._fully_shard import _fsdp_param as fparam  # FSDP2 internals: none until enable()

    if not getattr(fparam.free_storage, "_tide_wrapper", False):  # pass-through but for heap slots
        slots.ORIG_STORAGE[:] = [fparam.alloc_storage, fparam.free_storage]
        fparam.alloc_storage, fparam.free_storage = slots.alloc_storage, slots.free_storage
    fpg.foreach_all_gather = wrappers.all_gather
    fpg.foreach_all_gather_copy_out = wrappers.copy_out
    fpg.foreach_reduce = wrappers.reduce


def _uninstall(api: TorchApi) -> None:
    fpg = api.fpg
    from torch.distributed.fsdp._fully_shard import _fsdp_param as fparam  # FSDP2 internals: none until enable()

    if slots.ORIG_STORAGE and fparam.free_storage is slots.free_storage \
            and fparam.alloc_storage is slots.alloc_storage:
        fparam.alloc_storage, fparam.free_storage = slots.ORIG_STORAGE
        slots.ORIG_STORAGE.clear()
    for name, ours, orig in (("foreach_all_gather", wrappers.all_gather, api.orig_ag),
                             ("foreach_all_gather_copy_out", wrappers.copy_out, api.orig_copy_out),
                             ("foreach_reduce", wrappers.reduce, api.orig_reduce)):
        if getattr(fpg, name) is ours:
            setattr(fpg, name, orig)
        else:  # someone patched over us: leave theirs, our wrapper is no longer reachable
            log.warning("tide_triton.fsdp: %s was replaced by someone else; not restoring it", name)


# --------------------------------------------------------------------------- groups
def _existing_group(pg: dist.ProcessGroup) -> Any:
    """The open tide_triton group ``init(pg)`` would return, or None (creates nothing)."""
    return existing(pg)


def _resolve_group(group: Any, pg: dist.ProcessGroup, slot_reuse: bool = False) -> Any:
    """The tide_triton group for FSDP2's shard process group ``pg``."""
    if group is None:
        have = _existing_group(pg)
        if have is not None:
            return have
        # FSDP2 makes the same calls in the same order on every rank, step after step: only a
        # signature's first call exchanges it (the call identity still travels with every
        # call's data).  Slot-Reuse stages in the slots: a small ring.
        return init(pg, agree="first", **({"ring_bytes": slots.SLOT_REUSE_RING} if slot_reuse else {}))
    if isinstance(group, dist.ProcessGroup):
        g = init(group)
    elif isinstance(group, Group):
        g = group
    else:
        raise TypeError(f"group must be None, a ProcessGroup or a tide_triton Group, got {type(group).__name__}")
    if g.world_size != pg.size() or g.rank != pg.rank():
        raise ValueError(f"group must span FSDP2's shard group (size {pg.size()}, this rank {pg.rank()}), "
                         f"got size {g.world_size}, rank {g.rank}")
    if g.pg is not None and dist.get_process_group_ranks(g.pg) != dist.get_process_group_ranks(pg):
        raise ValueError(f"group must hold FSDP2's shard ranks {dist.get_process_group_ranks(pg)}, "
                         f"got {dist.get_process_group_ranks(g.pg)}")
    return g


def labelled_groups(mods: list[tuple[str, nn.Module]]) -> list[tuple[str, str, Any]]:
    """``(module name, group label, FSDPParamGroup)`` for every group of every module in
    ``mods``: the label is the module's name (``"layers.0[1]"`` for a module's second group),
    and a group that several modules share (``fully_shard([norm, head])``) carries one label
    naming them all (``"norm+head"``) wherever it appears -- the same on every rank."""
    rows, owners = [], {}
    for name, m in mods:
        groups = param_groups(m)
        for i, pg in enumerate(groups):
            owners.setdefault(id(pg), []).append(name if len(groups) == 1 else f"{name}[{i}]")
            rows.append((name, pg))
    return [(name, "+".join(owners[id(pg)]), pg) for name, pg in rows]


def _sentinel(device: torch.device) -> torch.Tensor:
    return torch.empty(0, device=device)


def _why_no_slot(pg: Any) -> str | None:
    if not all_sharded(pg.fsdp_params):
        return "slot_reuse: its parameters are unsharded now (call enable before the first step)"
    return None


def _attach(pg: Any, st: GroupState) -> None:
    _state.GROUPS[pg] = st
    for fp in pg.fsdp_params:
        _state.PARAMS[fp] = st


def _drop(pg: Any) -> None:
    st = _state.GROUPS.pop(pg, None)
    if st is not None:
        slots.unbind(pg, st)
    for fp in pg.fsdp_params:
        _state.PARAMS.pop(fp, None)


def group_state(pg: Any) -> GroupState | None:
    """tide_triton's record of an FSDPParamGroup (None: on the stock path)."""
    return _state.GROUPS.get(pg)


# --------------------------------------------------------------------------- public
def enable(module: nn.Module, *, group: Any = None, slot_reuse: bool = False,
           slot_pool: int = 2, release_slots: bool = True, prepared: bool = False) -> dict[str, str | None]:
    """Implementation of :func:`tide_triton.fsdp.enable` (``slot_pool``: its SLOT_POOL)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(slot_reuse, bool):
        raise TypeError(f"slot_reuse must be a bool, got {type(slot_reuse).__name__}")
    if not isinstance(release_slots, bool):
        raise TypeError(f"release_slots must be a bool, got {type(release_slots).__name__}")
    if not isinstance(prepared, bool):
        raise TypeError(f"prepared must be a bool, got {type(prepared).__name__}")
    if slot_reuse and (not is_int(slot_pool) or slot_pool < 1):
        raise ValueError(f"tide_triton.fsdp.SLOT_POOL must be an int >= 1, got {slot_pool!r}; "
                         "set it to 2 (default) or more before enable()")
    if group is not None:
        if not isinstance(group, (Group, dist.ProcessGroup)):
            raise TypeError(f"group must be None, a ProcessGroup or a tide_triton Group, got {type(group).__name__}")
    mods = fsdp_modules(module)
    if not mods:
        raise ValueError("module must contain a fully_shard-ed module (an FSDPModule), found none")
    try:
        api = load_api()
    except RuntimeError as e:
        api, unserved = None, str(e)
    options = _protocol_options(slot_reuse, slot_pool, release_slots, prepared)
    if api is None:  # the peers learn it (they would run tide_triton's collectives against stock ones)
        _agree_decisions([(name, label, pg, unserved) for name, label, pg in labelled_groups(mods)],
                         options, group)
        log.warning("tide_triton.fsdp: stock FSDP2 for all modules: %s", unserved)
        return {name: unserved for name, _ in mods}
    for name, m in mods:
        for pg in param_groups(m):
            if pg._training_state.name != "IDLE" or pg._all_gather_result is not None:
                raise RuntimeError(f"enable: {name} is in {pg._training_state.name}; call enable between steps")
            if slot_reuse and (held := _unreduced_grad(pg)) is not None:
                raise RuntimeError(_UNREDUCED.format(what="enable(slot_reuse=True)", name=name, param=held))
            have = _state.GROUPS.get(pg)
            if have is not None and (slot_reuse or have.slot is not None):
                raise RuntimeError(f"enable(slot_reuse={slot_reuse}): {name} is enabled already"
                                   f"{' with Slot-Reuse' if have.slot is not None else ''}; disable it first")
    plan = []  # (module name, group label, FSDPParamGroup, why it stays stock or None)
    for name, label, pg in labelled_groups(mods):
        why = why_stock(pg, api)
        if why is None and slot_reuse:
            why = _why_no_slot(pg)
        plan.append((name, label, pg, why))
    _agree_decisions(plan, options, group)
    result: dict[str, str | None] = {}
    done: set[int] = set()  # a group shared by several modules is set up once
    for name, label, pg, why in plan:
        first = id(pg) not in done
        done.add(id(pg))
        if why is None:
            if first:
                g = _resolve_group(group, pg._all_gather_process_group, slot_reuse)
                _attach(pg, GroupState(g, label, _sentinel(pg.device), weakref.ref(pg), use_prepared=prepared))
            result.setdefault(name, None)
        else:
            if first:
                _drop(pg)
                log.warning("tide_triton.fsdp: %s stays on stock FSDP2: %s", label, why)
            result[name] = why if result.get(name) is None else f"{result[name]}; {why}"
    if slot_reuse:
        try:
            slots.assign_slots(mods, slot_pool, release_slots)
        except Exception:  # nothing of this enable stays: the groups go back to stock FSDP2
            for _name, _label, pg, why in plan:
                if why is None:
                    _drop(pg)
            raise
    if len(_state.GROUPS):
        _install(api)
    return result


def _protocol_options(slot_reuse: bool, slot_pool: int, release_slots: bool, prepared: bool) -> list:
    """The options of ``enable`` that change what a rank does collectively (which heap regions
    it makes, which calls it runs as prepared ones, when it releases slots), as a signature's
    fields: the ranks agree them before anything is made.  Slot-Reuse's own settings count
    only with Slot-Reuse on."""
    return [("slot_reuse", slot_reuse), ("prepared", prepared),
            ("tide_triton.fsdp.SLOT_POOL", slot_pool if slot_reuse else None),
            ("release_slots", release_slots if slot_reuse else None)]


def _deadline(group: Any, apg: Any) -> tuple[float, str]:
    """The deadline of the tide_triton group that ``enable`` runs ``apg``'s collectives on
    (``group``'s, else the open group of the process group, else a new group's default),
    and how that group comes about -- a new group's set-up is collective: it is agreed."""
    have = group if isinstance(group, Group) else existing(group if isinstance(group, dist.ProcessGroup) else apg)
    if have is not None:  # given or found: the same on ranks that reach it either way
        return have.options.timeout_s, "an open tide_triton group"
    return GroupOptions().timeout_s, f"a new tide_triton group of {'group' if group is not None else 'FSDP2'}'s " \
                                     "process group"


def _agree_decisions(plan: list, options: list, group: Any = None) -> None:
    """Every rank of each FSDP2 process group takes the same path for each parameter group:
    tide_triton's collectives on one rank against stock ones on another pair nothing -- one
    side times out naming nobody useful, the other waits in the process group's collective.
    A decision is each rank's own reading (its torch build, its sources, its settings), so
    it is exchanged over the group's all-gather process group (once, in ``enable``; the
    bootstrap store, with the deadline of the group the collectives will run on), together
    with ``options`` (:func:`_protocol_options`) and how the group comes about: a difference
    raises on every rank, naming the group or option, the ranks and their values."""
    by_pg: dict[Any, list] = {}
    for _name, label, pg, why in plan:
        by_pg.setdefault(getattr(pg, "_all_gather_process_group", None), []).append((label, why))
    for apg, mine in by_pg.items():
        if apg is None or dist.get_world_size(apg) == 1:
            continue
        timeout_s, how = _deadline(group, apg)
        sig = ("tide_triton.fsdp.enable", *options, ("group", how))
        got = exchange_once(apg, (sig, mine), what="tide_triton.fsdp.enable's options and decisions",
                            timeout_s=timeout_s)
        check_same([(0, their_sig, None) for their_sig, _ in got], dist.get_rank(apg))
        ranks = dist.get_process_group_ranks(apg)  # global ranks: a shard group may be a sub-group (HSDP, EP)
        me = dist.get_rank(apg)
        where = "" if len(ranks) == dist.get_world_size() else f" of the shard group {ranks}"
        for r, (_, theirs) in enumerate(got):
            if [lab for lab, _ in theirs] != [lab for lab, _ in mine]:
                raise RuntimeError(f"enable: rank {ranks[r]}{where} holds other FSDP2 groups "
                                   f"({[lab for lab, _ in theirs]}) than rank {ranks[me]} "
                                   f"({[lab for lab, _ in mine]}); call enable on the same model on every rank")
            for (label, why), (_, their) in zip(mine, theirs):
                if (why is None) != (their is None):
                    tide, stock = (ranks[me], ranks[r]) if why is None else (ranks[r], ranks[me])
                    reason = their if why is None else why
                    raise RuntimeError(
                        f"enable: {label} would run tide_triton's collectives on rank {tide} and stock "
                        f"FSDP2's on rank {stock}{where} ({reason}); their collectives would never pair -- make "
                        f"the ranks agree (the same torch build, sources and settings) or disable it everywhere")


_UNREDUCED = ("{what}: {name} holds gradients accumulated without a reduce-scatter ({param}'s, "
              "set_requires_gradient_sync(False)) on its unsharded parameters, which Slot-Reuse moves "
              "into or out of a heap slot -- they would be lost; switch after the synced backward")


def _unreduced_grad(pg: Any) -> str | None:
    """The name of a parameter of ``pg`` whose gradient of micro-batches run without sync is
    held on its unsharded parameter (FSDP2 keeps it there when it reduces in the parameter's
    dtype, else in ``unsharded_accumulated_grad``), or None."""
    for fp in pg.fsdp_params:
        unsharded = fp.__dict__.get("_unsharded_param")
        if (unsharded is not None and unsharded.grad is not None) or \
                getattr(fp, "unsharded_accumulated_grad", None) is not None:
            return getattr(fp, "_param_fqn", None) or "a parameter"
    return None


def disable(module: nn.Module) -> None:
    """Put every FSDP2 module inside ``module`` back on the stock path (between steps).
    Once no group anywhere is enabled, FSDP2's own functions are restored."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for name, m in fsdp_modules(module):
        for pg in param_groups(m):
            st = _state.GROUPS.get(pg)
            if st is not None and pg._all_gather_result is not None:
                raise RuntimeError(f"disable: {name} has an all-gather in flight; call disable between steps")
            if st is not None and st.slot is not None and _why_no_slot(pg) is not None:
                raise RuntimeError(f"disable: {name} holds unsharded parameters in a heap slot; "
                                   "call disable between steps")
            if st is not None and st.slot is not None and (held := _unreduced_grad(pg)) is not None:
                raise RuntimeError(_UNREDUCED.format(what="disable", name=name, param=held))
    dropped = set()
    for _, m in fsdp_modules(module):
        for pg in param_groups(m):
            st = _state.GROUPS.get(pg)
            if st is not None and st.slot is not None:
                dropped.add(id(st.slot))
            _drop(pg)
    slots.release_emptied(dropped)  # collective: slots no group holds any more give back their memory
    if not len(_state.GROUPS) and _state.active is not None:
        _uninstall(_state.active)


def is_enabled(module: nn.Module) -> bool:
    """True when every FSDP2 parameter group inside ``module`` runs on tide_triton."""
    groups = [pg for _, m in fsdp_modules(module) for pg in param_groups(m)]
    return bool(groups) and all(pg in _state.GROUPS for pg in groups)


def heap_bytes(module: nn.Module) -> int:
    """Bytes of the heaps (this rank's) that tide_triton maps outside torch's allocator for the
    groups enabled inside ``module``, now: flags, receive ring, Slot-Reuse slots and the
    all-gather block (released ones not).  Each tide_triton group and device counts once."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    seen: dict[tuple[int, str], int] = {}
    for _, m in fsdp_modules(module):
        for pg in param_groups(m):
            st = _state.GROUPS.get(pg)
            if st is not None and not st.group.closed:
                key = (id(st.group), pg.device.type)
                if key not in seen:  # released slots are mapped nowhere
                    seen[key] = (st.group.heap_nbytes(pg.device) - slots.released_bytes(st.group, pg.device.type)
                                 - released_block_bytes(st.group, pg.device.type))
    return sum(seen.values())


def stats(module: nn.Module) -> dict[str, dict[str, int] | None]:
    """Per FSDP2 parameter group inside ``module`` (named by its module; a group several
    modules share, ``fully_shard([norm, head])``, once, as ``"norm+head"``): how many
    all-gathers and reduce-scatters tide_triton has served since :func:`enable` (None for a
    group on the stock path), and the nodes of its group (more than one: the cross-node
    collectives)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    out: dict[str, dict[str, int] | None] = {}
    for _name, label, pg in labelled_groups(fsdp_modules(module)):
        if label not in out:
            st = _state.GROUPS.get(pg)
            out[label] = None if st is None else {
                "all_gathers": st.all_gathers, "reduce_scatters": st.reduce_scatters,
                "direct_accumulations": st.direct_accumulations,
                "staged_reduce_scatters": st.staged_reduce_scatters, "slot_all_gathers": st.slot_all_gathers,
                "prepared_runs": st.prepared_runs,
                "prepared_binds": sum(p.binds for p in st.prepared.values()), "nodes": st.group.nodes}
    return out
