"""Interference: how much a reduce-scatter running next to a GEMM slows the GEMM down.

    python bench/interference.py [--model llama-3.1-70b] [--world-size 2] [--gemm-iters 200] [--json out.jsonl]
    TRITON_INTERPRET=1 python bench/interference.py --dry-run     # CPU, tiny sizes, logic only
    torchrun --nproc-per-node 2 bench/interference.py --backgrounds tide nccl [--share-gpu]

Under torchrun: one process per rank, tide_triton beside NCCL on FSDP2's path in the same run
(``bench/interference_ranks.py`` says how).  Otherwise one process, one GPU.  The victim is a single-wave GEMM, ``torch.mm`` of (M, K) x (K, N) bf16
with M x N x K = 1024 x 16896 x 8192 (about 0.35 ms on an H200), on its own stream.  Each GEMM
is timed with its own pair of CUDA events; ``gemm-iters`` (>= 50) GEMMs are enqueued behind a
gate (``cuStreamWaitValue32`` on a device word, opened by ``cuStreamWriteValue32`` from another
stream once all are enqueued: no host gaps between GEMMs, no kernel), so the timed window is
one back-to-back run.  Reported: median / p90 / mean per GEMM, and the slowdown of the median
and of the mean against the GEMM alone (the mean is the throughput loss: a background that holds
every SM for a while stalls a few GEMMs a lot and leaves the median alone).  ``--tide-max-ctas``
sweeps the accumulation kernel's grid bound: fewer CTAs hold fewer SMs for longer.

Backgrounds (each looped on W ranks, one thread and one stream per rank, as in
bench/collectives_gpu.py):

* ``tide``: ``tide_triton.reduce_scatter`` (bf16 grads -> fp32 shards, avg) of one model layer
  on ``tt.local_groups(W)``: bytes move on copy engines, sums in short Triton kernels;
* ``sm``: an SM-based reduce-scatter equivalent, FSDP2-style: every rank ``chunk_cat``s its bf16
  grads into an fp32 (W, F) buffer (FSDP2's reduce-scatter input, ``torch.ops.fsdp.chunk_cat``),
  then every destination d sums the W ranks' row d with ``torch.sum`` (fp32, the buffers are in the
  same process) and scales by 1/W -- the reduction NCCL's kernel would do, done by torch kernels
  on SMs, without NCCL's transfer.

Each background is started, runs ``--bg-warmup`` iterations alone (the first compiles kernels;
the later ones give its time per iteration alone), then the GEMMs are timed while it runs, then
it is stopped by a flag that all ranks read at the same iteration boundary (a rank leaving early
would leave its peers waiting in the collective) and joined with a timeout.  Every background
iteration is bracketed by CUDA events on the rank's stream, so the report says, on the GPU's
clock, which fraction of the GEMM window a background iteration was in flight (``coverage``,
min over ranks: must be ~100% for the numbers to mean anything), and how many background
iterations' worth of work was done inside the window (``bg iters in window``: sum over
iterations of the part of each inside the window, per rank) vs the iterations the background
would have completed in that time alone (``bg progress`` = ratio).

Also reported: SM time of one tide_triton reduce_scatter (all W ranks, under torch.profiler),
``sm_time_from_trace`` from bench/nccl_baseline.py: SM µs = sum_k dur_k * min(ctas_k, n_SM) / n_SM.
"""
from __future__ import annotations

import argparse
import faulthandler
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
    from bench.nccl_baseline import TINY_SHAPES, _chunk_cat_fn, profile_sm_time, short_kernel_names  # noqa: E402
except ImportError:  # run from elsewhere
    from nccl_baseline import (TINY_SHAPES, _chunk_cat_fn, profile_sm_time,  # type: ignore  # noqa: E402
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
    if clock.gpu:
        try:
            with torch.cuda.stream(stream):
                gate.close(stream)
                w0 = clock.mark()
                for _ in range(n):
                    s = clock.mark()
                    torch.mm(a, b, out=c)
                    marks.append((s, clock.mark()))
                w1 = clock.mark()
            if on_open:
                on_open()
        finally:
            gate.open()  # never leave the stream gated
        clock.sync(w1)
    else:
        if on_open:
            on_open()
        w0 = clock.mark()
        for _ in range(n):
            s = clock.mark()
            torch.mm(a, b, out=c)
            marks.append((s, clock.mark()))
        w1 = clock.mark()
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
              timeout_s: float, max_ctas: int | None = None,
              ) -> tuple[list, Callable[[int], None], Callable[[int], None], Callable[[], None]]:
    layout = tt.ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=timeout_s, ring_bytes=ring_bytes, max_ctas=max_ctas)
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
    from tide_triton.layout import ShardLayout

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
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-70b", help="layer from tide_triton.workloads, or 'tiny'")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--gemm", nargs=3, type=int, default=[1024, 16896, 8192], metavar=("M", "N", "K"))
    ap.add_argument("--gemm-iters", type=int, default=200, help="GEMMs per timed window (>= 50)")
    ap.add_argument("--backgrounds", nargs="+", default=None, choices=["tide", "sm", "nccl"],
                    help="default: tide sm (one process), tide nccl (torchrun); nccl needs torchrun, sm one process")
    ap.add_argument("--share-gpu", action="store_true",
                    help="torchrun: every rank on cuda:0 (default: rank on cuda:LOCAL_RANK %% GPUs)")
    ap.add_argument("--tide-max-ctas", nargs="+", type=int, default=[0],
                    help="accumulation grid bounds to sweep for the tide background (0: one CTA per tile)")
    ap.add_argument("--gemm-priority", nargs="+", default=["default", "high"], choices=["default", "high"],
                    help="the GEMM's stream priority: default (0, the lowest, as the collectives' streams) or "
                         "high (the highest CUDA offers: the collectives' kernels yield to it); one window each")
    ap.add_argument("--bg-warmup", type=int, default=4, help="background iterations before the window")
    ap.add_argument("--ring-bytes", type=int, default=256 << 20)
    ap.add_argument("--no-profile", action="store_true", help="skip the SM time of one tide reduce_scatter")
    ap.add_argument("--timeout", type=float, default=120.0, help="per wait on a background (s)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny sizes, Triton interpreter (sets TRITON_INTERPRET=1): checks the logic")
    ap.add_argument("--json", default=None, help="append result rows (with env info) to this JSON-lines file")
    args = ap.parse_args(argv)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    if args.backgrounds is None:
        args.backgrounds = ["tide", "nccl"] if torchrun else ["tide", "sm"]
    if torchrun:
        args.world_size = int(os.environ["WORLD_SIZE"])
        if "sm" in args.backgrounds:
            ap.error("--backgrounds sm runs in one process only (under torchrun: tide, nccl)")
    elif "nccl" in args.backgrounds:
        ap.error("--backgrounds nccl needs one process per rank: run under torchrun")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before tide_triton imports triton
        args.model = "tiny" if args.model == "llama-3.1-70b" else args.model
        args.gemm = [64, 64, 64]
        args.gemm_iters = max(50, min(args.gemm_iters, 60))
        args.bg_warmup = min(args.bg_warmup, 2)
        args.ring_bytes = min(args.ring_bytes, 4096 * args.world_size)
    elif args.gemm_iters < 50:
        ap.error("--gemm-iters must be >= 50")
    faulthandler.dump_traceback_later(float(os.environ.get("TIDE_HANG_DUMP_S", 900)), exit=True, file=sys.stderr)
    if torchrun:
        from interference_ranks import run_ranks

        return run_ranks(args)

    import tide_triton as tt
    from tide_triton.bench import env_info
    from tide_triton.workloads import layer_shapes

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU check", file=sys.stderr)
        return 2
    info = env_info(device)
    W = args.world_size
    shapes = TINY_SHAPES if args.model == "tiny" else layer_shapes(args.model)
    M, N, K = args.gemm
    print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
          f"git {info['git_sha']} | {info['date']}")
    print(f"victim: torch.mm {M}x{K} @ {K}x{N} bf16, {args.gemm_iters} per window | background: "
          f"{args.model} reduce-scatter on W={W} local ranks")
    clock = Clock(device)
    gate = Gate(device)
    if device.type == "cuda" and not gate.ok:
        print(f"WARNING: no stream gate ({gate.why}): GEMMs are timed as enqueued (host gaps possible)")
    a = torch.randn(M, K, device=device).to(torch.bfloat16)
    b = torch.randn(K, N, device=device).to(torch.bfloat16)
    c = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    rows: list[dict] = []
    base = dict(script="interference", model=args.model, world_size=W, gemm=[M, N, K],
                gemm_iters=args.gemm_iters, gated=gate.ok, device=str(device), **info)

    for gemm_priority in args.gemm_priority:
        # CUDA's stream priorities: 0 (default) is the lowest; the collectives' kernels run on
        # default-priority streams, so a GEMM stream of higher priority puts them below it.
        gstream, prio = gemm_stream(device, gemm_priority)
        base["gemm_priority"] = gemm_priority
        base["gemm_stream_priority"] = prio
        try:
            alone = gemm_alone(a, b, c, args.gemm_iters, clock, gate, gstream)
            rows.append({**base, "background": "none", **{k: v for k, v in alone.items() if k != "window"}})
        except Exception as e:  # noqa: BLE001
            print(f"ERROR timing the GEMM alone: {type(e).__name__}: {e}")
            traceback.print_exc()
            return 1

        plan = [(k, m) for k in args.backgrounds for m in (args.tide_max_ctas if k == "tide" else [0])]
        for kind, max_ctas in plan:
            bg = None
            close: Callable[[], None] = lambda: None  # noqa: E731
            try:
                if kind == "tide":
                    _, step, done, close = make_tide(tt, shapes, W, device, args.ring_bytes, args.timeout,
                                                     max_ctas or None)
                    impl = ("tide_triton.reduce_scatter bf16 -> fp32 avg (copy engines + Triton sums, "
                            f"{f'max_ctas={max_ctas}' if max_ctas else 'one CTA per tile'})")
                else:
                    step, done, impl = make_sm(shapes, W, device)
                bg = Background(kind, W, device, clock, step, done, args.timeout)
                bg.start()
                bg.wait_iterations(args.bg_warmup)
                before = min(bg.completed)
                marks: dict = {}
                res = time_gemms(a, b, c, args.gemm_iters, clock, gate, gstream,
                                 on_open=lambda: marks.update(c0=list(bg.completed)))
                marks["c1"] = list(bg.completed)
                if min(bg.completed) <= before and bg.errors:
                    raise RuntimeError("; ".join(bg.errors))
                bg.stop()
                if bg.errors:
                    raise RuntimeError("; ".join(bg.errors))
                st = bg.stats(res["window"], before)
                row = {**base, "background": kind, "background_impl": impl, "max_ctas": max_ctas or None,
                       **window_row(res, alone, st),
                       "bg_completed_host": [y - x for x, y in zip(marks["c0"], marks["c1"])]}
                rows.append(row)
            except Exception as e:  # noqa: BLE001
                print(f"ERROR background {kind}: {type(e).__name__}: {e}")
                traceback.print_exc()
                rows.append({**base, "background": kind, "max_ctas": max_ctas or None,
                             "error": f"{type(e).__name__}: {e}"})
                if bg is not None:
                    try:
                        bg.stop()
                    except Exception:  # noqa: BLE001
                        pass
            finally:
                try:
                    close()
                except Exception as e:  # noqa: BLE001
                    print(f"ERROR closing {kind}: {e}")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()

    sm_row = None
    if not args.no_profile:
        try:
            groups, step, done, close = make_tide(tt, shapes, W, device, args.ring_bytes, args.timeout)
            try:
                def once_all() -> None:
                    errs: list = []

                    def body(r: int) -> None:
                        try:
                            if device.type == "cuda":
                                with torch.cuda.stream(torch.cuda.Stream(device)):
                                    step(r)
                                    done(r)
                            else:
                                step(r)
                        except BaseException as e:  # noqa: BLE001
                            errs.append(f"rank {r}: {type(e).__name__}: {e}")

                    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(W)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join(args.timeout)
                    if errs or any(t.is_alive() for t in ts):
                        raise RuntimeError(errs or "a rank thread did not finish")

                once_all()  # warm: kernels compiled, heaps mapped
                res = profile_sm_time(once_all, device)
                sm_row = {**base, "background": "sm_time", "op": "tide reduce_scatter (all W ranks, one call)",
                          "sm_us": res["sm_us"], "sm_us_per_rank": None if res["sm_us"] is None else res["sm_us"] / W,
                          "kernel_us": res["kernel_us"], "n_kernels": res["n_kernels"],
                          "memcpy_us": res["memcpy_us"], "n_memcpy": res["n_memcpy"], "n_sm": res.get("n_sm"),
                          "kernels": res["kernels"]}
                rows.append(sm_row)
            finally:
                close()
        except Exception as e:  # noqa: BLE001
            print(f"ERROR SM time: {type(e).__name__}: {e}")
            traceback.print_exc()

    print_rows(rows)
    if sm_row is not None:
        sm = "n/a (CPU)" if sm_row["sm_us"] is None else f"{sm_row['sm_us']:.1f} µs ({sm_row['sm_us_per_rank']:.1f} per rank)"
        print(f"\nSM time of one tide_triton reduce_scatter ({args.model}, W={W}, all ranks): {sm} | "
              f"{sm_row['n_kernels']} kernels, {sm_row['kernel_us']:.1f} µs kernel time | copy engines: "
              f"{sm_row['n_memcpy']} copies, {sm_row['memcpy_us']:.1f} µs | {short_kernel_names(sm_row)}")
    if args.dry_run:
        print("(dry run: CPU, tiny sizes, Triton interpreter -- the numbers say nothing about GPUs)")
    append_rows(args.json, rows)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
