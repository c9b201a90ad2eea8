"""The pieces of the GEMM-interference benchmark shared by its two launch modes
(``bench/interference.py``: one process; ``bench/interference_ranks.py``: one process per rank
under torchrun): the clocks and the stream gate, the timed GEMM window, the looping
backgrounds, the rows.  What is measured and how: ``bench/interference.py``'s docstring."""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

try:
    from bench.nccl_baseline import TINY_SHAPES, _chunk_cat_fn, profile_sm_time, short_kernel_names  # noqa: E402, F401
except ImportError:  # run from elsewhere
    from nccl_baseline import (TINY_SHAPES, _chunk_cat_fn, profile_sm_time,  # type: ignore  # noqa: E402, F401
                               short_kernel_names)


# --------------------------------------------------------------------------- clocks
class Clock:
    """Marks on the current stream (CUDA events) or the host clock (CPU dry run)."""

    def __init__(self, device: torch.device) -> None:
        self.gpu = device.type == "cuda"
        self.device = device
        if self.gpu:
            torch.cuda.synchronize(device)
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            torch.cuda.synchronize(device)
        else:
            self.ref = time.perf_counter()

    def mark(self) -> Any:
        if self.gpu:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def at(self, m: Any) -> float:
        """ms since the reference (the mark must be complete)."""
        return self.ref.elapsed_time(m) if self.gpu else (m - self.ref) * 1e3

    def sync(self, m: Any) -> None:
        if self.gpu:
            m.synchronize()


class Gate:
    """Holds a stream until opened, with stream memory operations (no kernel)."""

    def __init__(self, device: torch.device) -> None:
        self.ok = False
        self.why = "CPU"
        if device.type != "cuda":
            return
        try:
            from tide_triton.transport.driver import cu, init

            init()
            self.cu = cu
            self.word = torch.zeros(1, dtype=torch.int32, device=device)
            self.stream = torch.cuda.Stream(device)
            self.epoch = 0
            self._GEQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
            self._WRITE = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
            torch.cuda.synchronize(device)
            self.ok = True
            self.why = ""
        except Exception as e:  # noqa: BLE001
            self.why = f"{type(e).__name__}: {e}"

    def close(self, stream: torch.cuda.Stream) -> None:
        if not self.ok:
            return
        self.epoch += 1
        err = self.cu.cuStreamWaitValue32(int(stream.cuda_stream), self.word.data_ptr(), self.epoch, self._GEQ)[0]
        if int(err) != 0:
            self.ok = False
            self.why = f"cuStreamWaitValue32 failed: {err}"

    def open(self) -> None:
        if not self.ok:
            return
        err = self.cu.cuStreamWriteValue32(int(self.stream.cuda_stream), self.word.data_ptr(), self.epoch,
                                           self._WRITE)[0]
        if int(err) != 0:
            raise RuntimeError(f"cuStreamWriteValue32 failed: {err} (the GEMM stream stays gated)")


def time_gemms(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, n: int, clock: Clock, gate: Gate,
               stream: Any, on_open: Callable[[], None] | None = None) -> dict:
    """n back-to-back GEMMs: per-GEMM ms and the window (ms since the clock's reference)."""
    marks = []

    def gemms() -> tuple[Any, Any]:  # the window's start and end marks
        w0 = clock.mark()
        for _ in range(n):
            s = clock.mark()
            torch.mm(a, b, out=c)
            marks.append((s, clock.mark()))
        return w0, clock.mark()

    if clock.gpu:
        try:
            with torch.cuda.stream(stream):
                gate.close(stream)
                w0, w1 = gemms()
            if on_open:
                on_open()
        finally:
            gate.open()  # never leave the stream gated
        clock.sync(w1)
    else:
        if on_open:
            on_open()
        w0, w1 = gemms()
    times = sorted(clock.at(e) - clock.at(s) for s, e in marks)
    return {"median_ms": statistics.median(times), "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
            "mean_ms": statistics.fmean(times), "min_ms": times[0], "n": n,
            "window": (clock.at(w0), clock.at(w1)), "window_ms": clock.at(w1) - clock.at(w0)}


# --------------------------------------------------------------------------- backgrounds
class Background:
    """W rank threads looping ``step(r)``; every iteration bracketed by marks; stop agreed by all
    ranks at an iteration boundary (a threading.Barrier whose action reads the flag)."""

    def __init__(self, name: str, W: int, device: torch.device, clock: Clock,
                 step: Callable[[int], None], done: Callable[[int], None], timeout_s: float,
                 limit: int | None = None) -> None:
        self.name, self.W, self.device, self.clock = name, W, device, clock
        self.step, self.done, self.timeout_s = step, done, timeout_s
        self.limit = limit
        """Stop after this many iterations (one process per rank: every rank runs the same count)."""
        self.stop_flag = threading.Event()
        self._stop_now = False
        self.barrier = threading.Barrier(W, action=self._decide)
        self.intervals: list[list[tuple[Any, Any]]] = [[] for _ in range(W)]
        self.completed = [0] * W
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._main, args=(r,), daemon=True) for r in range(W)]

    def _decide(self) -> None:
        self._stop_now = (self.stop_flag.is_set() or bool(self.errors)
                          or (self.limit is not None and min(self.completed) >= self.limit))

    def _main(self, r: int) -> None:
        try:
            if self.device.type == "cuda":
                with torch.cuda.stream(torch.cuda.Stream(self.device)):
                    self._loop(r)
            else:
                self._loop(r)
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001
            self.errors.append(f"{self.name} rank {r}: {type(e).__name__}: {e}")
            traceback.print_exc()
            self.barrier.abort()

    def _loop(self, r: int) -> None:
        while True:
            s = self.clock.mark()
            self.step(r)
            e = self.clock.mark()
            self.done(r)  # host waits for this iteration's work (bounded queue, prompt stop)
            self.intervals[r].append((s, e))
            self.completed[r] += 1
            self.barrier.wait(self.timeout_s)
            if self._stop_now:
                return

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wait_iterations(self, n: int) -> None:
        t0 = time.monotonic()
        while min(self.completed) < n:
            if self.errors:
                raise RuntimeError("; ".join(self.errors))
            if time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(f"{self.name}: {n} iterations not done in {self.timeout_s} s "
                                   f"(completed {self.completed})")
            time.sleep(0.005)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join()

    def join(self) -> None:
        """Wait for the rank threads to end (``stop`` or the iteration ``limit``)."""
        for t in self.threads:
            t.join(self.timeout_s)
        alive = [i for i, t in enumerate(self.threads) if t.is_alive()]
        if alive:
            self.barrier.abort()
            self.errors.append(f"{self.name}: rank thread(s) {alive} did not stop within {self.timeout_s} s")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stats(self, window: tuple[float, float] | None, before: int,
              alone_ms: Sequence[float] | None = None) -> dict:
        """Per rank: iteration ms alone (iterations 1..before-1, or ``alone_ms`` measured
        apart), coverage of the window, and iterations' worth of work inside it."""
        out: dict = {"completed": list(self.completed)}
        alone, cover, inside = [], [], []
        for r in range(self.W):
            iv = [(self.clock.at(s), self.clock.at(e)) for s, e in self.intervals[r]]
            durs = [e - s for s, e in iv[1:before]] or [e - s for s, e in iv]
            if alone_ms is not None:
                alone.append(alone_ms[r])
            else:
                alone.append(statistics.median(durs) if durs else float("nan"))
            if window is not None:
                w0, w1 = window
                ov = [max(0.0, min(e, w1) - max(s, w0)) for s, e in iv]
                cover.append(sum(ov) / (w1 - w0) if w1 > w0 else float("nan"))
                inside.append(sum(o / (e - s) for o, (s, e) in zip(ov, iv) if e > s))
        out["iter_alone_ms"] = alone
        if window is not None:
            wms = window[1] - window[0]
            out["coverage_min"] = min(cover)
            out["iters_in_window"] = inside
            out["iters_alone_in_window"] = [wms / a if a > 0 else float("nan") for a in alone]
            out["progress"] = min(i / x if x > 0 else float("nan")
                                  for i, x in zip(inside, out["iters_alone_in_window"]))
        return out


def gemm_stream(device: torch.device, priority: str) -> tuple[Any, int]:
    """The GEMM's stream at ``priority`` ("default": 0, the lowest, as the collectives'
    streams; "high": the highest CUDA offers, so the collectives' kernels yield to it)."""
    if device.type != "cuda":
        return None, 0
    prio = torch.cuda.Stream.priority_range()[1] if priority == "high" else 0
    return torch.cuda.Stream(device, priority=prio), prio


def gemm_alone(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, n: int, clock: Clock, gate: Gate,
               stream: Any) -> dict:
    """The GEMM timed alone, after a warm-up.  The first GEMMs run ungated: with lazy module
    loading (CUDA's default) loading cuBLAS's kernel can need a context synchronisation, which
    would wait forever on a stream held by the gate that only opens after the enqueue."""
    if clock.gpu:
        with torch.cuda.stream(stream):
            for _ in range(3):
                torch.mm(a, b, out=c)
        torch.cuda.synchronize(clock.device)
    time_gemms(a, b, c, 10, clock, gate, stream)
    return time_gemms(a, b, c, n, clock, gate, stream)


def window_row(res: dict, alone: dict, st: dict) -> dict:
    """The GEMM window's columns with a background: times, slowdowns against ``alone``, and
    the background's ``Background.stats``."""
    return {**{k: v for k, v in res.items() if k != "window"},
            "slowdown_pct": 100.0 * (res["median_ms"] / alone["median_ms"] - 1.0),
            "slowdown_mean_pct": 100.0 * (res["mean_ms"] / alone["mean_ms"] - 1.0),
            "bg_iter_alone_ms": st["iter_alone_ms"], "bg_coverage_min": st["coverage_min"],
            "bg_iters_in_window": st["iters_in_window"], "bg_iters_alone_in_window": st["iters_alone_in_window"],
            "bg_progress": st["progress"]}


def append_rows(path: str | None, rows: Sequence[dict]) -> None:
    """Append ``rows`` as JSON lines to ``path`` (nothing without one)."""
    if not path:
        return
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
    print(f"rows appended to {path}")


def make_tide(tt: Any, shapes: Sequence[tuple[int, ...]], W: int, device: torch.device, ring_bytes: int,
              timeout_s: float, max_ctas: int | None = None, rs_push: str = "auto",
              ) -> tuple[list, Callable[[int], None], Callable[[int], None], Callable[[], None]]:
    layout = tt.ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=timeout_s, ring_bytes=ring_bytes, max_ctas=max_ctas,
                             rs_push=rs_push,
                             devices=[device] * W if device.type == "cuda" else None)  # one GPU: the GEMM's
    grads = [[torch.randn(s, device=device).to(torch.bfloat16) for s in shapes] for _ in range(W)]
    shards = [[torch.empty(s, device=device) for s in layout.shard_shapes(r)] for r in range(W)]

    def step(r: int) -> None:
        tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="avg")

    def done(r: int) -> None:
        if device.type == "cuda":
            tt.synchronize(groups[r], timeout_s=timeout_s)

    def close() -> None:
        for g in groups:
            g.close()

    return groups, step, done, close


def make_sm(shapes: Sequence[tuple[int, ...]], W: int, device: torch.device,
            ) -> tuple[Callable[[int], None], Callable[[int], None], str]:
    from tide_triton.plan.layout import ShardLayout

    layout = ShardLayout(shapes, W)
    F = layout.flat_shard_numel
    chunk_cat, cc_name = _chunk_cat_fn()
    grads = [[torch.randn(s, device=device).to(torch.bfloat16) for s in shapes] for _ in range(W)]
    big = torch.empty(W, W, F, dtype=torch.float32, device=device)   # big[k]: rank k's (W, F) RS input
    out = [torch.empty(F, dtype=torch.float32, device=device) for _ in range(W)]
    cat_done = [None] * W
    sync = threading.Barrier(W)
    gpu = device.type == "cuda"

    def step(r: int) -> None:
        chunk_cat(grads[r], W, big[r])
        if gpu:
            ev = torch.cuda.Event()
            ev.record()
            cat_done[r] = ev
        sync.wait(120)                   # every rank's input is enqueued
        if gpu:
            for ev in cat_done:
                torch.cuda.current_stream(device).wait_event(ev)
        torch.sum(big[:, r], dim=0, out=out[r])
        out[r].mul_(1.0 / W)

    def done(r: int) -> None:
        if gpu:
            torch.cuda.current_stream(device).synchronize()
        sync.wait(120)                   # every rank has read big before it is overwritten

    return step, done, f"{cc_name} bf16->fp32 (W, F) per rank + torch.sum over ranks + mul_(1/W)"


def print_rows(rows: Sequence[dict]) -> None:
    """The result table (markdown)."""
    print()
    print("| background | implementation | GEMM median (ms) | p90 (ms) | mean (ms) | slowdown (median) | "
          "slowdown (mean) | bg coverage of window (min rank) | bg iters in window (per rank) | bg iters alone in that time | "
          "bg progress vs alone | bg iter alone (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["background"] == "sm_time":
            continue
        if "error" in r:
            print(f"| {r['background']} ({r.get('gemm_priority')} GEMM priority) | ERROR: {r['error']} | | | | | | | | | | |")
            continue
        if r["background"] == "none":
            print(f"| none ({r['gemm_priority']} GEMM priority) | GEMM alone | {r['median_ms']:.4f} | {r['p90_ms']:.4f} | {r['mean_ms']:.4f} | | | | | | | |")
            continue
        fmt = lambda xs, p=2: ", ".join(f"{x:.{p}f}" for x in xs)  # noqa: E731
        print(f"| {r['background']} ({r['gemm_priority']} GEMM priority) | {r['background_impl']} | {r['median_ms']:.4f} | {r['p90_ms']:.4f} | "
              f"{r['mean_ms']:.4f} | {r['slowdown_pct']:+.1f}% | {r['slowdown_mean_pct']:+.1f}% | "
              f"{100 * r['bg_coverage_min']:.0f}% | "
              f"{fmt(r['bg_iters_in_window'])} | {fmt(r['bg_iters_alone_in_window'])} | "
              f"{100 * r['bg_progress']:.0f}% | {fmt(r['bg_iter_alone_ms'], 3)} |")


# --------------------------------------------------------------------------- main
