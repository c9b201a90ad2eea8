"""Public collectives: ``reduce_scatter`` (bf16 grads in, fp32 shards out), ``all_gather``
(shards straight into per-parameter storage), their prepared forms and ``synchronize``.

What this module does: validate the arguments (this rank), agree on them (all ranks: same
signature, no errors), then call an executor -- node-local (:mod:`tide_triton.executors.node_local`,
the ring of :mod:`tide_triton.executors.ring`), across nodes (:mod:`tide_triton.executors.across_nodes`) or
prepared (:mod:`tide_triton.executors.prepared`).

Heap layout of every rank: ``[flags | reduce-scatter ring | named regions | all-gather block]``
(:mod:`tide_triton.plan.heap`; regions: :meth:`Group.heap_region`, the staging of
``reduce_scatter(..., staging=...)``).
"""
from __future__ import annotations

import math
from functools import lru_cache, partial
from itertools import chain
from typing import Any, Sequence

import torch

from .executors import state
from .executors import across_nodes
from .executors import node_local
from .executors import prepared
from .runtime import stall_watch
from .runtime.checks import (FLOAT_DTYPES, RS_APART, check_bound, check_gather_shards, check_shapes, check_tensor_list,
                      check_uniform, dtype_name)
from .errors import PeerAbortedError, PeerArgumentError
from .group.core import Group, resolve
from .plan.across_nodes import ReduceScatterPlan
from .plan.layout import DimShards, ShardLayout
from .group.regions import HeapRegion
from .plan.schedule import ring_plan
from .executors.work import Work
from .executors.work import capturing as _capturing  # the name the capture tests patch

_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel

def _check_region(g: Group, region: object, device: torch.device, name: str, use: str) -> None:
    """``region`` is a mapped :class:`HeapRegion` of ``g`` in the heap of ``device``'s type."""
    if not isinstance(region, HeapRegion):
        raise TypeError(f"{name} must be None or a HeapRegion (Group.heap_region), got {type(region).__name__}")
    if region.group is not g:
        raise ValueError(f"{name} region {region.key!r} belongs to another tide_triton group")
    if region.device.type != device.type:
        raise ValueError(f"{name} region {region.key!r} is in the {region.device.type} heap, "
                         f"the {use} are on {device.type}")
    if getattr(region, "released", False):
        raise ValueError(f"{name} region {region.key!r} is released (its memory is unmapped): "
                         f"restore() it on every rank before {'staging in' if name == 'staging' else 'using'} it")


def _check_staging(g: Group, staging: object, device: torch.device) -> None:
    _check_region(g, staging, device, "staging", "gradients")


def _scale(op: object, world: int) -> float | None:
    if isinstance(op, str) and op == "sum":
        return None
    if isinstance(op, str) and op == "avg":
        return 1.0 / world
    if isinstance(op, float) and not isinstance(op, bool):
        if not math.isfinite(op):
            raise ValueError(f"op as a scale must be a finite float, got {op!r} (every element would be "
                             "NaN or infinite)")
        return op
    raise ValueError(f'op must be "sum", "avg" or a float (pre-multiplied sum), got {op!r}')


def _refuse_capture(c: Any, name: str, stream: object) -> None:
    """A collective enqueued into a CUDA graph capture raises this at once (call ``c``'s
    refusal: published to the peers, the group stays usable) instead of recording a graph
    that hangs or reads early when replayed."""
    if _capturing(stream):
        c.refuse(RuntimeError(
            f"tide_triton.{name} cannot be captured in a CUDA graph (torch.cuda.graph / "
            "torch.cuda.CUDAGraph.capture_begin): (1) its flags carry per-call values -- the call number "
            "(call identity), the reduce-scatter chunk sequence, the all-gather epoch -- which a graph would "
            "bake in, so a second replay finds its waits already satisfied and reads slots before the peers "
            "wrote them; (2) its pacing waits on events from the host (group.parts.Pacer), which a capture "
            "cannot do; (3) a first call of a signature, heap growth or a new transport exchange with the "
            "peers on the host.  Capture a prepared collective instead (tide_triton.prepare_reduce_scatter / "
            "prepare_all_gather, then .run() inside the capture: fixed tensors, token flags), or call this one "
            "outside the captured region"))


def _check_stream(g: Group, stream: object, device: torch.device) -> None:
    """``stream``'s type; in the single-process mode also that no other rank of the group
    enqueues on the same CUDA stream (:meth:`Group.check_own_stream`)."""
    if stream is not None and not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"stream must be None or a torch.cuda.Stream, got {type(stream).__name__}")
    g.check_own_stream(stream, device)


def _full_and_shards(name: str, full: object, shards: object, world: int):
    """Checks shared by both collectives: full tensors (one dtype, one device, contiguous)
    and as many shards; the layout the full shapes define."""
    full_l = check_tensor_list(name, full)
    shards_l = check_tensor_list("shards", shards, len(full_l))
    if not full_l:
        raise ValueError(f"{name} must hold at least one tensor, got none")
    dtype, device = check_uniform(name, full_l, dtypes=FLOAT_DTYPES)
    return full_l, shards_l, dtype, device, _layout_of(full_l, world)


def _layout_of(tensors: list[torch.Tensor], world: int) -> ShardLayout:
    """The layout of these tensors' shapes, looked up by a key of plain ints (each tensor's
    dim count, then every size flattened): no object per tensor stays alive during the call.
    A shape object per parameter held at once started a garbage-collector pass every ~700
    parameters -- 4 passes per all-gather of the 256-expert layer, and now and then a full
    pass of ~70 ms over every object of the process inside one call
    (docs/constraints.md#garbage-collector-passes)."""
    return _layout(tuple(map(torch.Tensor.dim, tensors)),
                   tuple(chain.from_iterable(map(torch.Tensor.size, tensors))), world)


def split_parts(tensors: Sequence[torch.Tensor], ds: DimShards) -> list[torch.Tensor]:
    """``tensors`` (full parameters or shards, contiguous, one per parameter of ``ds``) as the
    dim-0 parts of :attr:`DimShards.layout`: views of each slice along the flattened dims before
    the sharded one, no copies."""
    out: list[torch.Tensor] = []
    for t, k, o in zip(tensors, ds.dims, ds.outer):
        if k == 0:
            out.append(t)
        elif o == 0:
            out.append(t.view(-1)[:0].view(0, *t.shape[k + 1:]))
        else:
            out.extend(t.view(o, *t.shape[k:]).unbind(0))
    return out


def _by_dims(g: Group, name: str, full: object, shards: object, shard_dims: object,
             gather: bool, in_region: bool = False) -> tuple[Any, Any, DimShards | None]:
    """``shard_dims`` given: ``(full parts, shard parts, DimShards)`` after this rank's checks of
    the tensors as the caller passed them (errors name the caller's indices); otherwise the
    arguments as they are and None."""
    world, rank = g.world_size, g.rank
    if shard_dims is None:
        return full, shards, None
    full_l = check_tensor_list(name, full)
    shards_l = check_tensor_list("shards", shards, len(full_l))
    if not full_l:
        return full_l, shards_l, None  # the common checks say it
    ds = DimShards([tuple(t.shape) for t in full_l], shard_dims, world)
    if ds.trivial:
        return full_l, shards_l, ds
    _, device = check_uniform(name, full_l, dtypes=FLOAT_DTYPES)
    check_uniform("shards", shards_l, dtypes=FLOAT_DTYPES, device=device)
    real, pad = ds.shard_shapes(rank), ds.shard_shapes(rank, padded=True)
    for i, (x, k) in enumerate(zip(shards_l, ds.dims)):
        got, s, c = tuple(x.shape), ds.shapes[i], ds.rows_per_rank[i]
        if got in (real[i], pad[i]):
            continue
        # a parameter passed padded hides its true size: any count up to c is an unpadded shard
        if (gather and s[k] == world * c and len(got) == len(s) and got[:k] == s[:k] and got[k + 1:] == s[k + 1:]
                and 0 <= got[k] <= c):
            continue
        alt = "" if real[i] == pad[i] else f" or padded {pad[i]}"
        raise ValueError(f"shards[{i}] must have shape {real[i]}{alt}, got {got} ({ds.shard_rule(i, rank)})")
    # storage, overlaps: on the caller's tensors (the parts' checks would name parts), before the
    # split (a view of a freed storage raises torch's own RuntimeError)
    _check_split_bound(g, name, full_l, shards_l, gather, in_region)
    return split_parts(full_l, ds), split_parts(shards_l, ds), ds


_REGION_APART = ("with params_region each rank copies its own entries into the parameters slice by slice, and "
                  "a slice written over shard bytes not yet read would be read back instead of the shard")
"""Why a ``shard_dims`` all-gather into a params region may not take shards inside the parameters."""


def _check_split_bound(g: Group, name: str, full: list[torch.Tensor], shards: list[torch.Tensor],
                       gather: bool, in_region: bool = False) -> None:
    """:func:`check_bound` of the caller's tensors of a ``shard_dims`` call, as the eager path
    checks the parts' on a new set of addresses: once per set (by addresses and sizes).  The
    parts lie inside these tensors, so their own later checks pass."""
    key = (name, tuple(map(_PTR, full)), tuple(map(_NUMEL, full)), tuple(map(_PTR, shards)),
           tuple(map(_NUMEL, shards)), full[0].element_size(), shards[0].element_size(), in_region)
    seen = state.of(g).checked_splits
    if key in seen:
        return
    if gather:
        check_bound("shards", shards, name, full, apart=_REGION_APART if in_region else None)
    else:
        check_bound(name, full, "shards", shards, apart=RS_APART)
    if len(seen) >= 64:
        seen.pop(next(iter(seen)))
    seen[key] = True


@lru_cache(maxsize=256)
def _layout(dims: tuple[int, ...], sizes: tuple[int, ...], world: int) -> ShardLayout:
    """The layout of shapes given as their dim counts and their sizes flattened, built once
    per (shapes, W): a training step's few parameter groups repeat every step, and building
    one checks every shape (~1.7 ms of host time for the 393 parameters of a Qwen3-30B-A3B
    layer, measured on the CPU)."""
    shapes, o = [], 0
    for d in dims:
        shapes.append(sizes[o:o + d])
        o += d
    return ShardLayout(shapes, world)


# --------------------------------------------------------------------------- reduce-scatter
def reduce_scatter(
    grads: Sequence[torch.Tensor],
    shards: Sequence[torch.Tensor],
    *,
    group: object = None,
    op: str | float = "avg",
    accumulate: bool = False,
    stream: object = None,
    async_op: bool = False,
    staging: object = None,
    shard_dims: object = None,
) -> Work:
    """``shards[i][:rows_r] = f(sum over ranks of grads[i][r*c : r*c + rows_r])``.

    ``grads[i]``: full gradient (contiguous; bf16, fp16 or fp32), same shapes on every rank.
    ``shards[i]``: this rank's shard, padded ``(c, *rest)`` or unpadded ``(rows_r, *rest)``;
    fp32 (bf16 and fp16 allowed).  ``op``: ``"sum"``, ``"avg"`` or a float ``s`` (the sum
    times ``s``).  With ``accumulate`` the previous shard value is added; otherwise padding
    rows become zero.  Sums are fp32 in a fixed order -- rank order 0..W-1 on one node; across
    nodes, local ranks first, then nodes as the rounds combine them (see
    :mod:`tide_triton.executors.across_nodes`) -- so repeated runs are bit-identical.

    ``staging``: a :class:`~tide_triton.group.regions.HeapRegion` of this group (Slot-Reuse) --
    the peers' contributions land in it instead of the group's receive ring, in chunks of
    ``staging.nbytes / (stages * (W-1))`` bytes.  Before its first write into rank ``d``'s
    copy this rank waits until ``d`` has called ``staging.vacate()`` once per use so far
    (``PeerTimeoutError`` naming ``d`` after the group's timeout); every rank must vacate
    its own copy, before or during this call, or its peers wait for it.

    ``shard_dims``: the dim each parameter is sharded on (None: 0; an int for all; one per
    parameter; FSDP2's ``Shard(dim)``): rank ``r``'s shard is ``grads[i]``'s entries
    ``[r*c, r*c + n_r)`` of that dim, ``c = ceil(size / W)``, read in place where they lie in
    the gradient (:class:`~tide_triton.plan.layout.DimShards`).
    """
    g = resolve(group)
    with g.call("reduce_scatter") as c:
        _refuse_capture(c, "reduce_scatter", stream)
        return _reduce_scatter(g, grads, shards, op, accumulate, stream, async_op, staging, shard_dims)


def _rs_arguments(g: Group, name: str, grads, shards, op, accumulate, shard_dims=None):
    """The reduce-scatter's own checks (this rank): ``(grads, shards, grads dtype, shards
    dtype, device, layout, scale, signature)``; TypeError / ValueError naming the argument."""
    W, me = g.world_size, g.rank
    grads, shards, ds = _by_dims(g, "grads", grads, shards, shard_dims, gather=False)
    grads_l, shards_l, gdt, device, layout = _full_and_shards("grads", grads, shards, W)
    check_shapes("shards", shards_l, layout.shard_shapes(me), layout.shard_shapes(me, padded=True),
                 why=lambda i: layout.shard_rule(i, me))
    sdt, _ = check_uniform("shards", shards_l, dtypes=FLOAT_DTYPES, device=device)
    scale = _scale(op, W)
    sig = (name, ("grads shapes", layout.shapes), ("grads dtype", dtype_name(gdt)),
           ("shards dtype", dtype_name(sdt)), ("op", repr(op)), ("accumulate", bool(accumulate)),
           ("device", device.type))
    if ds is not None and not ds.trivial:  # agreed as the caller passed them (they define the parts)
        sig = (name, ("grads shapes", ds.shapes), ("shard dims", ds.dims), *sig[2:])
    if g.call_label is not None:  # the FSDP2 drop-in: which parameter group (Group.labelled)
        sig += (("FSDP2 group", g.call_label),)
    return grads_l, shards_l, gdt, sdt, device, layout, scale, sig


def _reduce_scatter(g: Group, grads, shards, op, accumulate, stream, async_op, staging, shard_dims=None) -> Work:
    err: BaseException | None = None
    sig: object = None
    try:
        grads_l, shards_l, gdt, sdt, device, layout, scale, sig = _rs_arguments(
            g, "reduce_scatter", grads, shards, op, accumulate, shard_dims)
        _check_stream(g, stream, device)
        if staging is not None:
            _check_staging(g, staging, device)
            if g.nodes > 1:  # too small: ValueError
                ReduceScatterPlan(layout, g.topology, ring_bytes=staging.nbytes, grad_bytes=gdt.itemsize,
                                  wire_bytes=4, stages=g.options.stages)
            else:
                ring_plan(layout, staging.nbytes, gdt.itemsize, g.options.stages)
            sig += (("staging", (staging.key, staging.index, staging.offset, staging.nbytes)),)
    except (TypeError, ValueError) as e:
        err = e
    g.agree(sig, err)
    if g.nodes > 1:  # several nodes: the cross-node schedules (tide_triton/executors/across_nodes.py)
        return across_nodes.reduce_scatter(g, grads_l, shards_l, layout, gdt, sdt, device, scale,
                                               bool(accumulate), stream, async_op, staging)
    return node_local.reduce_scatter(g, grads_l, shards_l, layout, gdt, sdt, device, scale, bool(accumulate),
                                           stream, async_op, staging)


# --------------------------------------------------------------------------- all-gather
def all_gather(
    shards: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    group: object = None,
    stream: object = None,
    async_op: bool = False,
    params_region: object = None,
    shard_dims: object = None,
) -> Work:
    """``params[i][r*c : r*c + rows_r] = shard of rank r`` for every rank ``r``.

    ``shards[i]``: this rank's shard, padded ``(c, *rest)`` or unpadded ``(rows_r, *rest)``.
    ``params[i]``: the full parameter ``(d0, *rest)`` or padded ``(W*c, *rest)``; its dtype
    may differ from the shards' (each rank casts its own shard once, fp32 -> bf16 rounding to
    nearest even, and every rank pulls the cast bytes on copy engines).

    ``params_region``: a :class:`~tide_triton.group.regions.HeapRegion` of this group (one node)
    holding every ``params[i]``, at the same byte offsets on every rank (the FSDP2
    drop-in's Slot-Reuse slots).  Each rank then writes its own rows in place and the peers
    copy them straight from its copy of the region: no all-gather block in the heap and one
    copy pass less.  Until every peer has read them, this rank's rows must stay as they are:
    the next all-gather waits for that before it writes them, and the region's
    :meth:`~tide_triton.group.regions.HeapRegion.vacate` (before peers stage a reduce-scatter in
    it) waits for it too.

    ``shard_dims``: as for :func:`reduce_scatter` -- rank ``r``'s shard lands in entries
    ``[r*c, r*c + n_r)`` of that dim of ``params[i]``, in place (runs at the parameter's pitch).
    """
    g = resolve(group)
    with g.call("all_gather") as c:
        _refuse_capture(c, "all_gather", stream)
        return _all_gather(g, shards, params, stream, async_op, params_region, shard_dims)


def _ag_arguments(g: Group, name: str, shards, params, shard_dims=None, region: object = None):
    """The all-gather's own checks (this rank): ``(params, shards, params dtype, shards dtype,
    device, layout, signature)``.  The params' shapes (their dim 0 too) are agreed: a rank
    whose parameter has another dim 0 would place the others' rows by another layout (and pull
    rows they do not hold as zeros).  Full and padded (W * ceil(dim0 / W) rows) params may not
    be mixed."""
    params, shards, ds = _by_dims(g, "params", params, shards, shard_dims, gather=True, in_region=region is not None)
    params_l, shards_l, pdt, device, layout = _full_and_shards("params", params, shards, g.world_size)
    check_gather_shards(shards_l, layout, g.rank)
    sdt, _ = check_uniform("shards", shards_l, dtypes=FLOAT_DTYPES, device=device)
    sig = (name, ("params shapes", layout.shapes), ("params dtype", dtype_name(pdt)),
           ("shards dtype", dtype_name(sdt)), ("device", device.type))
    if ds is not None and not ds.trivial:  # agreed as the caller passed them (they define the parts)
        sig = (name, ("params shapes", ds.shapes), ("shard dims", ds.dims), *sig[2:])
    if g.call_label is not None:
        sig += (("FSDP2 group", g.call_label),)
    return params_l, shards_l, pdt, sdt, device, layout, sig


def _all_gather(g: Group, shards, params, stream, async_op, region, shard_dims=None) -> Work:
    err: BaseException | None = None
    sig: object = None
    source = None
    try:
        params_l, shards_l, pdt, sdt, device, layout, sig = _ag_arguments(g, "all_gather", shards, params,
                                                                          shard_dims, region)
        _check_stream(g, stream, device)
        # the call's addresses, read once (cache keys, the region's offsets)
        pptrs, sptrs, snumels = tuple(map(_PTR, params_l)), tuple(map(_PTR, shards_l)), tuple(map(_NUMEL, shards_l))
        if region is not None:
            _check_region(g, region, device, "params_region", "params")
            if g.nodes > 1:
                raise ValueError(f"params_region needs a group of one node, this one spans {g.nodes} nodes: "
                                 "across nodes the all-gather stages in its heap block (pass params_region=None)")
            # the same offsets on every rank: a peer reads my rows where its own are
            source = (region.offset, region.param_offsets(layout, pdt, sdt, pptrs, sptrs, snumels))
            sig += (("params_region", (region.key, region.index, region.offset, source[1])),)
    except (TypeError, ValueError) as e:
        err = e
    g.agree(sig, err)
    if g.nodes > 1:  # several nodes: the cross-node schedules (tide_triton/executors/across_nodes.py)
        return across_nodes.all_gather(g, shards_l, params_l, layout, pdt, sdt, device, stream, async_op)
    return node_local.all_gather(g, shards_l, params_l, layout, pdt, sdt, device, stream, async_op, region,
                                       source)


# --------------------------------------------------------------------------- prepared collectives
def _check_preparable(g: Group) -> None:
    if g.nodes > 1:
        raise ValueError(f"prepared collectives need a group of one node, this one spans {g.nodes} nodes "
                         "(call reduce_scatter / all_gather instead)")


def prepare_reduce_scatter(
    grads: Sequence[torch.Tensor],
    shards: Sequence[torch.Tensor],
    *,
    group: object = None,
    op: str | float = "avg",
    accumulate: bool = False,
    shard_dims: object = None,
) -> prepared.PreparedReduceScatter:
    """:func:`reduce_scatter` of these very tensors, checked, agreed and prepared once
    (collective); ``.run(stream=None, async_op=False)`` performs it as often as wanted, with
    host work independent of the parameter count (no checks, no agreement with the peers,
    no cache lookups per run).  The grads and shards must stay as they are -- address, shape,
    contiguity, dtype (each run checks them unless ``run(check_addresses=False)``); their values
    may change.
    Every rank must run the same prepared collectives in the same order (a rank running
    another one waits for it until the group's timeout, which names it).  One node; no
    staging.  Its ring is a heap region of ``ring_bytes`` shared by the group's prepared
    reduce-scatters (:mod:`tide_triton.executors.prepared`).  ``shard_dims``: as for :func:`reduce_scatter`."""
    return prepared_reduce_scatter_call(resolve(group), grads, shards, op, accumulate, hold=True,
                                        shard_dims=shard_dims)


def prepared_reduce_scatter_call(g: Group, grads, shards, op, accumulate, *, hold: bool, shard_dims=None):
    """:func:`prepare_reduce_scatter` on group ``g``; ``hold=False`` (the FSDP2 drop-in): the
    prepared collective keeps no tensor alive and is run on the tensors of the moment."""
    with g.call("prepare_reduce_scatter") as c:
        err: BaseException | None = None
        sig: object = None
        try:
            _check_preparable(g)
            grads_l, shards_l, gdt, sdt, device, layout, scale, sig = _rs_arguments(
                g, "prepare_reduce_scatter", grads, shards, op, accumulate, shard_dims)
            # the first set of addresses is bound from these
            check_bound("grads", grads_l, "shards", shards_l, apart=RS_APART)
            g.check_own_stream(None, device)  # the runs' stream is checked again at each run
        except (TypeError, ValueError) as e:
            err = e
        g.agree(sig, err)
        token = c.seq
    # runs check the tensors as the caller passed them, not the shard_dims parts (views of their own)
    checked = None if shard_dims is None else (list(grads), list(shards))
    return prepared.prepared_reduce_scatter(g, token, grads_l, shards_l, layout, gdt, sdt, device, scale,
                                            bool(accumulate), hold, checked)


def prepare_all_gather(
    shards: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    group: object = None,
    shard_dims: object = None,
) -> prepared.PreparedAllGather:
    """:func:`all_gather` of these very tensors, prepared once (collective) and performed by
    ``.run()``, like :func:`prepare_reduce_scatter`.  Its block is a heap region shared by the
    group's prepared all-gathers of the same block size.  ``shard_dims``: as for :func:`all_gather`."""
    return prepared_all_gather_call(resolve(group), shards, params, hold=True, shard_dims=shard_dims)


def prepared_all_gather_call(g: Group, shards, params, *, hold: bool, shard_dims=None):
    """:func:`prepare_all_gather` on group ``g`` (``hold`` as for
    :func:`prepared_reduce_scatter_call`)."""
    with g.call("prepare_all_gather") as c:
        err: BaseException | None = None
        sig: object = None
        try:
            _check_preparable(g)
            params_l, shards_l, pdt, sdt, device, layout, sig = _ag_arguments(g, "prepare_all_gather", shards,
                                                                              params, shard_dims)
            check_bound("shards", shards_l, "params", params_l)  # the first set of addresses is bound from these
            g.check_own_stream(None, device)  # the runs' stream is checked again at each run
        except (TypeError, ValueError) as e:
            err = e
        g.agree(sig, err)
        token = c.seq
    checked = None if shard_dims is None else (list(shards), list(params))  # as for the reduce-scatter
    return prepared.prepared_all_gather(g, token, shards_l, params_l, layout, sdt, pdt, device, hold, checked)


def synchronize(group: object = None, *, device: object = None, stream: object = None,
                timeout_s: float | None = None) -> None:
    """Block the host until the group's queued collective work on ``device`` (default: the
    GPU of the group's CUDA calls, else the current CUDA device) and ``stream`` (default: the
    current stream) is done.  GPU-side
    waits on peers cannot time out by themselves: this is where a dead or stuck peer
    surfaces, as :class:`~tide_triton.errors.PeerTimeoutError` naming it, after
    ``timeout_s`` (default: the group's).  A no-op for the host transport."""
    g = resolve(group)
    dev = torch.device(device) if device is not None else (
        g.cuda_device() or (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                            else torch.device("cpu")))
    if dev.type != "cuda":
        return
    t = g.transport(dev)
    limit = g.options.timeout_s if timeout_s is None else timeout_s
    with stall_watch.section(g.rank, f"synchronize (after call #{g._seq})", limit):
        _synchronize(g, t, dev, stream, limit)


def _synchronize(g: Group, t: Any, dev: torch.device, stream: object, limit: float) -> None:
    since = g._synced + 1
    poll = partial(g.raise_if_abandoned, since)  # a peer that gave up ends the wait at once
    try:
        if g.nodes > 1:  # the cross-node executor's stream first: it names a stuck NCCL peer
            across_nodes.synchronize_side(g, dev, limit)
        t.synchronize(timeout_s=limit, poll=poll)
        t.synchronize(timeout_s=limit, stream=stream if stream is not None else torch.cuda.current_stream(dev),
                      poll=poll)
    except (PeerArgumentError, PeerAbortedError) as e:  # from the poll: this GPU work cannot finish
        g._break(f"GPU work of call #{since}..#{g._seq} cannot finish: {e}")
        raise
    except TimeoutError as e:
        # Queued work that cannot finish: the group is broken (its flags and staging hold a
        # half-done call); name the peer's own error where it published one.
        better = g.explain_timeout(e, g._synced + 1)
        g._break(f"GPU work of call #{g._synced + 1}..#{g._seq} did not finish: {better or e}")
        if better is not None:
            raise better from e
        raise
    g._synced = g._seq
