"""FSDP2 drop-in: ``enable(model)`` switches ``fully_shard`` training to tide_triton's
collectives, ``disable(model)`` switches it back.

What changes for an enabled parameter group (torch 2.9-2.15, dim-0 sharding):

* all-gather: no copy-in and no copy-out.  :func:`tide_triton.all_gather` reads every
  parameter's padded shard (``FSDPParam._sharded_param_data``, the optimizer's dtype) and
  writes each rank's rows straight into every parameter's unsharded storage
  (``FSDPParam.all_gather_outputs[0]``), casting fp32 -> ``param_dtype`` on the way (round to
  nearest even, as ``_foreach_copy_`` does).  The flat ``all_gather_output`` buffer is gone.
* reduce-scatter: no ``chunk_cat`` and no flat reduce-dtype input.
  :func:`tide_triton.reduce_scatter` reads the autograd gradients as they are (bf16 under
  ``param_dtype=bf16``) and sums them in fp32, in rank order, into the sharded gradients:
  straight into an existing ``.grad`` (gradient accumulation, same pass) when every
  parameter of the group has one, otherwise into one flat output whose per-parameter views
  become the ``.grad`` DTensors exactly as in stock FSDP2.  Post-accumulate-grad hooks fire.
  Ops: AVG (default), ``set_gradient_divide_factor`` (a pre-multiplied sum),
  ``set_force_sum_reduction_for_comms`` (a sum, then the post-divide), the all-reduce hook.

How: FSDP2's ``_fsdp_param_group`` module calls ``foreach_all_gather``,
``foreach_all_gather_copy_out`` and ``foreach_reduce`` by name.  :func:`enable` installs one
wrapper for each into that module (once); a wrapper runs the tide_triton path only for
parameter groups marked enabled, and calls the original function, untouched, for every other
group.  When the last group is disabled the originals are put back.

Falls back to stock FSDP2 for a group, with one log line (logger ``"tide_triton"``) saying
why: Shard(dim > 0), HSDP / replicate meshes, a post-forward reshard mesh, CPU offload,
mixed parameter dtypes, an fp16 reduction (FSDP2 pre/post-divides it), DTensor (TP/EP)
parameters, all-gather extensions, custom comms, world size 1, an unknown torch version.

Slot-Reuse (``enable(..., slot_reuse=True)``): every group's unsharded storage
(``all_gather_outputs``) is a view of a heap region -- :data:`SLOT_POOL` slots shared
round-robin by the groups that reshard after forward, a private slot for the outermost module
(FSDP2 keeps the root unsharded after forward) and any group without a reshard after
forward.  FSDP2's ``free_storage`` / ``alloc_storage`` (``resize_``) pass through except for
these views, where they do nothing (a free records a CUDA event instead).  After backward's
reshard the post-backward reduce-scatter vacates the slot (``HeapRegion.vacate`` on the
reduce-scatter stream) and stages the peers' contributions in it
(``reduce_scatter(..., staging=slot)``) -- only when every group of the slot is resharded,
otherwise through the ring.  The next all-gather into a slot waits for the frees and the
last staged reduce-scatter (CUDA events), and raises if another group still holds it.

Streams (CUDA): the all-gather allocates the unsharded storage on FSDP2's all-gather stream
(after it waits for the copy-in stream), writes it there and records the event FSDP2's
copy-out waits on; the storage is marked used by the consumer stream so that freeing it at
reshard cannot hand it to the next all-gather early.  The reduce-scatter runs on FSDP2's
reduce-scatter stream after it waits for the current stream; the autograd gradients are
returned as the group's ``reduce_scatter_input`` so FSDP2 keeps them alive until the
reduce-scatter event, as it does with its own staging buffer.
"""
from __future__ import annotations

import ast
import inspect
import logging
import re
import textwrap
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["enable", "disable", "is_enabled", "stats", "heap_bytes", "supported_torch_version"]

log = logging.getLogger("tide_triton")

_FIRST, _LAST = (2, 9), (2, 15)

# Names FSDP2 returns from foreach_reduce, in the order the installed version's final
# ``return`` statement lists them (read from its source, see _reduce_return_order).
_REDUCE_RESULT_NAMES = frozenset({
    "reduce_scatter_input", "reduce_scatter_event", "post_reduce_stream", "post_reduce_event",
    "all_reduce_input", "all_reduce_event", "partial_reduce_output",
})
_AG_RESULT_FIELDS = ("all_gather_output", "all_gather_event", "all_gather_work",
                     "param_all_gather_input_dtypes", "param_all_gather_input_numels",
                     "all_gather_input_split_sizes")
_AG_ARGS = ("fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream",
            "device", "all_gather_comm")
_COPY_OUT_ARGS = ("all_gather_result", "fsdp_params", "group")
_REDUCE_ARGS = ("fsdp_params", "unsharded_grads", "reduce_scatter_group", "reduce_scatter_stream",
                "reduce_scatter_comm", "reduce_dtype", "device", "gradient_divide_factor",
                "all_reduce_group", "all_reduce_stream", "all_reduce_grads", "partial_reduce_output",
                "all_reduce_hook")


def supported_torch_version(version: str | None = None) -> str | None:
    """Which FSDP2 code path serves ``version`` (default: the installed torch):
    ``"2.9-2.14"`` (one ``foreach_reduce`` signature), ``"2.15"`` (``orig_dtype`` dropped,
    ``prepare_reduce_scatter_inputs`` / ``all_gather_output_fn`` keywords), or None."""
    v = torch.__version__ if version is None else version
    m = re.match(r"^(\d+)\.(\d+)", str(v))
    if m is None:
        return None
    mm = (int(m.group(1)), int(m.group(2)))
    if _FIRST <= mm < (2, 15):
        return "2.9-2.14"
    if mm == _LAST:
        return "2.15"
    return None


# --------------------------------------------------------------------------- installation
@dataclass
class _Api:
    """The installed torch's FSDP2 internals, checked once."""

    fpg: Any                    # torch.distributed.fsdp._fully_shard._fsdp_param_group
    fc: Any                     # ..._fsdp_collectives
    orig_ag: Callable
    orig_copy_out: Callable
    orig_reduce: Callable
    sig_ag: inspect.Signature
    sig_copy_out: inspect.Signature
    sig_reduce: inspect.Signature
    reduce_order: tuple[str | None, ...]
    path: str


_API: _Api | None = None
_API_ERROR: str | None = None
_ACTIVE: _Api | None = None  # the API the installed wrappers serve
_ENABLED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _reduce_return_order(fn: Callable) -> tuple[str | None, ...]:
    """The names in ``fn``'s last ``return (a, b, ...)`` (None for a literal None):
    the result layout FSDPParamGroup.post_backward unpacks in this torch version."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    if not isinstance(func, ast.FunctionDef):
        raise ValueError("foreach_reduce source is not a function definition")
    rets = [n for n in ast.walk(func) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    if not rets:
        raise ValueError("foreach_reduce has no `return (...)`")
    ret = max(rets, key=lambda n: n.lineno)  # the last one: the normal (non-HSDP-partial) exit
    out: list[str | None] = []
    for e in ret.value.elts:
        if isinstance(e, ast.Constant) and e.value is None:
            out.append(None)
        elif isinstance(e, ast.Name) and e.id in _REDUCE_RESULT_NAMES:
            out.append(e.id)
        else:
            raise ValueError(f"foreach_reduce returns {ast.unparse(e)!r}, which tide_triton does not know")
    return tuple(out)


def _load_api() -> _Api:
    global _API, _API_ERROR
    if _API is not None:
        return _API
    if _API_ERROR is not None:
        raise RuntimeError(_API_ERROR)
    try:
        path = supported_torch_version()
        if path is None:
            raise RuntimeError(f"torch {torch.__version__} is outside the versions tide_triton.fsdp knows (2.9-2.15)")
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

        orig_ag, orig_co, orig_rd = fpg.foreach_all_gather, fpg.foreach_all_gather_copy_out, fpg.foreach_reduce
        for f in (orig_ag, orig_co, orig_rd):
            if getattr(f, "_tide_wrapper", False):
                raise RuntimeError("FSDP2's functions are already tide_triton wrappers (module reloaded?)")
        sigs = [inspect.signature(f) for f in (orig_ag, orig_co, orig_rd)]
        for sig, names, what in zip(sigs, (_AG_ARGS, _COPY_OUT_ARGS, _REDUCE_ARGS),
                                    ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")):
            missing = [n for n in names if n not in sig.parameters]
            if missing:
                raise RuntimeError(f"torch {torch.__version__}: {what} lacks parameters {missing}")
        if path == "2.9-2.14" and "orig_dtype" not in sigs[2].parameters:
            raise RuntimeError(f"torch {torch.__version__}: foreach_reduce lacks orig_dtype")
        fields = getattr(fc.AllGatherResult, "_fields", ())
        if tuple(fields) != _AG_RESULT_FIELDS:
            raise RuntimeError(f"torch {torch.__version__}: AllGatherResult has fields {fields}")
        order = _reduce_return_order(orig_rd)
        if not hasattr(fc, "_get_gradient_divide_factors"):
            raise RuntimeError(f"torch {torch.__version__}: no _get_gradient_divide_factors")
        _API = _Api(fpg, fc, orig_ag, orig_co, orig_rd, *sigs, order, path)
        return _API
    except (RuntimeError, ImportError, OSError, TypeError, ValueError, SyntaxError) as e:
        _API_ERROR = str(e)
        raise RuntimeError(_API_ERROR) from None


def _install(api: _Api) -> None:
    global _ACTIVE
    fpg = api.fpg
    if getattr(fpg.foreach_reduce, "_tide_wrapper", False):
        return
    _ACTIVE = api
    from torch.distributed.fsdp._fully_shard import _fsdp_param as fparam

    if not getattr(fparam.free_storage, "_tide_wrapper", False):  # pass-through but for heap slots
        _ORIG_STORAGE[:] = [fparam.alloc_storage, fparam.free_storage]
        fparam.alloc_storage, fparam.free_storage = _alloc_storage, _free_storage
    fpg.foreach_all_gather = _wrapped_all_gather
    fpg.foreach_all_gather_copy_out = _wrapped_copy_out
    fpg.foreach_reduce = _wrapped_reduce


def _uninstall(api: _Api) -> None:
    fpg = api.fpg
    from torch.distributed.fsdp._fully_shard import _fsdp_param as fparam

    if _ORIG_STORAGE and fparam.free_storage is _free_storage and fparam.alloc_storage is _alloc_storage:
        fparam.alloc_storage, fparam.free_storage = _ORIG_STORAGE
        _ORIG_STORAGE.clear()
    for name, ours, orig in (("foreach_all_gather", _wrapped_all_gather, api.orig_ag),
                             ("foreach_all_gather_copy_out", _wrapped_copy_out, api.orig_copy_out),
                             ("foreach_reduce", _wrapped_reduce, api.orig_reduce)):
        if getattr(fpg, name) is ours:
            setattr(fpg, name, orig)
        else:  # someone patched over us: leave theirs, our wrapper is no longer reachable
            log.warning("tide_triton.fsdp: %s was replaced by someone else; not restoring it", name)


# --------------------------------------------------------------------------- per-group state
@dataclass
class _GroupState:
    group: Any            # tide_triton Group
    fqn: str
    sentinel: torch.Tensor
    reduce_fallback_logged: bool = False
    all_gathers: int = 0             # calls served by tide_triton.all_gather
    reduce_scatters: int = 0         # calls served by tide_triton.reduce_scatter
    direct_accumulations: int = 0    # of those, summed straight into existing .grad
    slot: "_Slot | None" = None      # Slot-Reuse: the heap slot holding the unsharded params
    pg: Any = None                   # the FSDPParamGroup (Slot-Reuse checks its state)
    staged_reduce_scatters: int = 0  # reduce-scatters staged in the vacated slot (Slot-Reuse)


SLOT_POOL = 2
"""Heap slots shared by the parameter groups that reshard after forward (Slot-Reuse), set
before :func:`enable`.  Two hold the group computing and the one prefetched (one ahead, as
FSDP2 prefetches by default); the slot of the group whose reduce-scatter stages in it is the
next prefetch's, so on a GPU that all-gather waits for the reduce-scatter.  3 lets them
overlap at the cost of one more unsharded group; deeper prefetching needs more (an
all-gather into a slot another group still holds raises, naming both)."""

_SLOT_REUSE_RING = 4 << 20
"""Receive ring of a tide_triton group created for Slot-Reuse (only reduce-scatters that
cannot stage in their slot, e.g. without a reshard after backward, use it)."""

_ALIGN = 64
_HEAP_STORAGES: dict[tuple[str, int], "_Slot"] = {}  # (device type, storage data_ptr) -> slot


class _Slot:
    """A heap region holding the unsharded parameters of one or more parameter groups
    (never two at once: checked at every all-gather and reduce-scatter)."""

    def __init__(self, region: Any, private: bool) -> None:
        self.region = region
        self.private = private
        self.members: "weakref.WeakSet[Any]" = weakref.WeakSet()   # FSDPParamGroups
        self.freed: list = []  # CUDA events: a member's reshard (its compute is done with it)

    def live_others(self, pg: Any) -> list:
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

        return [m for m in self.members if m is not pg
                and any(fp.sharded_state != ShardedState.SHARDED for fp in m.fsdp_params)]


def _state_of(fsdp_params: Any) -> _GroupState | None:
    """The tide state shared by all of ``fsdp_params`` (a group's params carry the same one)."""
    if not fsdp_params:
        return None
    st = getattr(fsdp_params[0], "_tide_state", None)
    if st is None:
        return None
    for p in fsdp_params:
        if getattr(p, "_tide_state", None) is not st:
            return None
    return st


def _param_groups(state: Any) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12
    if groups is not None:
        return list(groups)
    g = getattr(state, "_fsdp_param_group", None)
    return [g] if g is not None else []


def _fsdp_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from torch.distributed.fsdp import FSDPModule

    return [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def _why_stock(pg: Any, api: _Api) -> str | None:
    """Why this FSDPParamGroup must stay on the stock path (None: it can use tide_triton)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common as fcom
    from torch.distributed.fsdp._fully_shard._fsdp_api import CPUOffloadPolicy

    mi = pg.mesh_info
    if isinstance(mi, getattr(fcom, "DDPMeshInfo", ())) or isinstance(mi, getattr(fcom, "HSDPMeshInfo", ())):
        return "HSDP / replicate mesh (gradients are also all-reduced across replicas)"
    if not isinstance(mi, fcom.FSDPMeshInfo):
        return f"mesh {type(mi).__name__} is not a plain FSDP shard mesh"
    pf = pg.post_forward_mesh_info  # None (no reshard), mesh_info (reshard), or a smaller mesh
    if pf is not None and pf is not mi:
        return "reshard_after_forward=<int> (post-forward mesh)"
    if isinstance(pg.offload_policy, CPUOffloadPolicy):
        return "CPU offload policy"
    if pg.device.type not in ("cpu", "cuda"):
        return f"device {pg.device.type}"
    ws = pg._all_gather_process_group.size()
    if ws == 1:
        return "world size 1 (nothing to communicate)"
    rs_pg, ag_pg = pg._reduce_scatter_process_group, pg._all_gather_process_group
    if rs_pg is not ag_pg and dist.get_process_group_ranks(rs_pg) != dist.get_process_group_ranks(ag_pg):
        return "a reduce-scatter group with other ranks than the all-gather group"
    if type(pg._all_gather_comm) is not api.fc.DefaultAllGather:
        return f"custom all-gather comm {type(pg._all_gather_comm).__name__}"
    if type(pg._reduce_scatter_comm) is not api.fc.DefaultReduceScatter:
        return f"custom reduce-scatter comm {type(pg._reduce_scatter_comm).__name__}"
    for attr, default in (("_all_gather_output_fn", "_default_all_gather_output_fn"),
                          ("_prepare_reduce_scatter_inputs", "_default_reduce_scatter_input_fn")):
        if hasattr(pg, attr) and getattr(pg, attr) is not getattr(api.fc, default, object()):
            return f"a custom {attr.lstrip('_')} callback"
    dtypes = set()
    for fp in pg.fsdp_params:
        if fp.fsdp_placement.dim != 0:
            return f"Shard({fp.fsdp_placement.dim}) placement (tide_triton shards dim 0 only)"
        if getattr(fp, "is_dtensor", False):
            return "DTensor (TP/EP) parameters"
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return "all-gather extensions (fsdp_pre_all_gather)"
        dtypes.add(fp.sharded_param.dtype)
    if len(dtypes) > 1:
        return f"mixed parameter dtypes in one group ({sorted(map(str, dtypes))})"
    if not dtypes:
        return "no parameters"
    orig = dtypes.pop()
    if orig not in (torch.float32, torch.bfloat16, torch.float16):
        return f"parameter dtype {orig}"
    param_dtype = pg.mp_policy.param_dtype or orig
    reduce_dtype = pg.mp_policy.reduce_dtype or param_dtype
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        return f"{reduce_dtype} reduction (FSDP2 pre/post-divides it to avoid overflow)"
    return None


def _resolve_group(group: Any, pg: dist.ProcessGroup, slot_reuse: bool = False) -> Any:
    """The tide_triton group for FSDP2's shard process group ``pg``."""
    from .group import _GROUPS, Group, init

    if group is None:
        have = _GROUPS.get(id(pg))
        if slot_reuse and (have is None or have._closed):  # staging lives in the slots: a small ring
            return init(pg, ring_bytes=_SLOT_REUSE_RING)
        return init(pg)
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


def enable(module: nn.Module, *, group: Any = None, slot_reuse: bool = False) -> dict[str, str | None]:
    """Route every ``fully_shard``-ed module inside ``module`` (itself included) through
    tide_triton's all-gather and reduce-scatter.  Call it on every rank, after ``fully_shard``
    and between steps (not inside forward/backward).

    ``group``: the tide_triton group (or the process group to build it on) for the
    collectives; default: one per FSDP2 shard process group.  It must span the same ranks.
    ``slot_reuse``: Slot-Reuse -- every group's unsharded parameters live in a heap slot
    (:data:`SLOT_POOL` slots shared by the groups that reshard after forward, a private one for
    each group that does not, e.g. the root), and its reduce-scatter stages the peers'
    contributions in that slot once backward has vacated it, instead of in a receive ring.
    A tide_triton group created here then gets a 4 MiB ring (for reduce-scatters that
    cannot stage: no reshard after backward).  Call it before the first step;
    the heap slots are never freed (a later enable makes new ones).

    Returns ``{module name: None if on tide_triton, else the reason it stays stock}``; each
    stock module's reason is also logged once (logger ``"tide_triton"``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(slot_reuse, bool):
        raise TypeError(f"slot_reuse must be a bool, got {type(slot_reuse).__name__}")
    if group is not None:
        from .group import Group

        if not isinstance(group, (Group, dist.ProcessGroup)):
            raise TypeError(f"group must be None, a ProcessGroup or a tide_triton Group, got {type(group).__name__}")
    mods = _fsdp_modules(module)
    if not mods:
        raise ValueError("module must contain a fully_shard-ed module (an FSDPModule), found none")
    try:
        api = _load_api()
    except RuntimeError as e:
        log.warning("tide_triton.fsdp: stock FSDP2 for all modules: %s", e)
        return {name: str(e) for name, _ in mods}
    for name, m in mods:
        for pg in _param_groups(m._get_fsdp_state()):
            if pg._training_state.name != "IDLE" or pg._all_gather_result is not None:
                raise RuntimeError(f"enable: {name} is in {pg._training_state.name}; call enable between steps")
            have = getattr(pg, "_tide_state", None)
            if have is not None and (slot_reuse or have.slot is not None):
                raise RuntimeError(f"enable(slot_reuse={slot_reuse}): {name} is enabled already"
                                   f"{' with Slot-Reuse' if have.slot is not None else ''}; disable it first")
    result: dict[str, str | None] = {}
    for name, m in mods:
        groups = _param_groups(m._get_fsdp_state())
        reasons = []
        for i, pg in enumerate(groups):
            label = name if len(groups) == 1 else f"{name}[{i}]"
            why = _why_stock(pg, api)
            if why is None and slot_reuse:
                why = _why_no_slot(pg)
            if why is None:
                g = _resolve_group(group, pg._all_gather_process_group, slot_reuse)
                st = _GroupState(g, label, _sentinel(pg.device), pg=pg)
                pg._tide_state = st
                for fp in pg.fsdp_params:
                    fp._tide_state = st
                _ENABLED.add(pg)
            else:
                _drop(pg)
                log.warning("tide_triton.fsdp: %s stays on stock FSDP2: %s", label, why)
                reasons.append(why)
        if groups:
            result[name] = "; ".join(reasons) if reasons else None
    if slot_reuse:
        _assign_slots(module, mods)
    if len(_ENABLED):
        _install(api)
    return result


def _why_no_slot(pg: Any) -> str | None:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if any(fp.sharded_state != ShardedState.SHARDED for fp in pg.fsdp_params):
        return "slot_reuse: its parameters are unsharded now (call enable before the first step)"
    return None


def _group_layout(pg: Any, W: int) -> tuple[torch.dtype, list[tuple[int, int]], int]:
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


def _assign_slots(module: nn.Module, mods: list) -> None:
    """Slot-Reuse: heap slots for the enabled groups' unsharded parameters (collective: every
    rank walks the same modules in the same order).  Groups that may stay unsharded across
    other groups' work (the outermost FSDP module -- FSDP2 keeps the root unsharded after
    forward -- and any group without a reshard after forward) get a private slot; the
    others share :data:`SLOT_POOL` slots round-robin."""
    names = [n for n, _ in mods]
    pools: dict[int, list] = {}  # id(tide group) -> [(pg, st)]
    private: list = []
    for name, m in mods:
        outer = name == "<root>" or not any(o == "<root>" or name.startswith(o + ".") for o in names if o != name)
        for pg in _param_groups(m._get_fsdp_state()):
            st = getattr(pg, "_tide_state", None)
            if st is None:
                continue
            if outer or pg.post_forward_mesh_info is None:
                private.append((pg, st))
            else:
                pools.setdefault(id(st.group), []).append((pg, st))
    for pg, st in private + [x for v in pools.values() for x in v]:
        st.group._tide_fsdp_enables = getattr(st.group, "_tide_fsdp_enables", 0)
    tag = {}
    for pg, st in private + [x for v in pools.values() for x in v]:
        g = st.group
        if id(g) not in tag:
            g._tide_fsdp_enables += 1
            tag[id(g)] = f"fsdp{g._tide_fsdp_enables}"

    def floor(g: Any) -> int:  # a staged reduce-scatter needs >= 16 bytes per slot and peer
        return 16 * g.options.stages * max(1, g.world_size - 1)

    for pg, st in private:
        g = st.group
        nbytes = max(_group_layout(pg, g.world_size)[2], floor(g))
        _bind_slot(pg, st, _Slot(g.heap_region(f"{tag[id(g)]}:{st.fqn}", nbytes, pg.device), True))
    for members in pools.values():
        g = members[0][1].group
        need = max(max(_group_layout(pg, g.world_size)[2] for pg, _ in members), floor(g))
        slots = [_Slot(g.heap_region(f"{tag[id(g)]}:slot{k}", need, members[0][0].device), False)
                 for k in range(min(SLOT_POOL, len(members)))]
        for i, (pg, st) in enumerate(members):
            _bind_slot(pg, st, slots[i % len(slots)])


def _bind_slot(pg: Any, st: _GroupState, slot: _Slot) -> None:
    """The group's unsharded parameters become views of ``slot`` (FSDP2's
    ``all_gather_outputs``; its ``init_all_gather_outputs`` keeps existing ones)."""
    dt, offs, _ = _group_layout(pg, st.group.world_size)
    for fp, (off, n) in zip(pg.fsdp_params, offs):
        view = slot.region.tensor(dt, n, off)
        _HEAP_STORAGES[(view.device.type, view.untyped_storage().data_ptr())] = slot
        fp.all_gather_outputs = [view]
        if hasattr(fp, "_unsharded_param"):  # a stock-allocated one from before: made anew
            del fp._unsharded_param
    slot.members.add(pg)
    st.slot = slot


def _heap_slot(tensor: torch.Tensor) -> "_Slot | None":
    if not _HEAP_STORAGES:
        return None
    return _HEAP_STORAGES.get((tensor.device.type, tensor.untyped_storage().data_ptr()))


def _free_storage(tensor: torch.Tensor) -> None:
    """FSDP2's reshard frees unsharded storage with ``resize_(0)``; a heap slot stays (it is
    not resizable): the compute that used it is recorded so the next writer waits for it."""
    slot = _heap_slot(tensor)
    if slot is None:
        return _ORIG_STORAGE[1](tensor)
    if tensor.device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(tensor.device))
        slot.freed.append(ev)
    return None


def _alloc_storage(tensor: torch.Tensor) -> None:
    if _heap_slot(tensor) is None:
        return _ORIG_STORAGE[0](tensor)
    return None


_free_storage._tide_wrapper = True  # type: ignore[attr-defined]
_alloc_storage._tide_wrapper = True  # type: ignore[attr-defined]
_ORIG_STORAGE: list = []  # FSDP2's (alloc_storage, free_storage), once patched


def _sentinel(device: torch.device) -> torch.Tensor:
    t = torch.empty(0, device=device)
    t._tide_ag = True  # marks an AllGatherResult whose data already sits in the parameters
    return t


def _drop(pg: Any) -> None:
    st = getattr(pg, "_tide_state", None)
    if st is not None and st.slot is not None:  # stock allocates its own storage again
        for fp in pg.fsdp_params:
            fp.all_gather_outputs = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param
        st.slot.members.discard(pg)
    if getattr(pg, "_tide_state", None) is not None:
        del pg._tide_state
    for fp in pg.fsdp_params:
        if getattr(fp, "_tide_state", None) is not None:
            del fp._tide_state
    _ENABLED.discard(pg)


def disable(module: nn.Module) -> None:
    """Put every FSDP2 module inside ``module`` back on the stock path (between steps).
    Once no group anywhere is enabled, FSDP2's own functions are restored."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for name, m in _fsdp_modules(module):
        for pg in _param_groups(m._get_fsdp_state()):
            st = getattr(pg, "_tide_state", None)
            if st is not None and pg._all_gather_result is not None:
                raise RuntimeError(f"disable: {name} has an all-gather in flight; call disable between steps")
            if st is not None and st.slot is not None and _why_no_slot(pg) is not None:
                raise RuntimeError(f"disable: {name} holds unsharded parameters in a heap slot; "
                                   "call disable between steps")
    for _, m in _fsdp_modules(module):
        for pg in _param_groups(m._get_fsdp_state()):
            _drop(pg)
    if not len(_ENABLED) and _ACTIVE is not None:
        _uninstall(_ACTIVE)


def is_enabled(module: nn.Module) -> bool:
    """True when every FSDP2 parameter group inside ``module`` runs on tide_triton."""
    groups = [pg for _, m in _fsdp_modules(module) for pg in _param_groups(m._get_fsdp_state())]
    return bool(groups) and all(getattr(pg, "_tide_state", None) is not None for pg in groups)


def heap_bytes(module: nn.Module) -> int:
    """Bytes of the heaps (this rank's) that tide_triton maps outside torch's allocator for the
    groups enabled inside ``module``: receive ring, Slot-Reuse slots, flags.  Each tide_triton
    group and device counts once."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    seen: dict[tuple[int, str], int] = {}
    for _, m in _fsdp_modules(module):
        for pg in _param_groups(m._get_fsdp_state()):
            st = getattr(pg, "_tide_state", None)
            if st is not None and not st.group.closed:
                key = (id(st.group), pg.device.type)
                if key not in seen:
                    seen[key] = st.group.heap_nbytes(pg.device)
    return sum(seen.values())


def stats(module: nn.Module) -> dict[str, dict[str, int] | None]:
    """Per FSDP2 module inside ``module``: how many all-gathers and reduce-scatters
    tide_triton has served since :func:`enable` (None for a module on the stock path), and
    the nodes of its group (more than one: the cross-node collectives)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    out: dict[str, dict[str, int] | None] = {}
    for name, m in _fsdp_modules(module):
        for i, pg in enumerate(groups := _param_groups(m._get_fsdp_state())):
            st = getattr(pg, "_tide_state", None)
            out[name if len(groups) == 1 else f"{name}[{i}]"] = None if st is None else {
                "all_gathers": st.all_gathers, "reduce_scatters": st.reduce_scatters,
                "direct_accumulations": st.direct_accumulations,
                "staged_reduce_scatters": st.staged_reduce_scatters, "nodes": st.group.nodes}
    return out


# --------------------------------------------------------------------------- all-gather
def _wrapped_all_gather(*args: Any, **kwargs: Any):
    api = _ACTIVE
    a = api.sig_ag.bind(*args, **kwargs).arguments
    st = _state_of(a["fsdp_params"])
    if st is None or not _ag_ok(a["fsdp_params"]):
        return api.orig_ag(*args, **kwargs)
    return _tide_all_gather(st, api, a)


_wrapped_all_gather._tide_wrapper = True  # type: ignore[attr-defined]


def _ag_ok(fsdp_params: list) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return all(fp.sharded_state == ShardedState.SHARDED and not fp.offload_to_cpu for fp in fsdp_params)


@torch.no_grad()
def _tide_all_gather(st: _GroupState, api: _Api, a: dict):
    from torch.distributed.device_mesh import _get_device_handle

    from .collectives import all_gather

    fsdp_params, pg, device = a["fsdp_params"], a["group"], a["device"]
    copy_in_stream, ag_stream = a["all_gather_copy_in_stream"], a["all_gather_stream"]
    W = pg.size()
    handle = _get_device_handle(device.type)
    consumer = handle.current_stream()
    cuda = device.type == "cuda"
    ag_stream.wait_stream(copy_in_stream)  # inherits FSDP2's waits (copy-out, reshard events)
    slot = st.slot
    if slot is not None:  # Slot-Reuse: the slot must be free of other groups' parameters
        live = slot.live_others(st.pg)
        if live:
            raise RuntimeError(
                f"tide_triton.fsdp slot_reuse: all-gather of {st.fqn} into heap slot "
                f"{slot.region.key!r}, which {_state_of(live[0].fsdp_params).fqn} still uses (unsharded); "
                f"more groups are unsharded at once than tide_triton.fsdp.SLOT_POOL={SLOT_POOL} slots "
                "allow -- raise it before enable()")
        if cuda:  # after the previous occupants' compute and the last staged reduce-scatter
            for ev in slot.freed:
                ag_stream.wait_event(ev)
            slot.freed.clear()
            slot.region.wait_consumed(ag_stream)
    shards, outs, dtypes, numels = [], [], [], []
    with handle.stream(ag_stream):
        for fp in fsdp_params:
            src = fp._sharded_param_data  # padded shard, 1-D, the optimizer's dtype
            dt = fp.param_dtype or fp.orig_dtype
            n = src.numel()
            fp.init_all_gather_outputs([n], [dt], W, device)
            fp.alloc_all_gather_outputs()
            out = fp.all_gather_outputs[0]
            size = fp.padded_sharded_param_size
            rest = tuple(size[1:])
            shards.append(src.view(size[0], *rest))
            outs.append(out.view(W * size[0], *rest))
            dtypes.append([dt])
            numels.append([n])
        all_gather(shards, outs, group=st.group, stream=ag_stream if cuda else None)
        st.all_gathers += 1
        event = ag_stream.record_event()
    if cuda and consumer != ag_stream and slot is None:  # Stream objects compare by the stream, not identity
        for out in outs:  # freed on the consumer stream at reshard: not reusable before it is done
            out.record_stream(consumer)
    return api.fc.AllGatherResult(
        all_gather_output=st.sentinel, all_gather_event=event, all_gather_work=None,
        param_all_gather_input_dtypes=dtypes, param_all_gather_input_numels=numels,
        all_gather_input_split_sizes=[n[0] for n in numels])


def _wrapped_copy_out(*args: Any, **kwargs: Any):
    api = _ACTIVE
    a = api.sig_copy_out.bind(*args, **kwargs).arguments
    res = a["all_gather_result"]
    if not getattr(res.all_gather_output, "_tide_ag", False):
        return api.orig_copy_out(*args, **kwargs)
    # The data is already in the parameters: wait for it, nothing to copy.
    from torch.distributed.device_mesh import _get_device_handle

    device = res.all_gather_output.device
    if res.all_gather_event is not None:
        _get_device_handle(device.type).current_stream().wait_event(res.all_gather_event)
    W = a["group"].size()
    for numels, dtypes, fp in zip(res.param_all_gather_input_numels, res.param_all_gather_input_dtypes,
                                  a["fsdp_params"]):
        fp.init_all_gather_outputs(numels, dtypes, W, device)  # no-ops: done by the all-gather
        fp.alloc_all_gather_outputs()
    return None


_wrapped_copy_out._tide_wrapper = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- reduce-scatter
def _wrapped_reduce(*args: Any, **kwargs: Any):
    api = _ACTIVE
    ba = api.sig_reduce.bind(*args, **kwargs)
    ba.apply_defaults()
    a = ba.arguments
    st = _state_of(a["fsdp_params"])
    if st is None:
        return api.orig_reduce(*args, **kwargs)
    plan = _reduce_plan(st, api, a)
    if isinstance(plan, str):
        if not st.reduce_fallback_logged:
            st.reduce_fallback_logged = True
            log.warning("tide_triton.fsdp: %s reduce-scatter on stock FSDP2: %s", st.fqn, plan)
        return api.orig_reduce(*args, **kwargs)
    return _tide_reduce(st, api, a, *plan)


_wrapped_reduce._tide_wrapper = True  # type: ignore[attr-defined]


def _reduce_plan(st: _GroupState, api: _Api, a: dict):
    """(op, post_divide, orig_dtype) for tide_triton, or the reason to run stock."""
    from torch.distributed import ReduceOp

    grads, rs_group = a["unsharded_grads"], a["reduce_scatter_group"]
    if a["all_reduce_group"] is not None or a["partial_reduce_output"] is not None:
        return "HSDP all-reduce"
    prep = a.get("prepare_reduce_scatter_inputs")  # torch 2.15: tide_triton lays out the inputs itself
    if prep is not None and prep is not getattr(api.fc, "_default_reduce_scatter_input_fn", None):
        return "a custom prepare_reduce_scatter_inputs callback"
    if rs_group is None or rs_group.size() == 1:
        return "world size 1"
    if len({g.dtype for g in grads}) != 1:
        return f"mixed gradient dtypes {sorted({str(g.dtype) for g in grads})}"
    if any(fp.fsdp_placement.dim != 0 or fp.offload_to_cpu for fp in a["fsdp_params"]):
        return "Shard(dim > 0) or CPU offload"
    reduce_dtype = a["reduce_dtype"] or grads[0].dtype
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        return f"{reduce_dtype} reduction (pre/post-divide)"
    device, factor = a["device"], a["gradient_divide_factor"]
    force_sum = a.get("force_sum_reduction_for_comms", False)
    try:
        pre, post, rs_op, _ = api.fc._get_gradient_divide_factors(
            rs_group, None, reduce_dtype, device.type, factor, force_sum)
    except TypeError as e:
        return f"_get_gradient_divide_factors has an unknown signature ({e})"
    if pre is not None and pre != 1:
        return "a pre-divide factor"
    kind = rs_op if isinstance(rs_op, ReduceOp.RedOpType) else getattr(rs_op, "op", None)
    if kind == ReduceOp.AVG:
        op: str | float = "avg"
    elif kind == ReduceOp.SUM:
        op = "sum"
    elif kind == ReduceOp.PREMUL_SUM and factor:
        op = 1.0 / float(factor)
    else:
        return f"reduce op {rs_op!r}"
    if "orig_dtype" in a:
        orig_dtype = a["orig_dtype"]
    else:  # torch 2.15 dropped the argument: the group's parameters carry it
        orig_dtype = a["fsdp_params"][0].orig_dtype
    return op, (post if post not in (None, 1) else None), orig_dtype


def _combine(op: str | float, post: float, W: int) -> float:
    base = 1.0 if op == "sum" else (1.0 / W if op == "avg" else float(op))
    return base / post


@torch.no_grad()
def _tide_reduce(st: _GroupState, api: _Api, a: dict, op: str | float, post: float | None,
                 orig_dtype: torch.dtype | None):
    from torch.distributed.device_mesh import _get_device_handle
    from torch.distributed.tensor import DTensor

    from .collectives import reduce_scatter

    fsdp_params, unsharded_grads = a["fsdp_params"], a["unsharded_grads"]
    rs_group, rs_stream, device = a["reduce_scatter_group"], a["reduce_scatter_stream"], a["device"]
    hook, ar_stream = a["all_reduce_hook"], a["all_reduce_stream"]
    W = rs_group.size()
    handle = _get_device_handle(device.type)
    cuda = device.type == "cuda"
    current = handle.current_stream()
    grads = [g if g.is_contiguous() else g.contiguous() for g in unsharded_grads]
    unsharded_grads.clear()  # FSDP2's contract: the caller's list no longer owns them
    reduce_dtype = a["reduce_dtype"] or grads[0].dtype
    out_dtype = orig_dtype or reduce_dtype  # fp32 shards straight from the (bf16) grads
    if hook is None and post is not None:  # fold force-sum's post-divide into the op
        op, post = _combine(op, post, W), None

    # Where the sums go: straight into existing .grad when every parameter has one.
    locals_ = []
    for fp in fsdp_params:
        g = fp.sharded_param.grad
        loc = g._local_tensor if isinstance(g, DTensor) else None
        ok = (loc is not None and loc.dtype == out_dtype and loc.is_contiguous()
              and tuple(loc.shape) == tuple(fp.sharded_size) and loc.device == device)
        locals_.append(loc if ok else None)
    direct = hook is None and all(x is not None for x in locals_)

    rs_stream.wait_stream(current)
    flat = None
    with handle.stream(rs_stream):
        if direct:
            shards = locals_
        else:
            sizes = [fp.padded_sharded_param_size for fp in fsdp_params]
            numels = [s.numel() for s in sizes]
            flat = torch.empty(sum(numels), dtype=out_dtype, device=device)
            shards, off = [], 0
            for s, n in zip(sizes, numels):
                shards.append(flat[off:off + n].view(s))
                off += n
        staging = None
        if st.slot is not None and not st.slot.live_others(None):
            # Slot-Reuse: every group of the slot is resharded, so backward has vacated it
            # (on a GPU: once the work the reduce-scatter stream waited for is done).
            staging = st.slot.region
            staging.vacate(stream=rs_stream if cuda else None)
        reduce_scatter(grads, shards, group=st.group, op=op, accumulate=direct,
                       stream=rs_stream if cuda else None, staging=staging)
        st.reduce_scatters += 1
        st.staged_reduce_scatters += staging is not None
        st.direct_accumulations += direct
        reduce_scatter_event = rs_stream.record_event()
    post_reduce_stream = rs_stream
    if hook is not None:
        post_reduce_stream = ar_stream
        ar_stream.wait_stream(rs_stream)
        with handle.stream(ar_stream):
            hook(flat)
    with handle.stream(post_reduce_stream):
        if flat is not None:
            if post is not None:
                flat.div_(post)
            off = 0
            for fp in fsdp_params:
                new = torch.as_strided(flat, size=fp.sharded_size, stride=fp.contiguous_sharded_stride,
                                       storage_offset=off)
                if fp.sharded_param.grad is not None:
                    fp.sharded_param.grad._local_tensor += new
                else:
                    fp.sharded_param.grad = fp.to_sharded_dtensor(new)
                off += fp.padded_sharded_param_size.numel()
        for fp in fsdp_params:
            for h in (getattr(fp.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
                h(fp.sharded_param)
        post_reduce_event = post_reduce_stream.record_event()
    values = {
        # The autograd grads stay referenced until FSDP2 has waited for this event (its
        # ReduceScatterState), as its own staging buffer would: the copy queue reads them.
        "reduce_scatter_input": grads,
        "reduce_scatter_event": reduce_scatter_event,
        "post_reduce_stream": post_reduce_stream,
        "post_reduce_event": post_reduce_event,
        "all_reduce_input": None,
        "all_reduce_event": None,
        "partial_reduce_output": None,
    }
    return tuple(None if n is None else values[n] for n in api.reduce_order)
