"""Can a stream capture record a strided copy (``cuMemcpy2DAsync`` / ``cuMemcpy3DAsync``) whose
rows lie in different allocations?  (One GPU, seconds.)

A recorded prepared reduce-scatter failed with ``cuMemcpy3DAsync ... CUDA_ERROR_INVALID_VALUE``
where the same copies enqueued eagerly succeed (session 18): its strided run took one row from
each of eight gradients, eight ``torch.full`` tensors at a uniform pitch -- consecutive blocks of
the caching allocator, possibly of different ``cudaMalloc`` segments.  This probe makes both
cases on purpose and tries each form eagerly and under capture:

* rows inside one allocation (one tensor, rows at a pitch);
* rows of separate ``cuMemAlloc`` allocations that happen to be adjacent (uniform pitch);
* the eight gradients of the failing test (their allocation bases printed).

    python bench/strided_capture_probe.py
"""
from __future__ import annotations

import torch

from tide_triton.measure import env_info
from tide_triton.transport.driver import cu
from tide_triton.transport.signals import memcpy2d_struct, memcpy3d_struct, sub_row_bytes


def _base(p: int) -> tuple[int, int]:
    err, base, size = cu.cuMemGetAddressRange(cu.CUdeviceptr(p))
    return (int(base), int(size)) if int(err) == 0 else (-1, -1)


def _eager_or_captured(enqueue, capture: bool) -> str:
    """``enqueue(stream_handle) -> CUresult`` made on a side stream, or recorded into a CUDA
    graph there (``thread_local``) and replayed."""
    s = torch.cuda.Stream()
    if not capture:
        err = enqueue(s.cuda_stream)
        torch.cuda.synchronize()
        return "ok" if int(err) == 0 else f"{err}"
    g = torch.cuda.CUDAGraph()
    err = None
    try:
        with torch.cuda.graph(g, stream=s, capture_error_mode="thread_local"):
            err = enqueue(torch.cuda.current_stream().cuda_stream)
    except Exception as e:  # noqa: BLE001 - a probe reports
        return f"capture raised {type(e).__name__}: {str(e)[:80]} (call: {err})"
    if int(err) != 0:
        return f"{err}"
    g.replay()
    torch.cuda.synchronize()
    return "ok (replayed)"


def _try(form: str, dst: int, src: int, nbytes: int, rows: int, dpitch: int, spitch: int, capture: bool) -> str:
    if form == "1d":
        return _eager_or_captured(lambda h: cu.cuMemcpyAsync(dst, src, nbytes, h)[0], capture)
    sub = sub_row_bytes(nbytes, dpitch, spitch)
    if form == "3d" and sub is None:
        return "no sub-row size divides the pitches"
    m = (memcpy3d_struct(cu, dst, src, nbytes, rows, dpitch, spitch, sub) if form == "3d"
         else memcpy2d_struct(cu, dst, src, nbytes, rows, dpitch, spitch))
    fn = cu.cuMemcpy3DAsync if form == "3d" else cu.cuMemcpy2DAsync
    return _eager_or_captured(lambda h: fn(m, h)[0], capture)


def _case(name: str, dst: torch.Tensor, srcs: list[int], nbytes: int) -> None:
    rows = len(srcs)
    pitch = srcs[1] - srcs[0]
    uniform = all(srcs[i + 1] - srcs[i] == pitch for i in range(rows - 1))
    bases = {_base(p)[0] for p in srcs}
    print(f"\n{name}: {rows} rows of {nbytes} B, source pitch {pitch} (uniform: {uniform}), "
          f"{len(bases)} allocation(s) under the rows")
    if not uniform:
        print("  skipped: pitch not uniform")
        return
    if uniform and pitch == nbytes:  # adjacent rows: one 1-D copy spans the allocations too
        for capture in (False, True):
            res = _try("1d", dst.data_ptr(), srcs[0], nbytes * rows, 1, nbytes * rows, nbytes * rows, capture)
            print(f"  1d {'captured' if capture else 'eager   '} (one copy over all rows): {res}")
    for form in ("2d", "3d"):
        for capture in (False, True):
            dst.zero_()
            res = _try(form, dst.data_ptr(), srcs[0], nbytes, rows, nbytes, pitch, capture)
            print(f"  {form} {'captured' if capture else 'eager   '}: {res}")


def main() -> None:
    print(env_info(torch.device("cuda")))
    torch.cuda.init()
    nbytes = 2 << 20
    dst = torch.empty(8 * nbytes, dtype=torch.uint8, device="cuda")
    one = torch.ones(16 * nbytes, dtype=torch.uint8, device="cuda")
    _case("one allocation", dst, [one.data_ptr() + i * 2 * nbytes for i in range(8)], nbytes)
    # separate cuMemAlloc allocations, adjacent where the driver places them so
    allocs = []
    for _ in range(8):
        err, p = cu.cuMemAlloc(2 * nbytes)
        allocs.append(int(p))
    _case("separate cuMemAlloc allocations", dst, allocs, nbytes)
    adj = []
    for _ in range(8):
        err, p = cu.cuMemAlloc(nbytes)
        adj.append(int(p))
    _case("separate cuMemAlloc allocations of one row each", dst, adj, nbytes)
    allocs += adj
    # the failing test's gradients: 8 x (2048, 1024) bf16, rows = each one's second half
    grads = [torch.full((2048, 1024), 1.0, dtype=torch.bfloat16, device="cuda") for _ in range(8)]
    ptrs = [x.data_ptr() + nbytes for x in grads]
    print("\ngradients' allocations (base, size):", [(hex(b), s) for b, s in map(_base, ptrs)])
    _case("the test's gradients (second halves)", dst, ptrs, nbytes)
    for p in allocs:
        cu.cuMemFree(p)
    _vmm_case(dst, nbytes)


def _vmm_case(dst: torch.Tensor, nbytes: int) -> None:
    """Two cuMemCreate handles mapped side by side in one reserved range (how the heap
    grows, and torch's expandable segments): does a copy across the seam work?"""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = torch.cuda.current_device()
    acc = cu.CUmemAccessDesc()
    acc.location = prop.location
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    size = 4 * nbytes  # per handle
    err, va = cu.cuMemAddressReserve(2 * size, 0, 0, 0)
    handles = []
    for i in range(2):
        err, h = cu.cuMemCreate(size, prop, 0)
        handles.append(h)
        cu.cuMemMap(int(va) + i * size, size, 0, h, 0)
    cu.cuMemSetAccess(int(va), 2 * size, [acc], 1)
    base = int(va)
    print("\nVMM: two handles mapped side by side; cuMemGetAddressRange of each half:",
          [(hex(b - base), sz) for b, sz in (_base(base), _base(base + size))])
    rows = [base + size - 2 * nbytes + i * nbytes for i in range(4)]  # rows 0-1 in handle 0, 2-3 in 1
    _case("VMM rows across the seam", dst, rows, nbytes)
    cu.cuMemUnmap(base, 2 * size)
    for h in handles:
        cu.cuMemRelease(h)
    cu.cuMemAddressFree(base, 2 * size)


if __name__ == "__main__":
    main()
