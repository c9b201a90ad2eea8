"""tide_triton: zero-copy, layout-aware collectives for FSDP2.

Layout (:class:`ShardLayout`) -> schedule (:mod:`tide_triton.plan.schedule`) -> transport
(:mod:`tide_triton.transport`) -> kernels (:mod:`tide_triton.kernels`: placement,
accumulation, packing, all Triton).  Collectives: :func:`init`, :func:`reduce_scatter`,
:func:`all_gather`.  FSDP2 drop-in: :func:`tide_triton.fsdp.enable`.
"""
from . import fsdp  # FSDP2 drop-in; imports no FSDP2 internals until enable()
from .collectives import Work, all_gather, prepare_all_gather, prepare_reduce_scatter, reduce_scatter, synchronize
from .errors import (
    ArgumentMismatchError,
    GroupBrokenError,
    PeerAbortedError,
    PeerArgumentError,
    PeerLostError,
    PeerTimeoutError,
    TideTritonError,
)
from .group.core import Group, GroupOptions, init
from .plan.across_nodes import AllGatherPlan, ReduceScatterPlan
from .kernels import (
    accumulate_shards,
    accumulate_shards_ref,
    bind_accumulate_shards,
    bind_pack_shards,
    bind_place_shards,
    pack_shards,
    pack_shards_ref,
    place_shards,
    place_shards_ref,
)
from .plan.layout import DimShards, ShardLayout
from .group.single_process import local_groups
from .plan.topology import Topology

__version__ = "0.1.0"

__all__ = [
    "ShardLayout", "DimShards", "Topology", "AllGatherPlan", "ReduceScatterPlan",
    "init", "local_groups", "Group", "GroupOptions", "reduce_scatter", "all_gather", "synchronize", "Work",
    "prepare_reduce_scatter", "prepare_all_gather",
    "place_shards", "bind_place_shards", "place_shards_ref",
    "accumulate_shards", "bind_accumulate_shards", "accumulate_shards_ref",
    "pack_shards", "bind_pack_shards", "pack_shards_ref",
    "TideTritonError", "PeerTimeoutError", "PeerLostError", "PeerArgumentError", "ArgumentMismatchError",
    "PeerAbortedError", "GroupBrokenError",
    "fsdp",
    "__version__",
]
