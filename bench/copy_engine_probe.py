"""Which same-GPU copies the driver runs on copy engines and which on SMs: each way of copying
is issued while a kernel holds every thread slot of every SM, and the copy either takes its
idle time (a copy engine moved it) or is held back for milliseconds (it waited for SM slots:
on the H200 such copies ended when the fill was half done, a one-CTA kernel only at its end).

Why: the profiler cannot tell.  CUPTI reports an eager same-GPU ``cuMemcpyAsync`` as one
"Memcpy DtoD" whether or not the driver ran it as kernels, and a graph's memcpy nodes as
kernels or as memcpys depending on when it attached (pytorch/pytorch#191284); session 14 saw
``memcpyDtoD3DAligned`` / ``memcpy32_post`` kernels in recorded reduce-scatters and "Memcpy
DtoD" in recorded all-gathers.  This decides whether a recorded (graph) run keeps its copies
off the SMs, on one GPU (and, with a second GPU, for copies into its memory).

    python bench/copy_engine_probe.py [--fill-ms 20] [--iters 3]

Per way: ``alone`` (CUDA-event mean of ``iters`` copies on an idle GPU), ``done after`` (ms from
the fill kernel's start until the copy began / ended, issued 2 ms after it; the fill alone
takes ``fill`` ms) and the verdict: ``copy engine`` where the copy took at most 3x its idle
time (+0.2 ms), ``SMs (waited)`` where it ended at least 1 ms later than that, else
``unclear``.  With a second GPU, copies into its memory (peer access on) too.  Every way's
result is checked against the source.  GPU only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

from strided_copy import timed  # noqa: E402  (bench/: a CUDA-event time per call after one untimed call)
from tide_triton.measure import env_info  # noqa: E402
from tide_triton.transport.driver import check  # noqa: E402
from tide_triton.transport.signals import memcpy2d_struct, memcpy3d_struct  # noqa: E402

THREADS_PER_SM = 2048  # Hopper's resident-thread limit per SM
ISSUE_DELAY_S = 0.002


@triton.jit
def _fill(out, n_iter, BLOCK: tl.constexpr):
    """A dependent multiply-add chain per thread, ``n_iter`` long: holds its SM slots."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = i.to(tl.float32)
    for _ in range(n_iter):
        x = x * 0.999 + 0.5
    tl.store(out + i, x)


class Fill:
    """``_fill`` with enough CTAs of 1,024 threads to take every thread slot of every SM."""

    BLOCK = 1024

    def __init__(self, fill_ms: float, ctas_per_sm: int) -> None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.grid = props.multi_processor_count * ctas_per_sm
        self.out = torch.empty(self.grid * self.BLOCK, device="cuda")
        kernel = self._launch(1000)
        torch.cuda.synchronize()
        regs = kernel.n_regs
        self.full = ctas_per_sm * self.BLOCK >= THREADS_PER_SM and regs * self.BLOCK * ctas_per_sm <= 65536
        self.note = (f"{self.grid} CTAs x {self.BLOCK} threads on {props.multi_processor_count} SMs, {regs} "
                     f"registers/thread -> {'every thread slot taken' if self.full else 'NOT every slot taken'}")
        self.n_iter, self.ms = 100_000, 0.0
        for _ in range(8):  # scale until it takes fill_ms (+-20%)
            self.ms = self._time(self.n_iter)
            if abs(self.ms - fill_ms) <= 0.2 * fill_ms:
                break
            self.n_iter = max(1000, int(self.n_iter * fill_ms / max(self.ms, 1e-3)))
        if self.ms < 4 * ISSUE_DELAY_S * 1e3:
            raise RuntimeError(f"the fill takes {self.ms:.2f} ms: too short to tell copies apart")
        half = self._time(self.n_iter, self.grid // 2)
        self.note += f"; half the CTAs take {half:.2f} ms"

    def _launch(self, n_iter: int, grid: int = 0):
        return _fill[(grid or self.grid,)](self.out, n_iter, BLOCK=self.BLOCK, num_warps=self.BLOCK // 32)

    def _time(self, n_iter: int, grid: int = 0) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self._launch(n_iter, grid)
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def launch(self) -> None:
        self._launch(self.n_iter)


def batch_copier(d: int, x: int, n: int, prefer_overlap: bool):
    a = cu.CUmemcpyAttributes()
    a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    a.flags = (cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_overlap
               else cu.CUmemcpyFlags.CU_MEMCPY_FLAG_DEFAULT)
    attrs = [a]
    return lambda s: check(cu.cuMemcpyBatchAsync([cu.CUdeviceptr(d)], [cu.CUdeviceptr(x)], [n], 1, attrs, [0], 1, s),
                           "cuMemcpyBatchAsync")


def ways(dst: torch.Tensor, src: torch.Tensor) -> dict:
    """name -> (copy(stream handle), capturable, check()) over ``dst`` / ``src`` (bytes, one GPU)."""
    d, x, n = dst.data_ptr(), src.data_ptr(), src.numel()
    small = 1 << 20
    rows, width = 1024, n // 2048  # rows of half a pitch: an all-gather's strided run at W=2
    m2 = memcpy2d_struct(cu, d, x, width, rows, 2 * width, 2 * width)
    sub = 65536 if width % 65536 == 0 else width
    m3 = memcpy3d_struct(cu, d, x, width, rows, 2 * width, 2 * width, sub)
    whole = lambda: torch.equal(dst, src)  # noqa: E731
    strided = lambda: torch.equal(dst.view(rows, 2 * width)[:, :width], src.view(rows, 2 * width)[:, :width])  # noqa: E731
    one = torch.zeros(1, device="cuda")
    return {
        "nothing (an event only): the earliest end": (lambda s: None, False, lambda: True),
        "a one-CTA kernel (control: needs an SM)": (lambda s: one.add_(1), False, lambda: True),
        f"cuMemcpyAsync {n >> 20} MiB": (lambda s: check(cu.cuMemcpyAsync(d, x, n, s), "cuMemcpyAsync"), True, whole),
        "cuMemcpyAsync 1 MiB": (lambda s: check(cu.cuMemcpyAsync(d, x, small, s), "cuMemcpyAsync"), True,
                                lambda: torch.equal(dst[:small], src[:small])),
        f"batch, prefer overlap, {n >> 20} MiB": (batch_copier(d, x, n, True), False, whole),
        "batch, prefer overlap, 1 MiB": (batch_copier(d, x, small, True), False,
                                         lambda: torch.equal(dst[:small], src[:small])),
        f"batch, default flags, {n >> 20} MiB": (batch_copier(d, x, n, False), False, whole),
        f"cuMemcpy2DAsync {rows} rows x {width >> 10} KiB": (lambda s: check(cu.cuMemcpy2DAsync(m2, s), "2d"), True,
                                                             strided),
        f"cuMemcpy3DAsync {rows} rows, {sub >> 10} KiB sub-rows": (lambda s: check(cu.cuMemcpy3DAsync(m3, s), "3d"),
                                                                  True, strided),
    }


def peer_ways(src: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    """With a second GPU: copies from ``src`` (cuda:0) into cuda:1 memory through the unified
    address space with peer access on -- how a rank writes a peer GPU's mapped memory -- as
    (that destination, ways like :func:`ways`)."""
    if torch.cuda.device_count() < 2:
        return None, {}
    dst = torch.zeros(src.numel(), dtype=src.dtype, device="cuda:1")
    dev1 = check(cu.cuDeviceGet(1), "cuDeviceGet")
    ctx1 = check(cu.cuDevicePrimaryCtxRetain(dev1), "cuDevicePrimaryCtxRetain")
    err = cu.cuCtxEnablePeerAccess(ctx1, 0)[0]
    if err not in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        raise RuntimeError(f"cuCtxEnablePeerAccess(cuda:0 -> cuda:1): {err}")
    d, x, n = dst.data_ptr(), src.data_ptr(), src.numel()
    same = lambda: torch.equal(dst.cpu(), src.cpu())  # noqa: E731
    return dst, {
        f"cuMemcpyAsync {n >> 20} MiB to cuda:1": (lambda s: check(cu.cuMemcpyAsync(d, x, n, s), "peer"), True, same),
        f"batch, prefer overlap, {n >> 20} MiB to cuda:1": (batch_copier(d, x, n, True), False, same),
    }


def under_fill(fill: Fill, copy, side: torch.cuda.Stream) -> tuple[float, float, float]:
    """(ms from the fill's start (on the current stream) until ``copy``, issued on ``side`` 2 ms
    later, began; until it ended; ms the host spent in the call)."""
    torch.cuda.synchronize()
    start, before, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    fill.launch()
    time.sleep(ISSUE_DELAY_S)
    with torch.cuda.stream(side):
        before.record()
        t0 = time.perf_counter()
        copy()
        host = (time.perf_counter() - t0) * 1e3
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(before), start.elapsed_time(end), host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fill-ms", type=float, default=20.0)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--ctas-per-sm", type=int, default=THREADS_PER_SM // Fill.BLOCK,
                    help="fill CTAs of 1,024 threads per SM (2 take every thread slot)")
    args = ap.parse_args()
    torch.cuda.init()
    with torch.cuda.stream(torch.cuda.Stream()):  # not the legacy default stream: the batch call refuses it
        run(args)


def run(args) -> None:
    info = env_info(torch.device("cuda", torch.cuda.current_device()))
    version = check(cu.cuDriverGetVersion(), "cuDriverGetVersion")
    fill = Fill(args.fill_ms, args.ctas_per_sm)
    print(f"{info['gpu']} | torch {info['torch']} | CUDA {info['cuda']}, driver API {version} | git {info['git_sha']} "
          f"| {info['date']}\nfill: {fill.note}; {fill.ms:.2f} ms alone; copies issued "
          f"{ISSUE_DELAY_S * 1e3:.0f} ms after it on another stream")
    print("| way | launched | alone ms | began (ms from fill start) | ended | host ms in the call | verdict |")
    print("|---|---|---|---|---|---|---|")
    src = torch.randint(0, 255, (args.mib << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    side = torch.cuda.Stream()
    dst1, across = peer_ways(src)
    rows = [(name, w, dst) for name, w in ways(dst, src).items()] + [(name, w, dst1) for name, w in across.items()]
    for name, (copy, capturable, same), out in rows:
        forms = [("eager", copy)]
        if capturable:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                copy(torch.cuda.current_stream().cuda_stream)
            forms.append(("graph replay", g.replay))
        for form, fn in forms:
            call = (lambda f: lambda: f(torch.cuda.current_stream().cuda_stream))(fn) if form == "eager" else fn
            out.zero_()
            alone = statistics.mean(timed(call, args.iters))
            ok = same()
            out.zero_()
            began, done, host = under_fill(fill, call, side)
            ok = ok and same()
            late = done - began - alone  # beyond its idle time
            if late <= 2 * alone + 0.2:
                verdict = "copy engine"
            elif late >= 1.0:
                verdict = "SMs (waited)"
            else:
                verdict = "unclear"
            if not ok:
                verdict += "; WRONG RESULT"
            print(f"| {name} | {form} | {alone:.3f} | {began:.2f} | {done:.2f} | {host:.2f} | {verdict} |", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
