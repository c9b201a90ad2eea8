"""Raw Triton kernels behind placement, packing and accumulation.

One kernel does all three: a table of *tiles* (pieces of runs of contiguous elements) is
walked by a bounded grid of short-lived programs; each tile reads the same run from ``K``
source tensors (addresses from a pointer table), sums them in fp32 in a fixed order,
optionally scales, optionally adds the destination's old value, casts once and stores.
Placement and packing are the ``K = 1`` case; with equal dtypes and no arithmetic they
move the bits untouched (``RAW``).
"""
from __future__ import annotations

import triton
import triton.language as tl

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
def _to_f32(x, SOFT: tl.constexpr):
    # bf16 -> fp32 is exact: the bf16 bits are the fp32 high half.  The interpreter
    # flushes bf16 denormals to zero on its own cast, so it takes the integer path.
    if SOFT and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _cast_out(acc, OUT_DTYPE: tl.constexpr, SOFT: tl.constexpr):
    if SOFT and OUT_DTYPE == tl.bfloat16:
        return _rne_to_bf16(acc)
    else:
        return acc.to(OUT_DTYPE)


@triton.jit
def _src_ptr(src_tbl_ptr, src_stride_k, src_idx, src_off, k,
             SRC_DTYPE: tl.constexpr, SRC_ALIGN: tl.constexpr):
    addr = tl.load(src_tbl_ptr + k * src_stride_k + src_idx) + src_off * (SRC_DTYPE.primitive_bitwidth // 8)
    # The hint goes on the pointer: Triton's alignment analysis does not carry an integer's
    # divisibility through int_to_ptr (no hint, no 16-byte vector loads).
    return tl.multiple_of(addr.to(tl.pointer_type(SRC_DTYPE)), SRC_ALIGN)


@triton.jit
def _load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        return tl.load(ptr + offs, eviction_policy="evict_first")


@triton.jit
def _block(dst, src_tbl_ptr, src_stride_k, src_idx, src_off, offs, mask, scale,
           K: tl.constexpr, SRC_DTYPE: tl.constexpr, DST_DTYPE: tl.constexpr,
           HAS_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, RAW: tl.constexpr,
           SRC_ALIGN: tl.constexpr, SOFT: tl.constexpr, MASKED: tl.constexpr):
    # One BLOCK of one tile: dst[offs] = [dst +] scale * sum_k src_k[offs].
    if RAW:
        x = _load(_src_ptr(src_tbl_ptr, src_stride_k, src_idx, src_off, 0, SRC_DTYPE, SRC_ALIGN),
                  offs, mask, MASKED)
        out = x
    else:
        # Fixed order k = 0, 1, ..., K-1: results are bit-reproducible.  Starting from
        # source 0 (not from 0.0) keeps -0.0 a -0.0.
        acc = _to_f32(_load(_src_ptr(src_tbl_ptr, src_stride_k, src_idx, src_off, 0, SRC_DTYPE, SRC_ALIGN),
                            offs, mask, MASKED), SOFT)
        for k in tl.static_range(1, K):
            acc += _to_f32(_load(_src_ptr(src_tbl_ptr, src_stride_k, src_idx, src_off, k, SRC_DTYPE, SRC_ALIGN),
                                 offs, mask, MASKED), SOFT)
        if HAS_SCALE:
            acc = acc * scale
        if ACCUMULATE:
            acc += _to_f32(_load(dst, offs, mask, MASKED), SOFT)
        out = _cast_out(acc, DST_DTYPE, SOFT)
    if MASKED:
        tl.store(dst + offs, out, mask=mask)
    else:
        tl.store(dst + offs, out)


@triton.jit
def segmented_reduce_kernel(
    # tables: tiles (int64 [n_tiles, 5]), destination addresses, source addresses [K, n_src]
    tile_ptr, dst_tbl_ptr, src_tbl_ptr,
    # sizes: tiles, rounds per program (cdiv(n_tiles, grid)), sources per contribution
    n_tiles, n_iters, src_stride_k,
    # arithmetic
    scale,
    # compile-time switches
    K: tl.constexpr,
    SRC_DTYPE: tl.constexpr,
    DST_DTYPE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    RAW: tl.constexpr,         # K == 1, same dtypes, no arithmetic: move bits untouched
    SRC_ALIGN: tl.constexpr,   # bytes every source address is known to be a multiple of
    DST_ALIGN: tl.constexpr,   # bytes every destination address is known to be a multiple of
    SOFT: tl.constexpr,        # interpreter: bf16 conversions by integer arithmetic
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    arange = tl.arange(0, BLOCK)
    dst_bytes: tl.constexpr = DST_DTYPE.primitive_bitwidth // 8
    # Program p takes tiles p, p + nprog, ...; the last of its n_iters rounds may run past
    # the table: such a round does a 0-element tile.
    for i in range(0, n_iters):
        t = pid + i * nprog
        valid = t < n_tiles
        row = tile_ptr + tl.minimum(t, n_tiles - 1) * 5
        dst_idx = tl.load(row)
        dst_off = tl.load(row + 1)
        src_idx = tl.load(row + 2)
        src_off = tl.load(row + 3)
        numel = tl.where(valid, tl.load(row + 4), 0)
        dst_addr = tl.load(dst_tbl_ptr + dst_idx) + dst_off * dst_bytes
        dst = tl.multiple_of(dst_addr.to(tl.pointer_type(DST_DTYPE)), DST_ALIGN)
        # Whole blocks without masks (vector loads and stores), then one masked tail.
        n_full = numel // BLOCK
        for b in range(0, n_full):
            _block(dst, src_tbl_ptr, src_stride_k, src_idx, src_off, b * BLOCK + arange, None, scale,
                   K, SRC_DTYPE, DST_DTYPE, HAS_SCALE, ACCUMULATE, RAW, SRC_ALIGN, SOFT, False)
        offs = n_full * BLOCK + arange
        _block(dst, src_tbl_ptr, src_stride_k, src_idx, src_off, offs, offs < numel, scale,
               K, SRC_DTYPE, DST_DTYPE, HAS_SCALE, ACCUMULATE, RAW, SRC_ALIGN, SOFT, True)
