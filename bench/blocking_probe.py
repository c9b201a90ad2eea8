"""Which driver calls wait while another stream of the same context waits for a flag (one GPU,
one process): the question behind session 16's hangs.

In the single-process mode the H200 (driver 580) stopped rank threads inside
``cuGraphInstantiate``, ``cuGraphLaunch``, torch's ``capture_end`` and even ``cuEventRecord``
while peers' streams waited for flags those threads had still to write (docs/benchmarks.md,
"Session 16").  If such a call waits for the context's other work, then with one process per
rank -- how users run -- it would wait for a *peer process* (a slow peer: latency; a dead one:
a thread stuck in the driver, where no deadline fires).  This probe tells, per call, with no
peer at all: a stream of the context waits on a word of pinned host memory
(``cuStreamWaitValue64``), the call is made on another thread, and after ``--limit-s`` the word
is written by a plain CPU store (no driver call), releasing the stream.

    python bench/blocking_probe.py [--limit-s 3]

One row per call: ``returned`` (and how long it took) while the stream waited, or ``waited for
the flag`` (returned only after the release; how long after).  The copies' results are checked
once the stream ran.  GPU only.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import threading
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

from tide_triton.measure import env_info  # noqa: E402
from tide_triton.transport.driver import check  # noqa: E402
from tide_triton.transport.signals import memcpy3d_struct  # noqa: E402

MIB = 1 << 20


class Probe:
    """The context, a blocker stream waiting on a pinned host word, and a work stream."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        torch.zeros(1, device="cuda")  # torch's primary context, current on this thread
        self.ctx = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
        nb = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.blocker = check(cu.cuStreamCreate(nb), "cuStreamCreate(blocker)")
        self.work = check(cu.cuStreamCreate(nb), "cuStreamCreate(work)")
        self.capture = check(cu.cuStreamCreate(nb), "cuStreamCreate(capture)")
        # the word the blocker waits on: mapped pinned host memory, so a CPU store releases it
        self.host_word = int(check(cu.cuMemHostAlloc(128, cu.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc"))
        self.word = ctypes.c_int64.from_address(self.host_word)
        self.word.value = 0
        self.dev_word = check(cu.cuMemHostGetDevicePointer(self.host_word, 0), "cuMemHostGetDevicePointer")
        self.value = 0
        self.src = torch.arange(8 * MIB // 4, dtype=torch.int32, device="cuda")
        self.dst = torch.zeros_like(self.src)
        self._triton_x: dict[int, torch.Tensor] = {}

    def blocked(self, call: Callable[[], Any], during_load: bool = False) -> tuple[str, float]:
        """``call()`` on another thread while the blocker stream waits for the word: how it
        ended (``returned`` / ``waited for the flag`` / ``raised ...``) and its duration (ms)."""
        self.value += 1
        check(cu.cuStreamWaitValue64(self.blocker, self.dev_word, self.value,
                                     int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)),
              "cuStreamWaitValue64(blocker)")
        time.sleep(0.05)  # the wait is at the stream's head
        if int(cu.cuStreamQuery(self.blocker)[0]) == 0:
            raise RuntimeError("the blocker stream did not wait on the pinned word: this probe cannot tell")
        out: dict[str, Any] = {}
        loader = None
        if during_load:  # a thread inside cuModuleLoadData, which waits for the blocker
            def load() -> None:
                check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
                check(cu.cuModuleUnload(self.load_module()), "cuModuleUnload")
            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            time.sleep(0.3)
            if not loader.is_alive():
                raise RuntimeError("the module load did not wait for the blocker: this row cannot tell")

        def run() -> None:
            check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            t0 = time.perf_counter()
            try:
                call()
                out["how"] = "returned"
            except Exception as exc:  # noqa: BLE001 - reported in the row
                out["how"] = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            out["ms"] = (time.perf_counter() - t0) * 1e3

        th = threading.Thread(target=run, daemon=True)
        t0 = time.perf_counter()
        th.start()
        th.join(self.limit_s)
        waited = th.is_alive()
        released_at = (time.perf_counter() - t0) * 1e3
        self.word.value = self.value  # a CPU store: releases the blocker without a driver call
        th.join(60)
        if loader is not None:
            loader.join(60)
        if th.is_alive() or (loader is not None and loader.is_alive()):
            return "still inside the call 60 s after the release", float("nan")
        check(cu.cuStreamSynchronize(self.blocker), "cuStreamSynchronize(blocker)")
        if waited:
            return f"waited for the flag (returned {out['ms'] - released_at:.1f} ms after the release)", out["ms"]
        return out["how"], out["ms"]

    # ---- the calls ------------------------------------------------------------------------
    def captured(self, enqueue: Callable[[Any], None]) -> Any:
        """A graph of what ``enqueue(stream)`` enqueues (relaxed mode, the capture stream)."""
        check(cu.cuStreamBeginCapture(self.capture, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
              "cuStreamBeginCapture")
        enqueue(self.capture)
        return check(cu.cuStreamEndCapture(self.capture), "cuStreamEndCapture")

    def copy_1d(self, s: Any) -> None:
        check(cu.cuMemcpyAsync(self.dst.data_ptr(), self.src.data_ptr(), self.src.nbytes, s), "cuMemcpyAsync")

    def copy_3d(self, s: Any) -> None:
        rows, row = 64, self.src.nbytes // 64
        m = memcpy3d_struct(cu, self.dst.data_ptr(), self.src.data_ptr(), row, rows, row, row, row // 2)
        check(cu.cuMemcpy3DAsync(m, s), "cuMemcpy3DAsync")

    def read_word(self) -> int:
        """Read the awaited word through the device (a copy on an idle stream)."""
        check(cu.cuMemcpyDtoHAsync(self.host_word + 64, self.dev_word, 8, self.work), "cuMemcpyDtoHAsync")
        check(cu.cuStreamSynchronize(self.work), "cuStreamSynchronize")
        return ctypes.c_int64.from_address(self.host_word + 64).value

    def release_by_driver(self) -> None:
        """Release the blocker with a stream write from another stream (what a close does)."""
        check(cu.cuStreamWriteValue64(self.work, self.dev_word, self.value, 0), "cuStreamWriteValue64")
        check(cu.cuStreamSynchronize(self.work), "cuStreamSynchronize")

    def copies_1000(self, s: Any) -> None:
        n = 64 * 1024
        for i in range(1000):
            off = (i * n) % self.src.nbytes
            check(cu.cuMemcpyAsync(self.dst.data_ptr() + off, self.src.data_ptr() + off, n, s), "cuMemcpyAsync")

    def vmm_map(self) -> tuple[Any, int, int]:
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = torch.cuda.current_device()
        gran = int(check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))
        size = max(gran, 2 * MIB)
        handle = check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
        va = int(check(cu.cuMemAddressReserve(size, gran, 0, 0), "cuMemAddressReserve"))
        check(cu.cuMemMap(va, size, 0, handle, 0), "cuMemMap")
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = prop.location.id
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(cu.cuMemSetAccess(va, size, [acc], 1), "cuMemSetAccess")
        return handle, va, size

    def vmm_unmap(self, v: tuple[Any, int, int]) -> None:
        handle, va, size = v
        check(cu.cuMemUnmap(va, size), "cuMemUnmap")
        check(cu.cuMemRelease(handle), "cuMemRelease")
        check(cu.cuMemAddressFree(va, size), "cuMemAddressFree")

    def load_module(self) -> Any:
        major = torch.cuda.get_device_capability()[0]
        minor = torch.cuda.get_device_capability()[1]
        ptx = (f".version 7.8\n.target sm_{major}{minor}\n.address_size 64\n"
               ".visible .entry probe_noop()\n{\n\tret;\n}\n").encode() + b"\0"
        return check(cu.cuModuleLoadData(ptx), "cuModuleLoadData")

    def launch(self, mod: Any) -> None:
        fn = check(cu.cuModuleGetFunction(mod, b"probe_noop"), "cuModuleGetFunction")
        check(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, self.work, 0, 0), "cuLaunchKernel")

    def triton_first_call(self, which: int, stream: Any = None) -> None:
        """``_probe_add_one`` on a tensor whose dtype / size picks the variant (0, 1, 2: three)."""
        dtype = (torch.float32, torch.float16, torch.bfloat16)[which]
        x = self._triton_x.get(which)
        if x is None:  # made outside any capture (an allocation there would be the pool's)
            x = self._triton_x[which] = torch.zeros(1024 + which, dtype=dtype, device="cuda")
        with torch.cuda.stream(torch.cuda.ExternalStream(int(self.work if stream is None else stream))):
            _probe_add_one[(1,)](x, x.numel(), BLOCK=2048)

    def torch_graph_with_kernels(self) -> None:
        s = torch.cuda.ExternalStream(int(self.capture))
        a = torch.ones(256, 512, device="cuda")
        b = torch.empty(512, 256, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="thread_local")
            self.triton_first_call(2, self.capture)
            b.copy_(a.t())
            g.capture_end()
        self._keep = (g, a, b)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)
except ImportError:  # pragma: no cover - GPU machines have Triton
    _probe_add_one = None


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/blocking_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit-s", type=float, default=3.0,
                    help="how long a call may take before it counts as waiting for the flag")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    info = env_info(torch.device("cuda", 0))
    print(f"{info['gpu']} | torch {info['torch']} | CUDA driver API {check(cu.cuDriverGetVersion(), 'v')} | "
          f"git {info['git_sha']} | {info['date']} | a stream waits on a pinned word for {a.limit_s} s per call")
    p = Probe(a.limit_s)
    rows: list[tuple[str, str, float]] = []
    state: dict[str, Any] = {}

    def row(name: str, call: Callable[[], Any]) -> None:
        how, ms = p.blocked(call)
        rows.append((name, how, ms))
        print(f"| {name} | {how} | {ms:.2f} |", flush=True)

    print("| call (another thread; a stream of the context waits for a flag) | result | ms |")
    print("|---|---|---|")
    row("cuEventRecord on an idle stream (control)",
        lambda: check(cu.cuEventRecord(check(cu.cuEventCreate(0), "ev"), p.work), "cuEventRecord"))
    row("cuMemcpyAsync 8 MiB on an idle stream", lambda: p.copy_1d(p.work))
    row("capture a 1-D copy (begin, cuMemcpyAsync, end)", lambda: state.__setitem__("g1", p.captured(p.copy_1d)))
    row("cuGraphInstantiate (1-D copy graph)",
        lambda: state.__setitem__("x1", check(cu.cuGraphInstantiate(state["g1"], 0), "cuGraphInstantiate")))
    row("cuGraphLaunch, first (1-D)", lambda: check(cu.cuGraphLaunch(state["x1"], p.work), "cuGraphLaunch"))
    row("cuGraphLaunch, second (1-D)", lambda: check(cu.cuGraphLaunch(state["x1"], p.work), "cuGraphLaunch"))
    row("capture a 3-D copy", lambda: state.__setitem__("g3", p.captured(p.copy_3d)))
    row("cuGraphInstantiate (3-D copy graph)",
        lambda: state.__setitem__("x3", check(cu.cuGraphInstantiate(state["g3"], 0), "cuGraphInstantiate")))
    row("cuGraphLaunch, first (3-D)", lambda: check(cu.cuGraphLaunch(state["x3"], p.work), "cuGraphLaunch"))

    def torch_graph() -> None:
        s = torch.cuda.ExternalStream(int(p.capture))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin(capture_error_mode="thread_local")
            p.dst.copy_(p.src)
            g.capture_end()
        state["tg"] = g

    row("torch.cuda.CUDAGraph capture + capture_end (thread_local)", torch_graph)
    row("its replay, first", lambda: state["tg"].replay())
    row("capture 1000 small copies (64 KiB each) into one graph",
        lambda: state.__setitem__("gn", p.captured(p.copies_1000)))
    row("cuGraphInstantiate (1000-copy graph)",
        lambda: state.__setitem__("xn", check(cu.cuGraphInstantiate(state["gn"], 0), "cuGraphInstantiate")))
    row("cuGraphLaunch, first (1000-copy graph)", lambda: check(cu.cuGraphLaunch(state["xn"], p.work), "cuGraphLaunch"))
    row("cuGraphExecDestroy + cuGraphDestroy (1000-copy graph)",
        lambda: (check(cu.cuGraphExecDestroy(state.pop("xn")), "cuGraphExecDestroy"),
                 check(cu.cuGraphDestroy(state.pop("gn")), "cuGraphDestroy")))
    row("cuMemAlloc (1 MiB)", lambda: state.__setitem__("m", check(cu.cuMemAlloc(MIB), "cuMemAlloc")))
    row("cuMemFree (1 MiB)", lambda: check(cu.cuMemFree(state.pop("m")), "cuMemFree"))
    row("torch: a new caching-allocator segment (torch.empty 96 MiB)",
        lambda: state.__setitem__("t", torch.empty(96 * MIB, dtype=torch.uint8, device="cuda")))
    row("cuMemHostAlloc (pinned, 1 MiB)",
        lambda: state.__setitem__("h", check(cu.cuMemHostAlloc(MIB, 0), "cuMemHostAlloc")))
    row("cuMemFreeHost (that 1 MiB)", lambda: check(cu.cuMemFreeHost(state.pop("h")), "cuMemFreeHost"))
    row("torch: pin_memory() of a new size (caching host allocator, new block)",
        lambda: state.__setitem__("pin", torch.empty(3 * MIB + 4096, dtype=torch.uint8).pin_memory()))
    row("torch: pin_memory() again, block free in its cache (the same size)",
        lambda: (state.pop("pin"),
                 state.__setitem__("pin2", torch.empty(3 * MIB + 4096, dtype=torch.uint8).pin_memory())))
    row("VMM: cuMemCreate + reserve + map + set access (2 MiB)", lambda: state.__setitem__("v", p.vmm_map()))
    row("VMM: cuMemUnmap + cuMemRelease + cuMemAddressFree", lambda: p.vmm_unmap(state.pop("v")))
    row("cuModuleLoadData (a PTX module, first load)", lambda: state.__setitem__("mod", p.load_module()))
    row("cuLaunchKernel, first launch of that module's kernel", lambda: p.launch(state["mod"]))
    row("cuModuleUnload", lambda: check(cu.cuModuleUnload(state.pop("mod")), "cuModuleUnload"))
    row("a Triton kernel's first call (compile + load + launch)", lambda: p.triton_first_call(0))
    row("another specialization of it (load + launch, compiled kernel cache warm)", lambda: p.triton_first_call(1))
    # graphs holding kernel nodes (the library's recorded runs hold its Triton kernels)
    p.triton_first_call(2)  # a variant loaded while nothing waits: the graphs below load nothing of it
    torch.empty(512, 256, device="cuda").copy_(torch.ones(256, 512, device="cuda").t())  # and torch's copy
    torch.cuda.synchronize()
    row("capture a loaded Triton kernel (cuStreamBeginCapture .. End)",
        lambda: state.__setitem__("gk", p.captured(lambda s: p.triton_first_call(2, s))))
    row("cuGraphInstantiate (a graph with a Triton kernel node)",
        lambda: state.__setitem__("xk", check(cu.cuGraphInstantiate(state["gk"], 0), "cuGraphInstantiate")))
    row("cuGraphLaunch, first (Triton kernel node)",
        lambda: check(cu.cuGraphLaunch(state["xk"], p.work), "cuGraphLaunch"))
    row("torch.cuda.CUDAGraph of a Triton kernel + a strided torch copy_, capture_end", p.torch_graph_with_kernels)
    row("a torch kernel's first use in this process (torch.special.i0; lazy loading unless EAGER)",
        lambda: torch.special.i0(torch.ones(16, device="cuda")))
    row("cuCtxSynchronize (control: must wait)", lambda: check(cu.cuCtxSynchronize(), "cuCtxSynchronize"))

    # Does a thread stuck in a module load stop the others?  (A deadline or a watchdog on
    # another thread must still read flags and release waits.)
    print("\n| call (a third thread; another thread is inside cuModuleLoadData, waiting) | result | ms |")
    print("|---|---|---|")
    mod = p.load_module()  # loaded once (unblocked): its kernel launches below load nothing
    loaded = state.setdefault("loaded", mod)

    def during(name: str, call: Callable[[], Any]) -> None:
        how, ms = p.blocked(call, during_load=True)
        rows.append((name + " [during a load]", how, ms))
        print(f"| {name} | {how} | {ms:.2f} |", flush=True)

    during("cuStreamQuery of the waiting stream", lambda: cu.cuStreamQuery(p.blocker))
    during("cuMemcpyDtoHAsync + cuStreamSynchronize, idle stream (a flag read)", p.read_word)
    during("cuEventRecord on an idle stream", lambda: check(cu.cuEventRecord(check(cu.cuEventCreate(0), "ev"), p.work),
                                                              "cuEventRecord"))
    during("cuLaunchKernel of a loaded kernel", lambda: p.launch(loaded))
    during("cuStreamWriteValue64 of the awaited word, another stream (a release)", p.release_by_driver)
    torch.cuda.synchronize()
    ok = torch.equal(p.dst, p.src)
    print(f"copies checked: {'exact' if ok else 'WRONG'}")
    waited = [n for n, how, _ in rows if how.startswith("waited")]
    print("calls that waited for the other stream's flag: " + (", ".join(waited) if waited else "none"))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
