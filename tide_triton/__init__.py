"""tide_triton: zero-copy, layout-aware collectives for FSDP2.

Layout (:class:`ShardLayout`) -> kernels (:mod:`tide_triton.kernels`: placement,
accumulation, packing, all Triton).
"""
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
from .layout import ShardLayout

__version__ = "0.1.0"

__all__ = [
    "ShardLayout",
    "place_shards", "bind_place_shards", "place_shards_ref",
    "accumulate_shards", "bind_accumulate_shards", "accumulate_shards_ref",
    "pack_shards", "bind_pack_shards", "pack_shards_ref",
    "__version__",
]
