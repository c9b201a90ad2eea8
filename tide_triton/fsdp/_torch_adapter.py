"""What tide_triton.fsdp knows about the installed torch's FSDP2 internals, in one place.

Which torch versions are served (:func:`supported_torch_version`), the private functions and
records of ``torch.distributed.fsdp._fully_shard`` the drop-in wraps or reads, checked once
against their signatures and, for ``foreach_reduce``'s result layout, against their source
(:func:`load_api`), and the small readers of FSDP2's objects that the other modules use
(parameter groups of a module, sharded state, why a group must stay on the stock path).
Nothing here patches anything.
"""
from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_FIRST, _LAST = (2, 9), (2, 15)

# Names FSDP2 returns from foreach_reduce, in the order the installed version's final
# ``return`` statement lists them (read from its source, see reduce_return_order).
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


@dataclass(frozen=True)
class TorchApi:
    """The installed torch's FSDP2 internals, checked once."""

    fpg: Any
    """``torch.distributed.fsdp._fully_shard._fsdp_param_group``: calls the three functions by name."""
    fc: Any
    """``..._fsdp_collectives``: ``AllGatherResult``, the default comms and callbacks."""
    orig_ag: Callable
    """FSDP2's own ``foreach_all_gather``."""
    orig_copy_out: Callable
    """FSDP2's own ``foreach_all_gather_copy_out``."""
    orig_reduce: Callable
    """FSDP2's own ``foreach_reduce``."""
    sig_ag: inspect.Signature
    sig_copy_out: inspect.Signature
    sig_reduce: inspect.Signature
    reduce_order: tuple[str | None, ...]
    """Names of ``foreach_reduce``'s results in the order this version returns them."""
    path: str
    """:func:`supported_torch_version` of the installed torch."""
    partial_order: tuple[str | None, ...] | None = None
    """The same for its HSDP early return that hands back ``partial_reduce_output`` (gradient
    accumulation without the all-reduce); None: this version has none (that case stays stock)."""


_API: TorchApi | None = None
_API_ERROR: str | None = None  # why the installed torch cannot be served (cached: checked once)


def _tuple_returns(fn: Callable) -> list[ast.Return]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    if not isinstance(func, ast.FunctionDef):
        raise ValueError("foreach_reduce source is not a function definition")
    rets = [n for n in ast.walk(func) if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)]
    if not rets:
        raise ValueError("foreach_reduce has no `return (...)`")
    return rets


def reduce_return_order(fn: Callable) -> tuple[str | None, ...]:
    """The names in ``fn``'s last ``return (a, b, ...)`` (None for a literal None):
    the result layout FSDPParamGroup.post_backward unpacks in this torch version."""
    ret = max(_tuple_returns(fn), key=lambda n: n.lineno)  # the last one: the normal (non-HSDP-partial) exit
    return _names(ret.value)


def partial_return_order(fn: Callable) -> tuple[str | None, ...] | None:
    """The names of ``fn``'s ``return (...)`` that hands back ``partial_reduce_output`` (HSDP
    accumulation without the all-reduce), or None when it has none."""
    for ret in _tuple_returns(fn):
        try:
            names = _names(ret.value)
        except ValueError:  # not a result tuple tide_triton knows: not this one
            continue
        if "partial_reduce_output" in names:
            return names
    return None


def _names(ret: Any) -> tuple[str | None, ...]:
    out: list[str | None] = []
    for e in ret.elts:
        if isinstance(e, ast.Constant) and e.value is None:
            out.append(None)
        elif isinstance(e, ast.Name) and e.id in _REDUCE_RESULT_NAMES:
            out.append(e.id)
        elif ast.unparse(e) == "post_reduce_stream.record_event()":  # the HSDP early return's event
            out.append("post_reduce_event")
        else:
            raise ValueError(f"foreach_reduce returns {ast.unparse(e)!r}, which tide_triton does not know")
    return tuple(out)


def load_api() -> TorchApi:
    """The installed torch's FSDP2 internals, or RuntimeError saying why they cannot be
    served (the verdict is cached: the first call decides)."""
    global _API, _API_ERROR
    if _API is not None:
        return _API
    if _API_ERROR is not None:
        raise RuntimeError(_API_ERROR)
    try:
        path = supported_torch_version()
        if path is None:
            raise RuntimeError(f"torch {torch.__version__} is outside the versions tide_triton.fsdp knows (2.9-2.15)")
        # FSDP2 internals: import tide_triton loads none until enable(); a missing one is an unsupported torch
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
        order = reduce_return_order(orig_rd)
        if not hasattr(fc, "_get_gradient_divide_factors"):
            raise RuntimeError(f"torch {torch.__version__}: no _get_gradient_divide_factors")
        _API = TorchApi(fpg, fc, orig_ag, orig_co, orig_rd, *sigs, order, path, partial_return_order(orig_rd))
        return _API
    except (RuntimeError, ImportError, OSError, TypeError, ValueError, SyntaxError) as e:
        _API_ERROR = str(e)
        raise RuntimeError(_API_ERROR) from None


# --------------------------------------------------------------------------- FSDP2 readers
def fsdp_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every ``fully_shard``-ed module inside ``module`` (itself
    included, named ``"<root>"``), in ``named_modules`` order: the same on every rank."""
    from torch.distributed.fsdp import FSDPModule  # FSDP2: none of it loads until enable()

    return [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def param_groups(module: nn.Module) -> list:
    """The FSDPParamGroups of one ``fully_shard``-ed module (torch >= 2.12 may hold several)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12
    if groups is not None:
        return list(groups)
    g = getattr(state, "_fsdp_param_group", None)
    return [g] if g is not None else []


def all_sharded(fsdp_params: Any) -> bool:
    """Every parameter of ``fsdp_params`` holds only its shard (no unsharded storage in use)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState  # FSDP2 internals: none until enable()

    return all(fp.sharded_state == ShardedState.SHARDED for fp in fsdp_params)


def device_handle(device: torch.device) -> Any:
    """``torch.cuda`` (or the CPU's stand-in) as FSDP2 uses it for ``device``."""
    from torch.distributed.device_mesh import _get_device_handle  # torch private: a change fails enable(), not import

    return _get_device_handle(device.type)


SPLIT_PARTS_MAX = 4096
"""The most dim-0 parts a group's ``Shard(dim > 0)`` parameters may split into
(:class:`~tide_triton.plan.layout.DimShards`: ``prod(shape[:dim])`` each) for tide_triton to serve
it.  Every reduce-scatter makes a view per part and checks each, ~3 us a part on the host
before anything moves (Qwen3-30B-A3B's experts grouped ``[128, 768, 2048]`` on Shard(1), 384
parts: ~1 ms a call; its 384 expert matrices as 2-D weights on Shard(1), a part per row, 458752
parts: ~9 s a call; 2 busy x86 cores, torch 2.13, ``bench/shard_dims_host.py``).  Beyond it
stock FSDP2's few large copies cost less."""


def split_parts_why(fsdp_params: Any) -> str | None:
    """Why a group's ``Shard(dim > 0)`` parameters split into too many parts to serve (None: they
    do not)."""
    total, worst = 0, None
    for fp in fsdp_params:
        k, shape = fp.fsdp_placement.dim, tuple(fp._orig_size)
        k = k + len(shape) if k < 0 else k
        n = math.prod(shape[:k]) if k > 0 else 1
        total += n
        if k > 0 and (worst is None or n > worst[0]):
            worst = (n, k, shape)
    if total <= SPLIT_PARTS_MAX or worst is None:
        return None
    n, k, shape = worst
    return (f"Shard({k}) parameters that split into {total} slices (a parameter of shape {shape} into {n}: one per "
            f"entry of its dims before {k}); tide_triton serves up to SPLIT_PARTS_MAX = {SPLIT_PARTS_MAX} a group")


def why_stock(pg: Any, api: TorchApi) -> str | None:
    """Why this FSDPParamGroup must stay on the stock path (None: it can use tide_triton)."""
    # FSDP2 internals and DTensor (~500 modules): none loads until enable()
    from torch.distributed.fsdp._fully_shard import _fsdp_common as fcom
    from torch.distributed.fsdp._fully_shard._fsdp_api import CPUOffloadPolicy
    from torch.distributed.tensor import Shard

    mi = pg.mesh_info
    if not isinstance(mi, fcom.FSDPMeshInfo):  # DDPMeshInfo: FSDP2 all-reduces whole gradients
        return f"mesh {type(mi).__name__} shards nothing (replicate only: no all-gather, no reduce-scatter)"
    hsdp = isinstance(mi, getattr(fcom, "DDPMeshInfo", ()))  # HSDP: the replicas' all-reduce stays torch's
    if hsdp and not hasattr(pg, "_all_reduce_process_group"):
        return "HSDP without FSDP2's _all_reduce_process_group (unknown to tide_triton)"
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
        if type(fp.fsdp_placement) is not Shard:  # Shard(dim) of any dim is served; others are not
            return f"{fp.fsdp_placement} placement (tide_triton serves Shard(dim) placements)"
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return "all-gather extensions (fsdp_pre_all_gather)"
        dtypes.add(fp.sharded_param.dtype)
    if (why := split_parts_why(pg.fsdp_params)) is not None:
        return why
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
