"""Short-lived Triton kernels: all SM-side work of tide_triton (placement, packing,
bf16 -> fp32 accumulation).  Each launcher has a plain-torch ``*_ref``.

Without a CUDA device, compiled Triton cannot run at all; the kernels then run on CPU
tensors through Triton's interpreter.  Triton reads ``TRITON_INTERPRET`` when a kernel is
defined, so it is set here, before the kernel modules are imported, unless the user set it.
"""
import logging as _logging
import os as _os

import torch as _torch

if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"
    _logging.getLogger("tide_triton").info("no CUDA device: Triton kernels run through the interpreter")

from .accumulate import accumulate_shards, accumulate_shards_ref, bind_accumulate_shards  # noqa: E402
from .pack import bind_pack_shards, pack_shards, pack_shards_ref  # noqa: E402
from .placement import bind_place_shards, place_shards, place_shards_ref  # noqa: E402

__all__ = [
    "place_shards", "bind_place_shards", "place_shards_ref",
    "accumulate_shards", "bind_accumulate_shards", "accumulate_shards_ref",
    "pack_shards", "bind_pack_shards", "pack_shards_ref",
]
