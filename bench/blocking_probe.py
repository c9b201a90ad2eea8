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
        self.host_word = int(check(cu.cuMemHostAlloc(8, cu.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc"))
        self.word = ctypes.c_int64.from_address(self.host_word)
        self.word.value = 0
        self.dev_word = check(cu.cuMemHostGetDevicePointer(self.host_word, 0), "cuMemHostGetDevicePointer")
        self.value = 0
        self.src = torch.arange(8 * MIB // 4, dtype=torch.int32, device="cuda")
        self.dst = torch.zeros_like(self.src)

    def blocked(self, call: Callable[[], Any]) -> tuple[str, float]:
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
        if th.is_alive():
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
    row("cuMemAlloc + cuMemFree (1 MiB)",
        lambda: check(cu.cuMemFree(check(cu.cuMemAlloc(MIB), "cuMemAlloc")), "cuMemFree"))
    torch.cuda.synchronize()
    ok = torch.equal(p.dst, p.src)
    print(f"copies checked: {'exact' if ok else 'WRONG'}")
    waited = [n for n, how, _ in rows if how.startswith("waited")]
    print("calls that waited for the other stream's flag: " + (", ".join(waited) if waited else "none"))
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
