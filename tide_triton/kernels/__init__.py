"""Short-lived Triton kernels: all SM-side work of tide_triton (placement, packing,
bf16 -> fp32 accumulation).  Each launcher has a plain-torch ``*_ref``."""
from .accumulate import accumulate_shards, accumulate_shards_ref, bind_accumulate_shards
from .pack import bind_pack_shards, pack_shards, pack_shards_ref
from .placement import bind_place_shards, place_shards, place_shards_ref

__all__ = [
    "place_shards", "bind_place_shards", "place_shards_ref",
    "accumulate_shards", "bind_accumulate_shards", "accumulate_shards_ref",
    "pack_shards", "bind_pack_shards", "pack_shards_ref",
]
