"""tide_triton.fsdp's own records about FSDP2's objects, kept here rather than written onto them.

* :data:`GROUPS`: ``FSDPParamGroup -> GroupState`` for every enabled parameter group;
* :data:`PARAMS`: ``FSDPParam -> GroupState`` (FSDP2 hands the wrappers lists of FSDPParams:
  the group's own list for the all-gather, a filtered copy for the reduce-scatter);
* :data:`active`: the :class:`~._torch_adapter.TorchApi` whose functions the installed
  wrappers stand in for (None while nothing is installed).

All keyed weakly: a model that is dropped takes its records with it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ._torch_adapter import TorchApi

@dataclass(eq=False)
class GroupState:
    """What tide_triton keeps for one enabled FSDPParamGroup."""

    group: Any
    """The tide_triton Group running its collectives."""
    fqn: str
    """The module's name (``"<root>"``, ``"layers.0"``, ``"layers.0[1]"``), for messages."""
    sentinel: torch.Tensor
    """The empty ``all_gather_output`` of every AllGatherResult tide_triton returns: the data is
    already in the parameters (the copy-out wrapper recognises it by identity)."""
    pg_ref: weakref.ref[Any]
    """The FSDPParamGroup, weakly: the registries' values must not keep their keys alive."""
    reduce_fallback_logged: bool = False
    bf16_reduce_logged: bool = False
    """``reduce_dtype=bf16`` served (fp32 sums rounded once to bf16): said once per group."""
    all_gathers: int = 0
    """Calls served by tide_triton.all_gather."""
    reduce_scatters: int = 0
    """Calls served by tide_triton.reduce_scatter."""
    direct_accumulations: int = 0
    """Of those, summed straight into an existing ``.grad``."""
    slot: Any = None
    """Slot-Reuse: the heap slot (a :class:`~tide_triton.fsdp.slots.Slot`, which imports this
    module: not imported here) holding the unsharded parameters."""
    staged_reduce_scatters: int = 0
    """Reduce-scatters staged in the vacated slot (Slot-Reuse)."""
    ag_views: Any = None
    """``(key, (shards, outputs, dtypes, numels))``: the all-gather's per-parameter views,
    kept while the group's tensors stay the same (:func:`~.wrappers._ag_views`)."""
    slot_all_gathers: int = 0
    """All-gathers whose peers read this rank's rows straight from its slot (Slot-Reuse on
    one node: no all-gather block)."""
    use_prepared: bool = False
    """``enable(prepared=True)``: the collectives run as prepared ones where they can."""
    prepared: dict = field(default_factory=dict)
    """The group's prepared collectives by kind (``("ag", dtypes)``, ``("rs", op, accumulate,
    dtypes)``): made at a kind's first call -- the same call on every rank, since every rank
    makes the same calls -- and run on the tensors of each later call."""
    prepared_runs: int = 0
    """Calls served by a prepared collective's run (the first of each kind included)."""

    @property
    def pg(self) -> Any:
        return self.pg_ref()


GROUPS: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
PARAMS: weakref.WeakKeyDictionary[Any, GroupState] = weakref.WeakKeyDictionary()
active: TorchApi | None = None


def set_active(api: TorchApi | None) -> None:
    global active
    active = api


def state_of(fsdp_params: Any) -> GroupState | None:
    """The state shared by all of ``fsdp_params`` (a group's parameters carry the same one),
    or None (not enabled, or parameters of different groups)."""
    if not fsdp_params:
        return None
    st = PARAMS.get(fsdp_params[0])
    if st is None:
        return None
    for p in fsdp_params:
        if PARAMS.get(p) is not st:
            return None
    return st
