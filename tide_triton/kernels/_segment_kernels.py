"""Raw Triton kernels behind placement, packing and accumulation.

One kernel does all three: a table of *tiles* (pieces of runs of contiguous elements) is
walked by a bounded grid of short-lived programs; each tile reads the same run from ``K``
source tensors (addresses from a pointer table), sums them in fp32 in a fixed order,
optionally scales, optionally adds the destination's old value, casts once and stores.
Placement and packing are the ``K = 1`` case.
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["segmented_reduce_kernel", "TILE_FIELDS"]

# Tile table row: where to write, where to read, how many elements.
TILE_FIELDS = 5  # dst_idx, dst_off, src_idx, src_off, numel


@triton.jit
def _rne_to_bf16(x):
    # fp32 -> bf16, round to nearest even, by integer arithmetic. Used under the Triton
    # interpreter, whose own cast truncates; compiled code uses the hardware cvt.rn.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)  # keep NaN a NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_out(acc, OUT_DTYPE: tl.constexpr, SOFT_RNE: tl.constexpr):
    if SOFT_RNE and OUT_DTYPE == tl.bfloat16:
        return _rne_to_bf16(acc)
    else:
        return acc.to(OUT_DTYPE)


@triton.jit
def _load_src(src_tbl_ptr, src_stride_k, src_idx, src_off, offs, mask, k,
              SRC_DTYPE: tl.constexpr, SRC_ALIGN: tl.constexpr, MASKED: tl.constexpr):
    addr = tl.load(src_tbl_ptr + k * src_stride_k + src_idx) + src_off * (SRC_DTYPE.primitive_bitwidth // 8)
    src = tl.multiple_of(addr, SRC_ALIGN).to(tl.pointer_type(SRC_DTYPE))
    if MASKED:
        x = tl.load(src + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(src + offs, eviction_policy="evict_first")
    return x.to(tl.float32)


@triton.jit
def _load_sum(src_tbl_ptr, src_stride_k, src_idx, src_off, offs, mask,
              K: tl.constexpr, SRC_DTYPE: tl.constexpr, SRC_ALIGN: tl.constexpr, MASKED: tl.constexpr):
    # Fixed order k = 0, 1, ..., K-1: results are bit-reproducible.  Starting from source 0
    # (not from 0.0) keeps K = 1 a bit-exact copy (-0.0 stays -0.0).
    acc = _load_src(src_tbl_ptr, src_stride_k, src_idx, src_off, offs, mask, 0,
                    SRC_DTYPE, SRC_ALIGN, MASKED)
    for k in tl.static_range(1, K):
        acc += _load_src(src_tbl_ptr, src_stride_k, src_idx, src_off, offs, mask, k,
                         SRC_DTYPE, SRC_ALIGN, MASKED)
    return acc


@triton.jit
def segmented_reduce_kernel(
    # tables: tiles (int64 [n_tiles, 5]), destination addresses, source addresses [K, n_src]
    tile_ptr, dst_tbl_ptr, src_tbl_ptr,
    # sizes
    n_tiles, n_iters, src_stride_k,
    # arithmetic
    scale,
    # compile-time switches
    K: tl.constexpr,
    SRC_DTYPE: tl.constexpr,
    DST_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    SRC_ALIGN: tl.constexpr,   # bytes every source address is known to be a multiple of
    DST_ALIGN: tl.constexpr,   # bytes every destination address is known to be a multiple of
    SOFT_RNE: tl.constexpr,    # round fp32 -> bf16 by integer arithmetic (interpreter)
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    arange = tl.arange(0, BLOCK)
    dst_bytes: tl.constexpr = DST_DTYPE.primitive_bitwidth // 8
    # Program p takes tiles p, p + nprog, ...; n_iters = cdiv(n_tiles, nprog) rounds, the
    # last of which may run past the table: such a round does a 0-element tile.
    for i in range(0, n_iters):
        t = pid + i * nprog
        valid = t < n_tiles
        row = tile_ptr + tl.minimum(t, n_tiles - 1) * 5
        dst_idx = tl.load(row)
        dst_off = tl.load(row + 1)
        src_idx = tl.load(row + 2)
        src_off = tl.load(row + 3)
        numel = tl.where(valid, tl.load(row + 4), 0)
        dst_addr = tl.multiple_of(tl.load(dst_tbl_ptr + dst_idx) + dst_off * dst_bytes, DST_ALIGN)
        dst = dst_addr.to(tl.pointer_type(DST_DTYPE))
        # Whole blocks without masks (vector loads and stores), then one masked tail.
        n_full = numel // BLOCK
        for b in range(0, n_full):
            offs = b * BLOCK + arange
            acc = _load_sum(src_tbl_ptr, src_stride_k, src_idx, src_off, offs, None,
                            K, SRC_DTYPE, SRC_ALIGN, False)
            if HAS_SCALE:
                acc = acc * scale
            if ACCUMULATE:
                acc += tl.load(dst + offs).to(tl.float32)
            tl.store(dst + offs, _cast_out(acc, DST_DTYPE, SOFT_RNE))
        offs = n_full * BLOCK + arange
        mask = offs < numel
        acc = _load_sum(src_tbl_ptr, src_stride_k, src_idx, src_off, offs, mask,
                        K, SRC_DTYPE, SRC_ALIGN, True)
        if HAS_SCALE:
            acc = acc * scale
        if ACCUMULATE:
            acc += tl.load(dst + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + offs, _cast_out(acc, DST_DTYPE, SOFT_RNE), mask=mask)
