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
  ``reduce_dtype=bf16`` with fp32 parameters: the fp32 sums are rounded once to bf16 (stock
  sums in bf16; docs/fsdp.md states the bound), said once per group (INFO).
  Ops: AVG (default), ``set_gradient_divide_factor`` (a pre-multiplied sum),
  ``set_force_sum_reduction_for_comms`` (a sum, then the post-divide), the all-reduce hook.

Served as training stacks build FSDP2 (docs/fsdp.md, "Supported configurations"): DTensor
parameters (torchtitan's ``full_dtensor`` on a 1-D mesh, TP and EP placements: FSDP2's
collectives move their local tensors over the dp shard group), HSDP (the shard group's
all-gather and reduce-scatter; FSDP2's all-reduce across replicas stays torch's), several
meshes in one block (experts on their own ``edp`` mesh) -- each shard group its own
tide_triton group.

Falls back to stock FSDP2 for a group, with one log line (logger ``"tide_triton"``) saying
why: more Shard(dim > 0) slices than SPLIT_PARTS_MAX (2-D weights on Shard(1): a slice per row),
a replicate-only (DDP) mesh, a post-forward reshard mesh, CPU offload,
mixed parameter dtypes, an fp16 reduction (FSDP2 pre/post-divides it), all-gather
extensions, custom comms, world size 1, an unknown torch version.

Slot-Reuse (``enable(..., slot_reuse=True)``): every group's unsharded storage lives in a heap
slot (:mod:`.slots`; :data:`SLOT_POOL` slots shared by the groups that reshard after forward).
After backward's reshard the post-backward reduce-scatter vacates the slot
(``HeapRegion.vacate`` on the reduce-scatter stream) and stages the peers' contributions in it
(``reduce_scatter(..., staging=slot)``) -- only when every group of the slot is resharded,
otherwise through the ring.  The next all-gather into a slot waits for the frees and the last
staged reduce-scatter (CUDA events), and raises if another group still holds it.  Once
backward is over, every slot whose groups are all resharded is released (its memory given back
on every rank) and the next all-gather into it maps it again (``release_slots``).

The parts, one module each: :mod:`._torch_adapter` (which torch, FSDP2's internals checked
once, readers of its objects), :mod:`.install` (enable / disable and the patching),
:mod:`.slots` (the Slot-Reuse allocator), :mod:`.wrappers` (the all-gather, copy-out and
reduce-scatter that stand in for FSDP2's), :mod:`._state` (tide_triton's records, keyed
weakly by FSDP2's objects).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from . import install as _install
from ._torch_adapter import supported_torch_version
from .install import disable, heap_bytes, is_enabled, stats

__all__ = ["SLOT_POOL", "disable", "enable", "heap_bytes", "is_enabled", "stats", "supported_torch_version"]

SLOT_POOL = 2
"""Heap slots shared by the parameter groups that reshard after forward (Slot-Reuse), set
before :func:`enable`.  Two hold the group computing and the one prefetched (one ahead, as
FSDP2 prefetches by default); the slot of the group whose reduce-scatter stages in it is the
next prefetch's, so on a GPU that all-gather waits for the reduce-scatter.  3 lets them
overlap at the cost of one more unsharded group; deeper prefetching needs more (an
all-gather into a slot another group still holds raises, naming both)."""


def enable(module: nn.Module, *, group: Any = None, slot_reuse: bool = False,
           release_slots: bool = True, prepared: bool = False) -> dict[str, str | None]:
    """Route every ``fully_shard``-ed module inside ``module`` (itself included) through
    tide_triton's all-gather and reduce-scatter.  Call it on every rank, after ``fully_shard``
    and between steps (not inside forward/backward).

    ``group``: the tide_triton group (or the process group to build it on) for the
    collectives; default: the open group of each FSDP2 shard process group, else a new one
    with ``agree="first"`` (FSDP2 repeats the same calls every step: only a signature's first
    call exchanges it; every call still carries its identity to the peers).  It must span the
    same ranks.
    ``slot_reuse``: Slot-Reuse -- every group's unsharded parameters live in a heap slot
    (:data:`SLOT_POOL` slots shared by the groups that reshard after forward, a private one for
    each group that does not, e.g. the root), and its reduce-scatter stages the peers'
    contributions in that slot once backward has vacated it, instead of in a receive ring.
    A tide_triton group created here then gets a 4 MiB ring (for reduce-scatters that
    cannot stage: no reshard after backward).  Call it before the first step.
    ``release_slots`` (Slot-Reuse): give the slots' memory back after each backward (once
    every group of a slot is resharded and the step's reduce-scatters are done) and map it
    again at the next all-gather, so the optimizer step runs without them; this blocks the
    host until the GPU is idle at the end of backward.  False keeps them mapped for the
    group's life.
    ``prepared``: from a module's first all-gather / reduce-scatter of a kind on, run it as a
    prepared collective (:func:`tide_triton.prepare_all_gather`): no argument checks and no
    agreement per call, this rank's address-dependent preparation cached by address -- host
    work per call that does not grow with the parameter count.  Groups of one node without
    Slot-Reuse (the others keep the eager calls).  Tested on the CPU and the H200; off by
    default because it measured no faster there (FSDP2's tensors move between steps, and each
    new set of addresses costs a full check and bind: docs/fsdp.md, "Prepared collectives in the drop-in").

    The ranks agree ``slot_reuse``, ``prepared``, ``release_slots``, :data:`SLOT_POOL` and how
    the tide_triton group comes about before anything is made: a difference raises
    ``ArgumentMismatchError`` on every rank naming the option and the ranks' values.  Every wait
    has the group's deadline (``timeout_s``).

    Returns ``{module name: None if on tide_triton, else the reason it stays stock}``; each
    stock module's reason is also logged once (logger ``"tide_triton"``).
    """
    return _install.enable(module, group=group, slot_reuse=slot_reuse, slot_pool=SLOT_POOL,
                           release_slots=release_slots, prepared=prepared)
