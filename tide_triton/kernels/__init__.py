"""Short-lived Triton kernels: all SM-side work of tide_triton (placement, packing,
bf16 -> fp32 accumulation, multicast reduce / store).  Each launcher has a plain-torch
``*_ref``.  The segment engine the launchers run on (:mod:`tide_triton.kernels.segments`:
``Span``, ``SegmentProgram``, ``Binding``) is imported from there by the executors, which
bind it to heap and tensor addresses.

On CPU tensors a launch runs as plain torch by default, equal to the kernel bit for bit
(``TIDE_TRITON_CPU_KERNELS=torch``; :mod:`tide_triton.kernels.segments`), or through Triton's
interpreter (``interpret``).  Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so
:func:`tide_triton.runtime.envs.use_interpreter_if_no_gpu` decides it here, before the kernel modules
are imported: set without a CUDA device where the interpreter is asked for (a value the user
set is kept).
"""
from ..runtime import envs as _envs

_envs.use_interpreter_if_no_gpu()

from .accumulate import accumulate_shards, accumulate_shards_ref, bind_accumulate_shards  # noqa: E402
from .multimem import multimem_reduce, multimem_reduce_ref, multimem_store, multimem_store_ref  # noqa: E402
from .pack import bind_pack_shards, pack_shards, pack_shards_ref  # noqa: E402
from .placement import bind_place_shards, place_shards, place_shards_ref  # noqa: E402

__all__ = [
    "place_shards", "bind_place_shards", "place_shards_ref",
    "accumulate_shards", "bind_accumulate_shards", "accumulate_shards_ref",
    "pack_shards", "bind_pack_shards", "pack_shards_ref",
    "multimem_reduce", "multimem_reduce_ref", "multimem_store", "multimem_store_ref",
]
