"""Kernels on an NVSwitch multicast address: in-switch reduction loads and one-write stores.

* :data:`multimem_reduce_kernel` -- the reduce-scatter's reduction: every 16 bytes of the
  multicast range are read with ``multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2``
  (the switch reads every bound GPU's copy and sums 8 bf16 elements in fp32), then the
  kernel applies the scale / accumulation in fp32 and stores fp32.  The switch returns the
  sum rounded once to bf16 (the instruction's destination type is ``bf16x2``), so the path
  is exact only where every sum is representable in bf16 -- unlike the copy-engine path,
  whose fp32 sums keep 24 bits.
* :data:`multimem_store_kernel` -- the all-gather's write: each rank loads its shard
  (fp32, fp16 or bf16), casts to bf16 once (round to nearest even), and stores 16 bytes at a time
  with ``multimem.st.relaxed.sys.global.v4.bf16x2``: every bound GPU receives them.

Both need sm_90 and a multicast address (``MulticastObject.mc_ptr``); they cannot run
through Triton's interpreter (inline PTX).  :func:`multimem_reduce_ref` and
:func:`multimem_store_ref` are the same programs in plain torch over the bound buffers
themselves (one 1-D bf16 tensor per rank) -- what the CPU emulation runs, and the
reference the GPU check compares with.  Units: element offsets are bf16 elements of the
bound range; every offset is a multiple of 8 (16 bytes) and the range behind a partial
last group of 8 is padding the caller owns.

Not run on multicast hardware (docs/multicast.md).  The kernels are defined with plain
``@triton.jit`` whatever ``TRITON_INTERPRET`` says, so they can be compiled for sm_90
anywhere (tests/test_multicast_kernels.py).
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ..runtime import device_wide

GROUP = 8
"""bf16 elements per multimem access (16 bytes: ``.v4.bf16x2``)."""

LD_REDUCE_PTX = "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2"
ST_PTX = "multimem.st.relaxed.sys.global.v4.bf16x2"

_BLOCK = 512
"""Groups of 8 elements per program (8 KiB of bf16).  Not measured: no multicast hardware."""


def _jit(fn: Any) -> JITFunction:
    """``triton.jit`` that always makes a compilable :class:`JITFunction` (the interpreter's
    wrapper, chosen by ``TRITON_INTERPRET=1``, cannot be compiled for a GPU target)."""
    return JITFunction(fn)


def _multimem_reduce_kernel(
    # addresses: the multicast range (an int: no tensor views it), the fp32 output
    mc_addr, out_ptr,
    # sizes
    numel, scale,
    # compile-time switches
    HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # group index: elements 8g .. 8g+7
    live = g * 8 < numel
    addr = (mc_addr + g * 16).to(tl.uint64)
    r0, r1, r2, r3 = tl.inline_asm_elementwise(
        """
        {
            .reg .pred %p;
            setp.ne.s32 %p, $5, 0;
            @%p multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {$0, $1, $2, $3}, [$4];
        }
        """,
        "=r,=r,=r,=r,l,r",
        args=[addr, live.to(tl.int32)],
        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
        is_pure=False,
        pack=1,
    )
    words = (r0, r1, r2, r3)
    for k in tl.static_range(4):
        w = words[k]
        lo = (w << 16).to(tl.float32, bitcast=True)  # element 2k: the low half of the word
        hi = (w & 0xFFFF0000).to(tl.float32, bitcast=True)  # element 2k + 1
        for h in tl.static_range(2):
            v = lo if h == 0 else hi
            if HAS_SCALE:
                v = v * scale
            offs = g * 8 + 2 * k + h
            m = offs < numel
            if ACCUMULATE:
                v += tl.load(out_ptr + offs, mask=m, other=0.0)
            tl.store(out_ptr + offs, v, mask=m)


def _multimem_store_kernel(
    # addresses: the source shard (fp32, fp16 or bf16), the multicast range (an int)
    src_ptr, mc_addr,
    # sizes
    numel,
    # compile-time switches
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    g = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = g * 8 < numel
    addr = (mc_addr + g * 16).to(tl.uint64)
    # fp32 -> bf16 once (round to nearest even), two bf16 per 32-bit word, low half first
    e = g * 8
    x0 = tl.load(src_ptr + e + 0, mask=e + 0 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    x1 = tl.load(src_ptr + e + 1, mask=e + 1 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    x2 = tl.load(src_ptr + e + 2, mask=e + 2 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    x3 = tl.load(src_ptr + e + 3, mask=e + 3 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    x4 = tl.load(src_ptr + e + 4, mask=e + 4 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    x5 = tl.load(src_ptr + e + 5, mask=e + 5 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    x6 = tl.load(src_ptr + e + 6, mask=e + 6 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    x7 = tl.load(src_ptr + e + 7, mask=e + 7 < numel, other=0.0).to(tl.bfloat16).to(tl.uint16, bitcast=True)
    w0 = x0.to(tl.uint32) | (x1.to(tl.uint32) << 16)
    w1 = x2.to(tl.uint32) | (x3.to(tl.uint32) << 16)
    w2 = x4.to(tl.uint32) | (x5.to(tl.uint32) << 16)
    w3 = x6.to(tl.uint32) | (x7.to(tl.uint32) << 16)
    tl.inline_asm_elementwise(
        """
        {
            .reg .pred %p;
            setp.ne.s32 %p, $6, 0;
            @%p multimem.st.relaxed.sys.global.v4.bf16x2 [$1], {$2, $3, $4, $5};
            mov.u32 $0, 0;
        }
        """,
        "=r,l,r,r,r,r,r",
        args=[addr, w0, w1, w2, w3, live.to(tl.int32)],
        dtype=tl.uint32,
        is_pure=False,
        pack=1,
    )


multimem_reduce_kernel = _jit(_multimem_reduce_kernel)
multimem_store_kernel = _jit(_multimem_store_kernel)


def _grid(numel: int) -> tuple[int]:
    return (triton.cdiv(triton.cdiv(numel, GROUP), _BLOCK),)


_LOADED: set = set()
"""Kernel variants launched before in this process (see :func:`_settle_before_load`)."""
_LOADED_LOCK = threading.Lock()


def _settle_before_load(key: tuple, device_index: int | None) -> bool:
    """Before a variant's first launch, which loads its module -- a driver call that waits for
    every stream of the process (:mod:`tide_triton.runtime.device_wide`) -- the groups of this process
    settle, with their deadlines.  ``key``: what Triton specialises the variant on (the
    constexprs, each pointer's 16-byte alignment, each int's ``== 1`` / ``% 16 == 0`` /
    64-bit width).  Returns whether the variant is new (the caller adds it once launched)."""
    with _LOADED_LOCK:
        if (device_index, key) in _LOADED:
            return False
    device_wide.before(f"loading a kernel variant ({key[0]} {key[1:]})", device_index)
    return True


def _int_spec(v: int) -> tuple[bool, bool, bool]:
    return v == 1, v % 16 == 0, v >= 1 << 31


def _launched(key: tuple, device_index: int | None) -> None:
    with _LOADED_LOCK:
        _LOADED.add((device_index, key))


def _check_common(mc_addr: int, offset: int, numel: int) -> None:
    if offset % GROUP:
        raise ValueError(f"offset must be a multiple of {GROUP} elements (16 bytes), got {offset}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if mc_addr % 16:
        raise ValueError(f"mc_addr must be 16-byte aligned, got {mc_addr:#x}")


def multimem_reduce(mc_addr: int, offset: int, out: torch.Tensor, *, scale: float | None = None,
                    accumulate: bool = False) -> None:
    """``out[:] (+)= scale * sum over bound GPUs of range[offset : offset + out.numel()]``
    (bf16 elements, summed in fp32 by the switch, returned as bf16); enqueued on the current
    stream of ``out``'s device.  GPU with multicast only."""
    if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cuda":
        raise TypeError(f"out must be a contiguous float32 CUDA tensor, got {out.dtype} on {out.device}")
    n = out.numel()
    _check_common(mc_addr, offset, n)
    if n == 0:
        return
    key = ("multimem_reduce_kernel", scale is not None, bool(accumulate), out.data_ptr() % 16 == 0, _int_spec(n))
    new = _settle_before_load(key, out.device.index)
    # No fused multiply-add: ``scale * sum + old`` rounds twice, like the reference and the
    # copy-engine path's kernel (kernels/segments.py).
    multimem_reduce_kernel[_grid(n)](mc_addr + 2 * offset, out, n, 1.0 if scale is None else float(scale),
                                     HAS_SCALE=scale is not None, ACCUMULATE=bool(accumulate), BLOCK=_BLOCK,
                                     enable_fp_fusion=False)
    if new:
        _launched(key, out.device.index)


def multimem_store(src: torch.Tensor, mc_addr: int, offset: int) -> None:
    """Every bound GPU's ``range[offset : offset + src.numel()]`` = ``src`` as bf16 (one
    store per 16 bytes; the rest of a partial last group of 8 is written as zeros); enqueued
    on the current stream of ``src``'s device.  ``src``: fp32, fp16 or bf16 (the all-gather's
    shard dtypes).  GPU with multicast only."""
    if (src.dtype not in (torch.float32, torch.float16, torch.bfloat16) or not src.is_contiguous()
            or src.device.type != "cuda"):
        raise TypeError(f"src must be a contiguous float32, float16 or bfloat16 CUDA tensor, got {src.dtype} "
                        f"on {src.device}")
    n = src.numel()
    _check_common(mc_addr, offset, n)
    if n == 0:
        return
    key = ("multimem_store_kernel", str(src.dtype), src.data_ptr() % 16 == 0, _int_spec(n))
    new = _settle_before_load(key, src.device.index)
    multimem_store_kernel[_grid(n)](src, mc_addr + 2 * offset, n, BLOCK=_BLOCK)
    if new:
        _launched(key, src.device.index)


def multimem_reduce_ref(bound: Sequence[torch.Tensor], offset: int, out: torch.Tensor, *,
                        scale: float | None = None, accumulate: bool = False) -> None:
    """:func:`multimem_reduce` over the bound buffers (1-D bf16, one per GPU): the sum in
    fp32 (in buffer order), rounded once to bf16 as the switch returns it, then scaled and
    accumulated in fp32."""
    if offset % GROUP:
        raise ValueError(f"offset must be a multiple of {GROUP} elements (16 bytes), got {offset}")
    n = out.numel()
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for b in bound:
        if b.dtype != torch.bfloat16:
            raise TypeError(f"bound buffers must be bfloat16, got {b.dtype}")
        acc += b[offset:offset + n].float()
    v = acc.to(torch.bfloat16).float()
    if scale is not None:
        v = v * scale
    flat = out.view(-1)
    if accumulate:
        flat += v
    else:
        flat.copy_(v)


def multimem_store_ref(src: torch.Tensor, bound: Sequence[torch.Tensor], offset: int) -> None:
    """:func:`multimem_store` over the bound buffers: every buffer's ``[offset, offset +
    numel)`` gets ``src`` cast once to bf16, and the rest of a partial last group zeros."""
    if offset % GROUP:
        raise ValueError(f"offset must be a multiple of {GROUP} elements (16 bytes), got {offset}")
    n = src.numel()
    v = src.reshape(-1).to(torch.bfloat16)
    tail = (-n) % GROUP
    for b in bound:
        b[offset:offset + n].copy_(v)
        b[offset + n:offset + n + tail].zero_()
