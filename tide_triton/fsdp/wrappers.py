"""The three functions that stand in for FSDP2's ``foreach_all_gather``,
``foreach_all_gather_copy_out`` and ``foreach_reduce`` once :func:`~.install.install` has put
them into ``_fsdp_param_group``.  Each runs tide_triton's path for an enabled parameter group
and calls FSDP2's original, untouched, for every other group.

Streams (CUDA): the all-gather allocates the unsharded storage on FSDP2's all-gather stream
(after it waits for the copy-in stream), writes it there and records the event FSDP2's
copy-out waits on; the storage is marked used by the consumer stream so that freeing it at
reshard cannot hand it to the next all-gather early.  The reduce-scatter runs on FSDP2's
reduce-scatter stream after it waits for the current stream; the autograd gradients are
returned as the group's ``reduce_scatter_input`` so FSDP2 keeps them alive until the
reduce-scatter event, as it does with its own staging buffer.
"""
from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..plan.layout import DimShards
from ..collectives import all_gather as tide_all_gather
from ..collectives import prepared_all_gather_call, prepared_reduce_scatter_call, reduce_scatter, split_parts
from . import _state, slots
from ._state import GroupState, state_of
from ._torch_adapter import TorchApi, all_sharded, device_handle

log = logging.getLogger("tide_triton")


# --------------------------------------------------------------------------- all-gather
def all_gather(*args: Any, **kwargs: Any):
    """Stands in for FSDP2's ``foreach_all_gather``."""
    api = _state.active
    a = api.sig_ag.bind(*args, **kwargs).arguments
    st = state_of(a["fsdp_params"])
    if st is None or not _ag_ok(a["fsdp_params"]):
        return api.orig_ag(*args, **kwargs)
    return _tide_all_gather(st, api, a)


all_gather._tide_wrapper = True  # type: ignore[attr-defined]


def _ag_ok(fsdp_params: list) -> bool:
    return all_sharded(fsdp_params) and not any(fp.offload_to_cpu for fp in fsdp_params)


@torch.no_grad()
def _tide_all_gather(st: GroupState, api: TorchApi, a: dict):
    fsdp_params, pg, device = a["fsdp_params"], a["group"], a["device"]
    copy_in_stream, ag_stream = a["all_gather_copy_in_stream"], a["all_gather_stream"]
    W = pg.size()
    handle = device_handle(device)
    consumer = handle.current_stream()
    cuda = device.type == "cuda"
    ag_stream.wait_stream(copy_in_stream)  # inherits FSDP2's waits (copy-out, reshard events)
    slot = st.slot
    if slot is not None:  # Slot-Reuse: the slot must be free of other groups' parameters
        live = slot.live_others(st.pg)
        if live:
            other = _state.GROUPS.get(live[0])
            raise RuntimeError(
                f"tide_triton.fsdp slot_reuse: all-gather of {st.fqn} into heap slot "
                f"{slot.region.key!r}, which {other.fqn if other else 'another group'} still uses (unsharded, or "
                f"its all-gather issued and not yet waited for); "
                f"more groups are unsharded at once than tide_triton.fsdp.SLOT_POOL={slot.pool} slots "
                "allow -- raise it before enable()")
        slots.restore(slot)  # released after the last backward: memory again (collective)
        if cuda:  # after the previous occupants' compute and the last staged reduce-scatter
            for ev in slot.freed:
                ag_stream.wait_event(ev)
            slot.freed.clear()
            slot.region.wait_consumed(ag_stream)
    with handle.stream(ag_stream):
        if slot is None or st.ag_views is None:  # heap slots stay allocated: nothing to do per step
            for fp in fsdp_params:
                fp.init_all_gather_outputs([fp._sharded_param_data.numel()], [fp.param_dtype or fp.orig_dtype],
                                           W, device)
                fp.alloc_all_gather_outputs()
        shards, outs, dtypes, numels = _ag_views(st, fsdp_params, W)
        # Slot-Reuse on one node: the peers read this rank's rows straight from its slot (no
        # all-gather block; the slot's vacate before a staged reduce-scatter waits for them).
        region = slot.region if slot is not None and st.group.nodes == 1 else None
        with st.group.labelled(st.fqn):  # in the signature: other modules' calls never pair with it
            if st.use_prepared and slot is None and st.group.nodes == 1:
                _prepared_all_gather(st, shards, outs, ag_stream if cuda else None)
            else:
                tide_all_gather(shards, outs, group=st.group, stream=ag_stream if cuda else None,
                                params_region=region)
        st.all_gathers += 1
        st.slot_all_gathers += region is not None
        event = ag_stream.record_event()
    if cuda and consumer != ag_stream and slot is None:  # Stream objects compare by the stream, not identity
        for out in outs:  # freed on the consumer stream at reshard: not reusable before it is done
            out.record_stream(consumer)
    return api.fc.AllGatherResult(
        all_gather_output=st.sentinel, all_gather_event=event, all_gather_work=None,
        param_all_gather_input_dtypes=dtypes, param_all_gather_input_numels=numels,
        all_gather_input_split_sizes=[n[0] for n in numels])


def _prepared_all_gather(st: GroupState, shards: list, outs: list, stream: Any) -> None:
    """The group's all-gather as a prepared collective (``enable(prepared=True)``): made at its
    first call (collective: every rank is in the same call), run on this call's tensors --
    FSDP2's parameter group keeps its shapes, so a known set of addresses runs as bound."""
    key = ("ag", shards[0].dtype, outs[0].dtype)
    prep = st.prepared.get(key)
    if prep is None:
        prep = st.prepared[key] = prepared_all_gather_call(st.group, shards, outs, hold=False)
    prep._run_on(shards, outs, stream=stream)
    st.prepared_runs += 1


def _ag_views(st: GroupState, fsdp_params: list, W: int) -> tuple[list, list, list, list]:
    """The group's shards (padded, ``(c, *rest)``) and outputs (``(W * c, *rest)``) as views,
    their dtypes and numels: made once per set of tensors (a step's all-gathers repeat them;
    views follow their storage through FSDP2's free/alloc ``resize_``), so a many-parameter
    group pays no per-parameter view-making per step."""
    srcs = [fp._sharded_param_data for fp in fsdp_params]  # padded shards, 1-D, the optimizer's dtype
    outs0 = [fp.all_gather_outputs[0] for fp in fsdp_params]
    key = (tuple(map(id, srcs)), tuple(map(id, outs0)), W)
    if st.ag_views is not None and st.ag_views[0] == key:  # the cached views keep these tensors alive
        return st.ag_views[1]
    shards, outs, dtypes, numels = [], [], [], []
    for fp, src, out in zip(fsdp_params, srcs, outs0):
        size = fp.padded_sharded_param_size
        full = list(size)
        full[fp.fsdp_placement.dim] *= W  # Shard(dim): every rank's entries of that dim, in order
        shards.append(src.view(size))
        outs.append(out.view(full))
        dtypes.append([out.dtype])
        numels.append([src.numel()])
    ds = _dim_shards(fsdp_params, outs, W)
    if ds is not None:  # Shard(dim > 0): each rank's entries land in place, slice by slice
        shards, outs = _split(shards, ds), _split(outs, ds)
    st.ag_views = (key, (shards, outs, dtypes, numels))
    return shards, outs, dtypes, numels


def _dim_shards(fsdp_params: list, full: list, W: int):
    """The :class:`~tide_triton.plan.layout.DimShards` of a group with ``Shard(dim > 0)`` parameters
    (``full``: tensors of the unsharded shapes), or None when every one is ``Shard(0)``."""
    dims = tuple(fp.fsdp_placement.dim for fp in fsdp_params)
    if not any(dims):
        return None
    return _dim_shards_of(tuple(tuple(t.shape) for t in full), dims, W)


@lru_cache(maxsize=64)
def _dim_shards_of(shapes: tuple, dims: tuple, W: int) -> DimShards:
    return DimShards(shapes, dims, W)


def _split(tensors: list, ds: DimShards) -> list:
    return split_parts(tensors, ds)


def copy_out(*args: Any, **kwargs: Any):
    """Stands in for FSDP2's ``foreach_all_gather_copy_out``: for tide_triton's results the
    data is in the parameters already -- wait for it, nothing to copy."""
    api = _state.active
    a = api.sig_copy_out.bind(*args, **kwargs).arguments
    res = a["all_gather_result"]
    st = state_of(a["fsdp_params"])
    if st is None or res.all_gather_output is not st.sentinel:
        return api.orig_copy_out(*args, **kwargs)
    device = res.all_gather_output.device
    if res.all_gather_event is not None:
        device_handle(device).current_stream().wait_event(res.all_gather_event)
    return None  # FSDP2's copy-out would also init and alloc the outputs: the all-gather did


copy_out._tide_wrapper = True  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- reduce-scatter
def reduce(*args: Any, **kwargs: Any):
    """Stands in for FSDP2's ``foreach_reduce``."""
    api = _state.active
    ba = api.sig_reduce.bind(*args, **kwargs)
    ba.apply_defaults()
    a = ba.arguments
    st = state_of(a["fsdp_params"])
    if st is None:
        return api.orig_reduce(*args, **kwargs)
    plan = _reduce_plan(api, a)
    if isinstance(plan, str):
        if not st.reduce_fallback_logged:
            st.reduce_fallback_logged = True
            log.warning("tide_triton.fsdp: %s reduce-scatter on stock FSDP2: %s", st.fqn, plan)
        return api.orig_reduce(*args, **kwargs)
    return _tide_reduce(st, api, a, *plan)


reduce._tide_wrapper = True  # type: ignore[attr-defined]


def _reduce_plan(api: TorchApi, a: dict):
    """(op, post_divide, orig_dtype, HSDP all-reduce op or None) for tide_triton, or the reason to run stock."""
    grads, rs_group, ar_group = a["unsharded_grads"], a["reduce_scatter_group"], a["all_reduce_group"]
    prep = a.get("prepare_reduce_scatter_inputs")  # torch 2.15: tide_triton lays out the inputs itself
    if prep is not None and prep is not getattr(api.fc, "_default_reduce_scatter_input_fn", None):
        return "a custom prepare_reduce_scatter_inputs callback"
    if rs_group is None or rs_group.size() == 1:
        return "world size 1"
    if len({g.dtype for g in grads}) != 1:
        return f"mixed gradient dtypes {sorted({str(g.dtype) for g in grads})}"
    if any(fp.offload_to_cpu for fp in a["fsdp_params"]):
        return "CPU offload"
    reduce_dtype = a["reduce_dtype"] or grads[0].dtype
    if reduce_dtype not in (torch.float32, torch.bfloat16):
        return f"{reduce_dtype} reduction (pre/post-divide)"
    device, factor = a["device"], a["gradient_divide_factor"]
    force_sum = a.get("force_sum_reduction_for_comms", False)
    try:
        pre, post, rs_op, ar_op = api.fc._get_gradient_divide_factors(
            rs_group, ar_group, reduce_dtype, device.type, factor, force_sum)
    except TypeError as e:
        return f"_get_gradient_divide_factors has an unknown signature ({e})"
    if pre is not None and pre != 1:
        return "a pre-divide factor"
    if ar_group is None and a["partial_reduce_output"] is not None:
        return "a partial reduce output without an all-reduce group"
    if ar_group is not None and not a["all_reduce_grads"] and api.partial_order is None:
        return "HSDP accumulation without the all-reduce (this torch's foreach_reduce returns no partial sum)"
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
    return op, (post if post not in (None, 1) else None), orig_dtype, (ar_op if ar_group is not None else None)


_RELEASE_QUEUED = [False]


def _queue_release() -> None:
    """Once per backward: release the idle slots after FSDP2's final callback (queued at the
    root's pre-backward, so it runs first: the step's reduce-scatters are waited for).  Outside
    a backward (a reduce-scatter FSDP2 runs from its final callback still is inside) nothing
    is queued and the slots stay mapped."""
    if _RELEASE_QUEUED[0]:
        return
    try:
        torch.autograd.Variable._execution_engine.queue_callback(_release_after_backward)
    except RuntimeError:  # not inside a backward pass
        return
    _RELEASE_QUEUED[0] = True


def _release_after_backward() -> None:
    _RELEASE_QUEUED[0] = False
    slots.release_idle()


def _prepared_reduce_scatter(st: GroupState, fsdp_params: list, grads: list, shards: list, op: str | float,
                             accumulate: bool, stream: Any) -> None:
    """The group's reduce-scatter as a prepared collective, one per (op, accumulate, dtypes):
    made at that kind's first call (the same call on every rank), run on this call's tensors.
    A step in which some of the group's parameters got no gradient (FSDP2 leaves them out,
    the same on every rank; every step for a group with frozen parameters) has fewer
    tensors: which parameters they are joins the key, so it gets a program of its own -- run
    on the full one, the shapes' check would fail, and a run's error breaks the group (runs
    are not agreed)."""
    key: tuple = ("rs", repr(op), accumulate, grads[0].dtype, shards[0].dtype)
    pg = st.pg_ref()
    if pg is None or len(fsdp_params) != len(pg.fsdp_params):  # a subset: the FSDPParams' identities
        key += (tuple(map(id, fsdp_params)),)  # (C-level: ~5 us for 771; shapes would be ~130 us)
    prep = st.prepared.get(key)
    if prep is None:
        prep = st.prepared[key] = prepared_reduce_scatter_call(st.group, grads, shards, op, accumulate, hold=False)
    prep._run_on(grads, shards, stream=stream)
    st.prepared_runs += 1


def _combine(op: str | float, post: float, W: int) -> float:
    base = 1.0 if op == "sum" else (1.0 / W if op == "avg" else float(op))
    return base / post


@torch.no_grad()
def _tide_reduce(st: GroupState, api: TorchApi, a: dict, op: str | float, post: float | None,
                 orig_dtype: torch.dtype | None, ar_op: Any):
    fsdp_params, unsharded_grads = a["fsdp_params"], a["unsharded_grads"]
    rs_group, rs_stream, device = a["reduce_scatter_group"], a["reduce_scatter_stream"], a["device"]
    hook, ar_stream = a["all_reduce_hook"], a["all_reduce_stream"]
    ar_group = a["all_reduce_group"]  # HSDP: FSDP2's all-reduce across the replicas, run by torch as in stock
    W = rs_group.size()
    handle = device_handle(device)
    cuda = device.type == "cuda"
    current = handle.current_stream()
    grads = [g if g.is_contiguous() else g.contiguous() for g in unsharded_grads]
    unsharded_grads.clear()  # FSDP2's contract: the caller's list no longer owns them
    reduce_dtype = a["reduce_dtype"] or grads[0].dtype
    out_dtype = orig_dtype or reduce_dtype  # fp32 shards straight from the (bf16) grads
    # HSDP: the reduce-scatter's output is the all-reduce's input, in the reduce dtype as in
    # stock; the post-divide and the cast follow the all-reduce.
    flat_dtype = reduce_dtype if ar_group is not None else out_dtype
    if hook is None and post is not None and ar_group is None:  # fold force-sum's post-divide into the op
        op, post = _combine(op, post, W), None
    # reduce_dtype=bf16 with fp32 shards: summed in fp32, rounded once to bf16 -- the precision
    # the user asked for, stock's result dtype (FSDP2 casts its bf16 sums to orig_dtype)
    round_bf16 = reduce_dtype == torch.bfloat16 and out_dtype != torch.bfloat16
    if round_bf16 and not st.bf16_reduce_logged:
        st.bf16_reduce_logged = True
        log.info("tide_triton.fsdp: %s reduce_dtype=torch.bfloat16: the gradients are summed in fp32 and the "
                 "sums rounded once to bf16 (stock FSDP2 sums in bf16), held as %s like stock's", st.fqn,
                 out_dtype)
    locals_ = _grad_locals(fsdp_params, out_dtype, device)
    direct = hook is None and ar_group is None and not round_bf16 and all(x is not None for x in locals_)

    rs_stream.wait_stream(current)
    flat = None
    with handle.stream(rs_stream):
        if direct:
            shards = locals_
        else:
            flat, shards = _flat_shards(fsdp_params, flat_dtype, device)
        _run_reduce_scatter(st, fsdp_params, grads, shards, op, direct, rs_stream if cuda else None, W)
        if round_bf16 and flat.dtype != torch.bfloat16:  # before the event: the hook and the .grad read them
            flat.copy_(flat.to(torch.bfloat16))  # (HSDP's flat is bf16 already: the all-reduce's dtype)
        reduce_scatter_event = rs_stream.record_event()
        post_reduce_stream = rs_stream
        all_reduce_input = all_reduce_event = None
        partial = a["partial_reduce_output"]
        if ar_group is not None:  # FSDP2's HSDP steps, unchanged (accumulations on the reduce-scatter stream)
            if not a["all_reduce_grads"]:  # gradient accumulation without the all-reduce: keep the partial sum
                if partial is not None:
                    partial += flat
                else:
                    partial = flat
                return _reduce_result(api.partial_order, grads, reduce_scatter_event, post_reduce_stream,
                                      post_reduce_stream.record_event(), None, None, partial)
            if partial is not None:
                flat += partial
    if ar_group is not None:
        post_reduce_stream = ar_stream
        ar_stream.wait_stream(rs_stream)
        with handle.stream(ar_stream):
            dist.all_reduce(flat, group=ar_group, op=ar_op)
            all_reduce_input = flat  # FSDP2 holds it until the event: the next layer's buffers cannot reuse it
            all_reduce_event = ar_stream.record_event()
    if hook is not None:
        post_reduce_stream = ar_stream
        ar_stream.wait_stream(rs_stream)
        with handle.stream(ar_stream):
            hook(flat)
    with handle.stream(post_reduce_stream):
        if flat is not None:
            if post is not None:
                flat.div_(post)
            _add_to_grads(fsdp_params, flat if flat.dtype == out_dtype else flat.to(out_dtype))
        for fp in fsdp_params:
            for h in (getattr(fp.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
                h(fp.sharded_param)
        post_reduce_event = post_reduce_stream.record_event()
    return _reduce_result(api.reduce_order, grads, reduce_scatter_event, post_reduce_stream, post_reduce_event,
                          all_reduce_input, all_reduce_event, None)


def _run_reduce_scatter(st: GroupState, fsdp_params: list, grads: list, shards: list, op: str | float,
                        direct: bool, stream: Any, W: int) -> None:
    """The group's reduce-scatter of ``grads`` into ``shards`` on ``stream`` (None on the host):
    staged in the group's Slot-Reuse slot when backward has vacated it, prepared where the
    group asks for it, counted in the group's stats."""
    staging = None
    if st.slot is not None and not st.slot.region.released and not st.slot.live_others(None):
        # Slot-Reuse: every group of the slot is resharded, so backward has vacated it
        # (on a GPU: once the work the reduce-scatter stream waited for is done).
        staging = st.slot.region
        staging.vacate(stream=stream)
    parts = grads
    ds = _dim_shards(fsdp_params, grads, W)
    if ds is not None:  # Shard(dim > 0): each rank's entries read in place, slice by slice
        parts, shards = _split(grads, ds), _split(shards, ds)
    with st.group.labelled(st.fqn):
        if st.use_prepared and staging is None and st.group.nodes == 1:
            _prepared_reduce_scatter(st, fsdp_params, parts, shards, op, direct, stream)
        else:
            reduce_scatter(parts, shards, group=st.group, op=op, accumulate=direct, stream=stream, staging=staging)
    st.reduce_scatters += 1
    if st.slot is not None and st.slot.release:
        _queue_release()
    st.staged_reduce_scatters += staging is not None
    st.direct_accumulations += direct


def _grad_locals(fsdp_params: list, out_dtype: torch.dtype, device: torch.device) -> list:
    """Per parameter, the local tensor of its ``.grad`` where the sums can go straight into it
    (a DTensor's contiguous local of the shard's shape, dtype and device), else None."""
    from torch.distributed.tensor import DTensor  # ~500 modules: loaded by FSDP2, not by import tide_triton

    locals_ = []
    for fp in fsdp_params:
        g = fp.sharded_param.grad
        loc = g._local_tensor if isinstance(g, DTensor) else None
        ok = (loc is not None and loc.dtype == out_dtype and loc.is_contiguous()
              and tuple(loc.shape) == tuple(fp.sharded_size) and loc.device == device)
        locals_.append(loc if ok else None)
    return locals_


def _flat_shards(fsdp_params: list, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, list]:
    """One flat buffer of every parameter's padded shard, back to back, and its views per parameter."""
    sizes = [fp.padded_sharded_param_size for fp in fsdp_params]
    numels = [s.numel() for s in sizes]
    flat = torch.empty(sum(numels), dtype=dtype, device=device)
    shards, off = [], 0
    for s, n in zip(sizes, numels):
        shards.append(flat[off:off + n].view(s))
        off += n
    return flat, shards


def _add_to_grads(fsdp_params: list, out: torch.Tensor) -> None:
    """Each parameter's shard of ``out`` (padded shards back to back) added to its ``.grad``,
    or made its ``.grad`` where it has none."""
    off = 0
    for fp in fsdp_params:
        new = torch.as_strided(out, size=fp.sharded_size, stride=fp.contiguous_sharded_stride, storage_offset=off)
        if fp.sharded_param.grad is not None:
            fp.sharded_param.grad._local_tensor += new
        else:
            fp.sharded_param.grad = fp.to_sharded_dtensor(new)
        off += fp.padded_sharded_param_size.numel()


def _reduce_result(order: Any, grads: list, reduce_scatter_event: Any, post_reduce_stream: Any,
                   post_reduce_event: Any, all_reduce_input: Any, all_reduce_event: Any, partial: Any) -> tuple:
    """``foreach_reduce``'s results in ``order`` (the installed version's, read from its source)."""
    values = {
        # The autograd grads stay referenced until FSDP2 has waited for this event (its
        # ReduceScatterState), as its own staging buffer would: the copy queue reads them.
        "reduce_scatter_input": grads,
        "reduce_scatter_event": reduce_scatter_event,
        "post_reduce_stream": post_reduce_stream,
        "post_reduce_event": post_reduce_event,
        "all_reduce_input": all_reduce_input,
        "all_reduce_event": all_reduce_event,
        "partial_reduce_output": partial,
    }
    return tuple(None if n is None else values[n] for n in order)
